"""`AttentionPlan`: what the attention of one planned forward needs, built once and shared by every layer.

A planned forward (``generation/target.py``) builds the plan once (FlashInfer's ``plan()``): which cache rows are in
the packed batch, where each row's new tokens go in the paged pool (`build_plan` reserves the slots through the
cache's API), and which new tokens each new token may see (a causal chunk, or a tree's ancestors: a `TailMask`).
Each layer then only writes its K/V into the pool and attends (``run()``, in ``backend.py``).

Host work is flat in the batch and the tree size: the row bookkeeping is host arrays (numpy) handled with array
operations over all rows at once, masks stay bit-packed on the model's device as the caller made them, and nothing
is read back from the device. What a backend derives from the plan (the Triton kernel's metadata, the torch path's
per-row reads) is built on the first layer and kept in the plan's typed fields for the others.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..cache.paged import PagedCache
from ..kernels.mask_bits import num_words, pack_bits, unpack_bits

BACKENDS = ("torch", "triton")
SDPA_DECODE_ENV = "HF_SPECDEC_SDPA_DECODE_KEYS"
# One row decoding one token over at most this many keys runs SDPA (the torch path: one call per layer on the row's
# pages) instead of the Triton kernel on a GPU: the kernel's fixed cost per call lost to SDPA at one token
# (docs/kernels.md, "Short single-row decodes run SDPA"). ``scripts/gpu_check.sh`` measures the crossover;
# ``HF_SPECDEC_SDPA_DECODE_KEYS`` overrides it (0: never).
DEFAULT_SDPA_DECODE_KEYS = 1024


@dataclass(frozen=True)
class TailMask:
    """Which of its row's pending and new tokens (the row's *tail*) each new token of a forward sees, bit-packed.

    Every new token sees its row's whole committed prefix; within the tail a token always sees itself and never a
    later token (a tree's ancestors precede it; pending tokens precede the new ones): the kernels bound each query's
    key range by that.

    Attributes:
        words: `[N, W]` int32 on the model's device, or None when every row is causal: bit ``j % 32`` of word
            ``j // 32`` of packed token i is set iff tail token j is visible to it (`kernels.mask_bits`).
        causal: `[B]` bool (host): rows that are causal chunks (token i sees tail tokens ``0..i``; such a row has no
            pending tokens); their words are not read.
    """

    words: torch.Tensor | None
    causal: np.ndarray

    @classmethod
    def all_causal(cls, rows: int) -> TailMask:
        return cls(None, np.ones(rows, dtype=bool))

    @classmethod
    def from_rows(
        cls, masks: Sequence[torch.Tensor | None], q_lens: Sequence[int], pending_lens: Sequence[int], device
    ) -> TailMask:
        """From per-row bool masks `[n, pending + n]` (None: a causal chunk); one row at a time, for callers off the
        hot path (tests, tools)."""
        causal = np.array([m is None for m in masks], dtype=bool)
        if causal.all():
            return cls.all_causal(len(masks))
        width = max(p + n for p, n, m in zip(pending_lens, q_lens, masks) if m is not None)
        rows = []
        for b, (mask, n, pending) in enumerate(zip(masks, q_lens, pending_lens)):
            if mask is None:
                rows.append(torch.zeros(n, width, dtype=torch.bool))
                continue
            if tuple(mask.shape) != (n, pending + n):
                raise ValueError(f"row {b}: mask of shape {tuple(mask.shape)}, expected {(n, pending + n)}")
            rows.append(torch.nn.functional.pad(mask.to("cpu", torch.bool), (0, width - pending - n)))
        return cls(pack_bits(torch.cat(rows)).to(device), causal)

    @property
    def num_words(self) -> int:
        return 0 if self.words is None else int(self.words.shape[1])


@dataclass
class RowRead:
    """How the torch path reads one row (built once per forward, for every layer).

    Attributes:
        start, end: the row's packed token range.
        total: keys the row's tokens attend over (prefix + pending + new).
        where: the first pool slot when the row's pages are consecutive, else `[total]` slots.
        mask: `[n, total]` bool, or None when a plain causal mask (or none) suffices.
    """

    start: int
    end: int
    total: int
    where: int | torch.Tensor
    mask: torch.Tensor | None


@dataclass
class AttentionPlan:
    """Everything the attention of one forward needs, shared by all layers.

    Rows are packed back to back: packed tokens ``cu_seqlens[b] : cu_seqlens[b + 1]`` belong to cache row
    ``rows[b]``, which already holds ``prefix_lens[b]`` committed tokens. The new tokens are written at positions
    ``prefix_lens[b] + pending_lens[b], ...`` of the row (slots in ``slot_mapping``). Between the committed prefix
    and the new tokens a row may hold ``pending_lens[b]`` tokens written by earlier forwards but not committed (a
    draft model expanding its tree one level per forward); the new tokens see them only where ``mask`` says so.

    Attributes (B = rows in the forward, N = packed new tokens; host arrays are numpy int64):
        cache: the `PagedCache` the forward reads and writes.
        rows: `[B]` (host) cache row of each packed segment.
        cu_seqlens: `[B + 1]` (host) segment offsets in the packed batch.
        prefix_lens: `[B]` (host) committed length of each row before this forward.
        pending_lens: `[B]` (host) uncommitted tokens between each row's prefix and its new tokens.
        slot_mapping: `[N]` int64 pool slot of each new token (on the model's device).
        slot_start: the first slot when the new tokens' slots are consecutive (the usual case: a row's tail within
            its pages), else None; layers then write them with one slice copy instead of an indexed one.
        positions: `[N]` int64 position ids of the new tokens (rotary positions: prefix + depth for trees).
        mask: the `TailMask` of the forward.
        backend: ``"triton"`` or ``"torch"``: which attention path serves this forward (the call's backend, or the
            torch path for a short single-row decode of a Triton call: `sdpa_serves_decode`).
        kernel_metadata: the Triton kernel's metadata per (query heads per KV head, largest work tile), built by the
            first layer that needs it (``backend.py``).
        row_reads: the torch path's `RowRead` per row, built by the first layer that needs them.
        attention_modules: the attention modules that served this plan so far, in call order.
        state_modules: the layers with a state of their own (short convolutions) that served it, in call order.
        conv_windows: per kernel width, where each token's convolution window lies (``attention/short_conv.py``).
        checking: whether this forward records what the model asks of attention (the call's first forward; see
            ``generation/support.py``): ``attention_windows`` (each call's ``sliding_window`` argument) and
            ``mask_windows`` (the window of each mask transformers was asked to build: its ``local_size``, None
            for a plain causal mask).
    """

    cache: PagedCache
    rows: np.ndarray
    cu_seqlens: np.ndarray
    prefix_lens: np.ndarray
    pending_lens: np.ndarray
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    mask: TailMask
    slot_start: int | None = None
    backend: str = "torch"
    kernel_metadata: dict[tuple[int, int], object] = field(default_factory=dict)
    row_reads: list[RowRead] | None = None
    attention_modules: list = field(default_factory=list)
    state_modules: list = field(default_factory=list)
    conv_windows: dict[int, torch.Tensor] = field(default_factory=dict)
    checking: bool = False
    attention_windows: list = field(default_factory=list)
    mask_windows: list = field(default_factory=list)

    @property
    def write_slots(self) -> int | torch.Tensor:
        """Where the layers write the new tokens' K/V: `slot_start` when set, else `slot_mapping` (`PagedLayer.write`
        takes either)."""
        return self.slot_mapping if self.slot_start is None else self.slot_start

    @property
    def has_pending(self) -> bool:
        return bool(self.pending_lens.any())

    @property
    def num_rows(self) -> int:
        return int(self.rows.size)

    @property
    def q_lens(self) -> np.ndarray:
        """`[B]` new tokens per row (host)."""
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    def row_mask(self, b: int, device: torch.device) -> torch.Tensor | None:
        """`[n, prefix + pending + n]` bool mask of row b (None when a plain causal mask with no prefix suffices)."""
        n = int(self.cu_seqlens[b + 1] - self.cu_seqlens[b])
        prefix, pending = int(self.prefix_lens[b]), int(self.pending_lens[b])
        if self.mask.causal[b]:
            if prefix == 0 or n == 1:
                return None  # causal from scratch, or a single query that sees everything
            own = torch.ones(n, n, dtype=torch.bool, device=device).tril_()
        else:
            start = int(self.cu_seqlens[b])
            own = unpack_bits(self.mask.words[start : start + n], pending + n).to(device)
        mask = torch.ones(n, prefix + pending + n, dtype=torch.bool, device=device)
        mask[:, prefix:] = own
        return mask


def build_plan(
    cache: PagedCache,
    rows: Sequence[int] | np.ndarray,
    q_lens: Sequence[int] | np.ndarray,
    positions: torch.Tensor,
    mask: TailMask | Sequence[torch.Tensor | None] | None,
    device: torch.device | str,
    pending_lens: Sequence[int] | np.ndarray | None = None,
    backend: str = "torch",
) -> AttentionPlan:
    """Reserve pool slots for ``q_lens[b]`` new tokens of each row and return the forward's `AttentionPlan`.

    The rows' committed lengths do not change here: new tokens sit past them until `PagedCache.commit` (trees) or
    `PagedCache.commit_chunks` (chunks) decides what is kept.

    Args:
        cache: the cache the forward writes.
        rows: `[B]` distinct cache rows.
        q_lens: `[B]` new tokens of each row.
        positions: `[N]` int64 position ids of the packed new tokens.
        mask: the forward's `TailMask`; or per row a `[n, pending + n]` bool mask / None for a causal chunk
            (converted row by row: for callers off the hot path); None: every row causal.
        device: where the model runs.
        pending_lens: `[B]` uncommitted tokens already written after each row's prefix (default 0).
        backend: ``"triton"`` or ``"torch"`` (see `backend.choose_backend`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    rows = np.asarray(rows, dtype=np.int64)
    q_lens = np.asarray(q_lens, dtype=np.int64)
    pending = np.zeros_like(rows) if pending_lens is None else np.asarray(pending_lens, dtype=np.int64)
    if mask is None:
        mask = TailMask.all_causal(rows.size)
    elif not isinstance(mask, TailMask):
        mask = TailMask.from_rows(mask, q_lens.tolist(), pending.tolist(), device)
    if (mask.causal & (pending > 0)).any():
        raise ValueError("a row with pending tokens needs an explicit mask")
    if mask.words is not None and mask.words.shape[1] < num_words(int((pending + q_lens).max())):
        raise ValueError(f"a tail mask of {mask.words.shape[1]} words is too narrow for tails of {pending + q_lens}")
    prefix = cache.lengths_of(rows)
    if backend == "triton" and sdpa_serves_decode(torch.device(device), q_lens, pending, prefix):
        backend = "torch"
    slots = cache.reserve_rows(rows, prefix + pending, q_lens)
    cu = np.zeros(rows.size + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    return AttentionPlan(
        cache=cache,
        rows=rows,
        cu_seqlens=cu,
        prefix_lens=prefix,
        pending_lens=pending,
        slot_mapping=torch.from_numpy(slots).to(device, non_blocking=True),
        positions=positions.to(device),
        mask=mask,
        slot_start=_consecutive_start(slots),
        backend=backend,
    )


def _consecutive_start(slots: np.ndarray) -> int | None:
    """The first of ``slots`` `[N]` when they are consecutive, else None."""
    if slots.size == 0 or (slots.size > 1 and not (np.diff(slots) == 1).all()):
        return None
    return int(slots[0])


def sdpa_decode_keys(device: torch.device) -> int:
    """Most keys a single-row, one-token forward of the Triton backend may attend over and still run SDPA instead:
    ``HF_SPECDEC_SDPA_DECODE_KEYS`` when set, else `DEFAULT_SDPA_DECODE_KEYS` on a GPU and 0 elsewhere."""
    value = os.environ.get(SDPA_DECODE_ENV, "").strip()
    if value:
        try:
            keys = int(value)
        except ValueError:
            raise ValueError(f"{SDPA_DECODE_ENV}={value!r}: expected a number of keys (0: never)") from None
        return max(0, keys)
    return DEFAULT_SDPA_DECODE_KEYS if device.type == "cuda" else 0


def sdpa_serves_decode(device: torch.device, q_lens: np.ndarray, pending: np.ndarray, prefix: np.ndarray) -> bool:
    """Whether SDPA (the torch path) serves this forward of a Triton call: one row, one new token, no pending
    tokens, at most `sdpa_decode_keys` keys. Its row's pages are one view when they are consecutive, so SDPA runs
    once per layer without a copy; the output is the same attention either way."""
    if q_lens.size != 1 or int(q_lens[0]) != 1 or int(pending[0]):
        return False
    return int(prefix[0]) + 1 <= sdpa_decode_keys(device)
