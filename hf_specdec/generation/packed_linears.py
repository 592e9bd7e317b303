"""When and how the target's CPU `nn.Linear` layers run pre-packed MKL GEMMs while speculative forwards run: the
policy over the GEMM forms of ``kernels/cpu_linear.py``. The same block runs a draft model's linears (`PlannedModel`)
and a draft head's (the loop enters it for `Proposer.drafting_modules`: a tree level drafts a few rows at once;
EAGLE-1's gathered lm_head rows are such a module too, `heads/derived.py::lm_head_linear`).

Verifying a draft tree multiplies every weight matrix by ``n + 1`` rows instead of one. For one to three rows MKL
runs a matrix-vector kernel that streams the weights once; from four rows on it runs a GEMM that first *re-packs*
the weight matrix into its blocked layout on every call, an extra read and write of every weight. A forward of a few
rows then costs well above a 1-row forward although the arithmetic is negligible, and the tree budget, which sizes
trees by that cost, keeps them at one or two nodes (docs/lab/measurements.md, "Which GEMM form, measured per
machine").

`packed_linears(model)` removes that cost: inside the block, every plain `nn.Linear` of the model whose input has
2 to `TUNE_MAX_ROWS` rows runs the GEMM form measured fastest on this machine for its shape and row count (above 8
rows, for its bucket of row counts: `tuning_rows`)
(`_fastest_gemm`: `F.linear`, weight-major ``W @ x.T``, from `MIN_ROWS` rows ``torch.ops.mkl._mkl_linear`` on a
copy of its weight packed once with MKL's ``cblas_sgemm_pack``, and, where `build_cpu_kernels` compiled it on this
machine, the few-rows GEMM of ``kernels/few_rows_gemm.py`` on a copy of the weight packed in panels; copies are kept
per weight tensor and version until the weight is freed or changed). One row keeps `F.linear`, so single-token
decoding runs exactly the kernels of stock `generate`. With the few-rows GEMM a verify forward of up to 8 tokens can
cost less than a stock 1-token forward (docs/results/amd_few_rows_forward.json).
Same math, same fp32 precision; only the blocking of the sums may differ, as it already does between a 1-row and an
n-row forward.

Used only when it can help and cannot hurt: CPU, fp32, MKL built in or the few-rows GEMM built, no autograd, and
enough free memory for the packed copies. ``HF_SPECDEC_PACKED_LINEAR=0`` turns it off; ``HF_SPECDEC_CPU_KERNELS=0``
leaves the compiled few-rows GEMM out (MKL's forms only). The model is
left exactly as it was when the last block using it exits, also on errors: the patch is an instance attribute on
each layer, removed afterwards; layers that already carry an instance-level ``forward`` (accelerate hooks, user
patches) are left alone.

Thread safety: the patched layers run packed weights only for the thread (context) that entered the block for their
model (a `contextvars.ContextVar`); any other caller of the same model, a vanilla ``generate`` in another thread
say, runs stock `F.linear`. Concurrent blocks on one model share the patch (reference-counted under a lock).

Memory and when it runs. A weight has at most one copy, in one form for the whole process (`available_forms`): the
few-rows kernel's panels where it is built (the weight's size again, so the copies at most double the linear
weights' footprint), else MKL's packed buffer (`PACKED_SIZE_FACTOR` times the weight, allocated).
Copies are keyed by weight tensor, so every call and every head over one model shares them, and they are freed with
the weight. ``HF_SPECDEC_PACKED_MEMORY_MB`` caps the bytes all copies may hold together (a model whose copies would
pass it runs stock kernels); without it, a model packs only while its copies fit in `MEMORY_FRACTION` of the
memory available. Copies are made only where they pay and dropped when they stop paying:

- only forwards of 2 (MKL's: `MIN_ROWS`) to `MAX_ROWS` rows (verify forwards of small trees) use them; a prefill of
  a long prompt runs stock `F.linear` and packs nothing (its GEMM amortises MKL's re-pack over all its rows);
- a single call packs only from its `PACK_AFTER`-th such forward, so short answers never pay the packing;
- a ``generate`` call keeps the copies it made for the model's later calls (``keep_packed=None``, the default): they
  live until the weights change or are freed, or `release_packed_weights`. Releasing them at the end of every call
  made a plain series of calls re-pack the weights and run its first `PACK_AFTER` verify forwards on stock kernels
  each time, which cost the heads their whole gain (docs/results/zen3_plain_calls_release_seed1.json against
  zen3_plain_calls_keep_seed1.json). When a call ends, the copies of forms the tuner chose for none of the
  weight's row counts are dropped (`_drop_unchosen_copies`: the first process on a machine times every form, so it
  packs every form once). ``keep_packed=False`` releases them when the call ends; ``keep_packed=True`` also packs
  from the call's first verify forward; the ``with packed_weights(model):`` block packs at once (the warm-up) and
  releases the copies when it exits.

`packed_bytes(model)` says how many bytes the copies of ``model`` hold (allocated; ``spec_stats.packed_weight_bytes``
reports it at the end of a call).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import statistics
import threading
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..kernels import few_rows_gemm
from ..kernels.cpu_linear import GEMM_FORMS, MIN_PACKED_ROWS, available, available_forms, gemm, pack_weight
from ..models import cache_root

MIN_ROWS = MIN_PACKED_ROWS  # below this MKL's packed GEMM is not tried (its matrix-vector path is as fast)
MAX_ROWS = 256  # above this (prefill) the GEMM amortises its own re-pack: stock kernels, nothing packed
PACK_AFTER = 32  # a call that does not keep its copies packs from its 32nd verify forward (short calls never pack)
# MKL's packed buffer over the weight's own size, allocated (3.35x on the default model's matrices: docs/lab/
# measurements.md, "CPU: pre-packed linear weights for verify forwards")
PACKED_SIZE_FACTOR = 3.4
ENV_FLAG = "HF_SPECDEC_PACKED_LINEAR"
KERNELS_ENV_FLAG = "HF_SPECDEC_CPU_KERNELS"  # 0: the compiled few-rows GEMM is not loaded (MKL's forms only)
# Fraction of the machine's available memory the packed copies may take.
MEMORY_FRACTION = 0.5
MEMORY_ENV = "HF_SPECDEC_PACKED_MEMORY_MB"  # a cap, in MB, on the bytes every model's copies may hold together

# weight tensor -> (weight._version when packed, packed weight)
_PACKED = WeakIdKeyDictionary()
# weight tensor -> (weight._version when packed, its panels for the few-rows kernel)
_PANELS = WeakIdKeyDictionary()
# weight tensor -> eligible forwards run since its copies were last released (counted over calls: `PACK_AFTER`)
_FORWARDS_SEEN = WeakIdKeyDictionary()
# ids of the models whose packed linears this context (thread) entered
_ENTERED: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("hf_specdec_packed", default=frozenset())
# model id -> [number of open blocks, the layers patched]
_USERS: dict[int, list] = {}
_USERS_LOCK = threading.Lock()
# models whose copies outlive a call: open `packed_weights` blocks per model, and models pinned by keep_packed=True
_KEEP_BLOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PINNED: weakref.WeakSet = weakref.WeakSet()


def _switched_on(flag: str) -> bool:
    """Whether the environment variable ``flag`` leaves its feature on (unset, or anything but 0 / false / no / off)."""
    return os.environ.get(flag, "1").strip().lower() not in ("0", "false", "no", "off")


def _enabled_by_env() -> bool:
    return _switched_on(ENV_FLAG)


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
        and type(module.weight.data) is torch.Tensor  # not a quantized or distributed tensor subclass
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


def _cached_copy(cache: WeakIdKeyDictionary, weight: torch.Tensor, pack) -> torch.Tensor:
    """``pack(weight)``, kept in ``cache`` until the weight changes or is freed."""
    entry = cache.get(weight)
    version = _version(weight)
    if entry is not None and entry[0] == version:
        return entry[1]
    packed = pack(weight)
    cache[weight] = (version, packed)
    return packed


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """MKL-packed copy of ``weight`` (`[out, in]` fp32), cached until the weight changes or is freed."""
    return _cached_copy(_PACKED, weight, pack_weight)


def panel_weight(weight: torch.Tensor) -> torch.Tensor:
    """The few-rows kernel's panel copy of ``weight`` (`few_rows_gemm.pack_weight`), cached like `packed_weight`."""
    return _cached_copy(_PANELS, weight, few_rows_gemm.pack_weight)


