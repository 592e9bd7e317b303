"""MLP speculator proposer: token trees from an `MLPSpeculator`'s stages (Wertheimer et al. 2024, arXiv:2404.19124).

The loop hands the target's final normed hidden states (``hidden_state_layers = (-1,)``) of every token entering its
KV cache; the proposer keeps the last one per row: the state the target's lm_head turned into the current root. Stage
0 reads it with the root and guesses depth 1; stage d reads the state stage d - 1 computed at a depth-d node's parent
and that node's token, and guesses depth d + 1.

The tree is upstream's product tree (each node's ``top_k_tokens_per_head[d]`` best children) trimmed by cumulative
log-probability, level by level like a beam: at depth d + 1 only the ``widths[d]`` best-scored children of the kept
depth-d nodes survive (score = the sum of the stages' log-probabilities along the path). Every row of the batch is
drafted at once: one `[B, w, inner]` stage per depth and one top-k, no per-node Python.

As for Medusa and EAGLE, the speculator proposes wide candidate levels (`BUDGET_WIDTH` per level where the product
tree reaches that far, unless the caller chose ``widths``) with each node's path probability as its score, and the
loop's tree budget keeps what pays on this machine (``tree_budget=False`` verifies the levels whole); the shipped
step costs are the budget's prior cost curve.

Children are the deterministic top-k of the speculator (`DraftSampling.DETERMINISTIC`): greedy verification accepts
the target's argmax, and exact sampling uses the residual accept-and-remove rule, so sampling stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...heads.mlp_speculator import MLPSpeculator
from ..cost_model import PriorCurve
from ..tree import DraftSampling, DraftTree
from .base import Proposer, ProposerSetup, RowState, drafting_head
from .final_state import FinalStateAssistant

BUDGET_WIDTH = 8  # candidate nodes per level (where reachable); the loop's tree budget keeps what pays


def check_widths(widths: Sequence[int], spec: MLPSpeculator) -> list[int]:
    """``widths`` as ints, checked: at most ``n_predict`` depths, each at least 1 and reachable (a level cannot hold
    more nodes than its parents have top-k children, nor more than the draft vocabulary)."""
    widths = [int(w) for w in widths]
    if len(widths) > spec.n_predict:
        raise ValueError(f"widths={widths} is {len(widths)} deep but the speculator has {spec.n_predict} stages")
    parents = 1
    for d, w in enumerate(widths):
        reachable = min(parents * spec.top_k_tokens_per_head[d], spec.draft_vocab_size or spec.vocab_size)
        if not 1 <= w <= reachable:
            raise ValueError(
                f"widths[{d}]={w}: depth {d + 1} can hold 1 to {reachable} nodes ({parents} parent(s) x "
                f"top_k_tokens_per_head[{d}]={spec.top_k_tokens_per_head[d]})"
            )
        parents = w
    return widths


@torch.no_grad()
def draft_tree_batch(
    spec: MLPSpeculator, hidden: torch.Tensor, roots: torch.Tensor, widths: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The trimmed product tree of every row at once.

    Args:
        spec: the speculator.
        hidden: `[B, H]` the target's final hidden state at each row's last committed token.
        roots: `[B]` int64 each row's root token.
        widths: nodes kept per depth (`check_widths`).
    Returns:
        ``(tokens, parent, scores)``: `[B, N]` int64 token ids, `[B, N]` int64 parent node indices (-1 = root) and
        `[B, N]` float32 cumulative log-probabilities, N = ``sum(widths)``, nodes level by level (best first within
        a level), so the tree cut at depth d is the first ``sum(widths[:d])`` nodes.
    """
    b = hidden.shape[0]
    state = spec.base_state(hidden).unsqueeze(1)  # [B, 1, H]
    rows = spec.emb_rows(roots.to(state.device)).unsqueeze(1)  # [B, 1] emb rows of the fed tokens
    score = torch.zeros(b, 1, device=state.device)  # [B, C] cumulative log-probability of the current level
    tokens, parents, scores = [], [], []
    level_start = 0  # node index of the first node of the current level (parents of the next)
    for d, width in enumerate(widths):
        state = spec.stage(d, state, rows)  # [B, C, inner]
        logp = spec.stage_logits(d, state).float().log_softmax(-1)  # [B, C, V']
        k = min(spec.top_k_tokens_per_head[d], width, logp.shape[-1])
        top = logp.topk(k, dim=-1)  # [B, C, k]
        best = (score.unsqueeze(-1) + top.values).flatten(1).topk(width, dim=-1)  # [B, w]
        parent = torch.div(best.indices, k, rounding_mode="floor")  # [B, w] index within the current level
        rows = top.indices.flatten(1).gather(1, best.indices)  # [B, w] draft index == emb row
        tokens.append(spec.draft_to_token(rows))
        parents.append(parent + level_start if d else torch.full_like(parent, -1))
        scores.append(best.values)
        if d:
            level_start += widths[d - 1]
        state = state.gather(1, parent.unsqueeze(-1).expand(-1, -1, state.shape[-1]))  # [B, w, inner]
        score = best.values
    return torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(scores, 1)


