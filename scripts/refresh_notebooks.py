"""Re-execute the notebooks in place (outputs included) with their default settings, and stamp each with what it ran
with, so that a test can tell when a committed notebook no longer shows what the code produces:

    python scripts/refresh_notebooks.py                           # every notebook in notebooks/
    python scripts/refresh_notebooks.py notebooks/03_benchmark.ipynb

Run it on a quiet machine after the shipped heads change (tests/unit/test_notebook_freshness.py fails until then).
Each notebook's metadata gets an ``hf_specdec`` entry: the package version, `heads_digest` (a SHA-256 over the shipped
heads' config.json and model.safetensors), each head's own digest, the date, the machine and its load. The
``HF_SPECDEC_NOTEBOOK_*`` variables that CI sets to run the notebooks small are removed first: the committed copies
show the defaults, and progress bars are turned off (tqdm's and the Hub's), so the outputs hold what the cells print;
the kernel starts with third-party import-time notices silenced (`KERNEL_STARTUP`: tqdm's "IProgress not found",
torchao's and torch's logged warnings when torchao's compiled kernels do not match the installed torch), which say
nothing about hf_specdec. A busy machine (load average above `BUSY_LOAD` per core) is refused: the notebooks time
things, and on a busy CPU the figures are the other work's. Between notebooks the script waits (up to
`SETTLE_SECONDS`) for the load the previous notebook left to decay below that limit, so that one notebook's own run
does not mark the next one busy. ``--allow-busy`` runs anyway, for a local look; the stamp then records
``busy: true`` and tests/unit/test_notebook_freshness.py refuses such a copy in a commit. This is the one script that
executes the notebooks. Needs the test extra (nbclient, nbformat, ipykernel, matplotlib).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
ASSETS = ROOT / "hf_specdec" / "assets"
HEAD_FILES = ("config.json", "model.safetensors")  # what decides a head's drafts (README / report do not)
METADATA_KEY = "hf_specdec"
BUSY_LOAD = 0.5  # load average per core above which the timings would be the other work's
SMALL_RUN_VARIABLES = ("HF_SPECDEC_NOTEBOOK_TOKENS", "HF_SPECDEC_NOTEBOOK_CATEGORIES")
QUIET = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
SETTLE_SECONDS = 300  # how long to wait for the previous notebook's load to decay before the next one
KERNEL_STARTUP = """\
import logging, warnings
warnings.filterwarnings("ignore", message="IProgress not found")
for name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(name).setLevel(logging.ERROR)
"""


def busy(load_average: float, cores: int) -> bool:
    """Whether a machine at this 1-minute load average is too busy for the notebooks' timings."""
    return load_average > BUSY_LOAD * max(1, cores)


def _drafting_bytes(path: Path) -> bytes:
    """What of a head file decides its drafts: the weights as they are; the config without its ``model_card`` facts
    (measured figures, training notes: text for the card, like README.md), keys sorted."""
    if path.suffix != ".json":
        return path.read_bytes()
    config = json.loads(path.read_text())
    config.pop("model_card", None)
    return json.dumps(config, sort_keys=True).encode()


def shipped_heads(assets: Path = ASSETS) -> dict[str, str]:
    """``{head folder name: SHA-256 of its config.json (card facts left out) and model.safetensors}`` of every head
    in ``assets``."""
    out = {}
    for folder in sorted(p.parent for p in assets.glob("*/model.safetensors")):
        digest = hashlib.sha256()
        for name in HEAD_FILES:
            digest.update(name.encode() + b"\0" + _drafting_bytes(folder / name))
        out[folder.name] = digest.hexdigest()
    return out


def heads_digest(assets: Path = ASSETS) -> str:
    """One SHA-256 over every shipped head (`shipped_heads`): it changes when any head is retrained or re-tuned."""
    heads = shipped_heads(assets)
    if not heads:
        raise FileNotFoundError(f"no shipped head (a folder with model.safetensors) in {assets}")
    return hashlib.sha256("".join(f"{k}={v}\n" for k, v in heads.items()).encode()).hexdigest()


