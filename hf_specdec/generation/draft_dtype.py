"""The dtype draft heads compute in on this machine: bfloat16 where the CPU multiplies it faster than float32.

A draft head's step is a handful of small matrix products (a few rows times the head's weights and the lm_head rows
of its draft vocabulary), so on a CPU its cost is reading those weights. Where the CPU has native bf16 dot products
(AVX512-BF16, AMX) a bf16 copy of the weights halves the bytes and runs oneDNN's bf16 kernels, about four times
faster than fp32 on a head's product (docs/lab/measurements.md, "CPU: draft heads in the dtype the machine multiplies
fastest"). Where bf16 is emulated it is slower than fp32. So the choice is measured, once per process and shape, on
the machine at hand (`draft_dtype`), like the GEMM forms of ``packed_linears.py``.

Drafting in bf16 never changes what ``generate`` returns: the target verifies every drafted token in its own dtype,
so greedy output stays token-for-token the target's and sampling stays exact; only which tokens are proposed (and so
the speed) can differ. The target's own forwards are untouched.

``HF_SPECDEC_DRAFT_DTYPE`` overrides the measurement: ``auto`` (default), ``float32`` or ``bfloat16``.
"""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.nn.functional as F

ENV_VAR = "HF_SPECDEC_DRAFT_DTYPE"
# bf16 is chosen only when it is at least this much faster (a close race is not worth the rounding of the drafts)
MIN_SPEEDUP = 1.2
PROBE_ROWS = 8  # rows of the measured product (a tree level's frontier)
PROBE_OUT = 8192  # output features of the measured product (a draft vocabulary)
_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}

_MEASURED: dict[int, tuple[torch.dtype, dict[str, float]]] = {}  # in_features -> (choice, seconds per dtype)
_LOCK = threading.Lock()


def _requested() -> torch.dtype | None:
    """The dtype ``HF_SPECDEC_DRAFT_DTYPE`` asks for (None: ``auto``, measure)."""
    value = os.environ.get(ENV_VAR, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in _NAMES:
        raise ValueError(f"{ENV_VAR}={value!r}: use auto, float32 or bfloat16")
    return _NAMES[value]


def _seconds(x: torch.Tensor, w: torch.Tensor, repeats: int = 5) -> float:
    """Fastest of ``repeats`` timed `F.linear` calls (after one warm-up)."""
    F.linear(x, w)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        F.linear(x, w)
        best = min(best, time.perf_counter() - t0)
    return best


@torch.no_grad()
def measure(in_features: int) -> tuple[torch.dtype, dict[str, float]]:
    """``(choice, {dtype name: seconds})``: a `[PROBE_ROWS, in_features] x [in_features, PROBE_OUT]` product timed in
    fp32 and bf16 on this CPU (once per process and ``in_features``); bf16 when `MIN_SPEEDUP` times faster."""
    with _LOCK:
        if in_features not in _MEASURED:
            gen = torch.Generator().manual_seed(0)
            w = torch.randn(PROBE_OUT, in_features, generator=gen)
            x = torch.randn(PROBE_ROWS, in_features, generator=gen)
            times = {"float32": _seconds(x, w)}
            try:
                times["bfloat16"] = _seconds(x.bfloat16(), w.bfloat16())
            except RuntimeError:  # a build without bf16 matmul on this CPU
                times["bfloat16"] = float("inf")
            fast = times["float32"] >= MIN_SPEEDUP * times["bfloat16"]
            _MEASURED[in_features] = (torch.bfloat16 if fast else torch.float32, times)
        return _MEASURED[in_features]


def draft_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype a draft head whose weights look like ``param`` `[out, in]` should compute in here.

    fp32 weights on a CPU: bf16 where `measure` finds it faster (or ``HF_SPECDEC_DRAFT_DTYPE`` says so); any other
    device or dtype (a GPU, a head the user cast to fp16) keeps its own dtype.
    """
    if param.device.type != "cpu" or param.dtype != torch.float32:
        return param.dtype
    requested = _requested()
    if requested is not None:
        return requested
    return measure(int(param.shape[-1]))[0]


def measured() -> dict[int, dict]:
    """What was measured in this process: ``{in_features: {"choice": name, "seconds": {dtype: s}}}``."""
    with _LOCK:
        return {k: {"choice": str(c).removeprefix("torch."), "seconds": dict(t)} for k, (c, t) in _MEASURED.items()}


def describe() -> str | None:
    """One line for a report: the override, or each choice measured in this process with its timings (None before
    any)."""
    requested = _requested()
    if requested is not None:
        return f"{str(requested).removeprefix('torch.')} ({ENV_VAR})"
    return (
        "; ".join(
            f"{v['choice']} (measured for {k}-wide heads: fp32 {v['seconds']['float32'] * 1e3:.2f} ms, bf16 "
            f"{v['seconds']['bfloat16'] * 1e3:.2f} ms)"
            for k, v in sorted(measured().items())
        )
        or None
    )


__all__ = ["ENV_VAR", "describe", "draft_dtype", "measure", "measured"]
