"""Tensors derived from a head's (or its target's) weights, cached until a source tensor changes.

Heads gather rows of the target's lm_head at their draft vocabulary, or invert a token map, once and reuse the
result every step; a head drafting in another dtype than its own keeps a converted copy of itself. The cache key is
each source tensor's identity: storage pointer, device, dtype and version counter. Tensors made under
``torch.inference_mode()`` have no version counter (and cannot be changed outside inference mode), so for them the
pointer alone identifies the contents; a user calling ``generate`` inside ``inference_mode`` is the common case, not
an error. Every cached value lives in one plain attribute of the owner (`DERIVED_ATTR`), never saved, never a
buffer, and never copied with the owner.

    rows = cached_derived(self, "_draft_rows", (lm_head.weight, token_map), lambda: lm_head.weight[token_map])
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

DERIVED_ATTR = "_hf_specdec_derived"


def tensor_state(t: torch.Tensor | None) -> tuple:
    """What identifies the contents of ``t`` for a cache: pointer, device, dtype and version (None when untracked)."""
    if t is None:
        return (None,)
    version = None if t.is_inference() else t._version
    return (t.data_ptr(), t.device, t.dtype, version)


def cached_derived(owner: nn.Module, name: str, sources: Sequence[torch.Tensor | None], build: Callable[[], object]):
    """``build()``'s result, kept on ``owner`` under ``name`` and built again only when one of ``sources`` changed
    (`tensor_state`)."""
    key = tuple(tensor_state(t) for t in sources)
    store = owner.__dict__.setdefault(DERIVED_ATTR, {})  # atomic in CPython: concurrent callers share one dict
    cached = store.get(name)
    if cached is None or cached[0] != key:
        cached = (key, build())
        store[name] = cached
    return cached[1]


def dense_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as a plain dense tensor of its full shape, to copy from: a tensor-parallel shard (DTensor) is
    gathered whole, a quantized tensor subclass (torchao) dequantized; a plain tensor is returned as it is."""
    weight = weight.detach()
    if hasattr(weight, "full_tensor"):
        weight = weight.full_tensor()
    if type(weight) is not torch.Tensor and hasattr(weight, "dequantize"):
        weight = weight.dequantize()
    return weight


def lm_head_linear(owner: nn.Module, lm_head: nn.Linear, index: torch.Tensor | None, dtype: torch.dtype) -> nn.Linear:
    """An `nn.Linear` over the rows ``index`` `[V']` (all rows when None) of ``lm_head``'s weight `[V, H]` and bias,
    gathered once and kept on ``owner`` while neither the lm_head nor ``index`` changes. Its rows are in ``dtype``
    when that is narrower than the lm_head's (a head drafting in bf16 over an fp32 target), else in the lm_head's own
    dtype (an fp32 head over a bf16 target never copies the lm_head to fp32); all rows in their own dtype are the
    lm_head itself (no copy). A module rather than bare tensors so that the loop runs it on the GEMM form measured
    fastest for a tree level's few rows, as it runs the head's own linears (`Proposer.drafting_modules`). Its
    parameters need no gradient and belong to no module of the owner: never saved, never trained."""
    w, b = lm_head.weight, lm_head.bias
    if dtype.itemsize >= w.dtype.itemsize:
        dtype = w.dtype
    if index is None and w.dtype == dtype:
        return lm_head

    def gather() -> nn.Linear:
        idx = None if index is None else index.to(w.device)
        rows = w.detach() if idx is None else w.detach()[idx]  # [V', H]
        linear = nn.Linear(rows.shape[1], rows.shape[0], bias=b is not None, device="meta")
        linear.weight = nn.Parameter(rows.to(dtype).contiguous(), requires_grad=False)
        if b is not None:
            bias = b.detach() if idx is None else b.detach()[idx]  # [V']
            linear.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
        return linear.eval()

    return cached_derived(owner, f"_lm_head_rows_{dtype}", (w, b, index), gather)


def lm_head_logits(
    owner: nn.Module, lm_head: nn.Module, states: torch.Tensor, index: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """`[..., V']` logits of ``states`` `[..., H]` over the rows ``index`` `[V']` of ``lm_head`` (all when None). A
    linear lm_head multiplies only those rows (`lm_head_linear`, in ``dtype`` when it is narrower); any other module
    runs whole in its own dtype and is then indexed."""
    if isinstance(lm_head, nn.Linear):
        linear = lm_head_linear(owner, lm_head, index, dtype)
        return linear(states.to(device=linear.weight.device, dtype=linear.weight.dtype))
    param = next(lm_head.parameters())
    logits = lm_head(states.to(device=param.device, dtype=param.dtype))
    return logits if index is None else logits[..., index.to(logits.device)]


def drafting_copy(head: nn.Module, dtype: torch.dtype, shared: Sequence[str] = ()) -> nn.Module:
    """``head`` with its floating-point parameters in ``dtype``, to draft with: ``head`` itself when they already
    are, else a copy (in eval mode) made once and kept on ``head`` until one of its tensors changes.

    Args:
        head: the head module.
        dtype: the compute dtype.
        shared: names of plain attributes that hold the bound target's modules (its lm_head, its embeddings): the
            copy refers to the same modules instead of copying them.
    Buffers keep their dtype (EAGLE's rotary frequencies stay fp32); the head is not modified.
    """
    params = [p for p in head.parameters() if p.is_floating_point()]
    if all(p.dtype == dtype for p in params):
        return head

    def build() -> nn.Module:
        memo = {id(v): v for v in (head.__dict__.get(a) for a in shared) if v is not None}
        derived = head.__dict__.get(DERIVED_ATTR)
        if derived is not None:
            memo[id(derived)] = {}  # the copy starts with no cached values (and not with a copy of itself)
        twin = copy.deepcopy(head, memo)
        with torch.no_grad():
            for p in twin.parameters():
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
        return twin.eval()

    return cached_derived(head, f"_drafting_copy_{dtype}", [*head.parameters(), *head.buffers()], build)
