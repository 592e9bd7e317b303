"""The loop's tree budget through `model.generate`: greedy output stays vanilla's with budgets that change every step,
`spec_stats` reports the measured cost curve and the budgets, the cost curve is kept per model across calls."""

from __future__ import annotations

import pytest
import torch

import hf_specdec
from hf_specdec.generation.budget import TreeBudgeter
from hf_specdec.generation.cost_model import StepCostModel, cost_model_for
from hf_specdec.testing import OracleProposer, RandomTreeProposer, assert_same_tokens, left_pad, tiny_causal_lm

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [3, 4, 5], [9, 9, 8, 7, 6, 5, 4], [12, 13, 12, 13, 12, 13, 12, 13, 12]]


class OracleScoredTrees(OracleProposer):
    """`OracleProposer`'s trees (the target's greedy continuation with a wrong sibling per level), scored so that the
    budget's choice swings every step: the scores depend on the context length (a function of the context only)."""

    def __init__(self, model, depth: int = 6):
        super().__init__(model, depth)

    def propose(self, rows):
        trees = super().propose(rows)
        for r, tree in zip(rows, trees):
            level = [0.95, 0.5, 0.2, 0.05][r.tokens.numel() % 4]  # swings with the context length
            tree.scores = torch.tensor([level ** int(x) for x in tree.depth])
            tree.source = "oracle"
        return trees


def cpu_like_budget() -> TreeBudgeter:
    cost = StepCostModel()
    for n in range(1, 80):
        for _ in range(3):
            cost.record_verify(n, 1, 0.02 * (1 + 0.1 * (n - 1)))
    return TreeBudgeter(cost, explore_every=10**9)


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_matches_vanilla_with_budgets_that_change_every_step(tiny_models, batch):
    model = tiny_models["llama"]
    ids, mask = left_pad(PROMPTS[:batch])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    for name, assistant in {
        "oracle": OracleScoredTrees(model),
        "random": RandomTreeProposer(model.config.vocab_size, nodes=8),
        "ngram": hf_specdec.NgramAssistant(),
    }.items():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=24,
            do_sample=False,
            assistant=assistant,
            tree_budget=cpu_like_budget(),
            return_dict_in_generate=True,
        )
        assert_same_tokens(out.sequences, expected, f"batch={batch} assistant={name}")
        if name == "oracle":
            sizes = out.spec_stats.budget["nodes_per_row"]
            assert len(sizes) >= 3, f"the budget should change with the scores, got {sizes}"


def test_spec_stats_report_the_cost_curve_and_the_budgets():
    model = tiny_causal_lm("llama", seed=3)
    ids = torch.tensor([PROMPTS[0]])
    out = model.generate(
        ids, max_new_tokens=16, do_sample=False, assistant=OracleScoredTrees(model), return_dict_in_generate=True
    )
    stats = out.spec_stats
    budget = stats.budget
    assert sum(budget["nodes_per_row"].values()) == stats.steps
    assert sum(n * k for n, k in budget["nodes_per_row"].items()) == stats.drafted_tokens
    assert budget["cost"]["curve"] and all(s > 0 for s in budget["cost"]["curve"].values())
    # every step is a cost sample, but those whose forward also timed slower GEMM forms (the CPU tuner's trials)
    assert sum(budget["cost"]["samples"].values()) + budget["unfair_samples"] == stats.steps
    assert "oracle" in budget["calibration"]
    assert "budget" in stats.to_dict()


def test_tree_budget_false_verifies_trees_as_proposed():
    model = tiny_causal_lm("llama", seed=4)
    ids = torch.tensor([PROMPTS[2]])

    class Counting(RandomTreeProposer):
        proposed = 0

        def propose(self, rows):
            trees = super().propose(rows)
            Counting.proposed += sum(int((t.depth <= r.max_depth).sum()) for t, r in zip(trees, rows))
            return trees

    proposer = Counting(model.config.vocab_size, nodes=6)
    out = model.generate(
        ids, max_new_tokens=12, do_sample=False, assistant=proposer, tree_budget=False, return_dict_in_generate=True
    )
    assert out.spec_stats.budget == {}
    assert out.spec_stats.drafted_tokens == Counting.proposed > 0
    with pytest.raises(TypeError, match="tree_budget"):
        model.generate(ids, max_new_tokens=2, do_sample=False, assistant=proposer, tree_budget="yes")


def test_the_cost_curve_is_kept_per_model_across_calls_and_not_on_the_model():
    model = tiny_causal_lm("llama", seed=5)
    keys = set(model.__dict__)
    config = model.config.to_dict()
    ids = torch.tensor([PROMPTS[0]])
    model.generate(ids, max_new_tokens=6, do_sample=False, assistant=hf_specdec.NgramAssistant())
    first = cost_model_for(model).num_samples
    model.generate(ids, max_new_tokens=6, do_sample=False, assistant=hf_specdec.NgramAssistant())
    assert cost_model_for(model).num_samples > first > 0
    assert set(model.__dict__) == keys and model.config.to_dict() == config
