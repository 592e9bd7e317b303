"""What the committed notebooks show is what the current code produces: each was executed top to bottom (every
code cell ran, in order, none failed, outputs kept) by ``scripts/refresh_notebooks.py`` with the heads that ship
now. After a head is retrained, this fails until the notebooks are refreshed (CI also executes them, small, in
tests/integration/test_notebooks.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import hf_specdec

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
REFRESH = "python scripts/refresh_notebooks.py"


def _refresh_script():
    spec = importlib.util.spec_from_file_location("refresh_notebooks", ROOT / "scripts" / "refresh_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


refresh = _refresh_script()


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 3


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_committed_notebook_ran_with_the_shipped_heads(path):
    book = json.loads(path.read_text(encoding="utf-8"))
    stamp = book["metadata"].get(refresh.METADATA_KEY)
    assert stamp, f"{path.name} was not executed by {REFRESH} (no hf_specdec metadata): run it"
    current = refresh.shipped_heads()
    changed = sorted(k for k in current.keys() | stamp["heads"].keys() if current.get(k) != stamp["heads"].get(k))
    assert stamp["heads_sha256"] == refresh.heads_digest(), (
        f"{path.name} shows outputs of other heads ({', '.join(changed)} changed since {stamp['executed']}): "
        f"run {REFRESH} {path.relative_to(ROOT)}"
    )
    assert stamp["version"] == hf_specdec.__version__ == refresh.package_version()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_committed_notebook_has_its_outputs(path):
    book = json.loads(path.read_text(encoding="utf-8"))
    code = [c for c in book["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    counts = [c.get("execution_count") for c in code]
    assert all(isinstance(n, int) for n in counts), f"{path.name}: cells not executed: run {REFRESH}"
    assert counts == sorted(counts), f"{path.name}: cells executed out of order: run {REFRESH}"
    assert sum(1 for c in code if c.get("outputs")) >= len(code) // 2, f"{path.name}: outputs missing"
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{path.name}: a cell failed: {errors[0].get('ename')}"


def test_the_digest_follows_any_change_to_a_head(tmp_path):
    for name in ("medusa-x", "eagle-x"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"tree": [1]}')
        (tmp_path / name / "model.safetensors").write_bytes(b"weights")
        (tmp_path / name / "README.md").write_text("card")
    before = refresh.heads_digest(tmp_path)
    (tmp_path / "medusa-x" / "README.md").write_text("another card")
    assert refresh.heads_digest(tmp_path) == before  # the card does not change a draft
    (tmp_path / "medusa-x" / "config.json").write_text('{"tree": [1], "model_card": {"speedup": 1.3}}')
    assert refresh.heads_digest(tmp_path) == before  # nor do the card's facts in the config
    (tmp_path / "eagle-x" / "config.json").write_text('{"tree": [2]}')
    assert refresh.heads_digest(tmp_path) != before
    with pytest.raises(FileNotFoundError, match="no shipped head"):
        refresh.heads_digest(tmp_path / "nothing")


# Copies executed on a busy machine before the refresh script recorded it; each must be refreshed on a quiet
# machine (`python scripts/refresh_notebooks.py NOTEBOOK`). The test fails once a listed copy is quiet, so the entry
# cannot outlive its reason.
EXECUTED_BUSY: set[str] = set()


def _ran_busy(stamp: dict) -> bool:
    if "busy" in stamp:
        return bool(stamp["busy"])
    cores = int(stamp["machine"].rsplit(", ", 1)[1].split()[0])  # "AMD EPYC, 2 cores"
    return refresh.busy(stamp["load_average_before"][0], cores)


def test_the_busy_rule():
    assert refresh.busy(1.09, 2) and not refresh.busy(0.08, 2) and not refresh.busy(1.0, 2)
    assert _ran_busy({"busy": True}) and not _ran_busy({"busy": False})
    assert _ran_busy({"machine": "AMD EPYC, 2 cores", "load_average_before": [3.81, 2.9, 2.4]})


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_committed_notebook_ran_on_a_quiet_machine(path):
    stamp = json.loads(path.read_text(encoding="utf-8"))["metadata"][refresh.METADATA_KEY]
    if path.stem in EXECUTED_BUSY:
        assert _ran_busy(stamp), f"{path.name} now ran on a quiet machine: remove it from EXECUTED_BUSY"
        pytest.skip(f"{path.name} was executed on a busy machine; refresh it on a quiet one")
    assert not _ran_busy(stamp), (
        f"{path.name} was executed on a busy machine (load {stamp['load_average_before'][0]}): its timings are the "
        f"other work's; run {REFRESH} {path.relative_to(ROOT)} on a quiet machine, without --allow-busy"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_committed_notebook_has_no_progress_bars(path):
    book = json.loads(path.read_text(encoding="utf-8"))
    noise = [
        line
        for c in book["cells"]
        if c["cell_type"] == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "stream"
        for line in "".join(o["text"]).splitlines()
        if "it/s]" in line or "step/s" in line or "TqdmWarning" in line or "%|" in line
    ]
    assert not noise, f"{path.name} shows progress bars ({len(noise)} lines, e.g. {noise[0]!r}): run {REFRESH}"


def test_one_script_executes_the_notebooks():
    assert not (ROOT / "notebooks" / "execute.py").exists(), "scripts/refresh_notebooks.py is the one script"


def test_the_refresh_waits_for_the_previous_notebooks_load_to_decay(monkeypatch):
    """One notebook's own run must not stamp the next one busy: `settle` polls until the load is below the limit."""
    loads = iter([(1.8, 1.5, 1.2), (1.3, 1.4, 1.2), (0.9, 1.3, 1.2), (0.1, 0.1, 0.1)])
    monkeypatch.setattr(refresh.os, "getloadavg", lambda: next(loads))
    monkeypatch.setattr(refresh.time, "sleep", lambda s: None)
    assert refresh.settle(2) == (0.9, 1.3, 1.2)


def test_the_kernel_profile_silences_third_party_import_notices(tmp_path):
    startup = refresh.quiet_kernel_profile(tmp_path) / "profile_default" / "startup" / "00-quiet.py"
    import logging

    before = {name: logging.getLogger(name).level for name in ("torchao", "torch.utils._pytree")}
    try:
        exec(compile(startup.read_text(), str(startup), "exec"), {})
        assert logging.getLogger("torchao").level == logging.ERROR
    finally:  # this process's logging as it was
        for name, level in before.items():
            logging.getLogger(name).setLevel(level)
