"""`model.generate(ids, assistant=EagleHead(...))`: greedy output is token-for-token vanilla's on tiny random models of
two architectures (the head is Llama-style, the target need not be), batch 1 and 4 of mixed lengths, EAGLE-1 and
EAGLE-3 heads; the head's cache covers the prompt; sampling with EAGLE trees keeps the target's distribution
(chi-square against the exact enumeration, with a wrong verifier as the negative control)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

import hf_specdec
import hf_specdec.generation.loop as loop
from hf_specdec.generation.proposers import NgramAssistant, as_proposer
from hf_specdec.generation.proposers.eagle import EagleAssistant
from hf_specdec.generation.proposers.fallback import FallbackAssistant
from hf_specdec.heads.eagle import EagleHead
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
)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [3, 4, 5], [9, 9, 8, 7, 6, 5, 4], [12, 13, 12, 13, 12, 13, 12, 13, 12]]
# These tests check the EAGLE trees themselves; the loop's tree budget (when it has one) would cut a random head's
# low-probability trees down to nothing and leave the checks vacuous.
FULL_TREES = {"tree_budget": False} if "tree_budget" in inspect.signature(loop.generate).parameters else {}


def random_head(model, version=1, seed=0, draft_vocab=None) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead.for_model(model, version=version, draft_vocab=draft_vocab)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
    return head.eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_matches_vanilla(arch, batch):
    model = tiny_causal_lm(arch, num_layers=6) if arch == "qwen2" else tiny_causal_lm(arch, num_layers=6)
    ids, mask = left_pad(PROMPTS[:batch])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    cases = {
        "eagle1": random_head(model),
        "eagle1-draft-vocab": random_head(model, seed=1, draft_vocab=torch.arange(3, 60)),
        "eagle3": random_head(model, version=3, seed=2, draft_vocab=torch.arange(10, 80)),
        "wide": EagleAssistant(random_head(model, seed=3), top_k=8, depth=4, num_nodes=40),
        "cost-cut": EagleAssistant(random_head(model, seed=4), step_cost={n: 1.0 + 0.02 * n for n in (1, 8, 32)}),
        "ngram+eagle": FallbackAssistant(NgramAssistant(), random_head(model, seed=6)),
    }
    for name, assistant in cases.items():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=24, do_sample=False, assistant=assistant,
            return_dict_in_generate=True, **FULL_TREES,
        )  # fmt: skip
        assert_same_tokens(out.sequences, expected, f"{arch} batch={batch} {name}")
        assert out.spec_stats.drafted_tokens > 0, name


def test_resolution_and_target_check():
    model = tiny_causal_lm("llama", num_layers=6)
    head = random_head(model)
    proposer = as_proposer(head, model)
    assert isinstance(proposer, EagleAssistant) and proposer.hidden_state_layers == (-1,)
    three = random_head(model, version=3)
    assert as_proposer(three, model).hidden_state_layers == (2, 3, 3)
    other = tiny_causal_lm("llama", hidden_size=32)
    with pytest.raises(ValueError, match="hidden size 64 cannot serve .* hidden size 32"):
        other.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, assistant=head)


class Recording(EagleAssistant):
    """Records the head cache's length at every propose (the cache must cover the committed text)."""

    def propose(self, rows):
        trees = super().propose(rows)
        for r in rows:
            if r.max_depth > 0:  # a row with no budget left drafts nothing and commits nothing
                self.log.append((r.tokens.numel(), int(self.cache.lengths[r.row])))
        return trees


def test_head_cache_covers_the_prompt_and_the_accepted_path():
    model = tiny_causal_lm("llama", num_layers=6)
    assistant = Recording(random_head(model), top_k=4, depth=3, num_nodes=8)
    assistant.log = []
    ids, mask = left_pad(PROMPTS)
    model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, assistant=assistant, **FULL_TREES)
    # one pair (feature t, token t + 1) per committed token: the cache ends at the root's pair
    assert assistant.log and all(cached == committed - 1 for committed, cached in assistant.log), assistant.log[:8]
    assert assistant.log[0][1] >= len(PROMPTS[1])


