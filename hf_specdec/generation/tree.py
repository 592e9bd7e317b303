"""DraftTree: one row's speculative draft as flat tensors, plus builders and batch packing.

A tree has a *root* (the token the target already chose, not yet in its KV cache) and ``T`` draft nodes below it.
Nodes are stored in topological order (a parent always precedes its child) as flat tensors:

- ``tokens[T]``  the drafted token ids,
- ``parent[T]``  the parent's node index, ``-1`` for the root,
- ``depth[T]``   1 for the root's children, 2 for theirs, ...

"Tree positions" count the root too: position 0 is the root, position ``i + 1`` is node ``i``. The verification
forward feeds ``[root, node_0, ..., node_{T-1}]`` at positions ``L + [0, depth...]``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..kernels.mask_bits import num_words, unpack_bits


class DraftSampling(str, enum.Enum):
    """How a proposer chose the children of each node; the verifier picks its rule from this (docs/algorithms.md)."""

    DETERMINISTIC = "deterministic"  # top-k / lookup: children are a function of the context, no q needed
    WITHOUT_REPLACEMENT = "without_replacement"  # children drawn from q without replacement (Sequoia)
    IID = "iid"  # children drawn i.i.d. from q (SpecInfer multi-step sampling)


@dataclass
class DraftTree:
    """A draft tree of ``T`` nodes under a root token.

    Args:
        tokens: `[T]` int64 drafted token ids.
        parent: `[T]` int64 parent node index, -1 for the root; ``parent[i] < i``.
        depth: `[T]` int64 depth of each node (root's children have depth 1).
        sampling: how the children were chosen (see `DraftSampling`).
        draft_probs: optional `[T + 1, V]` draft distribution q *over the children* of each tree position
            (position 0 = root, ``i + 1`` = node i). Required for sampled drafts, ignored otherwise.
        scores: optional `[T]` the assistant's estimate of the probability that each node is accepted (a path
            probability); the loop's tree budget (``generation/budget.py``) decides from them how many nodes pay.
        source: which assistant drafted the tree (the tree budget calibrates each one's scores separately).
        depth_bound: no node is deeper than this, when the proposer knows it on the host (its tree's shape); None:
            the node count. Lets the loop skip reading ``depth`` back from the device (`pack_trees` sizes its
            ancestor computation by it, `max_depth` checks are skipped when the bound is within the row's budget).
    """

    tokens: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    sampling: DraftSampling = DraftSampling.DETERMINISTIC
    draft_probs: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    source: str | None = None
    _ancestors: torch.Tensor | None = field(default=None, repr=False, compare=False)
    depth_bound: int | None = field(default=None, kw_only=True)

    # ------------------------------------------------------------------ builders
    @classmethod
    def empty(cls, device: torch.device | str = "cpu") -> DraftTree:
        z = torch.zeros(0, dtype=torch.long, device=device)
        return cls(z, z.clone(), z.clone(), depth_bound=0)

    @classmethod
    def chain(cls, tokens: Sequence[int] | torch.Tensor, **kwargs) -> DraftTree:
        """A single path ``root -> tokens[0] -> tokens[1] -> ...``."""
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        n = tokens.numel()
        parent = torch.arange(-1, n - 1, dtype=torch.long, device=tokens.device)
        depth = torch.arange(1, n + 1, dtype=torch.long, device=tokens.device)
        return cls(tokens, parent, depth, depth_bound=n, **kwargs)

    @classmethod
    def from_parents(
        cls, tokens: Sequence[int] | torch.Tensor, parent: Sequence[int] | torch.Tensor, **kwargs
    ) -> DraftTree:
        """Build from tokens and parent indices (parents first); depths are derived."""
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        parent_list = [int(p) for p in torch.as_tensor(parent).reshape(-1).tolist()]
        if len(parent_list) != tokens.numel():
            raise ValueError(f"tokens has {tokens.numel()} entries but parent has {len(parent_list)}")
        depth_list: list[int] = []
        for i, p in enumerate(parent_list):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}; parents must precede their children (-1 = root)")
            depth_list.append(1 if p < 0 else depth_list[p] + 1)
        device = tokens.device
        return cls(
            tokens,
            torch.tensor(parent_list, dtype=torch.long, device=device),
            torch.tensor(depth_list, dtype=torch.long, device=device),
            depth_bound=max(depth_list, default=0),
            **kwargs,
        )

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]], topk_tokens: torch.Tensor) -> DraftTree:
        """Medusa-style static tree.

        Args:
            choices: paths such as ``[[0], [0, 0], [1], [0, 1]]``; ``[a, b]`` is the (a+1)-th best token of depth 1
                followed by the (b+1)-th best of depth 2. Every prefix of a path must be a path too.
            topk_tokens: `[D, K]` ranked candidate tokens per depth (row d feeds depth d + 1), K > max rank used.
        """
        paths = sorted({tuple(c) for c in choices}, key=lambda c: (len(c), c))
        index = {}
        tokens, parent = [], []
        for path in paths:
            if len(path) == 0:
                continue
            if len(path) > 1 and path[:-1] not in index:
                raise ValueError(f"tree choice {list(path)} has no parent path {list(path[:-1])} in the choices")
            index[path] = len(tokens)
            parent.append(index[path[:-1]] if len(path) > 1 else -1)
            tokens.append(topk_tokens[len(path) - 1, path[-1]])
        tok = torch.stack(tokens) if tokens else torch.zeros(0, dtype=torch.long, device=topk_tokens.device)
        return cls.from_parents(tok, torch.tensor(parent, dtype=torch.long)).to(topk_tokens.device).dedup_siblings()

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]], **kwargs) -> DraftTree:
        """A trie of token paths (each path starts below the root); shared prefixes are merged."""
        index: dict[tuple[int, ...], int] = {}
        tokens: list[int] = []
        parent: list[int] = []
        for path in paths:
            prefix: tuple[int, ...] = ()
            for tok in path:
                key = prefix + (int(tok),)
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(int(tok))
                    parent.append(index[prefix] if prefix else -1)
                prefix = key
        return cls.from_parents(torch.tensor(tokens, dtype=torch.long), parent, **kwargs)

    # ---------------------------------------------------------------- properties
    @property
    def num_nodes(self) -> int:
        return int(self.tokens.numel())

    def __len__(self) -> int:
        return self.num_nodes

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if self.num_nodes else 0

    def to(self, device: torch.device | str) -> DraftTree:
        return DraftTree(
            self.tokens.to(device),
            self.parent.to(device),
            self.depth.to(device),
            self.sampling,
            None if self.draft_probs is None else self.draft_probs.to(device),
            None if self.scores is None else self.scores.to(device),
            self.source,
            depth_bound=self.depth_bound,
        )

    def position_parents(self) -> torch.Tensor:
        """`[T]` parent of each node in tree positions (0 = root)."""
        return self.parent + 1

    def ancestor_mask(self) -> torch.Tensor:
        """`[T + 1, T + 1]` bool: ``A[i, j]`` iff tree position j is i or an ancestor of i (root column all True).

        Pointer doubling: after k rounds row i holds its ancestors less than ``2^k`` levels up, so ``ceil(log2(T +
        1))`` rounds of tensor operations cover any tree, with no loop over nodes and no read of the tree's values.
        """
        if self._ancestors is None:
            n = self.num_nodes + 1
            up = torch.cat([self.parent.new_zeros(1), self.position_parents()])  # [T + 1], the root its own parent
            mask = torch.eye(n, dtype=torch.bool, device=self.device)
            for last in _doubling_rounds(n):
                mask = mask | mask.index_select(0, up)
                if not last:
                    up = up.index_select(0, up)
            self._ancestors = mask
        return self._ancestors

    def positions(self, offset: int = 0) -> torch.Tensor:
        """`[T + 1]` position ids of ``[root, nodes...]`` when the committed prefix holds ``offset`` tokens."""
        root = torch.zeros(1, dtype=torch.long, device=self.device)
        return torch.cat([root, self.depth]) + offset

    def paths(self) -> list[list[int]]:
        """Root-to-leaf paths as lists of node indices (leaves in node order)."""
        has_child = torch.zeros(self.num_nodes, dtype=torch.bool)
        par = self.parent.tolist()
        for p in par:
            if p >= 0:
                has_child[p] = True
        out = []
        for leaf in range(self.num_nodes):
            if has_child[leaf]:
                continue
            path, node = [], leaf
            while node >= 0:
                path.append(node)
                node = par[node]
            out.append(path[::-1])
        return out

    def children(self, node: int) -> list[int]:
        """Node indices of the children of ``node`` (-1 = root), in order."""
        return (self.parent == node).nonzero().flatten().tolist()

    # -------------------------------------------------------------- transforms
    def dedup_siblings(self) -> DraftTree:
        """Merge siblings that carry the same token (the later one's subtree joins the first's).

        A duplicate wastes a verification slot. Trees with ``draft_probs`` keep the q rows of the surviving positions.
        `DraftSampling.IID` trees are returned unchanged: SpecInfer's rule is exact only on the draws as they were made.
        """
        if self.num_nodes == 0 or self.sampling == DraftSampling.IID:
            # i.i.d. draws keep their duplicates: the multi-draft rule is exact only on the children as drawn
            return self
        toks, par = self.tokens.tolist(), self.parent.tolist()
        seen: dict[tuple[int, int], int] = {}
        remap: list[int] = []
        keep: list[int] = []
        for i, (t, p) in enumerate(zip(toks, par)):
            new_p = remap[p] if p >= 0 else -1
            key = (new_p, t)
            if key in seen:
                remap.append(seen[key])
            else:
                seen[key] = len(keep)
                remap.append(len(keep))
                keep.append(i)
        if len(keep) == self.num_nodes:
            return self
        keep_t = torch.tensor(keep, dtype=torch.long, device=self.device)
        new_parent = [remap[par[i]] if par[i] >= 0 else -1 for i in keep]
        q = None
        if self.draft_probs is not None:
            q = self.draft_probs[torch.cat([torch.zeros(1, dtype=torch.long, device=self.device), keep_t + 1])]
        scores = None if self.scores is None else self.scores[keep_t]
        return DraftTree.from_parents(
            self.tokens[keep_t], new_parent, sampling=self.sampling, draft_probs=q, scores=scores, source=self.source
        )

    def subtree_nodes(self, nodes: torch.Tensor, parent: Sequence[int]) -> DraftTree:
        """The tree restricted to ``nodes`` `[T']` (increasing, on the tree's device), whose parents among them the
        caller already knows (``parent``: `[T']` new indices, -1 = root; `subset_parents`): nothing is read back."""
        q = None
        if self.draft_probs is not None:
            q = self.draft_probs[torch.cat([nodes.new_zeros(1), nodes + 1])]
        return DraftTree(
            self.tokens[nodes],
            torch.tensor(list(parent), dtype=torch.long).to(self.device, non_blocking=True),
            self.depth[nodes],
            self.sampling,
            q,
            None if self.scores is None else self.scores[nodes],
            self.source,
            depth_bound=self.depth_bound,
        )

    def subtree_keep(self, keep: torch.Tensor) -> DraftTree:
        """The tree restricted to nodes where ``keep`` `[T]` is True; every kept node's parent must be kept."""
        idx = keep.nonzero().flatten()  # [T'] kept nodes, in order
        new_par = torch.tensor(subset_parents(self.parent.tolist(), idx.tolist()), dtype=torch.long)
        q = None
        if self.draft_probs is not None:
            q = self.draft_probs[torch.cat([torch.zeros(1, dtype=torch.long, device=self.device), idx + 1])]
        scores = None if self.scores is None else self.scores[idx]
        return DraftTree(
            self.tokens[idx],
            new_par.to(self.device),
            self.depth[idx],
            self.sampling,
            q,
            scores,
            self.source,
            depth_bound=self.depth_bound,
        )


def subset_parents(parent: Sequence[int], keep: Sequence[int]) -> list[int]:
    """Keep a subset of a tree's nodes and renumber their parents.

    Args:
        parent: `[T]` parent of each node (-1 = the root).
        keep: `[T']` the nodes to keep (old indices), in their new order: each after its parent.
    Returns:
        `[T']` the kept nodes' parents as new indices (-1 = the root).
    """
    index: dict[int, int] = {}
    out = []
    for new, old in enumerate(keep):
        p = int(parent[old])
        if p >= 0 and p not in index:
            raise ValueError(f"subset of a tree: a kept node's parent was dropped (node {old}, parent {p})")
        out.append(index[p] if p >= 0 else -1)
        index[int(old)] = new
    return out


def _doubling_rounds(width: int) -> list[bool]:
    """The rounds of pointer doubling that reach every ancestor in rows of at most ``width`` positions (a node is at
    most ``width - 1`` levels below its root); each entry says whether it is the last round."""
    rounds = max(0, int(width - 1).bit_length())
    return [i == rounds - 1 for i in range(rounds)]


@dataclass
class PackedTrees:
    """A batch of trees of different sizes, packed back to back (no padding).

    Row b occupies packed positions ``cu_seqlens[b] : cu_seqlens[b + 1]``: its root, then its nodes. Everything is
    built by `pack_trees` with one host-to-device copy and a few tensor operations over the whole batch.

    Attributes:
        tokens: `[N]` int64 root and node tokens of every row.
        depth: `[N]` int64 depth (0 for roots).
        parent: `[N]` int64 packed index of each position's parent (a root is its own parent).
        cu_seqlens: `[B + 1]` int64 (CPU) offsets.
        trees: the per-row `DraftTree` s.
        positions: `[N]` int64 position ids ``base[b] + depth`` when `pack_trees` got the rows' committed lengths.
        width: the longest row, ``max(T_b) + 1``.
        depth_bound: no node is deeper (from the trees' `DraftTree.depth_bound`; sets the doubling rounds).
    """

    tokens: torch.Tensor
    depth: torch.Tensor
    parent: torch.Tensor
    cu_seqlens: torch.Tensor
    trees: list[DraftTree]
    positions: torch.Tensor | None = None
    width: int = 1
    depth_bound: int = 0
    own_bits: torch.Tensor | None = field(default=None, repr=False)  # [N, words] int32: each position's own bit

    @property
    def total(self) -> int:
        return int(self.tokens.numel())

    @property
    def q_lens(self) -> np.ndarray:
        """`[B]` positions per row (nodes + 1)."""
        cu = self.cu_seqlens.numpy()
        return cu[1:] - cu[:-1]

    def row_slice(self, b: int) -> slice:
        return slice(int(self.cu_seqlens[b]), int(self.cu_seqlens[b + 1]))

    def ancestor_bits(self) -> torch.Tensor:
        """`[N, ceil(width / 32)]` int32: bit j of packed position i's words is set iff the row's tree position j is
        i or an ancestor of i (the bit-packed ancestor masks of every row at once, by pointer doubling)."""
        bits, up = self.own_bits, self.parent
        for last in _doubling_rounds(self.depth_bound + 1):
            bits = bits | bits.index_select(0, up)
            if not last:
                up = up.index_select(0, up)
        return bits

    def ancestor_masks(self, bits: torch.Tensor | None = None) -> torch.Tensor:
        """`[N, width]` bool: row i is packed position i's ancestor mask over its row's tree positions (columns past
        the row's own size are False); ``bits`` is `ancestor_bits` when the caller has it."""
        return unpack_bits(self.ancestor_bits() if bits is None else bits, self.width)


def pack_trees(
    roots: Sequence[int] | torch.Tensor, trees: Sequence[DraftTree], base: Sequence[int] | np.ndarray | None = None
) -> PackedTrees:
    """Pack ``[root_b, nodes_b...]`` for every row b into flat tensors, on the trees' device.

    Host bookkeeping (offsets, where each root and node goes, each position's own mask bit) is computed with array
    operations and moved in one copy; the trees' tensors are concatenated once and never read on the host.

    Args:
        roots: `[B]` each row's root token (host ints, or a tensor).
        trees: the rows' trees.
        base: `[B]` the rows' committed lengths: ``positions = base[b] + depth`` (None: no positions).
    """
    num = len(trees)
    if len(roots) != num:
        raise ValueError(f"{len(roots)} roots for {num} trees")
    device = trees[0].device if trees else torch.device("cpu")
    sizes = np.array([t.tokens.shape[0] for t in trees], dtype=np.int64)
    if num and not sizes.any():
        return _pack_roots(roots, trees, base, device)
    q_lens = sizes + 1
    cu = np.zeros(num + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    total, nodes, width = int(cu[-1]), int(cu[-1]) - num, int(q_lens.max()) if num else 1
    deepest = max((t.depth_bound if t.depth_bound is not None else t.tokens.shape[0] for t in trees), default=0)
    words = num_words(width)
    starts = cu[:-1]
    row_start = np.repeat(starts, q_lens)  # [N]
    local = np.arange(total) - row_start  # [N] tree position within the row
    # where each packed field comes from in [roots, 0 x B, -1 x B, tokens..., depths..., parents...] (`flat` below)
    is_node = local > 0
    source = np.empty(total, dtype=np.int64)  # [N] the token's index in `flat`
    source[starts] = np.arange(num)
    source[is_node] = 3 * num + np.arange(nodes)
    step = np.where(is_node, nodes, num)  # [N] how far the depth and the parent are from the token in `flat`
    source = np.concatenate([source, source + step, source + 2 * step])  # [3N]
    own = np.zeros(total * words, dtype=np.int64)  # [N, words] each position's own bit
    own[np.arange(0, total * words, words) + (local >> 5)] = _BIT_VALUES[local & 31]
    host_roots = np.zeros(num, dtype=np.int64) if isinstance(roots, torch.Tensor) else np.asarray(roots, np.int64)
    base_rep = np.repeat(np.asarray(base, dtype=np.int64), q_lens) if base is not None else np.zeros(0, np.int64)
    heads = [host_roots, np.zeros(num, np.int64), np.full(num, -1, np.int64)]
    host = np.concatenate([*heads, source, row_start + 1, base_rep, own])
    dev = torch.from_numpy(host).to(device, non_blocking=True)
    o = np.cumsum([0, 3 * num, 3 * total, total, base_rep.size])
    head_t = dev[: o[1]]
    if isinstance(roots, torch.Tensor):
        head_t = torch.cat([roots.to(device=device, dtype=torch.long).reshape(num), head_t[num:]])
    flat = torch.cat([head_t] + [t.tokens for t in trees] + [t.depth for t in trees] + [t.parent for t in trees])
    packed = flat.index_select(0, dev[o[1] : o[2]]).view(3, total)  # [3, N] tokens, depths, parents within rows
    return PackedTrees(
        tokens=packed[0],
        depth=packed[1],
        parent=packed[2] + dev[o[2] : o[3]],  # a root's -1 lands on itself
        cu_seqlens=torch.from_numpy(cu),
        trees=list(trees),
        positions=packed[1] + dev[o[3] : o[4]] if base is not None else None,
        width=width,
        depth_bound=deepest,
        own_bits=dev[o[4] :].view(total, words).to(torch.int32),
    )


def _pack_roots(
    roots: Sequence[int] | torch.Tensor, trees: Sequence[DraftTree], base: Sequence[int] | np.ndarray | None, device
) -> PackedTrees:
    """`pack_trees` when every tree is empty (a step that drafts nothing): each row packs its root alone, its own
    parent at depth 0, and the general path's array bookkeeping is skipped."""
    num = len(trees)
    if isinstance(roots, torch.Tensor):
        tokens = roots.to(device=device, dtype=torch.long).reshape(num)
    else:
        tokens = torch.tensor(roots, dtype=torch.long).to(device)
    positions = torch.from_numpy(np.asarray(base, dtype=np.int64)).to(device) if base is not None else None
    return PackedTrees(
        tokens=tokens,
        depth=torch.zeros(num, dtype=torch.long, device=device),
        parent=torch.arange(num, device=device),
        cu_seqlens=torch.arange(num + 1),
        trees=list(trees),
        positions=positions,
        width=1,
        depth_bound=0,
        own_bits=torch.ones(num, 1, dtype=torch.int32, device=device),
    )


_BIT_VALUES = np.array([np.int32(np.uint32(1 << b).view(np.int32)) for b in range(32)], dtype=np.int64)
