"""Medusa proposer: the heads' top-k guesses arranged in a static token tree (Cai et al. 2024, arXiv:2401.10774).

The loop asks for the target's final normed hidden states (``hidden_state_layers = (-1,)``) of every token that
enters its KV cache; the proposer keeps the last one per row. That hidden state is the one the target's lm_head
turned into the current root, so Medusa head 0 applied to it guesses the token *after* the root (tree depth 1), head
k guesses depth k + 1. No second target pass is needed.

Each step runs all heads over all active rows in one batched matmul, takes the top-k of each head and lays the
tokens out on a static tree (a Medusa choices list, `DraftTree.from_choices` semantics): node ``[a, b]`` is head 0's
(a+1)-th guess followed by head 1's (b+1)-th. The tree is cut to each row's remaining depth (``max_depth``); every
node carries the heads' probabilities multiplied down its path (``DraftTree.scores``), from which the loop's tree
budget keeps the nodes that pay on the machine at hand.

The default tree is Sequoia's optimum for a generic acceptance profile (``generation/tree_shapes.py``) over
`DEFAULT_NUM_NODES` candidates.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...heads.formats.medusa import check_tree_choices
from ...heads.hub import base_model_dims
from ...heads.medusa import MedusaHeads
from ..cost_model import PriorCurve
from ..tree import DraftSampling, DraftTree
from ..tree_shapes import optimal_tree_choices, prior_acceptance
from .base import Proposer, ProposerSetup, RowState, drafting_head
from .final_state import FinalStateAssistant

DEFAULT_NUM_NODES = 48  # candidate nodes per row; the loop's tree budget keeps what pays (a GPU verifies ~64 at once)
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
    """Drafts a static token tree from `MedusaHeads` (deterministic top-k children) with each node's path
    probability under the heads as its score.

    Args:
        heads: the Medusa heads.
        tree_choices: a Medusa choices list such as ``[[0], [0, 0], [1]]``; default: `default_tree_choices` with
            ``num_nodes`` nodes. (The heads' own ``heads.tree_choices``, tuned offline for one machine, are used
            when passed here.)
        num_nodes: size of the default tree (ignored when choices are given).
        step_cost: ``{nodes: cost relative to a plain decoding step}``, default the heads' tuned table (their model
            card's ``tree.step_cost``): the tree budget's prior cost curve until it has measured this machine.

    The tree is the same whether or not the loop's tree budget cuts it (``tree_budget=False`` verifies it whole).
    """

    sampling = DraftSampling.DETERMINISTIC

    def __init__(
        self,
        heads: MedusaHeads,
        tree_choices: Sequence[Sequence[int]] | None = None,
        num_nodes: int = DEFAULT_NUM_NODES,
        step_cost: dict[int, float] | None = None,
    ):
        if not isinstance(heads, MedusaHeads):
            raise TypeError(f"MedusaAssistant needs MedusaHeads, got {type(heads).__name__}")
        self.heads = heads
        vocab = heads.draft_vocab_size or heads.vocab_size
        if tree_choices is None:
            tree_choices = default_tree_choices(heads.num_heads, num_nodes)
        else:
            tree_choices = check_tree_choices(tree_choices, heads.num_heads, vocab, "MedusaAssistant tree_choices")
        self.template = StaticTreeTemplate(tree_choices, heads.num_heads)
        if vocab is not None and self.template.k > vocab:
            raise ValueError(f"the tree uses rank {self.template.k - 1} but the heads predict only {vocab} tokens")
        self._last_hidden: dict[int, torch.Tensor] = {}
        self._lm_head = None
        self._draft_heads = heads
        if step_cost is None:
            step_cost = ((heads.model_card or {}).get("tree") or {}).get("step_cost")
        self.prior_cost = PriorCurve.from_node_costs(step_cost) if step_cost else None

    @property
    def tree_choices(self) -> list[list[int]]:
        return self.template.choices

    def validate(self, target: torch.nn.Module) -> None:
        self.heads.check_compatible(target)
        vocab = self.heads.draft_vocab_size or self.heads.vocab_size or base_model_dims(target)[1]
        if self.template.k > vocab:  # heads that take the target's lm_head and did not know its vocabulary
            raise ValueError(
                f"MedusaAssistant tree_choices use rank {self.template.k - 1}, but the heads draft from the "
                f"{vocab} tokens of {type(target).__name__}'s vocabulary (ranks 0..{vocab - 1})"
            )

    def start(self, setup: ProposerSetup) -> None:
        super().start(setup)
        self._lm_head = setup.target.get_output_embeddings() if self.heads.share_lm_head else None
        self._draft_heads = drafting_head(self.heads)  # the heads, or their copy in this machine's fastest dtype

    @torch.no_grad()
    def propose(self, rows: Sequence[RowState]) -> list[DraftTree]:
        trees = [DraftTree.empty(r.tokens.device) for r in rows]
        tmpl = self.template
        ready = [i for i, r in enumerate(rows) if r.max_depth > 0 and r.row in self._last_hidden]
        if not ready or not tmpl.num_nodes:
            return trees
        x = torch.stack([self._last_hidden[rows[i].row] for i in ready])  # [B, H]
        depth = min(tmpl.depth, max(rows[i].max_depth for i in ready))  # heads past every row's cap never run
        top, logp = self._topk(x, tmpl, depth)  # [B, D, K] tokens and their log-probabilities under the heads
        device = rows[ready[0]].tokens.device
        flat = top.reshape(len(ready), -1).to(device)  # [B, D * K]
        flat_logp = logp.reshape(len(ready), -1).to(device)  # [B, D * K]
        for j, i in enumerate(ready):
            codes, parent, node_depth, ancestors = tmpl.cut(rows[i].max_depth, device)
            scores = (ancestors[1:, 1:].to(flat_logp.dtype) @ flat_logp[j, codes]).exp()  # [T] path probability
            trees[i] = DraftTree(
                flat[j, codes], parent, node_depth, scores=scores, source="medusa", _ancestors=ancestors,
                depth_bound=min(rows[i].max_depth, tmpl.depth),
            )  # fmt: skip
        return trees

    def _topk(self, x: torch.Tensor, tmpl: StaticTreeTemplate, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`[B, D, K]` the first ``D = depth`` heads' K best tokens for the states ``x`` `[B, H]`, and their
        log-probabilities `[B, D, K]` under each head's softmax."""
        heads = self._draft_heads
        logits = heads.draft_logits(heads.head_states(x, depth), self._lm_head)  # [D, B, V']
        top = torch.log_softmax(logits.float(), dim=-1).topk(tmpl.k, dim=-1)  # [D, B, K]
        return self.heads.draft_to_token(top.indices).permute(1, 0, 2), top.values.permute(1, 0, 2)

    def finish(self) -> None:
        super().finish()
        self._lm_head, self._draft_heads = None, self.heads


def medusa_assistant_for(obj, target) -> Proposer | None:
    """``assistant=`` resolver: a `MedusaAssistant` when ``obj`` is `MedusaHeads`, else None."""
    if isinstance(obj, MedusaHeads):
        return MedusaAssistant(obj)
    return None
