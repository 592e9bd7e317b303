"""`AttentionPlan`: what the attention of one planned forward needs, built once and shared by every layer.

A planned forward (``generation/target.py``) builds the plan once (FlashInfer's ``plan()``): which cache rows are in
the packed batch, where each row's new tokens go in the paged pool (`build_plan` reserves the slots through the
cache's API), and which new tokens each new token may see (a causal chunk, or a tree's ancestors). Each layer then
only writes its K/V into the pool and attends (``run()``, in ``backend.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..cache.paged import PagedCache

BACKENDS = ("torch", "triton")


@dataclass
class AttentionPlan:
    """Everything the attention of one forward needs, shared by all layers.

    Rows are packed back to back: packed tokens ``cu_seqlens[b] : cu_seqlens[b + 1]`` belong to cache row
    ``rows[b]``, which already holds ``prefix_lens[b]`` committed tokens. The new tokens are written at positions
    ``prefix_lens[b] + pending_lens[b], ...`` of the row (slots in ``slot_mapping``). Between the committed prefix
    and the new tokens a row may hold ``pending_lens[b]`` tokens written by earlier forwards but not committed (a
    draft model expanding its tree one level per forward); the new tokens see them only where their mask says so.

    Attributes (B = rows in the forward, N = packed new tokens, n = one row's new tokens):
        cache: the `PagedCache` the forward reads and writes.
        rows: `[B]` cache row of each packed segment.
        cu_seqlens: `[B + 1]` int64 (CPU) segment offsets in the packed batch.
        prefix_lens: `[B]` committed length of each row before this forward.
        slot_mapping: `[N]` int64 pool slot of each new token (on the model's device).
        positions: `[N]` int64 position ids of the new tokens (rotary positions: prefix + depth for trees).
        new_token_masks: `[B]` per row `[n, pending + n]` bool visibility of the row's pending and new tokens for
            each new token, or None for a causal chunk (prefill / plain decode; pending must then be 0). Every row sees
            its whole committed prefix.
        pending_lens: `[B]` uncommitted tokens between each row's prefix and its new tokens (0 for the target).
        backend: ``"triton"`` or ``"torch"``: which attention path serves this forward (chosen once per call).
        extras: backend-specific metadata, built lazily once per forward (e.g. the Triton kernel's packed masks).
    """

    cache: PagedCache
    rows: list[int]
    cu_seqlens: torch.Tensor
    prefix_lens: list[int]
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    new_token_masks: list[torch.Tensor | None]
    pending_lens: list[int] = field(default_factory=list)
    backend: str = "torch"
    extras: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.pending_lens:
            self.pending_lens = [0] * len(self.rows)

    @property
    def has_pending(self) -> bool:
        return any(self.pending_lens)

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def q_lens(self) -> list[int]:
        cu = self.cu_seqlens.tolist()
        return [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]

    def row_mask(self, b: int, device: torch.device) -> torch.Tensor | None:
        """`[n, prefix + pending + n]` bool mask of row b (None when a plain causal mask with no prefix suffices)."""
        key = ("dense_mask", b, device)
        if key not in self.extras:
            n = int(self.cu_seqlens[b + 1] - self.cu_seqlens[b])
            prefix = self.prefix_lens[b]
            own = self.new_token_masks[b]
            pending = self.pending_lens[b]
            if own is None:
                if pending:
                    raise ValueError("a row with pending tokens needs an explicit mask")
                if prefix == 0 or n == 1:
                    self.extras[key] = None  # causal from scratch, or a single query that sees everything
                    return None
                own = torch.ones(n, n, dtype=torch.bool).tril_()
            if own.shape != (n, pending + n):
                raise ValueError(f"row {b}: mask of shape {tuple(own.shape)}, expected {(n, pending + n)}")
            mask = torch.ones(n, prefix + pending + n, dtype=torch.bool, device=device)
            mask[:, prefix:] = own.to(device)
            self.extras[key] = mask
        return self.extras[key]


def build_plan(
    cache: PagedCache,
    rows: Sequence[int],
    q_lens: Sequence[int],
    positions: torch.Tensor,
    new_token_masks: Sequence[torch.Tensor | None],
    device: torch.device | str,
    pending_lens: Sequence[int] | None = None,
    backend: str = "torch",
) -> AttentionPlan:
    """Reserve pool slots for ``q_lens[b]`` new tokens of each row and return the forward's `AttentionPlan`.

    The rows' committed lengths do not change here: new tokens sit past them until `PagedCache.commit` (trees) or
    `PagedCache.commit_chunk` (chunks) decides what is kept.

    Args:
        cache: the cache the forward writes.
        rows: `[B]` cache rows.
        q_lens: `[B]` new tokens of each row.
        positions: `[N]` int64 position ids of the packed new tokens.
        new_token_masks: `[B]` per row `[n, pending + n]` bool, or None for a causal chunk.
        device: where the model runs.
        pending_lens: `[B]` uncommitted tokens already written after each row's prefix (default 0).
        backend: ``"triton"`` or ``"torch"`` (see `backend.choose_backend`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    pending_lens = list(pending_lens) if pending_lens is not None else [0] * len(rows)
    slots, prefix = [], []
    for row, n, pend in zip(rows, q_lens, pending_lens):
        prefix.append(cache.lengths[row])
        slots.append(cache.reserve(row, cache.lengths[row] + pend, n))
    cu = torch.tensor([0, *q_lens], dtype=torch.long).cumsum(0)
    return AttentionPlan(
        cache=cache,
        rows=list(rows),
        cu_seqlens=cu,
        prefix_lens=prefix,
        slot_mapping=torch.cat(slots).to(device),
        positions=positions.to(device),
        new_token_masks=list(new_token_masks),
        pending_lens=pending_lens,
        backend=backend,
    )
