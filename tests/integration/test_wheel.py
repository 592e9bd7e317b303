"""The package installs like a library: ``python -m build`` makes a wheel (the code, the demo, the shipped heads and
the bench's questions), which installs into a fresh virtual environment with ``--no-index`` against the
dependencies already installed, and works from a folder outside the repository: ``hf-specdec --version``, a greedy
``generate`` with a shipped head, and the quick bench on one prompt."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import hf_specdec

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _run(argv: list, cwd: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    out = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{argv} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _source_copy(dest: Path) -> Path:
    """The repository's files as git sees them (tracked, and new files not ignored): what a clean clone builds."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("the wheel is built from a git checkout's files")
    listed = subprocess.run(["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def _see_installed_dependencies(venv: Path) -> None:
    """Let ``venv`` import what this interpreter has installed. ``--system-site-packages`` only reaches the *base*
    interpreter's packages: when the tests themselves run inside a virtual environment (as CI may), torch and the rest
    live in that environment's site-packages, so they are added as site directories (their ``.pth`` files processed
    too), after the new environment's own."""
    if sys.prefix == sys.base_prefix:
        return  # not inside a venv: --system-site-packages already sees everything
    (site_dir,) = (venv / "lib").glob("python*/site-packages")
    outer = [p for p in site.getsitepackages() if Path(p).is_dir()]
    lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in outer)
    (site_dir / "_outer_environment.pth").write_text(lines)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("build", reason="the test extra's `build` is not installed")
    tmp = tmp_path_factory.mktemp("wheel")
    src = _source_copy(tmp / "src")
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", tmp / "dist", src], tmp, dict(os.environ))
    (whl,) = (tmp / "dist").glob("hf_specdec-*.whl")
    return whl


def test_the_wheel_holds_the_heads_the_questions_the_demo_the_kernel_source_and_the_license(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for head in ("medusa", "eagle", "mlp-speculator"):
        folder = f"hf_specdec/assets/{head}-smollm2-135m-instruct"
        assert {f"{folder}/config.json", f"{folder}/model.safetensors", f"{folder}/README.md"} <= names
    assert "hf_specdec/assets/spec-bench/spec_bench_public.jsonl" in names
    assert {"hf_specdec/demo/app.py", "hf_specdec/demo/compare.py", "hf_specdec/cli.py"} <= names
    assert "hf_specdec/kernels/csrc/few_rows_gemm.cpp" in names  # hf-specdec build-kernels compiles it
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert wheel.name.startswith(f"hf_specdec-{hf_specdec.__version__}-")


def test_the_wheel_installs_offline_and_works_outside_the_repository(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", venv], tmp_path, dict(os.environ))
    _see_installed_dependencies(venv)
    bin_dir = venv / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "2")
    _run([bin_dir / "python", "-m", "pip", "install", "-q", "--no-index", "--no-deps", wheel], tmp_path, env)
    work = tmp_path / "elsewhere"
    work.mkdir()

    where = _run([bin_dir / "python", "-c", "import hf_specdec; print(hf_specdec.__file__)"], work, env).stdout
    assert Path(where.strip()).is_relative_to(venv), f"imported {where.strip()}, not the installed wheel"
    version = _run([bin_dir / "hf-specdec", "--version"], work, env).stdout.strip()
    assert version == f"hf-specdec {hf_specdec.__version__}"

    gen = _run([bin_dir / "hf-specdec", "generate", "What is the capital of France?", "--assistant", "medusa",
                "--max-new-tokens", "8", "--threads", "2"], work, env)  # fmt: skip
    assert gen.stdout.strip(), gen.stderr
    assert "assistant: medusa" in gen.stderr and "τ = " in gen.stderr

    bench = _run([bin_dir / "hf-specdec", "bench", "--categories", "translation", "--per-category", "1",
                  "--max-new-tokens", "16", "--threads", "2", "--quiet", "--out", "results"], work, env)  # fmt: skip
    report = (work / "results" / "results.md").read_text()
    assert "**overall**" in report and "| vanilla |" in report and "| ngram |" in report
    assert (work / "results" / "results.png").stat().st_size > 1000
    assert "spec_bench_public.jsonl (1 prompts" in bench.stdout
