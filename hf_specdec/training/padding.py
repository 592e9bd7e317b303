"""Batches of token id lists as padded `[B, W]` tensors with their attention masks: left padding for a batch the
target goes on generating from, right padding for a forward over finished sequences (causal attention keeps every
real token from seeing a pad, so positions need no offset)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B, W]` left-padded ids and attention mask of a batch of prompt id lists."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


def right_padded(sequences: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B, W]` right-padded ids (pad 0) and attention mask of a batch of id lists."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


__all__ = ["left_padded", "right_padded"]
