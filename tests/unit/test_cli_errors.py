"""Bad command-line values are one argparse-style error line and exit code 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hf_specdec.cli import main

CASES = [
    (["--max-new-tokens", "0"], ["--max-new-tokens", "at least 1", "0"]),
    (["--max-new-tokens", "abc"], ["--max-new-tokens", "abc"]),
    (["--draft-layers", "0"], ["--draft-layers", "at least 1"]),
    (["--do-sample", "--temperature", "0"], ["--temperature", "greater than 0"]),
    (["--do-sample", "--top-p", "1.5"], ["--top-p", "1.5"]),
    (["--temperature", "0.7"], ["--do-sample"]),
    (["--threads", "0"], ["--threads", "at least 1"]),
    (["--model", "/nonexistent"], ["--model", "/nonexistent", "no such folder"]),
    (["--model", "./not/here"], ["--model", "./not/here", "no such folder"]),
    (["--assistant", "nope"], ["--assistant", "nope"]),
]


def _error_line(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2, f"{argv}: exit code {info.value.code}"
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("extra, words", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_generate_refuses_bad_values_in_one_line(capsys, extra, words):
    line = _error_line(capsys, ["generate", "hello", *extra])
    missing = [w for w in words if w not in line]
    assert not missing, f"{missing} not in {line!r}"


def test_the_installed_command_prints_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "hf_specdec.cli", "generate", "hi", "--model", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "hf-specdec: error: --model /nonexistent: no such folder (pass a local model folder or a Hub id like org/name)"
    )


@pytest.mark.slow
def test_too_many_draft_layers_names_the_models_layer_count(capsys):
    line = _error_line(capsys, ["generate", "hi", "--assistant", "draft", "--draft-layers", "100"])
    assert "--draft-layers 100" in line and "30 layers" in line
