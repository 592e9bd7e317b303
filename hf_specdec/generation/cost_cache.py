"""Where the tree budget's learnt cost curve is kept between processes: one small JSON file per (machine, model) key.

A new process would otherwise start from a prior curve and pay for learning this machine's verify cost again on its
first call. `cost_model.cost_model_for` reads the file of its model's key when it creates the model's
`StepCostModel`; the loop writes it back at the end of a call (`CurveFile.due`: at most every `SAVE_EVERY_S`
seconds and only when new samples came in, plus once at exit). Why a loaded curve cannot mislead the budget for long:
`StepCostModel.load_state`.

- **Folder**: ``$HF_SPECDEC_COST_CACHE`` when it names a folder, else ``cost_curves/`` in hf_specdec's cache
  (`models.cache_root`: ``$HF_SPECDEC_CACHE``, else ``$HF_HOME/hf_specdec``, else ``$XDG_CACHE_HOME/hf_specdec``,
  else ``~/.cache/hf_specdec``). ``HF_SPECDEC_COST_CACHE=0`` turns the cache off: nothing is read or written.
- **Key**: everything that changes the curve (`curve_key`): the machine (CPU model name, the cores this process
  may use, torch's threads and version, the GPUs the model sits on), the model (a digest of its config without its
  name or path, its attention implementation, parameter dtypes, devices and tensor classes, quantization, whether
  hf_specdec packs its CPU linears and has its compiled few-rows GEMM, the attention backend) and the transformers / hf_specdec versions. The file's
  name is a digest of the key and the file holds the key itself: a curve whose key differs is never used.
- **Proposing costs**: what a draft model's level costs drafting for a target (`cost_model.ProposingCost`) is kept
  beside the curves, one ``proposing-<type>-<digest>.json`` per (target, draft) key (`proposing_key`: the target's
  curve key and the draft's model key), written when a call ends (throttled alike) and at exit.
- **Failures**: a file that is missing, unreadable or malformed is no curve; a folder that cannot be written logs
  one warning per process and the curve stays in memory. The user's call never fails because of the cache.

    file = curve_file(model)          # None while the cache is off or the model has no config to fingerprint
    state = file.read()               # the saved `StepCostModel.state()` of this very key, or None
    file.save(model, cost)            # when due; atomic: a temporary file in the folder, then os.replace
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import re
import tempfile
import threading
import time
from pathlib import Path

import torch

from ..attention.backend import choose_backend
from ..models import cache_root
from .packed_linears import _enabled_by_env, _layers_to_pack, load_cpu_kernels

logger = logging.getLogger(__name__)

ENV_VAR = "HF_SPECDEC_COST_CACHE"  # 0 / false / off / no: off; a path: the folder; unset, 1 / true / on: default
FORMAT = 1  # bump when the file's layout or the meaning of a curve's samples changes
SAVE_EVERY_S = 30.0  # a curve is written at most this often per process (and once more at exit)
_OFF = ("0", "false", "no", "off")
_ON = ("", "1", "true", "yes", "on")
# config entries that name a copy of the model rather than describe it (dtypes are read from the parameters)
_IDENTITY = ("_name_or_path", "name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash")
_WARNED: set[str] = set()


def cache_folder() -> Path | None:
    """The folder of the cost-curve files, or None while ``HF_SPECDEC_COST_CACHE`` turns the cache off."""
    value = os.environ.get(ENV_VAR, "").strip()
    if value.lower() in _OFF:
        return None
    if value.lower() not in _ON:
        return Path(value).expanduser()
    return cache_root() / "cost_curves"


@functools.lru_cache(maxsize=1)
def _cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what `platform` knows."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip().lower() in ("model name", "hardware", "cpu model") and value.strip():
                    return value.strip()
    return platform.processor() or platform.machine()


def _usable_cores() -> int:
    """Cores this process may run on (its affinity, which a container's cpuset limits), else the machine's."""
    with contextlib.suppress(AttributeError, OSError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@functools.cache
def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_key(devices: list[torch.device]) -> dict:
    """What of this machine changes a verify forward's seconds, for a model on ``devices``."""
    gpus = sorted({torch.cuda.get_device_name(d) for d in devices if d.type == "cuda"})
    return {
        "cpu": _cpu_name(),
        "arch": platform.machine(),
        "cores": _usable_cores(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "gpus": gpus,
        "cuda": torch.version.cuda if gpus else None,
    }


def _config_digest(config) -> str:
    """A digest of everything ``config`` says about the model's shape (not its name, path or dtype)."""
    values = config.to_dict()
    for name in _IDENTITY:
        values.pop(name, None)
    text = json.dumps(values, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]


def model_key(model: torch.nn.Module) -> dict:
    """What of ``model`` changes its verify forward's seconds (its weights' values do not)."""
    params = list(model.parameters())
    config = model.config
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None and not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    return {
        "type": getattr(config, "model_type", None),
        "architectures": getattr(config, "architectures", None),
        "config": _config_digest(config),
        "attention": getattr(config, "_attn_implementation", None),
        "dtypes": sorted({str(p.dtype) for p in params}),
        "devices": sorted({str(p.device) for p in params}),
        "tensors": sorted({type(p.data).__name__ for p in params}),  # quantized weights are tensor subclasses
        "quantization": quantization.get("quant_method") if quantization else None,
        "packed_linears": _enabled_by_env() and bool(_layers_to_pack(model, enabled=True)),
        # the compiled few-rows GEMM loaded: a curve learnt without it overstates a tree's cost where it runs
        "few_rows_gemm": load_cpu_kernels() and any(p.device.type == "cpu" for p in params),
        "attention_backend": choose_backend(params[0].device) if params else None,
    }


def curve_key(model: torch.nn.Module) -> dict:
    """The full key of ``model``'s curve on this machine (see the module docstring)."""
    devices = sorted({p.device for p in model.parameters()}, key=str)
    key = {
        "format": FORMAT,
        "machine": machine_key(devices),
        "model": model_key(model),
        "software": {"transformers": _version("transformers"), "hf_specdec": _version("hf_specdec")},
    }
    return json.loads(json.dumps(key, default=str))  # as a file gives it back (lists, not tuples), to compare


def _key_or_none(model: torch.nn.Module) -> dict | None:
    """`curve_key`, or None when something of the model cannot be fingerprinted (the cache then stays out)."""
    try:
        return curve_key(model)
    except (AttributeError, OSError, RuntimeError, TypeError, ValueError) as err:
        logger.debug("hf_specdec: no cost-curve cache for %s: %s", type(model).__name__, err)
        return None


def _write_atomically(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file in the same folder and `os.replace` (readers never see half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_state(path: Path, key: dict) -> dict | None:
    """The ``state`` a cache file holds (``{"key": ..., "saved": ..., "state": {...}}``) when it exists, parses and
    holds ``key`` itself; else None."""
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(payload, dict) or payload.get("key") != key:
        return None
    state = payload.get("state")
    return state if isinstance(state, dict) else None


def write_state(path: Path, key: dict, state: dict) -> None:
    """Write ``state`` under ``key`` into the cache file ``path``, atomically (`read_state` reads it); OSError when
    the folder cannot be written."""
    payload = {"key": key, "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "state": state}
    _write_atomically(path, json.dumps(payload))


def warn_unwritable(folder: Path, err: OSError) -> None:
    """Log, once per process and folder, that the cache cannot be written there (what is learnt stays in memory)."""
    if str(folder) in _WARNED:
        return
    _WARNED.add(str(folder))
    logger.warning(
        "hf_specdec: cannot write what the tree budget learnt (cost curves, GEMM forms) to %s (%s); it is kept in "
        "memory for this process only. Set %s to a writable folder, or to 0 to turn the cache off.",
        folder, err, ENV_VAR,
    )  # fmt: skip


class CurveFile:
    """The file of one curve key, and when this process last wrote it.

    Args:
        path: the JSON file (``{"key": ..., "saved": ..., "state": StepCostModel.state()}``).
        key: the `curve_key` of the model whose curve it holds.
    """

    def __init__(self, path: Path, key: dict):
        self.path, self.key = path, key
        self.saved_at: float | None = None  # time.monotonic() of this process's last write (or failed write)
        self.saved_clock = 0  # the cost model's sample clock at that write, or when the curve was read
        self._lock = threading.Lock()

    def read(self) -> dict | None:
        """The saved curve when the file exists, parses and holds this very key; else None."""
        return read_state(self.path, self.key)

    def due(self, clock: int, force: bool = False) -> bool:
        """Whether a curve at sample clock ``clock`` is to be written now: it has samples the file lacks, and this
        process's last write is `SAVE_EVERY_S` old (``force``: whatever its age)."""
        if clock <= self.saved_clock:
            return False
        return force or self.saved_at is None or time.monotonic() - self.saved_at >= SAVE_EVERY_S

    def save(self, model: torch.nn.Module, cost, force: bool = False, current_key: dict | None = None) -> bool:
        """Write ``cost``'s curve (a `StepCostModel`, or anything with ``samples_taken`` and ``state()``) when `due`
        and while the cache is on; returns whether it was written. Nothing is written once ``model``'s key (or
        ``current_key``, the key as it is now) differs from the file's (torch's threads, the attention
        implementation changed since): the curve then mixes two states."""
        with self._lock:
            clock = cost.samples_taken
            if cache_folder() is None or not self.due(clock, force):
                return False
            self.saved_at, self.saved_clock = time.monotonic(), clock
            if (current_key if current_key is not None else _key_or_none(model)) != self.key:
                return False
            try:
                write_state(self.path, self.key, cost.state())
            except OSError as err:
                warn_unwritable(self.path.parent, err)
                return False
            return True


def curve_file(model: torch.nn.Module) -> CurveFile | None:
    """The file of ``model``'s curve on this machine; None while the cache is off, or for a module without a
    transformers config (nothing to fingerprint it by)."""
    folder = cache_folder()
    if folder is None or not callable(getattr(getattr(model, "config", None), "to_dict", None)):
        return None
    key = _key_or_none(model)
    if key is None:
        return None
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()[:24]
    kind = re.sub(r"[^\w.-]", "_", str(key["model"]["type"] or "model"))
    return CurveFile(folder / f"{kind}-{digest}.json", key)


def proposing_key(target: torch.nn.Module, draft: torch.nn.Module, variant: str | None = None) -> dict | None:
    """The key of what ``draft`` costs drafting for ``target`` here (`cost_model.ProposingCost`: in units of the
    target's plain step, so both models count): the target's `curve_key`, the draft's `model_key` and the way the
    draft is run (``variant``, e.g. its draft vocabulary's size); None when either model cannot be fingerprinted."""
    target_key = _key_or_none(target)
    try:
        draft_key = model_key(draft)
    except (AttributeError, OSError, RuntimeError, TypeError, ValueError):
        return None
    if target_key is None:
        return None
    key = {"format": FORMAT, "kind": "proposing", "target": target_key, "draft": draft_key}
    if variant:
        key["variant"] = variant
    return json.loads(json.dumps(key, default=str))


def proposing_file(target: torch.nn.Module, draft: torch.nn.Module, variant: str | None = None) -> CurveFile | None:
    """The file of ``draft``'s proposing cost for ``target`` on this machine (``proposing-<type>-<digest>.json``
    beside the curves); None while the cache is off or a model has no transformers config."""
    folder = cache_folder()
    configs = [getattr(m, "config", None) for m in (target, draft)]
    if folder is None or not all(callable(getattr(c, "to_dict", None)) for c in configs):
        return None
    key = proposing_key(target, draft, variant)
    if key is None:
        return None
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()[:24]
    kind = re.sub(r"[^\w.-]", "_", str(key["draft"]["type"] or "model"))
    return CurveFile(folder / f"proposing-{kind}-{digest}.json", key)