def _copy_of(form: str, weight: torch.Tensor) -> torch.Tensor | None:
    """The packed operand ``form`` multiplies by (None for the forms that take the weight as it is)."""
    if form == "packed":
        return packed_weight(weight)
    return panel_weight(weight) if form == "few_rows" else None


def _kept(model: nn.Module) -> bool:
    """Whether ``model``'s copies outlive the call (an open `packed_weights` block, or ``keep_packed=True``)."""
    return model in _PINNED or _KEEP_BLOCKS.get(model, 0) > 0


def _packed_forward(module: nn.Linear, model: nn.Module):
    """``module``'s instance-level forward: for this thread's verify forwards of 2 to `TUNE_MAX_ROWS` rows, the
    fastest GEMM form measured on this machine (`_fastest_gemm`); up to `MAX_ROWS` the packed GEMM once packing is
    allowed; `F.linear` otherwise (one row: exactly stock decoding)."""
    weight, bias, key = module.weight, module.bias, id(model)

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        if not 2 <= rows <= MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, weight, bias)
        if torch.is_grad_enabled() or key not in _ENTERED.get():  # another thread's call of the model: stock kernels
            return F.linear(x, weight, bias)
        seen = _FORWARDS_SEEN[weight] = _FORWARDS_SEEN.get(weight, 0) + 1
        can_copy = seen >= PACK_AFTER or weight in _PACKED or weight in _PANELS or _kept(model)
        x2 = x.reshape(rows, x.shape[-1]).contiguous()  # [rows, in]
        if rows > TUNE_MAX_ROWS:  # a prompt's prefill: every length would be a new shape to time
            y = _gemm("packed" if "packed" in available_forms(can_copy, rows) else "linear", x2, weight, bias)
        else:
            y = _fastest_gemm(x2, weight, bias, can_copy)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    forward.hf_specdec_packed = True
    return forward


