"""The `hf_specdec` attention implementation registered with transformers, and the per-forward `AttentionPlan`.

The speculative loop runs the target with ``attn_implementation="hf_specdec"`` and passes an `AttentionPlan` as the
keyword argument ``hf_specdec_plan``; transformers forwards it, untouched, to the attention function of every layer.
The plan is built once per forward (FlashInfer's ``plan()``): which cache rows are in the packed batch, where each
row's new tokens go in the paged pool, and which new tokens each new token may see (a causal chunk, or a tree's
ancestors). Each layer then only writes its K/V into the pool and attends (``run()``).

Dispatch: CUDA tensors, and CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``), use the Triton kernels
of `tree_attention`; everything else uses the torch reference of `reference`. ``HF_SPECDEC_ATTENTION=torch`` or
``triton`` forces one path.
Without a plan (an ordinary forward of a model loaded with ``attn_implementation="hf_specdec"``) the function
falls back to transformers' SDPA attention, so such a model still works everywhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..cache.paged import PagedCache, PagedLayer

ATTENTION_NAME = "hf_specdec"
PLAN_KWARG = "hf_specdec_plan"


@dataclass
class AttentionPlan:
    """Everything the attention of one forward needs, shared by all layers.

    Rows are packed back to back: packed tokens ``cu_seqlens[b] : cu_seqlens[b + 1]`` belong to cache row
    ``rows[b]``, which already holds ``prefix_lens[b]`` committed tokens. The new tokens are written at positions
    ``prefix_lens[b] + pending_lens[b], ...`` of the row (slots in ``slot_mapping``). Between the committed prefix
    and the new tokens a row may hold ``pending_lens[b]`` tokens written by earlier forwards but not committed (a
    draft model expanding its tree one level per forward); the new tokens see them only where their mask says so.

    Attributes:
        cache: the target's `PagedCache`.
        rows: cache row of each packed segment.
        cu_seqlens: `[B + 1]` int64 (CPU) segment offsets in the packed batch.
        prefix_lens: committed length of each row before this forward.
        slot_mapping: `[N]` int64 pool slot of each new token.
        positions: `[N]` int64 position ids of the new tokens (rotary positions: prefix + depth for trees).
        new_token_masks: per row, `[n, pending + n]` bool visibility of the row's pending and new tokens for each new
            token, or None for a causal chunk (prefill / plain decode; pending must then be 0). Every row sees its
            whole committed prefix.
        pending_lens: per row, uncommitted tokens between the prefix and the new tokens (0 for the target).
        extras: backend-specific metadata, built lazily once per forward (e.g. the Triton kernel's packed masks).
    """

    cache: PagedCache
    rows: list[int]
    cu_seqlens: torch.Tensor
    prefix_lens: list[int]
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    new_token_masks: list[torch.Tensor | None]
    pending_lens: list[int] = field(default_factory=list)
    extras: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.pending_lens:
            self.pending_lens = [0] * len(self.rows)

    @property
    def has_pending(self) -> bool:
        return any(self.pending_lens)

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def q_lens(self) -> list[int]:
        cu = self.cu_seqlens.tolist()
        return [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]

    def row_mask(self, b: int, device: torch.device) -> torch.Tensor | None:
        """`[n, prefix + pending + n]` bool mask of row b (None when a plain causal mask with no prefix suffices)."""
        key = ("dense_mask", b, device)
        if key not in self.extras:
            n = int(self.cu_seqlens[b + 1] - self.cu_seqlens[b])
            prefix = self.prefix_lens[b]
            own = self.new_token_masks[b]
            pending = self.pending_lens[b]
            if own is None:
                if pending:
                    raise ValueError("a row with pending tokens needs an explicit mask")
                if prefix == 0 or n == 1:
                    self.extras[key] = None  # causal from scratch, or a single query that sees everything
                    return None
                own = torch.ones(n, n, dtype=torch.bool).tril_()
            if own.shape != (n, pending + n):
                raise ValueError(f"row {b}: mask of shape {tuple(own.shape)}, expected {(n, pending + n)}")
            mask = torch.ones(n, prefix + pending + n, dtype=torch.bool, device=device)
            mask[:, prefix:] = own.to(device)
            self.extras[key] = mask
        return self.extras[key]


def build_plan(
    cache: PagedCache,
    rows: Sequence[int],
    q_lens: Sequence[int],
    positions: torch.Tensor,
    new_token_masks: Sequence[torch.Tensor | None],
    device: torch.device | str,
    pending_lens: Sequence[int] | None = None,
) -> AttentionPlan:
    """Reserve pool slots for ``q_lens[b]`` new tokens of each row and return the forward's `AttentionPlan`.

    The rows' committed lengths do not change here: new tokens sit past them until `PagedCache.commit_rows`
    (trees) or `advance` (chunks) decides what is kept.
    """
    alloc = cache.allocator
    pending_lens = list(pending_lens) if pending_lens is not None else [0] * len(rows)
    slots, prefix = [], []
    for row, n, pend in zip(rows, q_lens, pending_lens):
        start = alloc.lengths[row] + pend
        alloc.reserve(row, start + n)
        slots.append(alloc.slot_range(row, start, start + n))
        prefix.append(alloc.lengths[row])
    cu = torch.tensor([0, *q_lens], dtype=torch.long).cumsum(0)
    return AttentionPlan(
        cache=cache,
        rows=list(rows),
        cu_seqlens=cu,
        prefix_lens=prefix,
        slot_mapping=torch.cat(slots).to(device),
        positions=positions.to(device),
        new_token_masks=list(new_token_masks),
        pending_lens=pending_lens,
    )


def use_triton(device: torch.device) -> bool:
    """Whether the Triton kernels serve tensors on ``device``: CUDA tensors, and CPU tensors in a process run under
    Triton's interpreter (``TRITON_INTERPRET=1``); ``HF_SPECDEC_ATTENTION=torch`` / ``triton`` force either path."""
    choice = os.environ.get("HF_SPECDEC_ATTENTION", "auto").lower()
    if choice == "torch":
        return False
    if choice == "triton":
        return True
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def hf_specdec_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over the paged cache for a packed batch of prefill chunks, decode tokens and draft trees.

    Args:
        query: `[1, H_q, N, D]` the packed new tokens' queries (rotary already applied).
        key, value: `[1, H_kv, N, D]` their keys and values.
    Returns:
        `[1, N, H_q, D]` attention output, and None for the weights.
    """
    plan: AttentionPlan | None = kwargs.pop(PLAN_KWARG, None)
    if plan is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"hf_specdec attention expects a packed batch of size 1, got {query.shape[0]}")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("hf_specdec attention does not support attention sinks (s_aux) yet")
    if dropout and module.training:
        raise NotImplementedError("hf_specdec attention is for inference; dropout is not supported")
    layer = plan.cache.layer(module.layer_idx)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    k_new = key[0].transpose(0, 1)  # [N, H_kv, D]
    v_new = value[0].transpose(0, 1)
    layer.write(plan.slot_mapping, k_new, v_new)
    sliding_window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    triton_ok = plan.extras.get("use_triton")
    if triton_ok is None:  # decided once per forward
        triton_ok = plan.extras["use_triton"] = use_triton(query.device)
    if triton_ok and softcap is None and sliding_window is None:
        from .tree_attention import paged_tree_attention

        out = paged_tree_attention(query[0].transpose(0, 1), layer.keys, layer.values, plan, scale)
        return out.unsqueeze(0), None  # [1, N, H_q, D]
    from .reference import paged_attention_reference

    out = paged_attention_reference(query, layer, plan, scale, sliding_window=sliding_window, softcap=softcap)
    return out, None  # [1, N, H_q, D]


def move_kv(layers: Sequence[PagedLayer], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the K/V of pool slots ``src`` `[M]` to slots ``dst`` `[M]` in every layer (reads happen before writes).

    On the Triton path all layers move in one kernel launch; the torch path copies layer by layer."""
    pools = [layer.flat() for layer in layers]
    if not pools:
        return
    device = pools[0][0].device
    src, dst = src.to(device), dst.to(device)
    if use_triton(device):
        from .tree_attention import move_kv_triton

        move_kv_triton(pools, src, dst)
        return
    for k, v in pools:
        k.index_copy_(0, dst, k.index_select(0, src))
        v.index_copy_(0, dst, v.index_select(0, src))


_PLANNED_FORWARD: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_specdec_planned_forward", default=False)


@contextlib.contextmanager
def planned_forward():
    """Marks a forward whose masks come from an `AttentionPlan`, so transformers builds none."""
    token = _PLANNED_FORWARD.set(True)
    try:
        yield
    finally:
        _PLANNED_FORWARD.reset(token)


def hf_specdec_mask(*args, **kwargs):
    """Mask hook for ``hf_specdec``: nothing inside a planned forward, SDPA's mask for the fallback path."""
    if _PLANNED_FORWARD.get():
        return None
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register the ``hf_specdec`` attention and its mask hook with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, hf_specdec_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, hf_specdec_mask)
