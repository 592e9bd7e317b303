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
from ...heads.draft_cache import DraftKVCache
from ..cost_model import PriorCurve
from ..tree import DraftSampling, DraftTree
from .base import Proposer, ProposerSetup, RowFeedback, RowState, drafting_head

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


class DFlashAssistant(Proposer):
    """Drafts DDTrees with a `DFlashHead`.

    Args:
        head: the drafter, or a folder / Hub id `DFlashHead.from_pretrained` reads (ours or the speculators layout).
        top_k: candidates per depth (default: the head's ``tree["top_k"]``, else 8).
        num_nodes: candidate nodes per row (default: ``tree["num_nodes"]``, else 48); the tree budget cuts them.
        step_cost: ``{nodes: cost of a step / a plain decoding step}`` (default: the head's ``tree["step_cost"]``):
            the tree budget's prior cost curve.
    """

    sampling = DraftSampling.DETERMINISTIC

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
        tree = head.tree or {}
        self.head = head
        self.top_k = int(top_k or tree.get("top_k") or DEFAULT_TOP_K)
        self.num_nodes = int(num_nodes if num_nodes is not None else tree.get("num_nodes") or DEFAULT_NUM_NODES)
        check_tree_sizes("DFlashAssistant", "the DDTree", top_k=self.top_k, num_nodes=self.num_nodes)
        cost = step_cost if step_cost is not None else tree.get("step_cost")
        self.prior_cost = PriorCurve.from_node_costs({int(n): float(c) for n, c in cost.items()}) if cost else None
        self.hidden_state_layers = head.feature_layers if head.aux_layers else None
        self.draft_head = head  # what drafts during a call: the head or its copy in another dtype
        self.cache: DraftKVCache | None = None
        self._pending: dict[int, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"DFlashAssistant(block_size={self.head.block_size}, top_k={self.top_k}, num_nodes={self.num_nodes})"

    # ------------------------------------------------------------------ lifecycle
    def validate(self, target: torch.nn.Module) -> None:
        self.head.bind(target)
        self.hidden_state_layers = self.head.feature_layers

    def start(self, setup: ProposerSetup) -> None:
        super().start(setup)
        self.draft_head = drafting_head(self.head)
        if self.draft_head is not self.head:
            self.draft_head.bind(setup.target)
        self.cache = self.draft_head.new_cache(max(1, setup.batch_size))
        self._pending = {}

    def finish(self) -> None:
        self.cache, self.draft_head, self._pending = None, self.head, {}

    def drafting_modules(self) -> tuple[torch.nn.Module, ...]:
        return (self.draft_head,)

    def observe(self, rows: Sequence[RowState], feedback: Sequence[RowFeedback]) -> None:
        layers = self.head.feature_layers
        for row, fb in zip(rows, feedback):
            if fb.hidden_states is None or any(layer not in fb.hidden_states for layer in layers):
                raise RuntimeError(f"DFlashAssistant needs the target's hidden states of layers {list(layers)}")
            feats = torch.cat([fb.hidden_states[layer] for layer in layers], dim=-1).detach()  # [m, n H]
            old = self._pending.get(row.row)
            self._pending[row.row] = feats if old is None else torch.cat([old, feats])

    # ------------------------------------------------------------------ drafting
    def _commit(self, slots: list[int]) -> None:
        """Turn the rows' queued states into their layers' keys and values in the cache (one head pass)."""
        pending = [self._pending.pop(s) for s in slots]
        cache, dev = self.cache, self.cache.key.device
        m = torch.tensor([p.shape[0] for p in pending], device=dev)  # [B]
        feats = torch.nn.utils.rnn.pad_sequence([p.to(dev) for p in pending], batch_first=True)  # [B, q, n H]
        lengths = cache.lengths[slots]  # [B]
        cache.reserve(int((lengths + m).max()))
        positions = lengths[:, None] + torch.arange(feats.shape[1], device=dev)  # [B, q]
        key, value = self.draft_head.context_kv(feats, positions)  # [B, layers * kvh, q, D]
        for i, slot in enumerate(slots):
            n0, n = int(lengths[i]), int(m[i])
            cache.key[slot, :, n0 : n0 + n], cache.value[slot, :, n0 : n0 + n] = key[i, :, :n], value[i, :, :n]
        cache.lengths[slots] = lengths + m

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

    @torch.no_grad()
    def propose(self, rows: Sequence[RowState]) -> list[DraftTree]:
        trees = [DraftTree.empty(r.tokens.device) for r in rows]
        # every observed row has states queued (each step commits the old root at least); a paused row's queue up
        ready = [i for i, r in enumerate(rows) if r.max_depth > 0 and r.row in self._pending]
        if not ready or self.num_nodes == 0:
            return trees
        slots = [rows[i].row for i in ready]
        self._commit(slots)
        logp = self._block_logp(slots, torch.tensor([rows[i].root for i in ready]))  # [B, D, V']
        values, index = logp.topk(min(self.top_k, logp.shape[-1]), dim=-1)  # [B, D, K]
        tokens = self.draft_head.draft_to_token(index)
        for j, (i, row_logp) in enumerate(zip(ready, values.tolist())):  # one read of the [B, D, K] values
            trees[i] = self._row_tree(rows[i], row_logp, tokens[j])
        return trees

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
