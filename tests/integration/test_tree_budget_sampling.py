"""Exact sampling holds when the tree budget cuts every row's tree differently at every step (chi-square of the
first three tokens against the enumerated target distribution, the harness of test_sampling_distribution.py)."""

from __future__ import annotations

import torch
from test_sampling_distribution import (  # noqa: F401  (e2e_model is a fixture)
    E2E_CONFIGS,
    E2E_ROWS,
    P_PASS,
    ExactTarget,
    RankedTreeProposer,
    SampledChainProposer,
    _describe,
    _generate_first_tokens,
    chi_square_p_values,
    e2e_model,
)

from hf_specdec.generation.budget import TreeBudgeter
from hf_specdec.generation.cost_model import StepCostModel, cost_grid


def swinging(inner_cls):
    """``inner_cls`` whose trees get scores that depend on the context, so the budget's cut of a row swings from step
    to step (and differs between rows that have generated different tokens)."""

    class Swinging(inner_cls):
        def propose(self, rows):
            trees = super().propose(rows)
            for row, tree in zip(rows, trees):
                level = (0.9, 0.45, 0.15)[(int(row.tokens[-1]) + row.tokens.numel()) % 3]
                tree.scores = torch.tensor([level ** int(d) for d in tree.depth])
                tree.source = "swinging"
            return trees

    return Swinging


def big_batch_budget(rows: int) -> TreeBudgeter:
    """A cost curve on which a node pays when its calibrated probability is above about an eighth at ``rows`` rows;
    the injected samples outweigh what the call measures."""
    cost = StepCostModel(window=10_000)
    for n in cost_grid():
        if rows // 2 <= n <= rows * 8:
            for _ in range(200):
                cost.record_verify(n, rows, 1.0 + n / (4 * rows))
    return TreeBudgeter(cost, explore_every=10**9)


def test_sampling_stays_exact_when_the_budget_cuts_every_step_differently(e2e_model):  # noqa: F811 (the fixture)
    for name, config, make in (
        ("ranked_tree", "temperature_top_k", swinging(RankedTreeProposer)),
        ("sampled_chain", "top_p", swinging(SampledChainProposer)),
    ):
        warpers = E2E_CONFIGS[config]
        exact = ExactTarget(e2e_model, warpers)
        budget = big_batch_budget(E2E_ROWS)
        # the budget drafts for a part of the rows only (its timings vary by machine): a lower floor of
        # two-token acceptances than the harness's 5% still leaves the chi-square its power on the first tokens
        counts = _generate_first_tokens(
            e2e_model, make(exact), warpers, E2E_ROWS, exact.pad, tree_budget=budget, min_depth2=0.02
        )
        sizes = budget.summary()["nodes_per_row"]
        assert len(sizes) >= 2, f"{name}: the budget should cut rows differently, got {sizes}"
        p_values = chi_square_p_values(counts, exact.joint)
        assert min(p_values.values()) > P_PASS, (
            f"{name} with {warpers} and a swinging budget: chi-square p-values {p_values}; first two tokens "
            f"(observed vs exact): {_describe(counts, exact.joint, 2)}"
        )
