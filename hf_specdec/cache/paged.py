"""PagedCache: a `transformers.Cache` whose K/V live in a pool of fixed-size blocks, one block table per row.

Layout (per layer): a row's token at position ``p`` lives in block ``block_table[row][p // block_size]`` at offset
``p % block_size``; its *slot* is ``block * block_size + offset``. All layers share one `BlockAllocator` (the same
block tables), so a slot means the same thing in every layer. The pools ``keys`` and ``values`` are stored

- slot-major (default): `[num_blocks, block_size, num_kv_heads, head_dim]`, a slot's heads side by side: what the
  Triton kernels read (a tile of keys is one row of ``H_kv * D`` columns per slot);
- head-major (``PagedCache(head_major=True)``): `[num_kv_heads, num_blocks * block_size, head_dim]`, each head's slots
  side by side, as transformers' `DynamicCache` stores them: the K/V of a row whose pages are consecutive is then a
  zero-copy `[H_kv, L, D]` view with unit stride between positions. The torch (CPU) attention path uses it: over
  slot-major pools SDPA reads each head with a stride of ``H_kv * D`` and measured twice as slow per decode step
  on a 2-core AMD EPYC (~95 us against ~50 us per layer at 300 keys), which was most of the loop's own overhead.

`PagedLayer.flat` gives the `[num_slots, H_kv, D]` view of either layout (what writes and commit copies index) and
`PagedLayer.gather_heads` a row's `[H_kv, L, D]` K/V (a view whenever the layout and the pages allow).

Two ways to use it:

- Drop-in: ``model.generate(ids, cache=PagedCache())`` (``past_key_values=`` before transformers' rename).
  ``update`` appends the new K/V of every row and returns the row's dense K/V, so any attention implementation works.
- Speculative decoding (hf_specdec's loop): a planned forward `reserve` s slots once; the registered attention
  writes K/V straight into them and reads through the block tables. Afterwards `commit_chunk` keeps a written chunk
  (prefill), `commit` moves accepted tree nodes into place (inside and across blocks) and frees pages of rejected
  nodes, `rollback` forgets a row's tail and `free` gives a row's blocks back. Nobody outside this module touches
  the `BlockAllocator`.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class BlockAllocator:
    """Block tables and lengths of every row; hands out and takes back blocks (lowest id first)."""

    def __init__(self, block_size: int = 16, initial_blocks: int = 0):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.num_blocks = initial_blocks  # capacity the layer pools must have
        self._free: list[int] = list(range(initial_blocks))
        heapq.heapify(self._free)
        self.block_tables: list[list[int]] = []
        self.lengths: list[int] = []  # committed tokens per row
        self.active: list[bool] = []
        self.dense_slots: torch.Tensor | None = None  # slots of the current drop-in forward (set by layer 0)

    # rows -------------------------------------------------------------------
    def add_rows(self, n: int) -> list[int]:
        start = len(self.lengths)
        for _ in range(n):
            self.block_tables.append([])
            self.lengths.append(0)
            self.active.append(True)
        return list(range(start, start + n))

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    def free_row(self, row: int) -> None:
        """Give every block of ``row`` back; the row keeps its index but holds nothing."""
        for blk in self.block_tables[row]:
            heapq.heappush(self._free, blk)
        self.block_tables[row] = []
        self.lengths[row] = 0
        self.active[row] = False

    # blocks -----------------------------------------------------------------
    def _take_block(self) -> int:
        if not self._free:
            grow = max(16, self.num_blocks)  # amortised doubling
            for blk in range(self.num_blocks, self.num_blocks + grow):
                heapq.heappush(self._free, blk)
            self.num_blocks += grow
        return heapq.heappop(self._free)

    def reserve(self, row: int, total_len: int) -> None:
        """Make sure ``row`` has blocks for positions ``[0, total_len)``."""
        need = -(-total_len // self.block_size)
        table = self.block_tables[row]
        while len(table) < need:
            table.append(self._take_block())

    def truncate(self, row: int, length: int) -> None:
        """Set the row's committed length to ``length`` and free blocks past it."""
        if length > len(self.block_tables[row]) * self.block_size:
            raise ValueError(f"row {row}: cannot keep {length} tokens, only blocks for fewer are reserved")
        keep = -(-length // self.block_size)
        table = self.block_tables[row]
        for blk in table[keep:]:
            heapq.heappush(self._free, blk)
        del table[keep:]
        self.lengths[row] = length

    def slots(self, row: int, positions: torch.Tensor | Sequence[int], device=None) -> torch.Tensor:
        """`[n]` flat slot ids of ``positions`` of ``row`` (the blocks must be reserved)."""
        pos = torch.as_tensor(positions, dtype=torch.long)
        table = torch.tensor(self.block_tables[row], dtype=torch.long)
        out = table[pos // self.block_size] * self.block_size + pos % self.block_size
        return out if device is None else out.to(device)

    def slot_range(self, row: int, start: int, stop: int, device=None) -> torch.Tensor:
        return self.slots(row, torch.arange(start, stop), device)

    def contiguous_span(self, row: int, length: int) -> int | None:
        """First slot if positions ``[0, length)`` of ``row`` occupy consecutive slots, else None."""
        table = self.block_tables[row]
        need = -(-length // self.block_size)
        if need == 0:
            return 0
        first = table[0]
        if table[need - 1] - first == need - 1 and all(table[i] == first + i for i in range(need)):
            return first * self.block_size
        return None

    def read_index(self, row: int, length: int, device=None) -> int | torch.Tensor:
        """How to read positions ``[0, length)`` of ``row``: the first slot (int) if they are consecutive, else slots."""
        start = self.contiguous_span(row, length)
        if start is not None:
            return start
        return self.slot_range(row, 0, length, device=device)

    def block_table_tensor(self, rows: Sequence[int], device=None) -> torch.Tensor:
        """`[len(rows), max_blocks]` int32 block tables, padded with 0 (kernels read lengths to stay in bounds)."""
        width = max((len(self.block_tables[r]) for r in rows), default=0)
        out = torch.zeros(len(rows), max(width, 1), dtype=torch.int32)
        for i, r in enumerate(rows):
            t = self.block_tables[r]
            if t:
                out[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        return out if device is None else out.to(device)

    def blocks_in_use(self) -> int:
        return self.num_blocks - len(self._free)


class PagedLayer(CacheLayerMixin):
    """One layer's block pools; block tables come from the shared `BlockAllocator`."""

    is_sliding = False
    is_croppable = True

    def __init__(self, allocator: BlockAllocator, layer_idx: int, head_major: bool = False):
        super().__init__()
        self.allocator = allocator
        self.layer_idx = layer_idx
        self.head_major = head_major

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Create empty pools from the shapes of `[..., H_kv, D]` states (heads on dim -2)."""
        h, d = key_states.shape[-2], key_states.shape[-1]
        dv = value_states.shape[-1]
        self.dtype, self.device = key_states.dtype, key_states.device
        bs = self.allocator.block_size
        k_shape, v_shape = ((h, 0, d), (h, 0, dv)) if self.head_major else ((0, bs, h, d), (0, bs, h, dv))
        self.keys = torch.zeros(k_shape, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(v_shape, dtype=self.dtype, device=self.device)
        self.is_initialized = True

    def ensure_capacity(self) -> None:
        """Grow the pools to the allocator's block count (new slots zeroed; existing ones copied once)."""
        n = self.allocator.num_blocks
        dim, unit = (1, self.allocator.block_size) if self.head_major else (0, 1)
        extra = n * unit - self.keys.shape[dim]
        if extra > 0:
            grow = [(*p.shape[:dim], extra, *p.shape[dim + 1 :]) for p in (self.keys, self.values)]
            self.keys = torch.cat([self.keys, self.keys.new_zeros(grow[0])], dim=dim)
            self.values = torch.cat([self.values, self.values.new_zeros(grow[1])], dim=dim)

    def flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`[num_blocks * block_size, H_kv, D]` views of the pools (strided over heads when head-major)."""
        if self.head_major:
            return self.keys.transpose(0, 1), self.values.transpose(0, 1)
        return self.keys.flatten(0, 1), self.values.flatten(0, 1)

    def write(self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store `[N, H_kv, D]` key/value rows at flat ``slots`` `[N]`."""
        if not self.is_initialized:
            self.lazy_initialization(key, value)
        self.ensure_capacity()
        k, v = self.flat()
        k.index_copy_(0, slots, key.to(k.dtype))
        v.index_copy_(0, slots, value.to(v.dtype))

    def gather(
        self, row: int, length: int, where: int | torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`[length, H_kv, D]` K and V of positions ``[0, length)`` of ``row`` (a view when the pages are contiguous).

        ``where`` is `read_index` 's result when the caller already has it (computed once per forward).
        """
        k, v = self.flat()
        if where is None:
            where = self.allocator.read_index(row, length, k.device)
        if isinstance(where, int):
            return k[where : where + length], v[where : where + length]
        return k.index_select(0, where), v.index_select(0, where)

    def gather_heads(
        self, row: int, length: int, where: int | torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`[H_kv, length, D]` K and V of positions ``[0, length)`` of ``row``: with head-major pools a view with unit
        stride between positions when the pages are contiguous, else a copy in that layout (``where`` as in
        `gather`)."""
        if where is None:
            where = self.allocator.read_index(row, length, self.keys.device)
        if self.head_major and not isinstance(where, int):  # scattered pages: copy straight into [H_kv, L, D]
            return self.keys.index_select(1, where), self.values.index_select(1, where)
        k, v = self.gather(row, length, where)  # [L, H_kv, D]
        return k.transpose(0, 1), v.transpose(0, 1)

    # transformers.Cache drop-in path -----------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append `[B, H_kv, S, D]` states at the slots layer 0 reserved; return dense `[B, H_kv, L + S, D]` K/V."""
        slots = self.allocator.dense_slots
        if slots is None or slots.numel() != key_states.shape[0] * key_states.shape[2]:
            raise RuntimeError("PagedCache: layer 0 must be updated first in every forward")
        self.write(
            slots.to(key_states.device),
            key_states.transpose(1, 2).flatten(0, 1),
            value_states.transpose(1, 2).flatten(0, 1),
        )
        ks, vs = [], []
        for b in range(key_states.shape[0]):
            k, v = self.gather_heads(b, self.allocator.lengths[b])  # [H_kv, L, D]
            ks.append(k)
            vs.append(v)
        return torch.stack(ks), torch.stack(vs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.allocator.lengths[0] if self.allocator.lengths else 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("crop PagedCache rows with PagedCache.rollback(row, length)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("PagedCache does not support beam search")


class PagedCache(Cache):
    """A paged K/V cache (see module docstring).

    Args:
        config: optional model config; when given, one layer per ``num_hidden_layers`` is created up front.
        block_size: tokens per block (any value >= 1; powers of two suit the Triton kernels).
        num_layers: number of layers when no config is given (otherwise layers are added lazily).
        head_major: store the pools head-major (see the module docstring): for the torch attention path and stock
            attention; the Triton kernels read slot-major pools (the default).
    """

    def __init__(self, config=None, *, block_size: int = 16, num_layers: int | None = None, head_major: bool = False):
        self.allocator = BlockAllocator(block_size)
        self.head_major = head_major
        if config is not None:
            cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
            num_layers = cfg.num_hidden_layers
        layers = [PagedLayer(self.allocator, i, head_major) for i in range(num_layers or 0)]
        super().__init__(layers=layers)

    # layers are created on demand so PagedCache() works without a config
    def layer(self, idx: int) -> PagedLayer:
        while len(self.layers) <= idx:
            self.layers.append(PagedLayer(self.allocator, len(self.layers), self.head_major))
        return self.layers[idx]

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Drop-in `Cache.update`: rows ``0..B-1`` each append ``S`` tokens (layer 0 reserves their slots)."""
        layer = self.layer(layer_idx)
        if layer_idx == 0:
            alloc = self.allocator
            bsz, seq = key_states.shape[0], key_states.shape[2]
            if alloc.num_rows < bsz:
                alloc.add_rows(bsz - alloc.num_rows)
            slots = []
            for b in range(bsz):
                start = alloc.lengths[b]
                alloc.reserve(b, start + seq)
                alloc.lengths[b] = start + seq
                slots.append(alloc.slot_range(b, start, start + seq))
            alloc.dense_slots = torch.cat(slots)
        return layer.update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.allocator.lengths[0] if self.allocator.lengths else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * max(len(self.layers), 1)

    # ------------------------------------------------------------ paged API
    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    @property
    def lengths(self) -> list[int]:
        return self.allocator.lengths

    def add_rows(self, n: int) -> list[int]:
        """``n`` new empty rows; returns their indices."""
        return self.allocator.add_rows(n)

    @property
    def num_rows(self) -> int:
        """Rows ever added (freed rows keep their index)."""
        return self.allocator.num_rows

    def is_active(self, row: int) -> bool:
        """Whether ``row`` still holds blocks (not yet `free` d)."""
        return self.allocator.active[row]

    def reserve(self, row: int, start: int, count: int) -> torch.Tensor:
        """Blocks for positions ``[start, start + count)`` of ``row``; returns their `[count]` int64 pool slots.

        The row's committed length does not change: the slots hold uncommitted tokens until `commit_chunk` or
        `commit` decides what is kept.
        """
        self.allocator.reserve(row, start + count)
        return self.allocator.slot_range(row, start, start + count)

    def commit_chunk(self, row: int, count: int) -> None:
        """Keep the ``count`` tokens written right after ``row``'s committed prefix (a prefill chunk) and forget
        anything past them."""
        self.allocator.truncate(row, self.allocator.lengths[row] + count)

    def free(self, row: int) -> None:
        """Give every block of ``row`` back; the row keeps its index but holds nothing."""
        self.allocator.free_row(row)

    def rollback(self, row: int, length: int) -> None:
        """Forget everything of ``row`` past ``length`` tokens (freeing whole blocks past it)."""
        if length > self.allocator.lengths[row]:
            raise ValueError(f"row {row} holds {self.allocator.lengths[row]} tokens; cannot roll back to {length}")
        self.allocator.truncate(row, length)

    def blocks_in_use(self) -> int:
        """Blocks currently held by rows."""
        return self.allocator.blocks_in_use()

    def block_tables(self, rows: Sequence[int]) -> torch.Tensor:
        """`[len(rows), max_blocks]` int32 block tables of ``rows``, padded with 0."""
        return self.allocator.block_table_tensor(rows)

    def read_index(self, row: int, length: int, device=None) -> int | torch.Tensor:
        """How to read positions ``[0, length)`` of ``row``: the first slot (int) if consecutive, else `[length]` slots."""
        return self.allocator.read_index(row, length, device)

    def slots(self, row: int, positions: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """`[n]` pool slots of (reserved) ``positions`` of ``row``."""
        return self.allocator.slots(row, positions)

    def commit(
        self, rows: Sequence[int], accepted: Sequence[torch.Tensor | Sequence[int]], *, use_triton: bool = False
    ) -> None:
        """After a verification forward, keep only the accepted tree positions of each row.

        The forward wrote the row's ``[root, node_0, ...]`` at positions ``L, L + 1, ...`` (``L`` = the row's
        committed length). ``accepted[i]`` lists tree positions (0 = root, ``j + 1`` = node j), root first,
        increasing. Their K/V moves to positions ``L, L + 1, ...`` (inside and across blocks), the row's length
        grows by ``len(accepted[i])`` and blocks that only held rejected nodes are freed.

        Args:
            rows: cache rows.
            accepted: per row `[1 + a]` accepted tree positions.
            use_triton: move the K/V with the Triton kernel (one launch for every layer) instead of torch copies.
        """
        alloc = self.allocator
        src_all, dst_all = [], []
        for row, acc in zip(rows, accepted):
            acc = torch.as_tensor(acc, dtype=torch.long).reshape(-1).cpu()
            if acc.numel() == 0 or int(acc[0]) != 0:
                raise ValueError(f"row {row}: accepted positions must start with the root (0), got {acc.tolist()}")
            base = alloc.lengths[row]
            n = acc.numel()
            moved = acc != torch.arange(n)
            if bool(moved.any()):
                src_all.append(alloc.slots(row, base + acc[moved]))
                dst_all.append(alloc.slots(row, base + torch.arange(n)[moved]))
            alloc.truncate(row, base + n)
        if src_all:
            if use_triton and self.head_major:
                raise ValueError("the Triton KV move reads slot-major pools; this PagedCache is head-major")
            pools = [layer.flat() for layer in self.layers if layer.is_initialized]
            _move_kv(pools, torch.cat(src_all), torch.cat(dst_all), use_triton)

    def memory_bytes(self) -> int:
        """Bytes held by the pools of every layer."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                total += (
                    layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
                )
        return total


def _move_kv(
    pools: Sequence[tuple[torch.Tensor, torch.Tensor]], src: torch.Tensor, dst: torch.Tensor, use_triton: bool
) -> None:
    """Copy the K/V of pool slots ``src`` `[M]` to slots ``dst`` `[M]` in every layer (reads happen before writes).

    Args:
        pools: per layer ``(k_flat, v_flat)``, each `[num_slots, H_kv, D]`.
        use_triton: one Triton launch for all layers (``kernels/move_kv.py``); else torch copies layer by layer.
    """
    if not pools:
        return
    device = pools[0][0].device
    src, dst = src.to(device), dst.to(device)
    if use_triton:
        from ..kernels.move_kv import move_kv_triton  # optional dependency: triton is imported only when used

        move_kv_triton(pools, src, dst)
        return
    for k, v in pools:
        k.index_copy_(0, dst, k.index_select(0, src))
        v.index_copy_(0, dst, v.index_select(0, src))
