"""DFlash proposer: a `DFlashHead` drafts a DDTree, a token tree over one block's per-depth distributions.

Context: the loop hands `observe` the target's hidden states at the head's feature layers for every token it commits
(the prompt after prefill, the old root and the accepted drafts after a step); the head turns them into its layers'
keys and values once, in its own cache (`DraftKVCache`, one slot per row, every layer side by side), so the cache
always holds exactly the committed text. A row the tree budget pauses costs nothing: its states queue up until it
drafts again.

Drafting, for every ready row in one head forward: the block ``[root, mask, ..., mask]`` at the positions after the
committed text attends to the row's cached context and, bidirectionally, to itself; the block's slot for depth d
gives the draft's marginal distribution q_d of the token d places after the root (`DFlashHead.num_depths` depths).

DDTree (the tree over the block): a node is a path of ranks ``(r_1, ..., r_d)`` into the depths' top-k lists, its
token the ``r_d``-th best of q_d, its score ``prod_i q_i(r_i)`` (the depths' distributions do not depend on the path,
so a path's probability under the block is that product). Best-first: a heap pops nodes in non-increasing score and
each popped node pushes its first child (rank 0 one depth down) and its next sibling (rank r_d + 1): both score at most
the popped node, so the first ``num_nodes`` pops are the ``num_nodes`` best paths, each after its parent (a tree,
parents first). Siblings carry the distinct top-k tokens of one depth. The candidates go out with their scores and
the loop's tree budget cuts each row to what pays on this machine (``tree_budget=False`` verifies them whole).

Exact sampling: the children of every node are chosen by rank, a function of the context only (a point mass each),
so the tree is `DraftSampling.DETERMINISTIC` and the verifier's residual rule applies: the block's marginals never enter
a ratio (docs/algorithms.md, "DDTree").
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Sequence

import torch

from ...heads.checks import check_tree_sizes
from ...heads.dflash import DFlashHead
from ..tree import DraftSampling, DraftTree
from .base import Proposer, RowState
from .hidden_states import HiddenStateProposer

DEFAULT_TOP_K = 8
DEFAULT_NUM_NODES = 48  # candidates per row; the loop's tree budget keeps what pays


def ddtree(
    logp: Sequence[Sequence[float]], max_depth: int, num_nodes: int
) -> tuple[list[int], list[int], list[int], list[float]]:
    """The ``num_nodes`` most probable rank paths over per-depth top-k log-probabilities, best first.

    Args:
        logp: `[D][K]` each depth's top-k log-probabilities, descending.
        max_depth: no node deeper than this.
        num_nodes: nodes at most.
    Returns:
        ``(parent, depth, rank, score)`` per node, in pop order (parents first): parent index (-1 = root), depth
        (1 = the root's children), rank into that depth's top-k, and path log-probability.
    """
    depth_cap, k = min(max_depth, len(logp)), len(logp[0]) if logp else 0
    parent, depth, rank, score = [], [], [], []
    # entries: (-score, insertion order, depth, rank, parent index, parent's score)
    heap = [(-logp[0][0], 0, 1, 0, -1, 0.0)] if depth_cap > 0 and k > 0 else []
    tie = 1
    while heap and len(parent) < num_nodes:
        neg, _, d, r, par, base = heapq.heappop(heap)
        if neg == float("inf"):  # a zero-probability path never pays; nor does anything after it
            break
        index = len(parent)
        parent.append(par), depth.append(d), rank.append(r), score.append(-neg)
        if d < depth_cap:
            heapq.heappush(heap, (neg - logp[d][0], tie, d + 1, 0, index, -neg))
            tie += 1
        if r + 1 < k:
            heapq.heappush(heap, (-(base + logp[d - 1][r + 1]), tie, d, r + 1, par, base))
            tie += 1
    return parent, depth, rank, score


class DFlashAssistant(HiddenStateProposer):
    """Drafts DDTrees with a `DFlashHead`; the life cycle (binding, the head's cache, the queued states) is
    `HiddenStateProposer`'s.

    Args:
        head: the drafter, or a folder / Hub id `DFlashHead.from_pretrained` reads (ours or the speculators layout).
        top_k: candidates per depth (default: the head's ``tree["top_k"]``, else 8).
        num_nodes: candidate nodes per row (default: ``tree["num_nodes"]``, else 48); the tree budget cuts them.
        step_cost: ``{nodes: cost of a step / a plain decoding step}`` (default: the head's ``tree["step_cost"]``):
            the tree budget's prior cost curve.
    """

    sampling = DraftSampling.DETERMINISTIC
    default_top_k, default_num_nodes = DEFAULT_TOP_K, DEFAULT_NUM_NODES

    def __init__(
        self,
        head: DFlashHead | str | os.PathLike,
        top_k: int | None = None,
        num_nodes: int | None = None,
        step_cost: dict[int, float] | None = None,
    ):
        if isinstance(head, (str, os.PathLike)):
            head = DFlashHead.from_pretrained(head)
        if not isinstance(head, DFlashHead):
            raise TypeError(f"DFlashAssistant needs a DFlashHead (or its folder), got {type(head).__name__}")
        super().__init__(head, top_k, num_nodes, step_cost)
        check_tree_sizes("DFlashAssistant", "the DDTree", top_k=self.top_k, num_nodes=self.num_nodes)

    def __repr__(self) -> str:
        return f"DFlashAssistant(block_size={self.head.block_size}, top_k={self.top_k}, num_nodes={self.num_nodes})"

    # ------------------------------------------------------------------ drafting
    def _context_kv(self, slots: list[int], lengths: torch.Tensor, m: torch.Tensor, feats: torch.Tensor):
        """The layers' keys and values of the rows' queued `[B, q, n H]` states: ``(None, key, value)``."""
        positions = lengths[:, None] + torch.arange(feats.shape[1], device=feats.device)  # [B, q]
        key, value = self.draft_head.context_kv(feats, positions)  # [B, layers * kvh, q, D]
        return None, key, value

    def _block_logp(self, slots: list[int], roots: torch.Tensor) -> torch.Tensor:
        """`[B, D, V']` log-probabilities of every drafted depth, one block per row after its cached context."""
        head, cache = self.draft_head, self.cache
        dev, k = cache.key.device, head.block_size
        lengths = cache.lengths[slots]  # [B] the roots' positions
        past = int(lengths.max())
        seen = torch.arange(past, device=dev)[None, :] < lengths[:, None]  # [B, S]
        mask = torch.cat([seen[:, None, :].expand(-1, k, -1), seen.new_ones(len(slots), k, k)], dim=-1)
        positions = lengths[:, None] + torch.arange(k, device=dev)  # [B, k]
        pk, pv = cache.key[slots, :, :past], cache.value[slots, :, :past]
        hidden = head.block_hidden(head.block_tokens(roots.to(dev)), positions, pk, pv, mask)  # [B, k, H]
        first = 0 if head.sample_from_anchor else 1
        return torch.log_softmax(head.logits(hidden[:, first : first + head.num_depths]), dim=-1)

    def _draft(self, rows: list[RowState]) -> list[DraftTree]:
        slots = [r.row for r in rows]
        self._commit(slots)
        logp = self._block_logp(slots, torch.tensor([r.root for r in rows]))  # [B, D, V']
        values, index = logp.topk(min(self.top_k, logp.shape[-1]), dim=-1)  # [B, D, K]
        tokens = self.draft_head.draft_to_token(index)
        # one read of the [B, D, K] values
        return [self._row_tree(r, row_logp, tokens[j]) for j, (r, row_logp) in enumerate(zip(rows, values.tolist()))]

    def _row_tree(self, row: RowState, logp: list[list[float]], tokens: torch.Tensor) -> DraftTree:
        """One row's DDTree from its `[D][K]` top-k log-probabilities and `[D, K]` tokens."""
        parent, depth, rank, score = ddtree(logp, row.max_depth, self.num_nodes)
        device = row.tokens.device
        if not parent:
            return DraftTree.empty(device)
        d = torch.tensor(depth, dtype=torch.long)
        node_tokens = tokens.cpu()[d - 1, torch.tensor(rank, dtype=torch.long)]
        tree = DraftTree(
            node_tokens.to(device), torch.tensor(parent, dtype=torch.long, device=device), d.to(device),
            self.sampling, depth_bound=max(depth),
        )  # fmt: skip
        tree.scores = torch.tensor(
            score, dtype=torch.float32, device=device
        ).exp()  # path probabilities, for the budget
        tree.source = "dflash"
        return tree


def dflash_assistant_for(obj, target) -> Proposer | None:
    """``assistant=`` resolver: a `DFlashAssistant` when ``obj`` is a `DFlashHead`, else None."""
    if isinstance(obj, DFlashHead):
        return DFlashAssistant(obj)
    return None


__all__ = ["DFlashAssistant", "ddtree", "dflash_assistant_for"]
