"""`model.generate(ids, assistant=MLPSpeculator(...))`: the level-trimmed product tree drafted for a whole batch at once
equals a per-row reference; greedy output is token-for-token vanilla's (tiny random models and, slow, the default model
with the shipped speculator), batch 1 and 4 of mixed lengths; sampling with its trees keeps the target's distribution
(chi-square against the exact enumeration, with a wrong verifier as the negative control)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hf_specdec  # noqa: F401  (routes generate(assistant=...))
from hf_specdec.generation.proposers import as_proposer
from hf_specdec.generation.proposers.mlp_speculator import (
    MLPSpeculatorAssistant,
    ancestor_masks,
    budget_widths,
    draft_tree_batch,
)
from hf_specdec.generation.tree import DraftTree
from hf_specdec.heads.mlp_speculator import MLPSpeculator
from hf_specdec.testing import (
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


def random_speculator(model, seed=0, token_map=None, **kwargs) -> MLPSpeculator:
    torch.manual_seed(seed)
    kwargs = {"inner_dim": 32, "n_predict": 3, "top_k_tokens_per_head": [3, 2, 2], "scale_input": True, **kwargs}
    return MLPSpeculator.for_model(model, token_map=token_map, **kwargs).eval()


# --------------------------------------------------------------------------------------------- the tree itself
def reference_tree(spec: MLPSpeculator, hidden: torch.Tensor, root: int, widths: list[int]) -> list[tuple]:
    """One row, node by node: expand each kept node's top-k, keep the ``widths[d]`` best paths by summed log-prob.
    Returns the level-ordered nodes as (token, parent, score)."""
    level = [(-1, spec.base_state(hidden[None])[0], spec.emb_rows(torch.tensor([root]))[0], 0.0)]
    nodes: list[tuple] = []
    start = 0
    for d, width in enumerate(widths):
        cands = []
        for p, (_, state, row, score) in enumerate(level):
            new_state = spec.stage(d, state, row)
            logp = spec.stage_logits(d, new_state).float().log_softmax(-1)
            top = logp.topk(min(spec.top_k_tokens_per_head[d], width))
            for v, i in zip(top.values.tolist(), top.indices.tolist()):
                cands.append((score + v, p, i, new_state))
        cands.sort(key=lambda c: -c[0])
        level_nodes = []
        for score, p, i, state in cands[:width]:
            parent = -1 if d == 0 else start + p
            nodes.append((int(spec.draft_to_token(torch.tensor(i))), parent, score))
            level_nodes.append((parent, state, torch.tensor(i), score))
        if d:
            start += widths[d - 1]
        level = level_nodes
    return nodes


@pytest.mark.parametrize("truncated", [False, True])
def test_batched_tree_equals_the_per_row_reference(truncated):
    model = tiny_causal_lm("llama")
    token_map = torch.randperm(97, generator=torch.Generator().manual_seed(3))[:40] if truncated else None
    spec = random_speculator(model, token_map=token_map, tie_weights=truncated)
    widths = [3, 4, 3]
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    roots = torch.tensor([4, 50, 96, 7, 4])
    tokens, parent, scores = draft_tree_batch(spec, hidden, roots, widths)
    masks = ancestor_masks(parent, widths)
    for b in range(5):
        ref = reference_tree(spec, hidden[b], int(roots[b]), widths)
        assert tokens[b].tolist() == [n[0] for n in ref]
        assert parent[b].tolist() == [n[1] for n in ref]
        torch.testing.assert_close(scores[b], torch.tensor([n[2] for n in ref]), rtol=1e-5, atol=1e-5)
        tree = DraftTree.from_parents(tokens[b], parent[b])
        assert torch.equal(masks[b], tree.ancestor_mask())
        assert tree.dedup_siblings().num_nodes == tree.num_nodes  # siblings carry distinct tokens


def test_widths_are_checked():
    spec = random_speculator(tiny_causal_lm("llama"))
    with pytest.raises(ValueError, match=r"widths\[1\]=7: depth 2 can hold 1 to 6 nodes"):
        MLPSpeculatorAssistant(spec, widths=[3, 7])
    with pytest.raises(ValueError, match="4 deep but the speculator has 3 stages"):
        MLPSpeculatorAssistant(spec, widths=[1, 1, 1, 1])


# --------------------------------------------------------------------------------------------- greedy equality
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_matches_vanilla(tiny_models, arch, batch):
    model = tiny_models[arch]
    ids, mask = left_pad(PROMPTS[:batch])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    token_map = torch.arange(3, 60)  # roots and targets outside the draft vocabulary happen
    cases = {
        "untied": random_speculator(model),
        "tied-truncated": random_speculator(model, seed=1, token_map=token_map, tie_weights=True),
        "wide-tree": MLPSpeculatorAssistant(random_speculator(model, seed=2), widths=[3, 6, 6]),
        "step-cost prior": MLPSpeculatorAssistant(
            random_speculator(model), step_cost={n: 1.0 + 0.05 * n for n in range(16)}
        ),
    }
    for name, assistant in cases.items():
        for budget in (False, True):  # the trees as proposed; cut by the loop's tree budget (the default)
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=24, do_sample=False, assistant=assistant,
                return_dict_in_generate=True, tree_budget=budget,
            )  # fmt: skip
            assert_same_tokens(out.sequences, expected, f"{arch} batch={batch} {name} tree_budget={budget}")
            assert budget or out.spec_stats.drafted_tokens > 0, name


def test_assistant_resolution_and_target_check():
    model = tiny_causal_lm("llama")
    spec = random_speculator(model)
    proposer = as_proposer(spec, model)
    # the candidate widths (the speculator's defaults, widened where its product tree reaches): the budget sizes them
    assert isinstance(proposer, MLPSpeculatorAssistant) and proposer.widths == budget_widths(spec, [3, 5, 5])
    assert spec.default_widths() == [3, 5, 5]
    other = tiny_causal_lm("llama", hidden_size=32)
    with pytest.raises(ValueError, match="hidden size 64 cannot serve a model with hidden size 32"):
        other.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, assistant=spec)


# --------------------------------------------------------------------------------------------- exact sampling
E2E_ROWS = 3000


@pytest.fixture(scope="module")
def e2e_model():
    return sampling_target()


def e2e_assistant(model) -> MLPSpeculatorAssistant:
    spec = random_speculator(model, seed=4, inner_dim=16, top_k_tokens_per_head=[4, 3, 2])
    return MLPSpeculatorAssistant(spec, widths=[4, 6, 4])


def test_sampling_with_speculator_trees_matches_the_target_distribution(e2e_model):
    counts = sample_first_tokens(e2e_model, e2e_assistant(e2e_model), E2E_ROWS, tree_budget=False)
    ps = first_tokens_p_values(counts, e2e_model)
    assert min(ps) > 1e-4, f"chi-square p-values of the first 1, 2, 3 tokens: {ps}"


def test_a_wrong_verifier_is_caught_with_these_trees(e2e_model):
    """The harness has power: verifying the speculator's trees greedily while sampling must be rejected."""
    with greedy_verification():
        counts = sample_first_tokens(e2e_model, e2e_assistant(e2e_model), E2E_ROWS // 3, tree_budget=False)
    ps = first_tokens_p_values(counts, e2e_model)
    assert min(ps) < 1e-6, f"greedy verification of a sampled call was not caught: p-values {ps}"


# --------------------------------------------------------------------------------------------- default model
SHIPPED = Path(hf_specdec.__file__).parent / "assets" / "mlp-speculator-smollm2-135m-instruct"


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 4])
def test_default_model_with_the_shipped_speculator_matches_vanilla(default_model, batch):
    model, tok = default_model
    spec = MLPSpeculator.from_pretrained(SHIPPED, base_model=model, dtype=torch.float32)
    ids, mask = spec_bench_batch(tok, batch)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    for budget in (False, True):  # its own trees, and the loop's default tree budget
        out = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, assistant=spec,
                             return_dict_in_generate=True, tree_budget=budget)  # fmt: skip
        assert_same_tokens(out.sequences, expected, f"default model batch={batch} tree_budget={budget}")
        assert budget or out.spec_stats.drafted_tokens > 0, out.spec_stats
