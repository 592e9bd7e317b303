"""The keys and values a draft head keeps of its own (EAGLE's decoder layer, DFlash's draft layers side by side):
`DraftKVCache`, one slot per batch row so that rows of different lengths draft together, and `ExtendKV`, which
stands in for transformers' ``Cache`` in one attention call over that cache plus the nodes being drafted."""

from __future__ import annotations

import torch


class DraftKVCache:
    """A draft head's own keys and values: one slot per batch row, each with its own length.

    Attributes:
        key / value: `[R, kv_heads, capacity, head_dim]`.
        lengths: `[R]` int64 committed entries per slot (positions ``0 .. lengths - 1``).
    """

    def __init__(self, rows: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device, capacity: int = 256):
        self.key = torch.zeros(rows, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.value = torch.zeros_like(self.key)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)

    @property
    def capacity(self) -> int:
        return int(self.key.shape[2])

    def reserve(self, needed: int) -> None:
        """Grow (doubling) so that every slot can hold ``needed`` entries."""
        if needed <= self.capacity:
            return
        cap = max(needed, 2 * self.capacity)
        grow = cap - self.capacity
        pad = self.key.new_zeros(*self.key.shape[:2], grow, self.key.shape[3])
        self.key = torch.cat([self.key, pad], dim=2)
        self.value = torch.cat([self.value, pad.clone()], dim=2)

    def truncate(self, slots: torch.Tensor, lengths: torch.Tensor) -> None:
        """Roll slots back: ``lengths[slots] = lengths`` (entries past it are dead and get overwritten)."""
        self.lengths[slots] = torch.minimum(self.lengths[slots], lengths.to(self.lengths.device))


class ExtendKV:
    """Stands in for transformers' ``Cache`` in one `LlamaAttention` call: the layer's new keys/values are appended
    to a fixed prefix (cache + processed tree nodes) and kept for the caller."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor):
        self.prefix_key, self.prefix_value = key, value  # [B, kv_heads, S, D]
        self.new_key = self.new_value = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.new_key, self.new_value = key_states, value_states  # [B, kv_heads, q, D]
        return torch.cat([self.prefix_key, key_states], dim=2), torch.cat([self.prefix_value, value_states], dim=2)
