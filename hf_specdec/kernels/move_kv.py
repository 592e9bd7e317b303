"""Triton kernel of the commit copy: move accepted tree nodes' K/V between pool slots, every layer in one launch.

`move_kv_triton` copies K/V rows between slots in one launch for K and V of every layer (the pools' base addresses
come in a pointer table). Each program owns a slice of the ``H_kv * D`` columns of one pool's moved rows and reads
all of them before it writes any, so sources and destinations may overlap. Tensors in, tensors out: the cache
(``cache/paged.py``) decides when to call it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .tree_attention import _check_runnable, _device_guard, _next_pow2


@triton.jit(do_not_specialize=["num_moves"])
def _move_kv_kernel(
    Pools,  # [T] int64 base addresses of T pools (K and V of every layer), each [num_slots, H_kv, D]
    Scratch,  # [T, M, H_kv * D] (multi-chunk only)
    Src,  # [M] int64
    Dst,  # [M] int64
    num_moves,
    cols,  # H_kv * D
    stride_s,  # slot stride of every pool
    stride_h,  # head stride of every pool
    D: tl.constexpr,
    DTYPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SINGLE_CHUNK: tl.constexpr,
):
    # Program (c, t) owns columns [c * BLOCK_C, +BLOCK_C) of every moved row of pool t; no other program touches
    # them, so reading all its sources before writing any destination (a CTA barrier between) is enough.
    pid = tl.program_id(0)
    t = tl.program_id(1)
    pool = tl.load(Pools + t).to(tl.pointer_type(DTYPE))
    c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    c_valid = c < cols
    c_off = (c // D) * stride_h + c % D  # [C] offset inside a slot
    offs_r = tl.arange(0, BLOCK_R)
    if SINGLE_CHUNK:  # every move fits in registers: load all, barrier, store all
        r_valid = offs_r < num_moves
        src = tl.load(Src + offs_r, mask=r_valid, other=0)
        dst = tl.load(Dst + offs_r, mask=r_valid, other=0)
        m = r_valid[:, None] & c_valid[None, :]
        x = tl.load(pool + src[:, None] * stride_s + c_off[None, :], mask=m)
        tl.debug_barrier()
        tl.store(pool + dst[:, None] * stride_s + c_off[None, :], x, mask=m)
    else:  # stage through scratch: all sources of this column slice first, then all destinations
        scratch = Scratch + t.to(tl.int64) * num_moves * cols
        for r0 in range(0, num_moves, BLOCK_R):
            rows = r0 + offs_r
            r_valid = rows < num_moves
            src = tl.load(Src + rows, mask=r_valid, other=0)
            m = r_valid[:, None] & c_valid[None, :]
            x = tl.load(pool + src[:, None] * stride_s + c_off[None, :], mask=m)
            tl.store(scratch + rows.to(tl.int64)[:, None] * cols + c[None, :], x, mask=m)
        tl.debug_barrier()
        for r0 in range(0, num_moves, BLOCK_R):
            rows = r0 + offs_r
            r_valid = rows < num_moves
            dst = tl.load(Dst + rows, mask=r_valid, other=0)
            m = r_valid[:, None] & c_valid[None, :]
            x = tl.load(scratch + rows.to(tl.int64)[:, None] * cols + c[None, :], mask=m)
            tl.store(pool + dst[:, None] * stride_s + c_off[None, :], x, mask=m)


_MOVE_SINGLE_MAX = 256  # moves that fit in one register tile; more go through a scratch buffer
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@functools.lru_cache(maxsize=64)
def _pointer_table(device: torch.device, addresses: tuple[int, ...]) -> torch.Tensor:
    """`[T]` int64 device tensor of pool base addresses (pools move only when they grow, so this is cached)."""
    return torch.tensor(addresses, dtype=torch.int64).to(device)


def move_kv_triton(pools: Sequence[tuple[torch.Tensor, torch.Tensor]], src: torch.Tensor, dst: torch.Tensor) -> int:
    """Copy the K/V rows of slots ``src`` `[M]` to ``dst`` `[M]` in place in every layer: one launch for K and V of
    all layers (one per group of pools that differ in dtype, head count, head dim or strides; one for a plain model).

    All reads happen before all writes (as ``index_select`` then ``index_copy``), so sources and destinations may
    interleave; destinations must be distinct.

    Args:
        pools: per layer ``(k_flat, v_flat)``, each `[num_slots, H_kv, D]` (flattened pages; last dim contiguous).
        src, dst: `[M]` slot ids, the same for every layer.
    Returns:
        the number of kernel launches.
    """
    tensors = [t for kv in pools for t in kv]
    if not tensors:
        return 0
    _check_runnable(tensors[0])
    num_moves = src.numel()
    if num_moves == 0:
        return 0
    if dst.numel() != num_moves:
        raise ValueError(f"move_kv: {num_moves} sources but {dst.numel()} destinations")
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError("move_kv: K/V pools must have a contiguous last dimension")
        if t.dtype not in _TL_DTYPES:
            raise ValueError(f"move_kv: unsupported pool dtype {t.dtype}")
        if t.device != tensors[0].device:
            raise ValueError(f"move_kv: pools on {t.device} and {tensors[0].device}")
        groups.setdefault((t.dtype, tuple(t.shape[1:]), t.stride(0), t.stride(1)), []).append(t)
    device = tensors[0].device
    src = src.to(device=device, dtype=torch.int64).contiguous()
    dst = dst.to(device=device, dtype=torch.int64).contiguous()
    single = num_moves <= _MOVE_SINGLE_MAX
    block_r = max(16, _next_pow2(num_moves)) if single else 64
    with _device_guard(device):
        for (dtype, (heads, d), stride_s, stride_h), group in groups.items():
            cols = heads * d
            block_c = max(16, min(_next_pow2(cols), 8192 // block_r))
            table = _pointer_table(device, tuple(t.data_ptr() for t in group))
            scratch = group[0] if single else torch.empty(len(group), num_moves, cols, dtype=dtype, device=device)
            grid = (triton.cdiv(cols, block_c), len(group))
            _move_kv_kernel[grid](
                table, scratch, src, dst, num_moves, cols, stride_s, stride_h,
                D=d, DTYPE=_TL_DTYPES[dtype], BLOCK_R=block_r, BLOCK_C=block_c, SINGLE_CHUNK=single, num_warps=4,
            )  # fmt: skip
    return len(groups)
