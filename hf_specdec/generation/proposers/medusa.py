"""Medusa proposer: the heads' top-k guesses arranged in a static token tree (Cai et al. 2024, arXiv:2401.10774).

The loop asks for the target's final normed hidden states (``hidden_state_layers = (-1,)``) of every token that
enters its KV cache; the proposer keeps the last one per row. That hidden state is the one the target's lm_head
turned into the current root, so Medusa head 0 applied to it guesses the token *after* the root (tree depth 1), head
k guesses depth k + 1. No second target pass is needed.

Each step runs all heads over all active rows in one batched matmul, takes the top-k of each head and lays the
tokens out on a static tree (a Medusa choices list, `DraftTree.from_choices` semantics): node ``[a, b]`` is head 0's
(a+1)-th guess followed by head 1's (b+1)-th. The tree is cut to each row's remaining budget (``max_depth``).

The default tree is Sequoia's optimum for a generic acceptance profile (``generation/tree_shapes.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...heads.medusa import MedusaHeads
from ..cost_model import PriorCurve
from ..tree import DraftSampling, DraftTree
from ..tree_shapes import optimal_tree_choices, prior_acceptance
from .base import Proposer, ProposerSetup, RowState, drafting_head
from .final_state import AdaptiveDepth, FinalStateAssistant

BUDGET_CANDIDATES = 48  # candidate nodes per row when the loop's tree budget sizes the trees
DEFAULT_NUM_NODES = 20  # CPU-sized default tree; GPUs verify ~64 nodes for about the cost of one
DEFAULT_MAX_DEPTH = 5


# --------------------------------------------------------------------------------------------- static trees
def default_tree_choices(num_heads: int, num_nodes: int = DEFAULT_NUM_NODES) -> list[list[int]]:
    """A tree of at most ``num_nodes`` nodes, ``min(num_heads, 5)`` deep: the top-1 chain through every head plus
    the rest of the budget spent as `optimal_tree_choices` would for `prior_acceptance`."""
    depth = min(num_heads, DEFAULT_MAX_DEPTH, max(num_nodes, 0))
    chain = {(0,) * d for d in range(1, depth + 1)}
    prior = prior_acceptance(depth)
    for budget in range(num_nodes, -1, -1):
        tree = {tuple(c) for c in optimal_tree_choices(prior, budget)} | chain
        if len(tree) <= num_nodes:
            return sorted((list(c) for c in tree), key=lambda c: (len(c), c))
    return []


class StaticTreeTemplate:
    """The node structure of a choices list, built once; a row's tree is then a gather of its top-k tokens.

    ``codes[i] = (depth_i - 1) * K + rank_i`` indexes the flattened `[depth, K]` top-k table of a row, so the row's
    tokens are ``topk.view(D * K)[codes]`` for every row at once. The structure is exactly
    ``DraftTree.from_choices(choices, topk)``'s (it is built by that function on the codes); since one head's top-k
    tokens are distinct, siblings never carry the same token and no deduplication is needed per row.
    """

    def __init__(self, choices: Sequence[Sequence[int]], num_heads: int):
        paths = sorted({tuple(int(x) for x in c) for c in choices if len(c)}, key=lambda c: (len(c), c))
        for path in paths:
            if min(path) < 0:
                raise ValueError(f"tree choice {list(path)} has a negative rank")
        self.choices = [list(p) for p in paths]
        self.depth = max((len(p) for p in paths), default=0)
        self.k = max((max(p) for p in paths), default=-1) + 1
        if self.depth > num_heads:
            deepest = next(p for p in paths if len(p) == self.depth)
            raise ValueError(
                f"tree choice {list(deepest)} is {self.depth} deep but the Medusa heads have {num_heads} heads; "
                f"use choices at most {num_heads} deep"
            )
        codes = torch.arange(max(self.depth, 1) * max(self.k, 1), dtype=torch.long).view(max(self.depth, 1), -1)
        tree = DraftTree.from_choices(self.choices, codes) if paths else DraftTree.empty()
        self.codes, self.parent, self.node_depth = tree.tokens, tree.parent, tree.depth
        self._cut: dict[tuple[int, str], tuple[torch.Tensor, ...]] = {}

    @property
    def num_nodes(self) -> int:
        return int(self.codes.numel())

    def cut(
        self, max_depth: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(codes, parent, depth, ancestor_mask)`` of the nodes at most ``max_depth`` deep, on ``device``."""
        key = (min(max_depth, self.depth), str(device))
        if key not in self._cut:
            keep = self.node_depth <= key[0]
            tree = DraftTree(self.codes, self.parent, self.node_depth).subtree_keep(keep)
            tree = tree.to(device)
            self._cut[key] = (tree.tokens, tree.parent, tree.depth, tree.ancestor_mask())
        return self._cut[key]