def package_version() -> str:
    """``hf_specdec.__version__`` of this checkout (read from the source, whatever copy is installed)."""
    found = re.search(r'^__version__ = "([^"]+)"', (ROOT / "hf_specdec" / "version.py").read_text(), re.MULTILINE)
    if found is None:
        raise ValueError("hf_specdec/version.py has no __version__ line")
    return found.group(1)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def settle(cores: int, limit_s: float = SETTLE_SECONDS, poll_s: float = 5.0) -> tuple[float, float, float]:
    """The load averages once the 1-minute one is no longer `busy` (or after ``limit_s`` seconds, busy or not)."""
    deadline = time.monotonic() + limit_s
    load = os.getloadavg()
    while busy(load[0], cores) and time.monotonic() < deadline:
        time.sleep(poll_s)
        load = os.getloadavg()
    return load


def quiet_kernel_profile(folder: Path) -> Path:
    """An IPython profile folder (for ``IPYTHONDIR``) whose startup file runs `KERNEL_STARTUP` in every kernel."""
    startup = folder / "profile_default" / "startup"
    startup.mkdir(parents=True, exist_ok=True)
    (startup / "00-quiet.py").write_text(KERNEL_STARTUP)
    return folder


def stamp(book, load_before: tuple[float, float, float]) -> dict:
    """Write (and return) the notebook's ``hf_specdec`` metadata: what it was executed with."""
    cores = os.cpu_count() or 1
    meta = {
        "version": package_version(),
        "heads_sha256": heads_digest(),
        "heads": shipped_heads(),
        "executed": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": _cpu(),
        "load_average_before": [round(x, 2) for x in load_before],
        "cores": cores,
        "busy": busy(load_before[0], cores),
        "torch": importlib.metadata.version("torch"),
        "transformers": importlib.metadata.version("transformers"),
    }
    book.metadata[METADATA_KEY] = meta
    return meta


def refresh(path: Path, timeout: int = 3600) -> dict:
    """Execute ``path`` top to bottom in a fresh kernel (working folder: notebooks/), write it back with its outputs
    and its stamp; a failing cell raises (nbclient's CellExecutionError) and the file is left as it was."""
    import nbformat
    from nbclient import NotebookClient

    book = nbformat.read(path, as_version=4)
    load = settle(os.cpu_count() or 1)
    NotebookClient(
        book, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    ).execute()
    meta = stamp(book, load)
    nbformat.write(book, path)
    return meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help="notebooks to refresh (default: every one in notebooks/)")
    parser.add_argument("--allow-busy", action="store_true", help="run even when the machine is busy (see below)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds one cell may run (default 3600)")
    args = parser.parse_args(argv)
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if busy(load, cores) and not args.allow_busy:  # the notebooks time things: a busy CPU skews every figure
        parser.error(f"the machine is busy (load average {load:.1f} on {cores} cores): the notebooks' timings would "
                     "show the other work, not hf-specdec; wait for a quiet machine or pass --allow-busy")  # fmt: skip
    for name in SMALL_RUN_VARIABLES:  # the committed copies show the notebooks' defaults
        os.environ.pop(name, None)
    os.environ.update(QUIET)  # the kernel inherits it: no progress bars in the outputs
    profile = Path(tempfile.mkdtemp(prefix="hf_specdec_ipython_"))
    os.environ["IPYTHONDIR"] = str(quiet_kernel_profile(profile))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    for path in args.paths or sorted(NOTEBOOKS.glob("*.ipynb")):
        t0 = time.perf_counter()
        meta = refresh(path, args.timeout)
        print(f"{path}: executed in {time.perf_counter() - t0:.0f} s (load before {meta['load_average_before']}); "
              f"heads {meta['heads_sha256'][:12]}", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
