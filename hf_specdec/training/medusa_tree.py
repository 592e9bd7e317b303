"""Choosing the static tree of trained Medusa heads from measured acceptance and measured verification cost.

Greedy self-distillation data is exactly what greedy decoding verifies: at position t the target's next tokens are
``input_ids[t + 2 ...]`` and the heads' guesses come from ``hidden[t]``. So for held-out positions the table
``match[p, d, k]`` (head d's rank-k guess is the token at depth d + 1) tells, for *any* static tree, how many draft
tokens it would accept there — no decoding needed. `tune_tree` then

1. turns ``match`` into per-depth, per-rank acceptance (``acceptance_table``) and builds the best tree of every size
   with Sequoia's dynamic programme (`optimal_tree_choices`),
2. scores each tree exactly on the held-out positions (`tree_tau`: mean tokens per step, the bonus token included),
3. divides by the verification cost measured on this machine, ``cost(n) = (t_verify(n + 1 tokens) + t_heads) /
   t_verify(1 token)`` over a committed context of typical length, and keeps the size with the best predicted
   speedup ``tau(n) / cost(n)``.

    tuning = tune_tree(heads, data, positions, model)
    heads.tree_choices = tuning.choices
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..generation.tree_shapes import optimal_tree_choices
from ..heads.medusa import MedusaHeads
from .labels import head_positions, medusa_labels
from .medusa import MedusaTrainingConfig
from .run import REPORT_NAME, split_sequences
from .shards import DistillationData, write_json
from .step_cost import step_cost_curve

DEFAULT_TREE_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)


@torch.no_grad()
def guess_matches(
    heads: MedusaHeads,
    data: DistillationData,
    positions: torch.Tensor,
    lm_head: torch.nn.Module,
    k: int = 8,
    chunk: int = 512,
) -> torch.Tensor:
    """`[P, D, k]` bool: whether head d's rank-r guess at position t equals the target's token t + d + 2 (False
    where the sequence has ended), for D = ``heads.num_heads``."""
    d = heads.num_heads
    was_training = heads.training
    heads.eval()
    out = []
    for start in range(0, positions.numel(), chunk):
        pos = positions[start : start + chunk]
        hidden = data.hidden[pos].float()  # [p, H]
        top = heads.topk_tokens(hidden, k, lm_head=lm_head).cpu()  # [p, D, k]
        labels = medusa_labels(data, pos, d).T  # [p, D], IGNORE (< 0) never matches
        out.append(top == labels.unsqueeze(-1))
    heads.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, d, k, dtype=torch.bool)


def acceptance_table(match: torch.Tensor) -> list[list[float]]:
    """``acceptance[d][r]``: P(head d's rank-r guess is right | every shallower head had the right token among its
    top k) — the per-depth acceptance `optimal_tree_choices` expects, estimated from ``match`` `[P, D, k]`."""
    alive = torch.ones(match.shape[0], dtype=torch.bool)
    table = []
    for d in range(match.shape[1]):
        n = int(alive.sum())
        table.append([float(x) / max(n, 1) for x in match[alive, d].sum(0).tolist()])
        alive &= match[:, d].any(-1)
    return table


def accepted_depths(choices: Sequence[Sequence[int]], match: torch.Tensor) -> torch.Tensor:
    """`[P]` int64: at each position of ``match`` `[P, D, k]`, the depth of the deepest node of the static tree
    ``choices`` that greedy verification accepts (a node is accepted where every guess on its path is right)."""
    accepted = torch.zeros(match.shape[0], dtype=torch.long)
    ok: dict[tuple[int, ...], torch.Tensor] = {(): torch.ones(match.shape[0], dtype=torch.bool)}
    for path in sorted({tuple(c) for c in choices}, key=len):
        if len(path) > match.shape[1] or max(path) >= match.shape[2]:
            raise ValueError(f"tree choice {list(path)} needs more heads or ranks than the match table has")
        parent = ok.get(path[:-1])
        if parent is None:
            raise ValueError(f"tree choice {list(path)} has no parent {list(path[:-1])} in the tree")
        ok[path] = parent & match[:, len(path) - 1, path[-1]]
        accepted = torch.where(ok[path], torch.clamp(accepted, min=len(path)), accepted)
    return accepted


def tree_tau(choices: Sequence[Sequence[int]], match: torch.Tensor) -> float:
    """Mean tokens per step (accepted drafts + the target's own token) of the static tree ``choices`` over the
    positions of ``match`` `[P, D, k]`."""
    if match.shape[0] == 0:
        return 1.0
    return 1.0 + float(accepted_depths(choices, match).float().mean())


def depth_acceptance(choices: Sequence[Sequence[int]], match: torch.Tensor) -> list[float]:
    """``q[k]``: for the static tree ``choices``, the fraction of positions whose accepted depth reaches k + 1 among
    those where it reaches k (reported with the chosen tree), over ``match`` `[P, D, k]`."""
    accepted = accepted_depths(choices, match)
    depth = max((len(c) for c in choices), default=0)
    return [float((accepted > k).sum()) / max(1, int((accepted >= k).sum())) for k in range(depth)]


@torch.no_grad()
def measure_step_cost(
    model: torch.nn.Module,
    heads: MedusaHeads,
    sizes: Sequence[int],
    context: int = 384,
    repeats: int = 7,
) -> dict[int, float]:
    """``cost[n]``: time of one speculative step with an ``n``-node tree relative to one plain decoding forward,
    on this machine (`step_cost_curve`), the heads' drafting over one hidden state timed after each verify forward
    (as in decoding, their weights are not cache-hot)."""
    device = next(model.parameters()).device
    hidden = torch.randn(1, heads.hidden_size, device=device)  # [1, H]
    lm_head = model.get_output_embeddings() if heads.share_lm_head else None
    k = max(1, min(8, heads.draft_vocab_size or heads.vocab_size or 8))
    return step_cost_curve(model, sizes, lambda: heads.topk_tokens(hidden, k, lm_head=lm_head), context, repeats)


@dataclass
class TreeTuning:
    """What `tune_tree` measured: for every size, the tree, its held-out τ, its cost and the predicted speedup."""

    choices: list[list[int]]
    acceptance: list[list[float]]
    rows: list[dict] = field(default_factory=list)  # {"nodes", "tau", "cost", "predicted_speedup", "choices"}
    depth_acceptance: list[float] = field(default_factory=list)  # of the chosen tree (`depth_acceptance`)

    @property
    def step_cost(self) -> dict[int, float]:
        """``{nodes: measured step cost}`` of every tree considered (reported with the chosen tree)."""
        return {r["nodes"]: r["cost"] for r in self.rows}

    def markdown(self) -> str:
        lines = ["| nodes | held-out τ | step cost | predicted speedup |", "|---:|---:|---:|---:|"]
        for r in self.rows:
            best = " **(chosen)**" if r["choices"] == self.choices else ""
            lines.append(f"| {r['nodes']} | {r['tau']:.3f} | {r['cost']:.3f} | {r['predicted_speedup']:.3f}x{best} |")
        return "\n".join(lines)


def tune_tree(
    heads: MedusaHeads,
    data: DistillationData,
    positions: torch.Tensor,
    model: torch.nn.Module,
    sizes: Sequence[int] = DEFAULT_TREE_SIZES,
    max_rank: int = 8,
    cost: dict[int, float] | None = None,
    context: int = 384,
) -> TreeTuning:
    """The static tree with the best predicted speedup for ``heads`` on this machine (see the module docstring).

    Args:
        heads: trained heads for ``model``.
        data / positions: held-out self-distillation data (`head_positions` of sequences not trained on).
        model: the target (its lm_head for shared heads; its forward for the cost measurement).
        sizes: tree sizes (draft nodes, root excluded) to consider.
        max_rank: guesses per head considered.
        cost: ``{n: cost}`` to use instead of measuring (e.g. measured once on another machine).
        context: committed tokens for the cost measurement.
    """
    lm_head = model.get_output_embeddings()
    k = min(max_rank, heads.draft_vocab_size or heads.vocab_size or max_rank)
    match = guess_matches(heads, data, positions, lm_head, k)
    acceptance = acceptance_table(match)
    costs = cost if cost is not None else measure_step_cost(model, heads, sizes, context)
    # drafting nothing is always an option (cost 1, τ 1); a budget the heads cannot use (every further guess has zero
    # measured acceptance) yields a smaller tree already listed, or one whose cost was not measured: skipped
    rows = [{"nodes": 0, "tau": 1.0, "cost": 1.0, "predicted_speedup": 1.0, "choices": []}]
    for n in sizes:
        choices = optimal_tree_choices(acceptance, n)
        if len(choices) in {r["nodes"] for r in rows} or len(choices) not in costs:
            continue
        tau = tree_tau(choices, match)
        c = float(costs[len(choices)])
        rows.append({"nodes": len(choices), "tau": tau, "cost": c, "predicted_speedup": tau / c, "choices": choices})
    best = max(rows, key=lambda r: r["predicted_speedup"])
    return TreeTuning(
        choices=best["choices"],
        acceptance=acceptance,
        rows=rows,
        depth_acceptance=depth_acceptance(best["choices"], match),
    )


def tune_and_save_tree(
    heads: MedusaHeads,
    data: DistillationData,
    out_dir: str | os.PathLike,
    model: torch.nn.Module,
    config: MedusaTrainingConfig,
    report: dict,
) -> TreeTuning:
    """`tune_tree` on the held-out sequences of ``config``'s split, then store the result where `train_medusa` put the
    heads: the tree, its costs and per-depth acceptance in the heads' config and model card (``save_pretrained``),
    the table in ``training_report.json``."""
    t0 = time.perf_counter()
    _, eval_seqs = split_sequences(data, config.eval_fraction, config.seed)
    tuning = tune_tree(heads, data, head_positions(data, eval_seqs), model)
    best = next(r for r in tuning.rows if r["choices"] == tuning.choices)
    heads.tree_choices = tuning.choices
    heads.model_card["tree"] = {
        "nodes": len(tuning.choices),
        "held_out_tau": round(best["tau"], 3),
        "measured_step_cost": round(best["cost"], 3),
        # for the run-time depth choice (MedusaAssistant(adaptive=...)): cost per tree size, acceptance per depth
        "step_cost": {str(n): round(c, 4) for n, c in tuning.step_cost.items()},
        "depth_acceptance": [round(q, 4) for q in tuning.depth_acceptance],
        "chosen_by": "held-out acceptance x verify cost measured on the training machine",
    }
    heads.save_pretrained(out_dir)
    report["tree_tuning"] = {
        "time_s": round(time.perf_counter() - t0, 1),
        "acceptance": [[round(x, 4) for x in row] for row in tuning.acceptance],
        "rows": [{**r, "tau": round(r["tau"], 4), "cost": round(r["cost"], 4)} for r in tuning.rows],
        "chosen": tuning.choices,
    }
    write_json(Path(out_dir) / REPORT_NAME, report)
    return tuning


__all__ = [
    "DEFAULT_TREE_SIZES",
    "accepted_depths",
    "TreeTuning",
    "acceptance_table",
    "depth_acceptance",
    "guess_matches",
    "measure_step_cost",
    "tree_tau",
    "tune_and_save_tree",
    "tune_tree",
]
