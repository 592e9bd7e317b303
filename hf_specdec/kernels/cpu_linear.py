"""Pre-packed MKL GEMM for the target's `nn.Linear` layers on CPU, used while speculative forwards run.

Verifying a draft tree multiplies every weight matrix by ``n + 1`` rows instead of one. For one to three rows MKL
runs a matrix-vector kernel that streams the weights once; from four rows on it runs a GEMM that first *re-packs*
the weight matrix into its blocked layout on every call, an extra read and write of every weight. On the default
model (2-core Xeon, fp32) that makes a 4-row forward cost ~1.5x a 1-row forward although the arithmetic is
negligible; it is what kept trees on this machine at one or two nodes (docs/results.md).

`packed_linears(model)` removes that cost: inside the block, every plain `nn.Linear` of the model whose input has
at least `MIN_ROWS` rows runs ``torch.ops.mkl._mkl_linear`` on a copy of its weight packed once (MKL's
``cblas_sgemm_pack``; the copy is kept, keyed by the weight tensor and its version, until the weight is freed or
changed). Fewer rows keep `F.linear`, so single-token decoding runs exactly the same kernels as stock `generate`.
Same math, same fp32 precision; only the blocking of the sums may differ, as it already does between a 1-row and an
n-row forward.

Used only when it can help and cannot hurt: CPU, fp32, MKL built in, no autograd, and enough free memory for the
packed copies (they double the linear weights' memory). ``HF_SPECDEC_PACKED_LINEAR=0`` turns it off. The model is
left exactly as it was when the last block using it exits, also on errors: the patch is an instance attribute on
each layer, removed afterwards; layers that already carry an instance-level ``forward`` (accelerate hooks, user
patches) are left alone.

Thread safety: the patched layers run packed weights only for the thread (context) that entered the block for their
model (a `contextvars.ContextVar`); any other caller of the same model, a vanilla ``generate`` in another thread
say, runs stock `F.linear`. Concurrent blocks on one model share the patch (reference-counted under a lock).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

MIN_ROWS = 4  # below this MKL's matrix-vector path is as fast as the packed GEMM (measured; docs/results.md)
ENV_FLAG = "HF_SPECDEC_PACKED_LINEAR"
# Fraction of the machine's available memory the packed copies may take.
MEMORY_FRACTION = 0.5

# weight tensor -> (weight._version when packed, packed weight)
_PACKED = WeakIdKeyDictionary()
# ids of the models whose packed linears this context (thread) entered
_ENTERED: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("hf_specdec_packed", default=frozenset())
# model id -> [number of open blocks, the layers patched]
_USERS: dict[int, list] = {}
_USERS_LOCK = threading.Lock()


def available() -> bool:
    """Whether this torch build has MKL's packed linear ops."""
    return bool(torch.backends.mkl.is_available()) and hasattr(torch.ops.mkl, "_mkl_linear")


def _enabled_by_env() -> bool:
    return os.environ.get(ENV_FLAG, "1").strip().lower() not in ("0", "false", "no", "off")


def _available_memory_bytes() -> int | None:
    """Memory the OS can give without swapping (Linux ``MemAvailable``: free + reclaimable page cache)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _eligible(module: nn.Module) -> bool:
    own = module.__dict__.get("forward")
    return (
        type(module) is nn.Linear
        and (own is None or getattr(own, "hf_specdec_packed", False))
        and module.weight.device.type == "cpu"
        and module.weight.dtype == torch.float32
        and (module.bias is None or module.bias.dtype == torch.float32)
    )


def _version(weight: torch.Tensor) -> int:
    try:
        return weight._version
    except RuntimeError:  # an inference-mode tensor: no version counter, and it cannot be changed in place later
        return 0


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """MKL-packed copy of ``weight`` (`[out, in]` fp32), cached until the weight changes or is freed."""
    entry = _PACKED.get(weight)
    version = _version(weight)
    if entry is not None and entry[0] == version:
        return entry[1]
    with torch.no_grad():
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), 64)
    _PACKED[weight] = (version, packed)
    return packed


def _packed_forward(module: nn.Linear, model_id: int):
    weight, bias = module.weight, module.bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        if rows < MIN_ROWS or x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
            return F.linear(x, weight, bias)
        if model_id not in _ENTERED.get():  # another thread's call of the same model: stock kernels
            return F.linear(x, weight, bias)
        return torch.ops.mkl._mkl_linear(x.contiguous(), packed_weight(weight), weight, bias, rows)

    forward.hf_specdec_packed = True
    return forward


@contextlib.contextmanager
def packed_linears(model: nn.Module, enabled: bool | None = None):
    """Run ``model``'s fp32 CPU `nn.Linear` layers on pre-packed weights inside the block (see the module doc).

    ``enabled=None`` decides by itself (CPU fp32 layers, MKL, ``HF_SPECDEC_PACKED_LINEAR``, free memory); ``False``
    makes this a no-op; ``True`` skips the memory check. Yields the number of layers patched.
    """
    if enabled is False or not available() or (enabled is None and not _enabled_by_env()):
        yield 0
        return
    layers = [m for m in model.modules() if _eligible(m)]
    if enabled is None and layers:
        weights = {id(m.weight): m.weight for m in layers}.values()
        need = sum(w.numel() * w.element_size() for w in weights if w not in _PACKED)
        free = _available_memory_bytes()
        if free is not None and need > MEMORY_FRACTION * free:
            layers = []
    if not layers:
        yield 0
        return
    key = id(model)
    with _USERS_LOCK:
        entry = _USERS.get(key)
        if entry is None:
            patched = [m for m in layers if "forward" not in m.__dict__]
            for m in patched:
                m.forward = _packed_forward(m, key)
            entry = _USERS[key] = [0, patched]
        entry[0] += 1
    token = _ENTERED.set(_ENTERED.get() | {key})
    try:
        yield len(entry[1])
    finally:
        _ENTERED.reset(token)
        with _USERS_LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                for m in entry[1]:
                    m.__dict__.pop("forward", None)
                del _USERS[key]


def release_packed_weights(model: nn.Module | None = None) -> None:
    """Free the packed copies of ``model``'s weights (of every model when None)."""
    if model is None:
        _PACKED.clear()
        return
    for p in model.parameters():
        _PACKED.pop(p, None)
