"""PagedCache: a `transformers.Cache` whose K/V live in a pool of fixed-size blocks, one block table per row.

Layout (per layer): a row's token at position ``p`` lives in block ``block_table[row][p // block_size]`` at offset
``p % block_size``; its *slot* is ``block * block_size + offset``. All layers share one `BlockAllocator` (the same
block tables), so a slot means the same thing in every layer. The pools ``keys`` and ``values`` are stored

- slot-major (default): `[num_blocks, block_size, num_kv_heads, head_dim]`, a slot's heads side by side: what the
  Triton kernels read (a tile of keys is one row of ``H_kv * D`` columns per slot);
- head-major (``PagedCache(head_major=True)``): `[num_kv_heads, num_blocks * block_size, head_dim]`, each head's slots
  side by side, as transformers' `DynamicCache` stores them: the K/V of a row whose pages are consecutive is then a
  zero-copy `[H_kv, L, D]` view with unit stride between positions. The torch (CPU) attention path uses it: over
  slot-major pools SDPA reads each head with a stride of ``H_kv * D``, about twice as slow per decode step, which
  was most of the loop's own overhead (docs/lab/measurements.md, "PagedCache").

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

from collections.abc import Sequence

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..text_config import text_config
from .conv_states import ConvStates
from .recurrent_states import RecurrentStates


class BlockAllocator:
    """Block tables and lengths of every row; hands out and takes back blocks (lowest id first).

    The bookkeeping is host arrays (numpy): ``tables[row, i]`` is the row's i-th block, ``counts[row]`` how many it
    holds, ``lengths[row]`` its committed tokens, and the free blocks are a sorted array. Every operation takes a
    batch of rows and runs as array operations over all of them (no loop over rows or blocks), so the host time of
    reserving, committing and freeing does not grow with the batch or the tree size.
    """

    def __init__(self, block_size: int = 16, initial_blocks: int = 0):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.num_blocks = initial_blocks  # capacity the layer pools must have
        self._free = np.arange(initial_blocks, dtype=np.int64)  # sorted ascending
        self._tables = np.zeros((0, 1), dtype=np.int64)  # [row capacity, block capacity]
        self._counts = np.zeros(0, dtype=np.int64)  # blocks held per row
        self._lengths = np.zeros(0, dtype=np.int64)  # committed tokens per row
        self._active = np.zeros(0, dtype=bool)
        self._rows = 0
        self.dense_slots: torch.Tensor | None = None  # slots of the current drop-in forward (set by layer 0)

    # rows -------------------------------------------------------------------
    def add_rows(self, n: int) -> list[int]:
        start = self._rows
        if start + n > self._counts.size:
            cap = max(start + n, 2 * self._counts.size, 4)
            self._tables = _grown(self._tables, (cap, self._tables.shape[1]))
            self._counts, self._lengths = _grown(self._counts, (cap,)), _grown(self._lengths, (cap,))
            self._active = _grown(self._active, (cap,))
        self._active[start : start + n] = True
        self._rows = start + n
        return list(range(start, start + n))

    @property
    def num_rows(self) -> int:
        return self._rows

    @property
    def lengths(self) -> list[int]:
        """Committed tokens of every row (a copy)."""
        return self._lengths[: self._rows].tolist()

    @property
    def active(self) -> list[bool]:
        return self._active[: self._rows].tolist()

    @property
    def block_tables(self) -> list[list[int]]:
        """Every row's blocks, in order (a copy)."""
        return [self._tables[r, : self._counts[r]].tolist() for r in range(self._rows)]

    def length(self, row: int) -> int:
        return int(self._lengths[row])

    def lengths_of(self, rows: np.ndarray) -> np.ndarray:
        """`[B]` committed lengths of ``rows`` `[B]`."""
        return self._lengths[rows]

    def is_active(self, row: int) -> bool:
        return bool(self._active[row])

    def free_row(self, row: int) -> None:
        """Give every block of ``row`` back; the row keeps its index but holds nothing."""
        self._give(self._tables[row, : self._counts[row]])
        self._counts[row] = self._lengths[row] = 0
        self._active[row] = False

    # blocks -----------------------------------------------------------------
    def _give(self, blocks: np.ndarray) -> None:
        if blocks.size:
            blocks = np.sort(blocks.astype(np.int64))
            self._free = np.insert(self._free, np.searchsorted(self._free, blocks), blocks)

    def _take(self, count: int) -> np.ndarray:
        """The ``count`` lowest free blocks (the pool grows, doubling, when there are not enough)."""
        while self._free.size < count:
            grow = max(16, self.num_blocks)  # amortised doubling
            self._free = np.concatenate([self._free, np.arange(self.num_blocks, self.num_blocks + grow)])
            self.num_blocks += grow
        taken, self._free = self._free[:count], self._free[count:]
        return taken

    def reserve_rows(self, rows: np.ndarray, total_lens: np.ndarray) -> None:
        """Make sure each of ``rows`` `[B]` (distinct) has blocks for positions ``[0, total_lens[b])``."""
        need = -(-total_lens // self.block_size)
        have = self._counts[rows]
        extra = np.maximum(need - have, 0)
        count = int(extra.sum())
        if not count:
            return
        width = int(need.max())
        if width > self._tables.shape[1]:
            self._tables = _grown(self._tables, (self._tables.shape[0], max(width, 2 * self._tables.shape[1])))
        first = np.cumsum(extra) - extra  # [B] index of each row's first new block among the taken ones
        cols = np.arange(count) - np.repeat(first, extra) + np.repeat(have, extra)
        self._tables[np.repeat(rows, extra), cols] = self._take(count)
        self._counts[rows] = have + extra

    def reserve(self, row: int, total_len: int) -> None:
        """Make sure ``row`` has blocks for positions ``[0, total_len)``."""
        self.reserve_rows(np.array([row]), np.array([total_len]))

    def truncate_rows(self, rows: np.ndarray, lengths: np.ndarray) -> None:
        """Set the committed lengths of ``rows`` `[B]` (distinct) to ``lengths`` `[B]` and free blocks past them."""
        held = self._counts[rows]
        short = lengths > held * self.block_size
        if short.any():
            b = int(short.argmax())
            raise ValueError(
                f"row {int(rows[b])}: cannot keep {int(lengths[b])} tokens, only blocks for fewer are reserved"
            )
        keep = -(-lengths // self.block_size)
        drop = held - keep  # [B] blocks each row gives back
        count = int(drop.sum())
        if count:
            first = np.cumsum(drop) - drop
            cols = np.arange(count) - np.repeat(first, drop) + np.repeat(keep, drop)
            self._give(self._tables[np.repeat(rows, drop), cols])
        self._counts[rows] = keep
        self._lengths[rows] = lengths

    def truncate(self, row: int, length: int) -> None:
        """Set the row's committed length to ``length`` and free blocks past it."""
        self.truncate_rows(np.array([row]), np.array([length]))

    def slots_of(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """`[M]` flat slot ids of the (reserved) ``positions`` `[M]` of ``rows`` `[M]`."""
        bs = self.block_size
        return self._tables[rows, positions // bs] * bs + positions % bs

    def span_slots(self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """`[sum(counts)]` slots of positions ``[starts[b], starts[b] + counts[b])`` of each of ``rows``, row after
        row (reserved)."""
        bs, width = self.block_size, self._tables.shape[1]
        first = np.cumsum(counts) - counts
        table_row, shift = np.repeat(np.stack([rows * width, starts - first]), counts, axis=1)  # [2, M]
        positions = np.arange(table_row.size) + shift
        return self._tables.ravel()[table_row + positions // bs] * bs + positions % bs

    def slots(self, row: int, positions: torch.Tensor | Sequence[int], device=None) -> torch.Tensor:
        """`[n]` flat slot ids of ``positions`` of ``row`` (the blocks must be reserved)."""
        pos = np.asarray(torch.as_tensor(positions, dtype=torch.long).cpu())
        out = torch.from_numpy(self.slots_of(np.full(pos.size, row), pos))
        return out if device is None else out.to(device)

    def slot_range(self, row: int, start: int, stop: int, device=None) -> torch.Tensor:
        return self.slots(row, torch.arange(start, stop), device)

    def contiguous_span(self, row: int, length: int) -> int | None:
        """First slot if positions ``[0, length)`` of ``row`` occupy consecutive slots, else None."""
        need = -(-length // self.block_size)
        if need == 0:
            return 0
        table = self._tables[row, :need].astype(np.int64)
        if (np.diff(table) == 1).all():
            return int(table[0]) * self.block_size
        return None

    def read_index(self, row: int, length: int, device=None) -> int | torch.Tensor:
        """How to read positions ``[0, length)`` of ``row``: the first slot (int) if they are consecutive, else slots."""
        start = self.contiguous_span(row, length)
        if start is not None:
            return start
        return self.slot_range(row, 0, length, device=device)

    def block_table_array(self, rows: np.ndarray) -> np.ndarray:
        """`[len(rows), max_blocks]` int64 block tables, padded with 0 (kernels read lengths to stay in bounds)."""
        width = max(int(self._counts[rows].max()) if len(rows) else 0, 1)
        return self._tables[rows, :width]

    def block_table_tensor(self, rows: Sequence[int], device=None) -> torch.Tensor:
        """`[len(rows), max_blocks]` int32 block tables, padded with 0 (kernels read lengths to stay in bounds)."""
        out = torch.from_numpy(self.block_table_array(np.asarray(rows, dtype=np.int64)).astype(np.int32))
        return out if device is None else out.to(device)

    def relabel_blocks(self, perm: Sequence[int]) -> None:
        """Rename every block ``b`` to ``perm[b]`` (a permutation of the pool; the caller moves the pages' data)."""
        perm = np.asarray(perm, dtype=np.int64)
        held = np.arange(self._tables.shape[1])[None, :] < self._counts[:, None]
        self._tables[held] = perm[self._tables[held]]
        self._free = np.sort(perm[self._free])

    def blocks_in_use(self) -> int:
        return self.num_blocks - int(self._free.size)


def _grown(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``array`` copied into the top-left corner of zeros of ``shape``."""
    out = np.zeros(shape, dtype=array.dtype)
    out[tuple(slice(0, n) for n in array.shape)] = array
    return out


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

    def write(self, slots: torch.Tensor | int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store `[N, H_kv, D]` key/value rows at flat ``slots`` `[N]`, or at ``slots, slots + 1, ...`` when an int
        (one slice copy: cheaper than the indexed copy for the one token of a decode step)."""
        if not self.is_initialized:
            self.lazy_initialization(key, value)
        self.ensure_capacity()
        k, v = self.flat()
        if isinstance(slots, int):
            k[slots : slots + key.shape[0]].copy_(key)
            v[slots : slots + value.shape[0]].copy_(value)
            return
        k.index_copy_(0, slots, key.to(k.dtype))
        v.index_copy_(0, slots, value.to(v.dtype))

    def write_heads(self, slots: torch.Tensor | int, key: torch.Tensor, value: torch.Tensor) -> None:
        """`write` for `[H_kv, N, D]` key/value (transformers' layout of one batch row): head-major pools take a
        consecutive run of slots as they are, with no transposes."""
        if self.head_major and isinstance(slots, int) and self.is_initialized:
            self.ensure_capacity()
            self.keys[:, slots : slots + key.shape[1]].copy_(key)
            self.values[:, slots : slots + value.shape[1]].copy_(value)
            return
        self.write(slots, key.transpose(0, 1), value.transpose(0, 1))

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
        if self.head_major:  # a view of consecutive slots, or scattered pages copied straight into [H_kv, L, D]
            if isinstance(where, int):
                return self.keys[:, where : where + length], self.values[:, where : where + length]
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
            k, v = self.gather_heads(b, self.allocator.length(b))  # [H_kv, L, D]
            ks.append(k)
            vs.append(v)
        return torch.stack(ks), torch.stack(vs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.allocator.length(0) if self.allocator.num_rows else 0

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
            cfg = text_config(config)
            num_layers = cfg.num_hidden_layers
        layers = [PagedLayer(self.allocator, i, head_major) for i in range(num_layers or 0)]
        super().__init__(layers=layers)
        self.conv_states = ConvStates()  # short-convolution layers' state (cache/conv_states.py), when a model has any
        self.recurrent_states = RecurrentStates()  # gated delta nets' state (cache/recurrent_states.py)

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
            rows = np.arange(bsz)
            starts = alloc.lengths_of(rows)
            slots = self.reserve_rows(rows, starts, np.full(bsz, seq))
            alloc.truncate_rows(rows, starts + seq)
            alloc.dense_slots = torch.from_numpy(slots)
        return layer.update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.allocator.length(0) if self.allocator.num_rows else 0

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
        """Committed tokens of every row (a copy; `length` / `lengths_of` for one row / a batch)."""
        return self.allocator.lengths

    def length(self, row: int) -> int:
        """Committed tokens of ``row``."""
        return self.allocator.length(row)

    def lengths_of(self, rows: np.ndarray) -> np.ndarray:
        """`[B]` committed tokens of ``rows`` `[B]` (host int64 arrays)."""
        return self.allocator.lengths_of(rows)

    def add_rows(self, n: int) -> list[int]:
        """``n`` new empty rows; returns their indices."""
        return self.allocator.add_rows(n)

    @property
    def num_rows(self) -> int:
        """Rows ever added (freed rows keep their index)."""
        return self.allocator.num_rows

    def is_active(self, row: int) -> bool:
        """Whether ``row`` still holds blocks (not yet `free` d)."""
        return self.allocator.is_active(row)

    def reserve_rows(self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Blocks for positions ``[starts[b], starts[b] + counts[b])`` of each of ``rows`` (distinct; host int64
        arrays `[B]`); returns the `[sum(counts)]` int64 pool slots, row after row.

        The rows' committed lengths do not change: the slots hold uncommitted tokens until `commit_chunks` or
        `commit` decides what is kept.
        """
        self.allocator.reserve_rows(rows, starts + counts)
        return self.allocator.span_slots(rows, starts, counts)

    def reserve(self, row: int, start: int, count: int) -> torch.Tensor:
        """`reserve_rows` for one row: its `[count]` int64 pool slots as a tensor."""
        return torch.from_numpy(self.reserve_rows(np.array([row]), np.array([start]), np.array([count])))

    def commit_chunks(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """Keep the ``counts[b]`` tokens written right after each of ``rows``' committed prefix (prefill chunks) and
        forget anything past them."""
        self.allocator.truncate_rows(rows, self.allocator.lengths_of(rows) + counts)
        for states in (self.conv_states, self.recurrent_states):
            if states:
                states.commit(rows, [slice(0, int(c)) for c in counts])

    def commit_chunk(self, row: int, count: int) -> None:
        """`commit_chunks` for one row."""
        self.commit_chunks(np.array([row]), np.array([count]))

    def free(self, row: int) -> None:
        """Give every block of ``row`` back; the row keeps its index but holds nothing."""
        self.allocator.free_row(row)
        self.conv_states.free(row)
        self.recurrent_states.free(row)

    def rollback(self, row: int, length: int) -> None:
        """Forget everything of ``row`` past ``length`` tokens (freeing whole blocks past it)."""
        if length > self.allocator.length(row):
            raise ValueError(f"row {row} holds {self.allocator.length(row)} tokens; cannot roll back to {length}")
        if (self.conv_states or self.recurrent_states) and length < self.allocator.length(row):
            raise NotImplementedError(
                "a row of convolution or recurrent layers cannot be rolled back past committed tokens"
            )
        self.allocator.truncate(row, length)

    def blocks_in_use(self) -> int:
        """Blocks currently held by rows."""
        return self.allocator.blocks_in_use()

    def block_tables(self, rows: Sequence[int] | np.ndarray) -> torch.Tensor:
        """`[len(rows), max_blocks]` int32 (CPU) block tables of ``rows``, padded with 0."""
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

        The verdicts are read to the host once for the whole batch (one concatenation; the only read of a step);
        the bookkeeping is array operations over every row at once.

        Args:
            rows: cache rows (distinct).
            accepted: per row `[1 + a]` accepted tree positions.
            use_triton: move the K/V with the Triton kernel (one launch for every layer) instead of torch copies.
        """
        rows = np.asarray(rows, dtype=np.int64)
        acc_t = [a if isinstance(a, torch.Tensor) else torch.as_tensor(a, dtype=torch.long) for a in accepted]
        for states in (self.conv_states, self.recurrent_states):
            if states:
                states.commit(rows, acc_t)
        counts = np.array([a.shape[0] for a in acc_t], dtype=np.int64)
        acc = torch.cat(acc_t).cpu().numpy() if acc_t else np.zeros(0, np.int64)  # [M]
        first = np.cumsum(counts) - counts
        if counts.min(initial=1) == 0 or (acc[first] != 0).any():
            b = int(((counts == 0) | (acc[np.minimum(first, max(acc.size - 1, 0))] != 0)).argmax())
            got = acc[first[b] : first[b] + counts[b]].tolist()
            raise ValueError(f"row {int(rows[b])}: accepted positions must start with the root (0), got {got}")
        alloc = self.allocator
        base = alloc.lengths_of(rows)
        if acc.size == rows.size:  # every row kept its root alone (a step that drafted nothing): nothing moves
            alloc.truncate_rows(rows, base + 1)
            return
        owner = np.repeat(np.arange(rows.size), counts)  # [M] which row each accepted position belongs to
        index = np.arange(acc.size) - first[owner]  # [M] where each accepted position goes
        moved = acc != index
        if moved.any():
            if use_triton and self.head_major:
                raise ValueError("the Triton KV move reads slot-major pools; this PagedCache is head-major")
            who = owner[moved]
            where = base[who]
            slots = alloc.slots_of(np.tile(rows[who], 2), np.concatenate([where + acc[moved], where + index[moved]]))
            pools = [layer.flat() for layer in self.layers if layer.is_initialized]
            _move_kv(pools, torch.from_numpy(slots), use_triton)
        alloc.truncate_rows(rows, base + counts)

    def memory_bytes(self) -> int:
        """Bytes held by the pools of every layer."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                total += (
                    layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
                )
        return total


def _move_kv(pools: Sequence[tuple[torch.Tensor, torch.Tensor]], src_dst: torch.Tensor, use_triton: bool) -> None:
    """Copy the K/V of pool slots ``src`` to slots ``dst`` in every layer (reads happen before writes).

    Args:
        pools: per layer ``(k_flat, v_flat)``, each `[num_slots, H_kv, D]`.
        src_dst: `[2 M]` int64 (host) the source slots, then the destination slots.
        use_triton: one Triton launch for all layers (``kernels/move_kv.py``); else torch copies layer by layer.
    """
    by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for kv in pools:  # a model dispatched over several devices (device_map) has pools on each
        by_device.setdefault(kv[0].device, []).append(kv)
    for device, group in by_device.items():
        src, dst = src_dst.to(device, non_blocking=True).chunk(2)  # one host-to-device copy per device, no wait
        if use_triton:
            from ..kernels.move_kv import move_kv_triton  # optional dependency: triton is imported only when used

            move_kv_triton(group, src, dst)
            continue
        for k, v in group:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))
