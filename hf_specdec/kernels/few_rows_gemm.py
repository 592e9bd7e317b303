"""A CPU GEMM for a few fp32 rows, compiled on the machine that runs it: ``x @ W.T + b`` streaming ``W`` once.

A verify forward multiplies every weight matrix by the tree's ``n + 1`` rows. MKL's `F.linear` costs about one
matrix-vector product per row on some CPUs (docs/results/amd_few_rows_forward.json, ``gemm_us``), although the
arithmetic is negligible next to reading the weights. `csrc/few_rows_gemm.cpp` runs on a copy of the weight packed once
in panels of output features (`pack_weight`: `[ceil(out / P), in, P]`, P = 32 features with AVX-512, 16 with AVX2; the
weight's size again, about a third of MKL's packed copy) and multiplies each weight vector it loads by up to 8 rows (6
with AVX2) held in registers; more rows run chunk after chunk on each panel while it is in cache, so the weights are
read from memory once for all rows, with a software prefetch of the stream ahead of the loads (where the weights come
from DRAM the hardware prefetcher alone fell behind the FMAs of 4 rows and more). Same fp32 math as `F.linear`; only the
blocking of the sums differs, as it already does between MKL's 1-row and n-row kernels.

It is C++ built with `torch.utils.cpp_extension` (a C++ compiler and ninja, once per machine and source, ~1 min)
into a folder the caller names, and never compiled implicitly: `build(folder)` compiles (``hf-specdec build-kernels``
calls it, and ``scripts/install.sh`` runs that), `load(folder)` imports an earlier build and does nothing when there
is none. Whether the form runs at all is policy (``generation/packed_linears.py``: only where it measured fastest).

    build(folder)                  # True when built (or already built) and loaded
    load(folder)                   # True when an earlier build was found and loaded; never compiles
    packed = pack_weight(weight)   # once per weight; then for each forward of a few rows:
    linear(x2, packed, weight.shape[0], bias)   # [rows, out]
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import platform
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "few_rows_gemm.cpp"
_FLAGS = {"avx512": ["-O3", "-DHF_AVX512", "-mavx512f", "-mfma"], "avx2": ["-O3", "-mavx2", "-mfma"]}
_LOCK = threading.Lock()
_MODULE: list = [None]  # the loaded extension module


def variant() -> str | None:
    """The instruction set this CPU gets the kernel in ("avx512" or "avx2"; torch's own dispatch level), None where
    there is none (not x86-64, or no AVX2)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    capability = torch.backends.cpu.get_cpu_capability().upper()
    if capability.startswith("AVX512"):
        return "avx512"
    return "avx2" if capability.startswith("AVX2") else None


def extension_name() -> str | None:
    """The build's name: the variant, the source's digest and torch's version (a change of any rebuilds)."""
    kind = variant()
    if kind is None:
        return None
    digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + " ".join(_FLAGS[kind]).encode())
    return f"hf_specdec_few_rows_{kind}_{digest.hexdigest()[:12]}"


def _import_built(path: Path):
    loader = importlib.machinery.ExtensionFileLoader(path.stem, str(path))
    spec = importlib.util.spec_from_file_location(path.stem, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load(folder: Path) -> bool:
    """Import the kernel built earlier under ``folder``; False (and nothing compiled) when there is no build for this
    CPU, source and torch."""
    with _LOCK:
        if _MODULE[0] is not None:
            return True
        name = extension_name()
        built = folder / name / f"{name}.so" if name else None
        if built is None or not built.is_file():
            return False
        try:
            _MODULE[0] = _import_built(built)
        except (ImportError, OSError):  # a broken or foreign build: as if there were none
            return False
        return True


def build(folder: Path, verbose: bool = False) -> bool:
    """Compile the kernel for this CPU under ``folder`` (a no-op when built already) and load it. Raises
    `RuntimeError` naming what is missing where it cannot be built (no AVX2, no compiler or ninja, a failed build)."""
    name = extension_name()
    if name is None:
        raise RuntimeError(
            f"the few-rows CPU GEMM needs an x86-64 CPU with AVX2; this one is {platform.machine()} "
            f"with torch's {torch.backends.cpu.get_cpu_capability()} kernels"
        )
    if load(folder):
        return True
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        raise RuntimeError("building the few-rows CPU GEMM needs ninja: pip install ninja")
    out = folder / name
    out.mkdir(parents=True, exist_ok=True)
    try:
        module = cpp_extension.load(
            name=name, sources=[str(SOURCE)], extra_cflags=_FLAGS[variant()], build_directory=str(out), verbose=verbose
        )
    except (RuntimeError, OSError, ImportError) as exc:
        raise RuntimeError(f"building the few-rows CPU GEMM failed (a C++ compiler is needed): {exc}") from exc
    with _LOCK:
        _MODULE[0] = module
    return True


def loaded() -> bool:
    """Whether the kernel is loaded in this process (`build` or `load` returned True)."""
    return _MODULE[0] is not None


def _module():
    module = _MODULE[0]
    if module is None:
        raise RuntimeError("the few-rows CPU GEMM is not loaded: call build(folder) or load(folder) first")
    return module


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`[ceil(out / P), in, P]` panels of the fp32 ``weight`` `[out, in]` (P: the kernel's panel width; the last
    panel zero-padded): the operand of `linear`."""
    width = _module().panel_width()
    out, inp = weight.shape
    full, rest = divmod(out, width)
    w = weight.detach()
    with torch.no_grad():  # written in place, no padded intermediate: a copy of the lm_head is ~0.1 GB at its peak
        panels = torch.empty(full + (rest > 0), inp, width, dtype=torch.float32)
        panels[:full].copy_(w[: full * width].view(full, width, inp).transpose(1, 2))
        if rest:
            panels[full].zero_()[:, :rest].copy_(w[full * width :].T)
        return panels


def linear(x2: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """`[rows, out_features]` = contiguous fp32 ``x2`` `[rows, in]` times the weight that `pack_weight` packed into
    ``packed`` `[panels, in, P]`, transposed (+ ``bias`` `[out_features]`)."""
    return _module().few_rows_linear(x2, packed, out_features, bias)
