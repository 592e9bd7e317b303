"""Bit-packed boolean masks: what the tree-attention kernel reads, and the plan and the trees keep.

A mask row of ``L`` booleans is ``ceil(L / 32)`` int32 words: bit ``j % 32`` of word ``j // 32`` is column ``j``
(bit 31 is the sign bit; the words are bit patterns, not numbers). Tensors in, tensors out, on any device.
"""

from __future__ import annotations

import functools

import torch

WORD_BITS = 32


def num_words(width: int) -> int:
    """Words per row of a ``width``-column mask (at least one)."""
    return max(1, -(-int(width) // WORD_BITS))


@functools.lru_cache(maxsize=16)
def _bit_values(device: torch.device) -> torch.Tensor:
    """`[32]` int32: the value of bit b as an int32 (bit 31 is -2^31)."""
    return (torch.ones(WORD_BITS, dtype=torch.int64) << torch.arange(WORD_BITS)).to(torch.int32).to(device)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """`[..., L]` bool -> `[..., ceil(L / 32)]` int32 words (columns past ``L`` are 0)."""
    width = mask.shape[-1]
    words = num_words(width)
    if words * WORD_BITS != width:
        mask = torch.nn.functional.pad(mask, (0, words * WORD_BITS - width))
    bits = mask.reshape(*mask.shape[:-1], words, WORD_BITS).to(torch.int32)
    # distinct bits never carry: bits 0..30 sum below 2^31 and bit 31 adds -2^31, so int32 sums are exact patterns
    return (bits * _bit_values(mask.device)).sum(-1, dtype=torch.int32)


def unpack_bits(words: torch.Tensor, width: int) -> torch.Tensor:
    """`[..., W]` int32 words -> `[..., width]` bool (``width <= 32 W``)."""
    bits = torch.bitwise_and(words.unsqueeze(-1), _bit_values(words.device)).bool()  # [..., W, 32]
    return bits.flatten(-2)[..., :width]


def single_bits(columns: torch.Tensor, words: int) -> torch.Tensor:
    """`[N, words]` int32 rows with only bit ``columns[i]`` set (``columns``: `[N]` int64, each < 32 * words)."""
    out = torch.zeros(columns.numel(), words, dtype=torch.int32, device=columns.device)
    values = _bit_values(columns.device)[columns % WORD_BITS]
    out.scatter_(1, (columns // WORD_BITS)[:, None], values[:, None])
    return out


__all__ = ["WORD_BITS", "num_words", "pack_bits", "single_bits", "unpack_bits"]