# --------------------------------------------------------------------------------------------- proposer
class MedusaAssistant(FinalStateAssistant):
    """Drafts a static token tree from `MedusaHeads` (deterministic top-k children).

    Args:
        heads: the Medusa heads.
        tree_choices: a Medusa choices list such as ``[[0], [0, 0], [1]]``; default: ``heads.tree_choices``, else
            `default_tree_choices` with ``num_nodes`` nodes.
        num_nodes: size of the default tree (ignored when choices are given).
        adaptive: cut the tree per row and step to the depth that pays, from the row's measured acceptance and the
            step cost (`AdaptiveDepth`). Needs a cost table: ``step_cost`` or the heads' tuned one (their model
            card's ``tree.step_cost``, written by `hf-specdec train medusa`); ``None`` = on when one is available.
        step_cost: ``{nodes: cost relative to a plain decoding step}`` for ``adaptive``.

    With the loop's tree budget (the default; ``ProposerSetup.budget``) the heads propose a larger candidate tree
    (``tree_choices`` when given, else `default_tree_choices` with `BUDGET_CANDIDATES` nodes) whose node scores are
    the heads' own probabilities multiplied down each path, and the budget keeps the nodes that pay on this machine;
    ``adaptive`` and the tuned tree then serve only without the budget, and the tuned step costs become the budget's
    prior cost curve.
    """

    sampling = DraftSampling.DETERMINISTIC

    def __init__(
        self,
        heads: MedusaHeads,
        tree_choices: Sequence[Sequence[int]] | None = None,
        num_nodes: int = DEFAULT_NUM_NODES,
        adaptive: bool | None = None,
        step_cost: dict[int, float] | None = None,
    ):
        if not isinstance(heads, MedusaHeads):
            raise TypeError(f"MedusaAssistant needs MedusaHeads, got {type(heads).__name__}")
        self.heads = heads
        # the heads' own tuned tree (possibly empty: drafting does not pay) comes with its measured costs
        tuned_tree = tree_choices is None and heads.tree_choices is not None
        user_choices = tree_choices is not None
        if tree_choices is None:
            tree_choices = (
                heads.tree_choices
                if heads.tree_choices is not None
                else default_tree_choices(heads.num_heads, num_nodes)
            )
        self.template = StaticTreeTemplate(tree_choices, heads.num_heads)
        candidates = default_tree_choices(heads.num_heads, max(num_nodes, BUDGET_CANDIDATES))
        self.candidates = StaticTreeTemplate(tree_choices if user_choices else candidates, heads.num_heads)
        vocab = heads.draft_vocab_size or heads.vocab_size
        if vocab is not None and self.template.k > vocab:
            raise ValueError(f"the tree uses rank {self.template.k - 1} but the heads predict only {vocab} tokens")
        self._last_hidden: dict[int, torch.Tensor] = {}
        self._lm_head = None
        self._draft_heads = heads
        self.adaptive = self._adaptive_depth(adaptive, step_cost, tuned_tree)
        self.prior_cost = self._tuned_costs(step_cost, tuned_tree)

    def _tuned_costs(self, step_cost, tuned_tree: bool) -> PriorCurve | None:
        """The step costs measured when the tree was tuned, as the tree budget's prior cost curve."""
        if step_cost is None and tuned_tree:
            step_cost = ((self.heads.model_card or {}).get("tree") or {}).get("step_cost")
        return PriorCurve.from_node_costs(step_cost) if step_cost else None

    def _adaptive_depth(self, adaptive, step_cost, tuned_tree: bool) -> AdaptiveDepth | None:
        tuned = (self.heads.model_card or {}).get("tree") or {}
        if step_cost is None and tuned_tree:
            step_cost = {int(n): float(c) for n, c in (tuned.get("step_cost") or {}).items()} or None
        if adaptive is False or (adaptive is None and step_cost is None) or self.template.depth == 0:
            return None
        if step_cost is None:
            raise ValueError(
                "adaptive=True needs step_cost={nodes: cost} (or heads whose model card holds the tuned tree's costs)"
            )
        depth = self.template.node_depth
        nodes = [int((depth <= d).sum()) for d in range(self.template.depth + 1)]
        prior = tuned.get("depth_acceptance") if tuned_tree else None
        return AdaptiveDepth(nodes, step_cost, prior or [0.5] * self.template.depth)

    @property
    def tree_choices(self) -> list[list[int]]:
        return self.template.choices

    def validate(self, target: torch.nn.Module) -> None:
        self.heads.check_compatible(target)

    def start(self, setup: ProposerSetup) -> None:
        super().start(setup)
        self._lm_head = setup.target.get_output_embeddings() if self.heads.share_lm_head else None
        self._draft_heads = drafting_head(self.heads)  # the heads, or their copy in this machine's fastest dtype

    @torch.no_grad()
    def propose(self, rows: Sequence[RowState]) -> list[DraftTree]:
        trees: list[DraftTree | None] = [None] * len(rows)
        ready = [i for i, r in enumerate(rows) if r.max_depth > 0 and r.row in self._last_hidden]
        budgeted = self.budget is not None
        tmpl = self.candidates if budgeted else self.template
        if ready and tmpl.num_nodes:
            x = torch.stack([self._last_hidden[rows[i].row] for i in ready])  # [B, H]
            depth = min(tmpl.depth, max(rows[i].max_depth for i in ready))  # heads past every row's cap never run
            top, logp = self._topk(x, tmpl, depth)  # [B, D, K] tokens, and their log-probabilities under the heads
            device = rows[ready[0]].tokens.device
            flat = top.reshape(len(ready), -1).to(device)  # [B, D * K]
            flat_logp = None if logp is None else logp.reshape(len(ready), -1).to(device)  # [B, D * K]
            for j, i in enumerate(ready):
                cut = rows[i].max_depth
                if self.adaptive is not None and not budgeted:
                    cut = self.adaptive.depth(rows[i].row, cut)
                if cut == 0:
                    continue
                codes, parent, depth, ancestors = tmpl.cut(cut, device)
                scores = None
                if flat_logp is not None:  # path probability: the heads' probabilities multiplied down the path
                    scores = (ancestors[1:, 1:].to(flat_logp.dtype) @ flat_logp[j, codes]).exp()  # [T]
                trees[i] = DraftTree(
                    flat[j, codes], parent, depth, scores=scores, source="medusa", _ancestors=ancestors
                )
        return [t if t is not None else DraftTree.empty(rows[i].tokens.device) for i, t in enumerate(trees)]

    def _topk(self, x: torch.Tensor, tmpl: StaticTreeTemplate, depth: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`[B, D, K]` the first ``D = depth`` heads' K best tokens for the states ``x`` `[B, H]`, and with a tree
        budget their log-probabilities `[B, D, K]` under each head's softmax (None without)."""
        heads = self._draft_heads
        if self.budget is None:
            return heads.topk_tokens(x, tmpl.k, num_heads=depth, lm_head=self._lm_head), None
        logits = heads.draft_logits(heads.head_states(x, depth), self._lm_head)  # [D, B, V']
        top = torch.log_softmax(logits.float(), dim=-1).topk(tmpl.k, dim=-1)  # [D, B, K]
        idx = top.indices if self.heads.token_map is None else self.heads.token_map.to(x.device)[top.indices]
        return idx.permute(1, 0, 2), top.values.permute(1, 0, 2)

    def finish(self) -> None:
        super().finish()
        self._lm_head, self._draft_heads = None, self.heads


def medusa_assistant_for(obj, target) -> Proposer | None:
    """``assistant=`` resolver: a `MedusaAssistant` when ``obj`` is `MedusaHeads`, else None."""
    if isinstance(obj, MedusaHeads):
        return MedusaAssistant(obj)
    return None