def ancestor_masks(parent: torch.Tensor, widths: Sequence[int]) -> torch.Tensor:
    """`[B, N + 1, N + 1]` bool ancestor masks (tree positions, 0 = root) of level-ordered trees `[B, N]`, built one
    level at a time for the whole batch."""
    b, n = parent.shape
    mask = torch.eye(n + 1, dtype=torch.bool, device=parent.device).expand(b, -1, -1).clone()
    mask[:, :, 0] = True
    start = 0
    for width in widths:
        rows = slice(start + 1, start + width + 1)
        par_rows = mask.gather(1, (parent[:, start : start + width] + 1).unsqueeze(-1).expand(-1, -1, n + 1))
        mask[:, rows] |= par_rows
        start += width
    return mask


def budget_widths(spec: MLPSpeculator, widths: Sequence[int]) -> list[int]:
    """Candidate level widths: each level of ``widths`` widened to `BUDGET_WIDTH` nodes where the product tree
    reaches that far (never narrower than ``widths``)."""
    out, parents = [], 1
    vocab = spec.draft_vocab_size or spec.vocab_size
    for d, w in enumerate(widths):
        reachable = min(parents * spec.top_k_tokens_per_head[d], vocab)
        out.append(max(w, min(BUDGET_WIDTH, reachable)))
        parents = out[-1]
    return check_widths(out, spec)


class MLPSpeculatorAssistant(FinalStateAssistant):
    """Drafts level-trimmed product trees from an `MLPSpeculator` (deterministic top-k children).

    Args:
        speculator: the speculator.
        widths: nodes kept per depth; default: the speculator's ``tree["widths"]`` (else upstream's n_candidates
            paths, `default_widths`) widened to `BUDGET_WIDTH` candidates per level (`budget_widths`).
        step_cost: ``{nodes: cost of a step / a plain decoding step}``; default: the speculator's ``tree.step_cost``:
            the tree budget's prior cost curve (see the module docstring).
    """

    sampling = DraftSampling.DETERMINISTIC

    def __init__(
        self,
        speculator: MLPSpeculator,
        widths: Sequence[int] | None = None,
        step_cost: dict[int, float] | None = None,
    ):
        if not isinstance(speculator, MLPSpeculator):
            raise TypeError(f"MLPSpeculatorAssistant needs an MLPSpeculator, got {type(speculator).__name__}")
        self.speculator = speculator
        if widths is None:
            widths = budget_widths(speculator, check_widths(speculator.default_widths(), speculator))
        self.widths = check_widths(widths, speculator)
        if step_cost is None:
            step_cost = {int(n): float(c) for n, c in (speculator.tree.get("step_cost") or {}).items()} or None
        self.prior_cost = PriorCurve.from_node_costs(step_cost) if step_cost else None
        self._last_hidden: dict[int, torch.Tensor] = {}
        self._draft = speculator

    def validate(self, target: torch.nn.Module) -> None:
        self.speculator.check_compatible(target)

    def start(self, setup: ProposerSetup) -> None:
        super().start(setup)
        self._draft = drafting_head(self.speculator)  # the speculator, or its copy in this machine's fastest dtype

    def finish(self) -> None:
        super().finish()
        self._draft = self.speculator

    def drafting_modules(self) -> tuple[torch.nn.Module, ...]:
        return (self._draft,)

    @torch.no_grad()
    def propose(self, rows: Sequence[RowState]) -> list[DraftTree]:
        cuts = [min(r.max_depth, len(self.widths)) if r.row in self._last_hidden else 0 for r in rows]
        trees = [DraftTree.empty(r.tokens.device) for r in rows]
        ready = [i for i, c in enumerate(cuts) if c > 0]
        if not ready:
            return trees
        widths = self.widths[: max(cuts[i] for i in ready)]
        nodes_at_depth = [sum(widths[:d]) for d in range(len(widths) + 1)]
        hidden = torch.stack([self._last_hidden[rows[i].row] for i in ready])  # [B, H]
        roots = torch.tensor([rows[i].root for i in ready], dtype=torch.long)  # [B]
        tokens, parent, logp = draft_tree_batch(self._draft, hidden, roots, widths)  # [B, N] each
        depth = torch.repeat_interleave(torch.arange(1, len(widths) + 1), torch.tensor(widths))  # [N]
        device = rows[ready[0]].tokens.device
        tokens, parent, depth = tokens.to(device), parent.to(device), depth.to(device)
        masks = ancestor_masks(parent, widths)  # [B, N + 1, N + 1]
        probs = logp.exp()  # [B, N]
        for j, i in enumerate(ready):
            n = nodes_at_depth[cuts[i]]
            trees[i] = DraftTree(
                tokens[j, :n],
                parent[j, :n],
                depth[:n],
                DraftSampling.DETERMINISTIC,
                _ancestors=masks[j, : n + 1, : n + 1],
                depth_bound=cuts[i],
            )
            # the draft's path probability per node, for the tree budget that ranks nodes across rows and assistants
            trees[i].scores, trees[i].source = probs[j, :n], "mlp_speculator"
        return trees


def mlp_speculator_assistant_for(obj, target) -> Proposer | None:
    """``assistant=`` resolver: an `MLPSpeculatorAssistant` when ``obj`` is an `MLPSpeculator`, else None."""
    if isinstance(obj, MLPSpeculator):
        return MLPSpeculatorAssistant(obj)
    return None
