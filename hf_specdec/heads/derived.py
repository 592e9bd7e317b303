"""Tensors derived from a head's (or its target's) weights, cached until a source tensor changes.

Heads gather rows of the target's lm_head at their draft vocabulary, or invert a token map, once and reuse the
result every step. The cache key is each source tensor's identity: storage pointer, device, dtype and version
counter. Tensors made under ``torch.inference_mode()`` have no version counter (and cannot be changed outside
inference mode), so for them the pointer alone identifies the contents; a user calling ``generate`` inside
``inference_mode`` is the common case, not an error.

    rows = cached_derived(self, "_draft_rows", (lm_head.weight, token_map), lambda: lm_head.weight[token_map])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn


def tensor_state(t: torch.Tensor | None) -> tuple:
    """What identifies the contents of ``t`` for a cache: pointer, device, dtype and version (None when untracked)."""
    if t is None:
        return (None,)
    version = None if t.is_inference() else t._version
    return (t.data_ptr(), t.device, t.dtype, version)


def cached_derived(owner: nn.Module, name: str, sources: Sequence[torch.Tensor | None], build: Callable[[], object]):
    """``build()``'s result, kept on ``owner`` as a plain attribute ``name`` (never saved, never a buffer) and built
    again only when one of ``sources`` changed (`tensor_state`)."""
    key = tuple(tensor_state(t) for t in sources)
    cached = owner.__dict__.get(name)
    if cached is None or cached[0] != key:
        cached = (key, build())
        owner.__dict__[name] = cached
    return cached[1]
