"""The GEMM forms `packed_linears` measured fastest on this CPU, kept between processes: one small JSON file per machine.

`packed_linears` times every GEMM form on the first calls of each (weight shape, row count, threads, packing allowed)
and keeps the fastest for the process. A new process would time them all again inside its first verify forwards,
slowing its first calls' steps (docs/lab/changelog.md, "The GEMM forms kept between processes";
docs/results/intel_gemm_forms_cache.json). The loop therefore starts every call from the choices an earlier process saved (`load_gemm_choices`, read once per process) and writes
new ones back at the end of a call (`save_gemm_choices`, throttled like the cost curves, and once at exit).

- **Folder and switch**: the cost curves' (`cost_cache.cache_folder`: ``HF_SPECDEC_COST_CACHE``; ``0`` turns both
  off).
- **Key**: this machine as `cost_cache.machine_key` describes it for the CPU (CPU model, usable cores, torch's
  version, which brings its MKL), without the thread count, which is part of every choice's own key, and the GEMM
  forms this process can run (the compiled few-rows kernel loaded or not: choices timed without it are not kept
  where it is built). A file whose key differs is never read; entries that are no valid choice are skipped.
- **Failures**: as the cost curves': a missing or malformed file is no choices, an unwritable folder one warning;
  the user's call never fails because of the cache.

    load_gemm_choices()     # once per process: the choices saved for this machine, for the shapes not timed yet
    save_gemm_choices()     # at the end of a call: new choices, merged with the file's (throttled)
"""

from __future__ import annotations

import atexit
import hashlib
import json
import threading
import time
from pathlib import Path

import torch

from ..kernels.cpu_linear import available_forms
from .cost_cache import SAVE_EVERY_S, cache_folder, machine_key, read_state, warn_unwritable, write_state
from .packed_linears import adopt_gemm_forms, is_gemm_choice, load_cpu_kernels, measured_gemm_forms

FORMAT = 1  # bump when the file's layout or the meaning of a choice changes
_LOCK = threading.Lock()
_STATE = {"loaded": False, "saved_at": None, "saved": {}}  # read yet; last write; what the file holds, as known


def _file_key() -> dict:
    machine = machine_key([torch.device("cpu")])
    machine.pop("threads", None)
    load_cpu_kernels()  # the forms this process can run: choices made without the kernel are not used where it is built
    forms = list(available_forms(can_copy=True))
    return json.loads(json.dumps({"format": FORMAT, "machine": machine, "forms": forms}, default=str))


def choices_file() -> Path | None:
    """This machine's file of GEMM choices; None while the cache is off."""
    folder = cache_folder()
    if folder is None:
        return None
    key = _file_key()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()[:24]
    return folder / f"gemm-forms-{digest}.json"


def _read(path: Path) -> dict[tuple, str]:
    """The valid choices in ``path`` when it exists, parses and holds this machine's key; else none."""
    state = read_state(path, _file_key()) or {}
    entries = state.get("forms")
    forms = {}
    for entry in entries if isinstance(entries, list) else ():
        if isinstance(entry, list) and len(entry) == 7 and is_gemm_choice(tuple(entry[:6]), entry[6]):
            forms[tuple(entry[:6])] = entry[6]
    return forms


def load_gemm_choices() -> int:
    """Adopt the choices saved for this machine (the first call in a process reads the file; later calls do
    nothing); returns how many were taken."""
    with _LOCK:
        if _STATE["loaded"]:
            return 0
        _STATE["loaded"] = True
        path = choices_file()
        _STATE["saved"] = _read(path) if path is not None else {}
        return adopt_gemm_forms(_STATE["saved"])


def save_gemm_choices(force: bool = False) -> bool:
    """Write this process's choices, merged with the file's, when the file lacks some of them (or holds another
    form) and this process's last write is `cost_cache.SAVE_EVERY_S` old (``force``: whatever its age); returns
    whether it wrote. Never raises for an unwritable folder."""
    with _LOCK:
        last = _STATE["saved_at"]
        if not force and last is not None and time.monotonic() - last < SAVE_EVERY_S:
            return False
        path = choices_file()
        if path is None:
            return False
        forms, known = measured_gemm_forms(), _STATE["saved"]
        if all(known.get(k) == form for k, form in forms.items()):
            return False
        merged = {**_read(path), **forms}
        _STATE["saved_at"], _STATE["saved"] = time.monotonic(), merged
        try:
            write_state(path, _file_key(), {"forms": [[*key, form] for key, form in sorted(merged.items())]})
        except OSError as err:
            warn_unwritable(path.parent, err)
            return False
        return True


@atexit.register
def _save_at_exit() -> None:
    save_gemm_choices(force=True)


__all__ = ["choices_file", "load_gemm_choices", "save_gemm_choices"]