# --------------------------------------------------------------------------------------------- exact sampling
E2E_ROWS = 3000


@pytest.fixture(scope="module")
def e2e_model():
    return sampling_target()


def e2e_assistant(model) -> EagleAssistant:
    # every token is a depth-1 child, the best-scored deeper nodes fill the rest: deep acceptance despite a random head
    return EagleAssistant(random_head(model, seed=5), top_k=SAMPLING_VOCAB, depth=3, num_nodes=40)


def test_sampling_with_eagle_trees_matches_the_target_distribution(e2e_model):
    counts = sample_first_tokens(e2e_model, e2e_assistant(e2e_model), E2E_ROWS, **FULL_TREES)
    ps = first_tokens_p_values(counts, e2e_model)
    assert min(ps) > 1e-4, f"chi-square p-values of the first 1, 2, 3 tokens: {ps}"


def test_a_wrong_verifier_is_caught_with_these_trees(e2e_model):
    """The harness has power: verifying the EAGLE trees greedily while sampling must be rejected."""
    with greedy_verification():  # it rejects most random drafts by design: no power check on the drafts
        counts = sample_first_tokens(
            e2e_model, e2e_assistant(e2e_model), E2E_ROWS // 3, check_power=False, **FULL_TREES
        )
    ps = first_tokens_p_values(counts, e2e_model)
    assert min(ps) < 1e-6, f"greedy verification of a sampled call was not caught: p-values {ps}"


# --------------------------------------------------------------------------------------------- default model
SHIPPED = Path(hf_specdec.__file__).parent / "assets" / "eagle-smollm2-135m-instruct"


@pytest.mark.skipif(not (SHIPPED / "config.json").is_file(), reason="no EAGLE head ships yet")
@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 4])
def test_default_model_with_the_shipped_head_matches_vanilla(default_model, batch):
    model, tok = default_model
    head = EagleHead.from_pretrained(SHIPPED, base_model=model, dtype=torch.float32)
    ids, mask = spec_bench_batch(tok, batch)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, assistant=head)
    assert_same_tokens(out, expected, f"default model batch={batch}, the loop's tree budget")
    # tau of the head's own trees (the tree budget sizes trees from this machine's timings and may rightly cut them)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, assistant=head,
                         return_dict_in_generate=True, **FULL_TREES)  # fmt: skip
    assert_same_tokens(out.sequences, expected, f"default model batch={batch}, full trees")
    # measured with the shipped head: tau 1.3+ on the first question alone, 1.19 on the batch of four (translation
    # and summaries, where the head rarely guesses the copied words); a broken head or cache accepts ~nothing
    assert out.spec_stats.tau > 1.1, f"the shipped head barely drafts anything useful: {out.spec_stats}"


@pytest.mark.skipif(not (SHIPPED / "config.json").is_file(), reason="no EAGLE head ships yet")
@pytest.mark.slow
def test_default_assistants_eagle_and_ngram_eagle_load_the_shipped_head(default_model):
    from hf_specdec.assistants import available_assistants

    model, tok = default_model
    assert {"eagle", "ngram+eagle"} <= set(available_assistants())
    eagle = hf_specdec.load_default_assistant("eagle")
    assert isinstance(eagle, EagleAssistant) and eagle.head.tree.get("step_cost"), "the shipped head carries its tree"
    combo = hf_specdec.load_default_assistant("ngram+eagle")
    assert isinstance(combo, FallbackAssistant)
    ids = tok.apply_chat_template([{"role": "user", "content": "Repeat after me: the quick brown fox."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]  # fmt: skip
    expected = model.generate(ids, max_new_tokens=24, do_sample=False)
    for assistant in (eagle, combo):
        assert_same_tokens(model.generate(ids, max_new_tokens=24, do_sample=False, assistant=assistant), expected,
                           repr(assistant))  # fmt: skip
