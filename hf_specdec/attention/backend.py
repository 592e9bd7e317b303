"""The attention of planned forwards, hooked into transformers once and switched per call, per thread.

A planned forward (``generation/target.py``) runs the model *as it is*, with its own ``attn_implementation``
(``sdpa``, ``eager``, ...): nothing on the model or its configs is written. Instead, the first time a model is used
for speculative decoding, the attention and mask functions transformers looks up for its implementation are wrapped
once (`install_for`). Each wrapper asks a `contextvars.ContextVar` whether *this* thread is inside `planned` (a
planned forward): if so it serves the forward's `AttentionPlan` (`paged_attention`), and the mask hook tells
transformers to build no mask; otherwise it calls the function it wraps, unchanged. So two threads may run a vanilla
and a speculative ``generate`` on one model object at the same time, and the model's config is never touched.
The wrappers read a plain count of the open plans first (`active_plan`), so ``torch.compile`` still traces them,
with ``fullgraph=True`` too, after a speculative call.

Backends: the plan carries ``"triton"`` (the kernels of ``kernels/tree_attention.py``) or ``"torch"`` (the reference
of `reference`), chosen once per call by `choose_backend`: CUDA tensors, and CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``), use Triton; ``HF_SPECDEC_ATTENTION=torch`` / ``triton`` (read when a call starts) or the
caller's explicit choice force one path.

The name ``"hf_specdec"`` is also registered, for models loaded with ``attn_implementation="hf_specdec"``: outside a
planned forward it behaves as SDPA.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
import weakref
from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import gated_delta, lightning, mamba, short_conv
from .plan import BACKENDS, AttentionPlan
from .reference import paged_attention_reference
from .unsupported import UnsupportedModelError

ATTENTION_NAME = "hf_specdec"
BACKEND_ENV = "HF_SPECDEC_ATTENTION"

_ACTIVE_PLAN: contextvars.ContextVar[AttentionPlan | None] = contextvars.ContextVar("hf_specdec_plan", default=None)
_INSTALL_LOCK = threading.Lock()
_OPEN_PLANS = 0  # `planned` blocks open in any thread (read by `active_plan`)
_OPEN_LOCK = threading.Lock()


# ---------------------------------------------------------------------------------------------- backend choice
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401  (optional dependency)
    except ImportError:
        return False
    return True


def choose_backend(device: torch.device | str, requested: str | None = None) -> str:
    """``"triton"`` or ``"torch"`` for a call whose model runs on ``device``; decided once per call.

    Args:
        device: the model's device.
        requested: ``"triton"``, ``"torch"`` or None/``"auto"``: None reads ``HF_SPECDEC_ATTENTION`` (default auto).
            Auto picks Triton for CUDA tensors, and for CPU tensors when the process runs under
            ``TRITON_INTERPRET=1``, if triton is installed.
    """
    choice = (requested or os.environ.get(BACKEND_ENV, "auto")).lower()
    if choice in BACKENDS:
        return choice
    if choice != "auto":
        raise ValueError(f"{BACKEND_ENV}={choice!r}: expected one of {('auto', *BACKENDS)}")
    device = torch.device(device)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "torch"
    return "triton" if _triton_importable() else "torch"


# ---------------------------------------------------------------------------------------------- planned forwards
@contextlib.contextmanager
def planned(plan: AttentionPlan):
    """Inside the block, in this thread (and this async context), attention layers serve ``plan``."""
    global _OPEN_PLANS
    with _OPEN_LOCK:
        _OPEN_PLANS += 1
    token = _ACTIVE_PLAN.set(plan)
    try:
        yield plan
    finally:
        _ACTIVE_PLAN.reset(token)
        with _OPEN_LOCK:
            _OPEN_PLANS -= 1


def active_plan() -> AttentionPlan | None:
    """The plan of the planned forward running in this thread, if any.

    The wrappers stay installed after a speculative call, so a later ``torch.compile(model, fullgraph=True)`` (or
    transformers' compiled static-cache ``generate``) traces through them, and dynamo cannot trace the `contextvars`
    lookup. While no thread is inside `planned` (`_OPEN_PLANS` is 0, a plain global dynamo reads and guards on) the
    answer is None without it; a compiled region entered while some plan is open retraces and reaches the lookup."""
    if _OPEN_PLANS == 0:
        return None
    return _ACTIVE_PLAN.get()


def tree_attention_metadata(plan: AttentionPlan, device: torch.device, group: int, max_block_m: int):
    """The Triton kernel's metadata of ``plan`` (built by the first layer, then kept in ``plan.kernel_metadata``)."""
    from ..kernels.tree_attention import build_tree_attention_metadata  # optional dependency

    key = (group, max_block_m)
    meta = plan.kernel_metadata.get(key)
    if meta is None:
        meta = plan.kernel_metadata[key] = build_tree_attention_metadata(
            plan.q_lens,
            plan.prefix_lens,
            plan.pending_lens,
            plan.mask.causal,
            plan.mask.words,
            plan.cache.block_tables(plan.rows),
            device,
            group,
            max_block_m,
        )
    return meta


def triton_tree_attention(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    *,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """The Triton kernel over ``plan``: `[N, H_q, D]` queries, `[blocks, block_size, H_kv, D]` pools, optional `[H_q]`
    attention-sink logits -> `[N, H_q, D]`."""
    from ..kernels.tree_attention import max_block_m, paged_tree_attention  # optional dependency

    group = max(1, query.shape[1] // k_pool.shape[2])
    meta = tree_attention_metadata(plan, query.device, group, max_block_m(query.dtype))
    return paged_tree_attention(query, k_pool, v_pool, meta, scale, sinks=sinks, num_splits=num_splits)


def attention_chunk(module: torch.nn.Module) -> int | None:
    """The chunk size of a ``chunked_attention`` layer (Llama 4: a token sees only keys of its own chunk of
    ``attention_chunk_size`` positions; transformers gives it as the layer's mask, not as an argument), else None.

    Read from the config once per layer and kept (a layer's kind is fixed when the model is built): a config's
    attribute reads cost microseconds in transformers 5, and every layer of every forward asks."""
    known = _CHUNKS.get(module, _UNKNOWN)
    if known is not _UNKNOWN:
        return known
    config = getattr(module, "config", None)
    kinds = getattr(config, "layer_types", None)
    chunk = None
    if kinds and kinds[module.layer_idx] == "chunked_attention":
        chunk = int(config.attention_chunk_size)
    _CHUNKS[module] = chunk
    return chunk


_CHUNKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> its chunk size or None
_UNKNOWN = object()


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: AttentionPlan,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over the paged cache for a packed batch of prefill chunks, decode tokens and draft trees.

    Args:
        module: the attention layer (its ``layer_idx`` picks the cache layer).
        query: `[1, H_q, N, D]` the packed new tokens' queries (rotary already applied).
        key, value: `[1, H_kv, N, D]` their keys and values.
        plan: the forward's `AttentionPlan`.
    Returns:
        `[1, N, H_q, D]` attention output, and None for the weights.
    """
    if query.shape[0] != 1:
        raise ValueError(f"hf_specdec attention expects a packed batch of size 1, got {query.shape[0]}")
    if not isinstance(getattr(module, "layer_idx", None), int):
        raise UnsupportedModelError(
            f"{type(module).__name__} runs attention without a layer index (layer_idx), so hf_specdec cannot tell "
            "which cache layer it reads",
            f"its attention ({type(module).__name__}) has no layer index",
        )
    if dropout and module.training:
        raise NotImplementedError("hf_specdec attention is for inference; dropout is not supported")
    plan.attention_modules.append(module)
    if plan.checking:
        plan.attention_windows.append(kwargs.get("sliding_window"))
    layer = plan.cache.layer(module.layer_idx)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer.write_heads(plan.write_slots, key[0], value[0])  # [H_kv, N, D]
    sliding_window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
    chunk = attention_chunk(module)
    if plan.backend == "triton" and softcap is None and sliding_window is None and chunk is None:  # sinks or not
        if layer.head_major:
            raise ValueError("the Triton tree attention reads slot-major pools; this PagedCache is head-major")
        out = triton_tree_attention(query[0].transpose(0, 1), layer.keys, layer.values, plan, scale, sinks=sinks)
        return out.unsqueeze(0).contiguous(), None  # [1, N, H_q, D]
    out = paged_attention_reference(
        query, layer, plan, scale, sliding_window=sliding_window, softcap=softcap, sinks=sinks, chunk_size=chunk
    )
    return out.contiguous(), None  # [1, N, H_q, D], contiguous as SDPA's (some layers .view() it)


# ---------------------------------------------------------------------------------------------- transformers hooks
def _module_eager_attention(module: torch.nn.Module, *args, **kwargs):
    """The eager attention of ``module``'s own modeling file (transformers passes it as the default for "eager")."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(
            f"{type(module).__name__} runs eager attention but its module {type(module).__module__} has no "
            "eager_attention_forward for hf_specdec to fall back to; load the model with attn_implementation='sdpa'"
        )
    return fn(module, *args, **kwargs)


def _wrap_attention(fallback: Callable) -> Callable:
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        plan = active_plan()
        if plan is None:
            return fallback(module, query, key, value, attention_mask, *args, **kwargs)
        if attention_mask is not None:  # the mask hook gave none: the layer computed a mask of its own
            raise UnsupportedModelError(
                f"{type(module).__name__} builds an attention mask of its own (not transformers' causal, sliding or "
                "padding mask, which hf_specdec replaces by its tree masks)",
                f"its attention ({type(module).__name__}) builds a mask of its own",
            )
        return paged_attention(module, query, key, value, plan, *args, **kwargs)

    attention.hf_specdec_fallback = fallback
    return attention


def _wrap_mask(fallback: Callable) -> Callable:
    def mask(*args, **kwargs):
        plan = active_plan()
        if plan is not None:
            if plan.checking:
                plan.mask_windows.append(kwargs.get("local_size"))  # a sliding window's (or chunk's) size
            return None  # the plan carries the masks
        return fallback(*args, **kwargs)

    mask.hf_specdec_fallback = fallback
    return mask


def _install(name: str) -> None:
    """Wrap the attention and mask functions registered under ``name`` (once; call under the lock)."""
    current = AttentionInterface().get(name)  # a fresh interface: the functions registered for every model
    if current is None and name == "eager":
        current = _module_eager_attention
    if current is None:
        raise ValueError(
            f"attention implementation {name!r} is not registered with transformers' AttentionInterface; "
            "hf_specdec can serve models whose attention transformers dispatches by name (sdpa, eager, flash, ...)"
        )
    if not hasattr(current, "hf_specdec_fallback"):
        AttentionInterface.register(name, _wrap_attention(current))
    mask = AttentionMaskInterface().get(name)
    if mask is not None and not hasattr(mask, "hf_specdec_fallback"):
        AttentionMaskInterface.register(name, _wrap_mask(mask))


def install_for(model: torch.nn.Module) -> None:
    """Make planned forwards of ``model`` reach `paged_attention` (idempotent and thread-safe; the model is not
    modified: the functions transformers dispatches to for its implementations are wrapped once)."""
    configs = [model.config]
    if hasattr(model.config, "get_text_config"):
        configs.append(model.config.get_text_config(decoder=True))
    names = {getattr(c, "_attn_implementation", None) or "eager" for c in configs}
    with _INSTALL_LOCK:
        for name in sorted(names):
            _install(name)
    short_conv.install_for(model, active_plan)
    gated_delta.install_for(model, active_plan)
    mamba.install_for(model, active_plan)
    lightning.install_for(model, active_plan)


def register() -> None:
    """Register the ``hf_specdec`` attention name with transformers (idempotent): SDPA outside planned forwards."""
    with _INSTALL_LOCK:
        if not hasattr(AttentionInterface().get(ATTENTION_NAME), "hf_specdec_fallback"):
            AttentionInterface.register(ATTENTION_NAME, _wrap_attention(sdpa_attention_forward))
            AttentionMaskInterface.register(ATTENTION_NAME, _wrap_mask(sdpa_mask))
