"""Triton kernel of the ``hf_specdec`` attention backend: paged tree attention.

`paged_tree_attention` attends the packed new tokens of a forward (prefill chunks, decode tokens, draft trees, rows
of a ragged batch) over their rows' paged K/V. Its metadata (`build_tree_attention_metadata`) is built once per
forward by the caller (``attention/backend.py`` caches it on the forward's plan: FlashInfer's plan/run split), so every
layer only launches:

- **work tiles**: each row's new tokens are cut into tiles of ``TOKENS_PER_TILE`` tokens; one program handles a tile
  for one KV head, all ``GROUP = H_q / H_kv`` query heads of that KV head stacked on the M axis (row ``m`` = token
  ``m // GROUP``, head ``m % GROUP``), so each K/V tile is loaded once per group (GQA/MQA).
- **key range**: a tile reads the row's committed prefix (no mask), then its pending + new tokens (the "tail"), whose
  visibility comes from a bit-packed mask: query i's int32 word ``w`` has bit ``j % 32`` set iff tail token
  ``j = 32 w + j % 32`` is visible. Causal rows (prefill, decode) are flagged and use ``j <= i`` with no mask reads.
  The range stops at the last key any query of the tile can see, and tail tiles with no visible key are skipped.
- **split-K** (flash-decoding): when tiles x KV heads do not fill the GPU (batch 1, long context), each tile's key
  range is split over ``num_splits`` programs that write fp32 partials (unnormalised output, running max and sum);
  a second kernel merges them. Online softmax runs in fp32 with base-2 exponentials.
- **attention sinks** (gpt-oss's ``s_aux``): an optional `[H_q]` logit per query head that joins each query's softmax
  denominator and contributes no value. A single pass starts its online softmax from the sink (running max = the
  sink, sum = 1, output 0); split-K programs leave it out and the merge kernel adds it once, as one more partial.

The commit copy of accepted tree nodes lives in `move_kv`. This module knows nothing of the package: tensors in,
tensors out.

The kernels run on CUDA, and on CPU tensors under Triton's interpreter. In triton 3.x ``TRITON_INTERPRET=1`` is read
when a function is decorated with ``@triton.jit``: for triton's own helpers (``tl.zeros``, ``tl.cdiv``, ...) that is
``import triton``, which ``import hf_specdec`` (through transformers) already does. So the variable must be in the
environment before the process imports triton; setting ``os.environ`` later gives a clear error at the first launch.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)  # how the kernels below were decorated
# triton's own @jit helpers (tl.zeros, tl.cdiv, ...) were decorated when triton was first imported; both must agree
_LANG_INTERPRETED: bool = type(tl.zeros).__name__ == "InterpretedFunction"

_MIN_KEYS_PER_SPLIT = 256  # a split-K program reads at least this many keys (else the merge pass costs more)
_MAX_SPLITS = 32


# --------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _online_softmax_step(qk, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold one `[M, N]` tile of base-2 scores (-inf = masked) and its `[N, D]` values into the running state."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at zero
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _sink_logits_log2(Sinks, head):
    """The attention-sink logits of query heads ``head`` (`[M]`), in the base-2 units of the scores."""
    return tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634  # log2(e)


@triton.jit
def _load_kv_tile(
    k_head, v_head, bt_row, keys, key_ok, offs_d, d_valid, q,
    stride_kb, stride_ks, stride_vb, stride_vs,
    PAGE: tl.constexpr, MASK_KEYS: tl.constexpr,
):  # fmt: skip
    """The `[N, D]` keys and values at positions ``keys`` of one row and KV head, through the row's block table, in
    the dtype of the queries ``q`` (``MASK_KEYS``: positions where ``key_ok`` is false read zeros; else every position
    is known to be valid)."""
    if MASK_KEYS:  # a constexpr: only one branch is compiled
        block = tl.load(bt_row + keys // PAGE, mask=key_ok, other=0).to(tl.int64)
        kv_mask = key_ok[:, None] & d_valid[None, :]
    else:
        block = tl.load(bt_row + keys // PAGE).to(tl.int64)
        kv_mask = d_valid[None, :]
    k_off = block * stride_kb + (keys % PAGE) * stride_ks
    v_off = block * stride_vb + (keys % PAGE) * stride_vs
    k = tl.load(k_head + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_head + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    return k.to(q.dtype), v.to(q.dtype)


@triton.jit
def _load_queries(Q, q_idx, head, offs_d, q_valid, d_valid, stride_qn, stride_qh, DOT_FP32: tl.constexpr):
    """The work tile's `[M, D]` queries (packed index ``q_idx`` and head ``head``, `[M]` each; zeros where not
    ``q_valid``), in fp32 when ``DOT_FP32`` (keys and values then follow the queries' dtype)."""
    q_ptrs = Q + q_idx.to(tl.int64)[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=q_valid[:, None] & d_valid[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    return q


@triton.jit
def _split_key_tiles(kv_len, prefix, split, num_splits, BLOCK_N: tl.constexpr):
    """This split's share of a work tile's key range, in key tiles of ``BLOCK_N``: ``(lo, mid, hi)``, where
    ``[lo, mid)`` is pure committed prefix (no mask) and ``[mid, hi)`` reaches the row's tail (masked)."""
    n_kv_tiles = tl.cdiv(kv_len, BLOCK_N)
    per_split = tl.cdiv(n_kv_tiles, num_splits)
    lo = split * per_split
    hi = tl.maximum(tl.minimum(lo + per_split, n_kv_tiles), lo)
    mid = tl.minimum(tl.maximum(prefix // BLOCK_N, lo), hi)
    return lo, mid, hi


@triton.jit
def _tail_visibility(keys, prefix, kv_len, tok, q_idx, q_valid, q_tree, causal, MaskWords, words):
    """`[M, N]` which of the tile's queries see which of ``keys``: the committed prefix, then within the row's tail
    either causal order or the query's bit in ``MaskWords``."""
    j = keys - prefix  # [N] index among the row's tail tokens (negative inside the prefix)
    in_tail = (j >= 0) & (keys < kv_len)
    word_ptrs = MaskWords + q_idx[:, None] * words + (j >> 5)[None, :]
    word = tl.load(word_ptrs, mask=q_tree[:, None] & in_tail[None, :], other=0)  # [M, N] the word holding each bit
    tree_vis = ((word >> (j & 31)[None, :]) & 1) != 0
    tail_vis = tl.where(causal, j[None, :] <= tok[:, None], tree_vis)
    return (keys < prefix)[None, :] | (in_tail[None, :] & q_valid[:, None] & tail_vis)


@triton.jit
def _store_tile(
    Out, OPart, MPart, LPart, acc, m_i, l_i, q_idx, head, offs_d, q_valid, d_valid, split, num_queries,
    num_heads_q, stride_on, stride_oh, HEAD_DIM: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """Write a work tile's result: normalised rows of ``Out``, or (split-K) the unnormalised `[M, D]` ``acc``
    with the running max ``m_i`` and sum ``l_i`` (`[M]`) of this split, for the merge kernel."""
    out_mask = q_valid[:, None] & d_valid[None, :]
    if not SPLIT_K:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o_ptrs = Out + q_idx.to(tl.int64)[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, (acc / l_safe[:, None]).to(Out.dtype.element_ty), mask=out_mask)
    else:
        part = (split * num_queries + q_idx).to(tl.int64) * num_heads_q + head  # [M]
        tl.store(OPart + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
        tl.store(MPart + part, m_i, mask=q_valid)
        tl.store(LPart + part, l_i, mask=q_valid)


# Arguments that change from step to step are not specialised on, so a generation compiles a handful of variants.
@triton.jit(do_not_specialize=["num_queries", "num_splits", "words"])
def _paged_tree_attention_kernel(
    Q,  # [N, H_q, D]
    K,  # [num_blocks, PAGE, H_kv, D]
    V,
    Out,  # [N, H_q, D]
    OPart,  # [num_splits, N, H_q, D] fp32 (split-K only)
    MPart,  # [num_splits, N, H_q] fp32
    LPart,
    Sinks,  # [H_q] attention-sink logits (read only when HAS_SINKS)
    BlockTables,  # [B, max_blocks] int32
    CuSeqlens,  # [B + 1] int32
    PrefixLens,  # [B] int32
    IsCausal,  # [B] int32
    MaskWords,  # [N, words] int32
    TileRow,  # [T] int32
    TileQStart,  # [T] int32 first token (within the row) of the tile
    TileKvLen,  # [T] int32 keys the tile reads: prefix + last visible tail token + 1
    scale_log2,  # softmax scale * log2(e)
    num_queries, num_heads_q, num_splits, words,
    stride_qn, stride_qh, stride_on, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, TOKENS_PER_TILE: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT_K: tl.constexpr,  # num_splits > 1: write partials for the merge kernel
    HAS_SINKS: tl.constexpr,  # join Sinks to every query's softmax (split-K: the merge kernel does)
    DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    tile, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)

    row = tl.load(TileRow + tile)
    q_start = tl.load(TileQStart + tile)
    kv_len = tl.load(TileKvLen + tile)
    seq_start = tl.load(CuSeqlens + row)
    n_new = tl.load(CuSeqlens + row + 1) - seq_start
    prefix = tl.load(PrefixLens + row)
    causal_flag = tl.load(IsCausal + row)
    causal = causal_flag != 0

    offs_m = tl.arange(0, BLOCK_M)
    tok = q_start + offs_m // GROUP  # [M] token of the row
    head = kv_head * GROUP + offs_m % GROUP  # [M] query head
    q_valid = (offs_m < TOKENS_PER_TILE * GROUP) & (tok < n_new)
    q_tree = q_valid & ((offs_m * 0 + causal_flag) == 0)  # [M] (a vector: the interpreter mis-types bool scalars)
    q_idx = seq_start + tok  # [M] packed query index
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    q = _load_queries(Q, q_idx, head, offs_d, q_valid, d_valid, stride_qn, stride_qh, DOT_FP32)  # [M, D]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if HAS_SINKS and not SPLIT_K:  # the sink as a first key without value: max = sink, sum = exp2(0) = 1
        m_i = _sink_logits_log2(Sinks, head)
        l_i += 1.0

    lo, mid, hi = _split_key_tiles(kv_len, prefix, split, num_splits, BLOCK_N)

    offs_n = tl.arange(0, BLOCK_N)
    bt_row = BlockTables + row.to(tl.int64) * stride_bt
    k_head = K + kv_head.to(tl.int64) * stride_kh
    v_head = V + kv_head.to(tl.int64) * stride_vh

    for t in range(lo, mid):  # committed prefix: every query sees every key, no mask
        keys = t * BLOCK_N + offs_n
        k, v = _load_kv_tile(
            k_head, v_head, bt_row, keys, keys < kv_len, offs_d, d_valid, q,
            stride_kb, stride_ks, stride_vb, stride_vs, PAGE, False,
        )  # fmt: skip
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [M, N]
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, DOT_PRECISION)

    for t in range(mid, hi):  # the end of the prefix and the tail: prefix | causal | tree bits
        keys = t * BLOCK_N + offs_n
        visible = _tail_visibility(keys, prefix, kv_len, tok, q_idx, q_valid, q_tree, causal, MaskWords, words)
        if tl.max(visible.to(tl.int32)) > 0:  # skip tiles that no query of this tile can see
            k, v = _load_kv_tile(
                k_head, v_head, bt_row, keys, keys < kv_len, offs_d, d_valid, q,
                stride_kb, stride_ks, stride_vb, stride_vs, PAGE, True,
            )  # fmt: skip
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            qk = tl.where(visible, qk, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, DOT_PRECISION)

    _store_tile(
        Out, OPart, MPart, LPart, acc, m_i, l_i, q_idx, head, offs_d, q_valid, d_valid, split, num_queries,
        num_heads_q, stride_on, stride_oh, HEAD_DIM, SPLIT_K,
    )  # fmt: skip


@triton.jit(do_not_specialize=["num_queries", "num_splits"])
def _merge_splits_kernel(
    Out,  # [N, H_q, D]
    OPart,  # [num_splits, N, H_q, D] fp32
    MPart,  # [num_splits, N, H_q] fp32
    LPart,
    Sinks,  # [H_q] attention-sink logits (read only when HAS_SINKS)
    num_queries,
    num_heads_q,
    num_splits,
    stride_on,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    pid = tl.program_id(0)  # = query * H_q + head
    query = pid // num_heads_q
    head = pid % num_heads_q
    offs_s = tl.arange(0, BLOCK_S)
    s_valid = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    part = offs_s.to(tl.int64) * num_queries * num_heads_q + pid  # [S]
    m = tl.load(MPart + part, mask=s_valid, other=float("-inf"))
    l_part = tl.load(LPart + part, mask=s_valid, other=0.0)
    acc = tl.load(
        OPart + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_valid[:, None] & d_valid[None, :], other=0.0
    )
    m_max = tl.max(m, 0)
    if HAS_SINKS:  # the sink once, as one more partial with max = sink, sum = 1 and output 0
        sink = _sink_logits_log2(Sinks, head)
        m_max = tl.maximum(m_max, sink)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # [S]; empty splits (m = -inf) weigh 0
    l_tot = tl.sum(w * l_part, 0)
    if HAS_SINKS:
        l_tot += tl.exp2(sink - m_max)
    l_tot = tl.where(l_tot == 0.0, 1.0, l_tot)
    o = tl.sum(w[:, None] * acc, 0) / l_tot  # [D]
    tl.store(Out + query.to(tl.int64) * stride_on + head * stride_oh + offs_d, o.to(Out.dtype.element_ty), mask=d_valid)


# ------------------------------------------------------------------------------------------------ metadata
@dataclass
class TreeAttentionMetadata:
    """Per-forward kernel metadata (device tensors + launch constants), shared by every layer of the forward."""

    block_tables: torch.Tensor  # [B, max_blocks] int32
    cu_seqlens: torch.Tensor  # [B + 1] int32
    prefix_lens: torch.Tensor  # [B] int32
    is_causal: torch.Tensor  # [B] int32
    mask_words: torch.Tensor  # [N, words] int32, bit j of query i = tail token j visible
    tile_row: torch.Tensor  # [T] int32
    tile_q_start: torch.Tensor  # [T] int32
    tile_kv_len: torch.Tensor  # [T] int32
    num_queries: int
    num_tiles: int
    words: int
    block_m: int
    tokens_per_tile: int
    max_kv_len: int
    tree_rows: int

    @property
    def mask_bytes(self) -> int:
        """Bytes of tree mask a forward reads per (layer, KV head): the bit-packed words of tree rows."""
        return self.mask_words.numel() * 4 if self.tree_rows else 0


def _next_pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def max_block_m(dtype: torch.dtype) -> int:
    """Largest work tile for queries of ``dtype``: fp32 dots run on FMA units in "ieee" precision, where big tiles
    spill registers, so fp32 keeps them small."""
    return 16 if dtype == torch.float32 else 64


def build_tree_attention_metadata(
    q_lens: Sequence[int] | np.ndarray,
    prefix_lens: Sequence[int] | np.ndarray,
    pending_lens: Sequence[int] | np.ndarray,
    causal: Sequence[bool] | np.ndarray,
    mask_words: torch.Tensor | None,
    block_tables: np.ndarray | torch.Tensor,
    device: torch.device,
    group: int,
    max_block_m: int = 64,
) -> TreeAttentionMetadata:
    """Kernel metadata of one forward for ``group`` query heads per KV head.

    A work tile stacks ``tokens_per_tile`` tokens x ``group`` heads on ``block_m`` rows (16 to ``max_block_m``, at
    least the group), so a decode token gets one small tile and a tree or a chunk a few full ones. A tile reads keys
    up to its last token's own position: within its row's tail a token sees itself and never a later token.

    Built on the host from the rows' sizes alone, with array operations over every row and tile at once (no loop
    over rows, nothing read from the device), and moved to ``device`` in one copy; the bit-packed mask stays where
    the caller made it. Every layer of the forward reuses the result.

    Args:
        q_lens: `[B]` (host) new tokens of each row, packed back to back.
        prefix_lens: `[B]` (host) committed tokens of each row (seen by every new token of the row).
        pending_lens: `[B]` (host) uncommitted tokens between the prefix and the new tokens.
        causal: `[B]` (host) rows that are causal chunks (no pending tokens; their mask words are not read).
        mask_words: `[N, words]` int32 on ``device``: bit j of token i = tail token j visible (`kernels.mask_bits`),
            or None when every row is causal.
        block_tables: `[B, max_blocks]` int32 (host) block table of each row.
    """
    q = np.asarray(q_lens, dtype=np.int64)
    pending = np.asarray(pending_lens, dtype=np.int64)
    causal = np.asarray(causal, dtype=bool)
    if (causal & (pending > 0)).any():
        raise ValueError(f"row {int((causal & (pending > 0)).argmax())}: a row with pending tokens needs a mask")
    if mask_words is None and not causal.all():
        raise ValueError("tree rows need mask words")
    block_m, tokens_per_tile = _tile_shape(q, group, max_block_m)
    tiles = -(-q // tokens_per_tile)  # [B] work tiles per row
    num_tiles = int(tiles.sum())
    tile_row = np.repeat(np.arange(q.size), tiles)  # [tiles]
    tile_q_start = (np.arange(num_tiles) - np.repeat(np.cumsum(tiles) - tiles, tiles)) * tokens_per_tile
    last_token = np.minimum(tile_q_start + tokens_per_tile, q[tile_row]) - 1  # the tile's last token sees the most
    tile_kv_len = np.asarray(prefix_lens, dtype=np.int64)[tile_row] + pending[tile_row] + last_token + 1
    cu = np.zeros(q.size + 1, dtype=np.int64)
    np.cumsum(q, out=cu[1:])
    tables = np.asarray(block_tables)
    host = [tables.reshape(-1), cu, np.asarray(prefix_lens), causal, tile_row, tile_q_start, tile_kv_len]
    parts = _to_device_once(host, device)
    if mask_words is None:
        mask_words = torch.zeros(1, 1, dtype=torch.int32, device=device)
    return TreeAttentionMetadata(
        block_tables=parts[0].view(tables.shape),
        mask_words=mask_words.contiguous(),
        cu_seqlens=parts[1],
        prefix_lens=parts[2],
        is_causal=parts[3],
        tile_row=parts[4],
        tile_q_start=parts[5],
        tile_kv_len=parts[6],
        num_queries=int(cu[-1]),
        num_tiles=num_tiles,
        words=int(mask_words.shape[1]),
        block_m=block_m,
        tokens_per_tile=tokens_per_tile,
        max_kv_len=int(tile_kv_len.max()) if num_tiles else 0,
        tree_rows=int((~causal).sum()),
    )


def _tile_shape(q_lens: np.ndarray, group: int, max_block_m: int) -> tuple[int, int]:
    """``(block_m, tokens_per_tile)``: rows of a work tile (a power of two from 16 to ``max_block_m``, at least the
    group) and the tokens it stacks (``group`` heads each)."""
    block_m = min(max_block_m, max(16, _next_pow2(int(q_lens.max(initial=1)) * group)))
    block_m = max(block_m, _next_pow2(group))
    return block_m, block_m // group


def _to_device_once(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """``arrays`` (flat host arrays) as int32 tensors on ``device``, moved in one host-to-device copy that does not
    wait for the device."""
    sizes = [a.size for a in arrays]
    host = torch.from_numpy(np.concatenate(arrays).astype(np.int32))
    return list(torch.split(host.to(device, non_blocking=True), sizes))


_SM_COUNT: dict[int, int] = {}


def split_count(num_programs: int, max_kv_len: int, sm_count: int) -> int:
    """Split-K factor: about two waves of programs, at least `_MIN_KEYS_PER_SPLIT` keys per split, a power of two
    (so few merge-kernel variants get compiled)."""
    target = 2 * sm_count
    if num_programs >= target:
        return 1
    by_length = max(1, max_kv_len // _MIN_KEYS_PER_SPLIT)
    splits = max(1, min(-(-target // max(1, num_programs)), by_length, _MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


def _default_num_splits(meta: TreeAttentionMetadata, num_kv_heads: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter gains nothing from splitting
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return split_count(meta.num_tiles * num_kv_heads, meta.max_kv_len, _SM_COUNT[idx])


@triton.jit
def _scalar_range_probe_kernel(X, Out):
    acc = 0
    for t in range(0, tl.load(X)):
        acc += t
    tl.store(Out, acc)


@functools.cache
def _interpreter_runs_scalar_ranges() -> bool:
    """Whether this triton's interpreter accepts a loaded scalar as a loop bound, as the kernels need (triton 3.6's
    interpreter converts it with ``int()`` on a one-element array, which numpy >= 2.4 refuses)."""
    out = torch.zeros(1, dtype=torch.int32)
    try:
        _scalar_range_probe_kernel[(1,)](torch.full((1,), 3, dtype=torch.int32), out)
    except Exception as exc:  # noqa: BLE001 - any failure means the kernels cannot run here
        if "0-dimensional" in repr(exc):
            return False
        raise
    return int(out[0]) == 3


def _check_runnable(t: torch.Tensor) -> None:
    if INTERPRETED != _LANG_INTERPRETED:
        raise RuntimeError(
            f"TRITON_INTERPRET was {'set' if INTERPRETED else 'unset'} after triton was imported: triton's "
            "helpers and hf_specdec's kernels disagree on interpreter mode. Set TRITON_INTERPRET=1 in the environment "
            "before the process starts (importing hf_specdec or transformers imports triton)"
        )
    if t.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"the Triton kernels got {t.device.type} tensors but were compiled for a GPU; to run them on a CPU start "
            "the process with TRITON_INTERPRET=1 in its environment, or use HF_SPECDEC_ATTENTION=torch"
        )
    if INTERPRETED and not _interpreter_runs_scalar_ranges():
        import numpy

        raise RuntimeError(
            f"triton {triton.__version__}'s interpreter cannot run hf_specdec's kernels with numpy "
            f"{numpy.__version__} (it turns loop bounds into Python ints with int() on a one-element array, which "
            "numpy 2.4 refuses): install numpy<2.4 or a newer triton (3.9 works), or use HF_SPECDEC_ATTENTION=torch"
        )


# ------------------------------------------------------------------------------------------------ launchers
def paged_tree_attention(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: TreeAttentionMetadata,
    scale: float,
    *,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of the packed new tokens over their rows' paged K/V, with per-row causal or tree masks.

    Same semantics as the torch reference (``attention/reference.py``) without sliding window / soft-capping: row
    ``b`` sees its committed prefix, then among its pending + new tokens those its mask allows (causal when None).
    The new tokens' K/V must already be in the pools. With ``sinks``, each query's softmax also spreads over its
    head's sink logit, which adds ``exp(sink - max)`` to the denominator and nothing to the output (gpt-oss).

    Args:
        query: `[N, H_q, D]` queries of the packed new tokens (last dim contiguous).
        k_pool, v_pool: `[num_blocks, block_size, H_kv, D]` the layer's pools.
        meta: the forward's `build_tree_attention_metadata` for this group size and `max_block_m` of the dtype.
        scale: softmax scale.
        sinks: `[H_q]` attention-sink logits (unscaled, as gpt-oss's ``s_aux``; any float dtype, read as fp32).
        num_splits: split-K factor (default: chosen from the GPU's SM count; 1 on CPU).
    Returns:
        `[N, H_q, D]` in ``query``'s dtype.
    """
    _check_runnable(query)
    _check_inputs(query, k_pool, v_pool, meta, sinks)
    num_queries, heads_q, head_dim = query.shape
    _, page, heads_kv, _ = k_pool.shape
    group = heads_q // heads_kv
    out = torch.empty(num_queries, heads_q, head_dim, dtype=query.dtype, device=query.device)
    if num_queries == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    splits = num_splits if num_splits is not None else _default_num_splits(meta, heads_kv, query.device)
    splits = max(1, int(splits))
    block_d = max(16, _next_pow2(head_dim))
    block_n = (16 if block_d >= 128 else 32) if query.dtype == torch.float32 else 64
    num_warps = 8 if meta.block_m >= 64 or block_d >= 128 else 4
    if splits > 1:
        o_part = torch.empty(splits, num_queries, heads_q, head_dim, dtype=torch.float32, device=query.device)
        m_part = torch.empty(splits, num_queries, heads_q, dtype=torch.float32, device=query.device)
        l_part = torch.empty_like(m_part)
    else:
        o_part = m_part = l_part = out  # unused
    # the interpreter multiplies bf16 tiles as raw uint16 bits: compute its dots in fp32 instead
    dot_fp32 = INTERPRETED and query.dtype == torch.bfloat16
    dot_precision = "ieee" if query.dtype == torch.float32 or dot_fp32 else "tf32"
    sinks_ptr = sinks if sinks is not None else out  # unused without sinks
    grid = (meta.num_tiles, heads_kv, splits)
    with _device_guard(query.device):
        _paged_tree_attention_kernel[grid](
            query, k_pool, v_pool, out, o_part, m_part, l_part, sinks_ptr,
            meta.block_tables, meta.cu_seqlens, meta.prefix_lens, meta.is_causal, meta.mask_words,
            meta.tile_row, meta.tile_q_start, meta.tile_kv_len,
            scale * math.log2(math.e), num_queries, heads_q, splits, meta.words,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
            v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
            meta.block_tables.stride(0),
            GROUP=group, TOKENS_PER_TILE=meta.tokens_per_tile, PAGE=page, HEAD_DIM=head_dim,
            BLOCK_M=meta.block_m, BLOCK_N=block_n, BLOCK_D=block_d, SPLIT_K=splits > 1, HAS_SINKS=sinks is not None,
            DOT_PRECISION=dot_precision, DOT_FP32=dot_fp32, num_warps=num_warps, num_stages=3,
        )  # fmt: skip
        if splits > 1:
            _merge_splits_kernel[(num_queries * heads_q,)](
                out, o_part, m_part, l_part, sinks_ptr, num_queries, heads_q, splits, out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=_next_pow2(splits), HAS_SINKS=sinks is not None,
                num_warps=4,
            )  # fmt: skip
    return out


def _check_inputs(query, k_pool, v_pool, meta: TreeAttentionMetadata, sinks: torch.Tensor | None) -> None:
    """Refuse arguments of `paged_tree_attention` the kernel cannot read (see its docstring for the shapes)."""
    _, heads_q, head_dim = query.shape
    _, page, heads_kv, head_dim_k = k_pool.shape
    if head_dim_k != head_dim or v_pool.shape[-1] != head_dim:
        raise ValueError(f"query head dim {head_dim} but K/V pools have {head_dim_k}/{v_pool.shape[-1]}")
    if heads_q % heads_kv:
        raise ValueError(f"{heads_q} query heads are not a multiple of {heads_kv} KV heads")
    if page & (page - 1):
        raise ValueError(
            f"the Triton kernel needs a power-of-two block size, got {page}; use HF_SPECDEC_ATTENTION=torch"
        )
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("K/V pools must have a contiguous last dimension")
    if meta.tokens_per_tile != meta.block_m // (heads_q // heads_kv):
        raise ValueError(
            f"the kernel metadata was built for another number of query heads per KV head than {heads_q // heads_kv}"
        )
    if sinks is not None:
        _check_sinks(sinks, heads_q, query.device)


def _check_sinks(sinks: torch.Tensor, heads_q: int, device: torch.device) -> None:
    """Refuse ``sinks`` (`[H_q]`) the kernel cannot read as one logit per query head."""
    if sinks.shape != (heads_q,) or not sinks.is_floating_point():
        raise ValueError(
            f"attention sinks must be one float logit per query head, shape ({heads_q},); got {tuple(sinks.shape)} "
            f"{sinks.dtype}"
        )
    if sinks.device != device or sinks.stride(0) != 1:
        raise ValueError(
            f"attention sinks must be a contiguous tensor on {device}, like the queries; got {sinks.device}"
        )


def _device_guard(device: torch.device):
    """Launch on ``device``'s GPU (Triton launches on the current CUDA device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