# The GEMM forms of a linear layer over a few rows, and which one is fastest here, measured per (out, in, rows
# (`tuning_rows`), bias, threads, packing allowed): the first `TUNE_TRIALS` calls of each form are timed, then the
# one with the lowest median is kept for the process, and saved for later processes on this machine (`gemm_cache`).
# The fastest form differs between CPUs (weight-major on one, MKL's packed GEMM on another: docs/lab/measurements.md,
# "Which GEMM form, measured per machine"), hence a choice per machine.
TUNE_TRIALS = 3
TUNE_MAX_ROWS = 64  # verify forwards of draft trees; above, MKL-packed when allowed, else F.linear
_GEMM_CHOICE: dict[tuple, str] = {}
_GEMM_TRIALS: dict[tuple, dict[str, list[float]]] = {}
_TUNING_CALLS = [0]  # GEMMs run as timed trials so far (a forward that ran one is not a fair sample of its cost)


def tuning_rows(rows: int) -> int:
    """The row count whose measured choice serves a GEMM over ``rows`` rows: ``rows`` itself up to 8, then the next
    of four steps per doubling (10, 12, ..., 16, 20, ..., 32, 40, ..., 64, 80, ...). The forms' relative speeds change
    smoothly with the rows, and a tree budget meets most counts up to 64: timing each one's forms ran in up to half
    the verify steps of a batch of four's first calls (benchmarks/batch_rows_steps.py)."""
    if rows <= 8:
        return rows
    step = 1 << (rows.bit_length() - 3)  # 9-16: 2, 17-32: 4, 33-64: 8, ... (a power of two is its bucket's top)
    return -(-rows // step) * step


def tuning_calls() -> int:
    """How many GEMMs ran as timed trials of a form so far, in this process: a caller timing a forward compares the
    count before and after it to know whether the forward also tried slower forms."""
    return _TUNING_CALLS[0]


def _gemm(form: str, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`[rows, out]` = ``x2`` `[rows, in]` times ``weight`` `[out, in]` transposed (+ ``bias``), computed as ``form``
    (the packed and few-rows forms on this process's cached copies)."""
    return gemm(form, x2, weight, bias, _copy_of(form, weight))


def _fastest_gemm(x2: torch.Tensor, weight: torch.Tensor, bias, can_copy: bool) -> torch.Tensor:
    """`[rows, out]` ``F.linear(x2, weight, bias)`` of `[rows, in]` ``x2`` through the form measured fastest for this
    shape and row count (see above; ``can_copy``: packed copies of the weight are allowed)."""
    rows = tuning_rows(x2.shape[0])  # the choice measured for nearby row counts serves this one
    key = (weight.shape[0], weight.shape[1], rows, bias is not None, torch.get_num_threads(), can_copy)
    form = _GEMM_CHOICE.get(key)
    if form is not None:
        return _gemm(form, x2, weight, bias)
    forms = available_forms(can_copy, rows)
    trials = _GEMM_TRIALS.setdefault(key, {f: [] for f in forms})
    form = min(forms, key=lambda f: len(trials[f]))
    _TUNING_CALLS[0] += 1
    copy = _copy_of(form, weight)  # a layer's first use packs its copy: not part of what the form costs a call
    start = time.perf_counter()
    out = gemm(form, x2, weight, bias, copy)
    trials[form].append(time.perf_counter() - start)
    if all(len(trials[f]) >= TUNE_TRIALS for f in forms):
        _GEMM_CHOICE[key] = min(forms, key=lambda f: statistics.median(trials[f]))
        _GEMM_TRIALS.pop(key, None)
    return out


def measured_gemm_forms() -> dict[tuple, str]:
    """The forms chosen so far, keyed ``(out, in, rows, bias, threads, packing allowed)`` (what `gemm_cache` saves)."""
    return dict(_GEMM_CHOICE)


def adopt_gemm_forms(forms: dict[tuple, str]) -> int:
    """Take choices measured earlier on this machine (`gemm_cache`: another process) for the keys this process has
    not chosen yet, so that their forms are not timed again; an entry that is no valid key and form is skipped.
    Returns how many were taken."""
    taken = 0
    for key, form in forms.items():
        if not is_gemm_choice(key, form) or key in _GEMM_CHOICE:
            continue
        _GEMM_CHOICE[key] = form
        _GEMM_TRIALS.pop(key, None)
        taken += 1
    return taken


def is_gemm_choice(key, form) -> bool:
    """Whether ``key``, ``form`` is a choice `_fastest_gemm` could have made: ``(out, in, rows, bias, threads,
    packing allowed)`` with positive ints and bools, and a form of `GEMM_FORMS` ("packed" only where allowed,
    "few_rows" only while its kernel is loaded)."""
    if not (isinstance(key, tuple) and len(key) == 6 and isinstance(form, str) and form in GEMM_FORMS):
        return False
    out, inp, rows, has_bias, threads, can_copy = key
    ints = all(type(v) is int and v > 0 for v in (out, inp, rows, threads))
    return ints and type(has_bias) is bool and type(can_copy) is bool and form in available_forms(can_copy, rows)


def gemm_choices() -> dict[str, str]:
    """The GEMM form chosen so far per ``"out x in, rows[, bias][, packable]"`` (for reports)."""
    out = {}
    for (o, i, rows, has_bias, threads, can_pack), form in sorted(_GEMM_CHOICE.items()):
        name = (
            f"{o}x{i}, {rows} rows, {threads} threads"
            + (", bias" if has_bias else "")
            + (", packable" if can_pack else "")
        )
        out[name] = form
    return out


def kernel_folder() -> Path:
    """Where `build_cpu_kernels` puts the compiled few-rows GEMM: ``kernels/`` in hf_specdec's cache folder."""
    return cache_root() / "kernels"


def build_cpu_kernels(verbose: bool = False) -> bool:
    """Compile the few-rows fp32 GEMM (`kernels/few_rows_gemm.py`) for this CPU into `kernel_folder`, once per
    machine, source and torch (about a minute; ``hf-specdec build-kernels`` runs it), and load it: from then on the
    verify forwards of every process on this machine time it beside MKL's forms and run it where it is fastest.
    Raises `RuntimeError` naming what is missing (AVX2, a C++ compiler, ninja)."""
    return few_rows_gemm.build(kernel_folder(), verbose=verbose)


_KERNELS_LOOKED_UP = [False]


def load_cpu_kernels() -> bool:
    """Load an earlier `build_cpu_kernels` (looked up once per process; never compiles; not with
    ``HF_SPECDEC_CPU_KERNELS=0``); whether it is loaded."""
    if not _KERNELS_LOOKED_UP[0]:
        _KERNELS_LOOKED_UP[0] = True
        if _switched_on(KERNELS_ENV_FLAG):
            few_rows_gemm.load(kernel_folder())
    return few_rows_gemm.loaded()


def _layers_to_pack(model: nn.Module, enabled: bool | None) -> list[nn.Linear]:
    """The layers to patch: none when switched off, unavailable, or when the copies would not fit in memory."""
    if enabled is False or (enabled is None and not _enabled_by_env()):
        return []
    if not (load_cpu_kernels() or available()):
        return []
    layers = [m for m in model.modules() if _eligible(m)]
    if enabled is None and layers:
        weights = {id(m.weight): m.weight for m in layers}.values()
        forms = available_forms(True, MAX_ROWS)  # the copy form this process makes, if any (one per weight)
        mkl, panels = PACKED_SIZE_FACTOR * ("packed" in forms), float("few_rows" in forms)  # copy size / weight's
        need = sum(
            w.numel() * w.element_size() * (mkl * (w not in _PACKED) + panels * (w not in _PANELS)) for w in weights
        )
        free = _available_memory_bytes()
        if free is not None and need > MEMORY_FRACTION * free:
            return []
        cap = _memory_cap_bytes()
        if cap is not None and need + _held_bytes() > cap:
            return []
    return layers


def _memory_cap_bytes() -> int | None:
    """``HF_SPECDEC_PACKED_MEMORY_MB`` in bytes (None when unset); a value that is no number >= 0 is refused."""
    text = os.environ.get(MEMORY_ENV, "").strip()
    if not text:
        return None
    try:
        mb = float(text)
    except ValueError:
        mb = -1.0
    if not mb >= 0 or mb == float("inf"):
        raise ValueError(f"{MEMORY_ENV}={text!r}: expected a number of megabytes >= 0 (0 packs nothing)")
    return int(mb * 1e6)


def _held_bytes() -> int:
    """Bytes every packed copy of this process holds now, whatever model it belongs to."""
    return sum(copy.numel() * copy.element_size() for cache in (_PACKED, _PANELS) for _, copy in cache.values())


@contextlib.contextmanager
def packed_linears(model: nn.Module, enabled: bool | None = None, keep: bool | None = False):
    """Run ``model``'s fp32 CPU `nn.Linear` layers on pre-packed weights inside the block (see the module doc).

    Args:
        model: the model whose linears are patched for this thread.
        enabled: None decides by itself (CPU fp32 layers, MKL, ``HF_SPECDEC_PACKED_LINEAR``, free memory); False
            makes this a no-op; True skips the memory check.
        keep: False releases the copies when the last open block on the model exits (unless a `packed_weights`
            block or an earlier ``keep=True`` holds them); None leaves the copies made for later blocks (until
            `release_packed_weights`, or the weights change or are freed); True does that too and packs from the
            first verify forward instead of the `PACK_AFTER`-th. Whenever the copies stay, those of forms the tuner
            chose nowhere are dropped (`_drop_unchosen_copies`).
    Yields:
        the number of layers patched.
    """
    layers = _layers_to_pack(model, enabled)
    if not layers:
        yield 0
        return
    key = id(model)
    with _USERS_LOCK:
        if keep:
            _PINNED.add(model)
        entry = _USERS.get(key)
        if entry is None:
            patched = [m for m in layers if "forward" not in m.__dict__]
            for m in patched:
                m.forward = _packed_forward(m, model)
            entry = _USERS[key] = [0, patched, False]  # open blocks, layers patched, whether one keeps the copies
        entry[0] += 1
        entry[2] = entry[2] or keep is not False
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
                if entry[2]:
                    _drop_unchosen_copies(model)
                elif not _kept(model):
                    release_packed_weights(model)


_COPY_FORMS = {"packed": _PACKED, "few_rows": _PANELS}  # the forms that run on a copy of the weight, and its cache


def _drop_unchosen_copies(model: nn.Module) -> None:
    """Free the copies of ``model``'s weights in a form that the tuner chose for none of the weight's row counts,
    once no row count of the weight's shape is still being timed (its trials would pack the copy again)."""
    chosen: dict[tuple[int, int], set[str]] = {}
    for (out, inp, _rows, _bias, _threads, can_copy), form in _GEMM_CHOICE.items():
        if can_copy:
            chosen.setdefault((out, inp), set()).add(form)
    timing = {key[:2] for key in _GEMM_TRIALS if key[5]}
    for p in model.parameters():
        shape = tuple(p.shape)
        if p.dim() != 2 or shape in timing:
            continue
        for form, cache in _COPY_FORMS.items():
            if form not in chosen.get(shape, ()):
                cache.pop(p, None)


@contextlib.contextmanager
def packed_weights(model: nn.Module, enabled: bool | None = None):
    """Pack ``model``'s CPU fp32 linear weights now and keep the copies for every ``generate`` call in the block.

    The explicit warm-up: the first speculative call inside the block does not pay the packing, and no call inside
    re-packs. The copies are released when the block exits (unless a ``keep_packed=True`` call pinned them). Does
    nothing where packing does not apply (no MKL, not CPU fp32, ``HF_SPECDEC_PACKED_LINEAR=0``, not enough memory).

    Args:
        model: the target (or draft) model.
        enabled: as in `packed_linears`.
    Yields:
        the bytes the packed copies hold (0 when nothing was packed).
    """
    layers = _layers_to_pack(model, enabled)
    with _USERS_LOCK:
        _KEEP_BLOCKS[model] = _KEEP_BLOCKS.get(model, 0) + 1
    try:
        with torch.no_grad():
            for m in layers:
                if available():
                    packed_weight(m.weight)
                if few_rows_gemm.loaded():
                    panel_weight(m.weight)
        yield packed_bytes(model)
    finally:
        with _USERS_LOCK:
            _KEEP_BLOCKS[model] -= 1
            if _KEEP_BLOCKS[model] == 0:
                del _KEEP_BLOCKS[model]
            if not _kept(model) and id(model) not in _USERS:
                release_packed_weights(model)


def packed_bytes(model: nn.Module) -> int:
    """Bytes allocated by the packed copies of ``model``'s weights now held (0 when none)."""
    total = 0
    for p in model.parameters():
        for cache in (_PACKED, _PANELS):
            entry = cache.get(p)
            if entry is not None:
                total += entry[1].numel() * entry[1].element_size()
    return total


def release_packed_weights(model: nn.Module | None = None) -> None:
    """Free the packed copies of ``model``'s weights (of every model when None) and undo ``keep_packed=True``."""
    if model is None:
        _PACKED.clear()
        _PANELS.clear()
        _FORWARDS_SEEN.clear()
        _PINNED.clear()
        return
    _PINNED.discard(model)
    for p in model.parameters():
        _PACKED.pop(p, None)
        _PANELS.pop(p, None)
        _FORWARDS_SEEN.pop(p, None)
