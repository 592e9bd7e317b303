"""`model.generate(ids, assistant=DFlashHead(...))`: greedy output is token-for-token vanilla's on tiny random targets
of two architectures and on the default model, batch 1 and a ragged batch of 4, alone and behind n-gram lookup;
sampling with DDTrees keeps the target's distribution (chi-square against the exact enumeration, with a wrong
verifier as the negative control)."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.generation.proposers import NgramAssistant, as_proposer
from hf_specdec.generation.proposers.dflash import DFlashAssistant
from hf_specdec.generation.proposers.fallback import FallbackAssistant
from hf_specdec.heads.dflash import DFlashHead
from hf_specdec.testing import (
    SAMPLING_VOCAB,
    assert_same_tokens,
    first_tokens_p_values,
    greedy_verification,
    left_pad,
    sample_first_tokens,
    sampling_target,
    spec_bench_batch,
    tiny_causal_lm,
    torch_threads,
)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny models: intra-op threads only add wake-up latency (badly so on a busy machine)."""
    with torch_threads(1):
        yield


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [3, 4, 5], [9, 9, 8, 7, 6, 5, 4], [12, 13, 12, 13, 12, 13, 12, 13, 12]]
FULL_TREES = {"tree_budget": False}  # a random head's trees would be cut to nothing by the budget: checks vacuous


def random_head(model, seed=0, **kwargs) -> DFlashHead:
    torch.manual_seed(seed)
    head = DFlashHead.for_model(model, **{"block_size": 4, **kwargs})
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
    return head.eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_matches_vanilla(arch, batch):
    model = tiny_causal_lm(arch, num_layers=6)
    ids, mask = left_pad(PROMPTS[:batch])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    cases = {
        "dflash": random_head(model),
        "two-layers-draft-vocab": random_head(model, seed=1, num_layers=2, draft_vocab=torch.arange(3, 60)),
        "from-anchor": random_head(model, seed=2, sample_from_anchor=True, block_size=3),
        "wide": DFlashAssistant(random_head(model, seed=3, block_size=6), top_k=12, num_nodes=60),
        "ngram+dflash": FallbackAssistant(NgramAssistant(), random_head(model, seed=4)),
    }
    for name, assistant in cases.items():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, assistant=assistant,
                             return_dict_in_generate=True, **FULL_TREES)  # fmt: skip
        assert_same_tokens(out.sequences, expected, f"{arch} batch={batch} {name}")
        assert out.spec_stats.drafted_tokens > 0, name
    # the loop's tree budget, sizing trees from this machine's timings
    out = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, assistant=cases["dflash"])
    assert_same_tokens(out, expected, f"{arch} batch={batch} tree budget")


def test_resolution_folder_and_target_check(tmp_path):
    model = tiny_causal_lm("llama", num_layers=6)
    head = random_head(model)
    proposer = as_proposer(head, model)
    assert isinstance(proposer, DFlashAssistant) and proposer.hidden_state_layers == (1, 3, 5)
    head.save_pretrained(tmp_path)
    from_folder = DFlashAssistant(str(tmp_path))
    ids = torch.tensor([PROMPTS[0]])
    expected = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert_same_tokens(model.generate(ids, max_new_tokens=12, do_sample=False, assistant=from_folder), expected)
    other = tiny_causal_lm("llama", hidden_size=32, num_layers=6)
    with pytest.raises(ValueError, match="hidden size 64 cannot serve .* hidden size 32"):
        other.generate(ids, max_new_tokens=4, assistant=head)


# --------------------------------------------------------------------------------------------- exact sampling
E2E_ROWS = 3000


@pytest.fixture(scope="module")
def e2e_model():
    return sampling_target()


def e2e_assistant(model) -> DFlashAssistant:
    # every token at every depth is a candidate; the 40 most probable rank paths form the tree
    return DFlashAssistant(random_head(model, seed=5, block_size=4), top_k=SAMPLING_VOCAB, num_nodes=40)


def test_sampling_with_ddtrees_matches_the_target_distribution(e2e_model):
    counts = sample_first_tokens(e2e_model, e2e_assistant(e2e_model), E2E_ROWS, **FULL_TREES)
    ps = first_tokens_p_values(counts, e2e_model)
    assert min(ps) > 1e-4, f"chi-square p-values of the first 1, 2, 3 tokens: {ps}"


def test_a_wrong_verifier_is_caught_with_these_trees(e2e_model):
    """The harness has power: verifying the DDTrees greedily while sampling must be rejected."""
    with greedy_verification():
        counts = sample_first_tokens(
            e2e_model, e2e_assistant(e2e_model), E2E_ROWS // 3, check_power=False, **FULL_TREES
        )
    ps = first_tokens_p_values(counts, e2e_model)
    assert min(ps) < 1e-6, f"greedy verification of a sampled call was not caught: p-values {ps}"


# --------------------------------------------------------------------------------------------- default model
@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 4])
def test_default_model_greedy_matches_vanilla(default_model, batch):
    model, tok = default_model
    head = random_head(model, seed=6, block_size=8)
    ids, mask = spec_bench_batch(tok, batch)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    dflash = DFlashAssistant(head, num_nodes=16)  # a small tree: this checks exactness, not speed
    for assistant in (dflash, FallbackAssistant(NgramAssistant(), DFlashAssistant(head, num_nodes=16))):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, assistant=assistant,
                             return_dict_in_generate=True, **FULL_TREES)  # fmt: skip
        assert_same_tokens(out.sequences, expected, f"default model batch={batch} {assistant!r}")
        assert out.spec_stats.drafted_tokens > 0
