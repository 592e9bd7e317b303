"""Bad command-line values are one argparse-style error line and exit code 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hf_specdec.cli import main

# one row per case: the command line, and the words its one error line must contain (the option, the value, what is
# expected). Every case is refused before any model is loaded.
CASES = [
    (["generate", "hello", "--max-new-tokens", "0"], ["--max-new-tokens", "at least 1", "0"]),
    (["generate", "hello", "--max-new-tokens", "abc"], ["--max-new-tokens", "abc"]),
    (["generate", "hello", "--draft-layers", "0"], ["--draft-layers", "at least 1"]),
    (["generate", "hello", "--do-sample", "--temperature", "0"], ["--temperature", "greater than 0"]),
    (["generate", "hello", "--do-sample", "--top-p", "1.5"], ["--top-p", "1.5"]),
    (["generate", "hello", "--temperature", "0.7"], ["--do-sample"]),
    (["generate", "hello", "--threads", "0"], ["--threads", "at least 1"]),
    (["generate", "hello", "--model", "/nonexistent"], ["--model", "/nonexistent", "no such folder"]),
    (["generate", "hello", "--model", "./not/here"], ["--model", "./not/here", "no such folder"]),
    (["generate", "hello", "--assistant", "nope"], ["--assistant", "nope"]),
    (["bench", "--threads", "0"], ["--threads", "at least 1", "0"]),
    (["bench", "--threads", "-2"], ["--threads", "at least 1", "-2"]),
    (["bench", "--model", "/nonexistent"], ["--model", "/nonexistent", "no such folder"]),
    (["bench", "--batch", "0"], ["--batch", "at least 1", "0"]),
    (["bench", "--batch-size", "0"], ["unrecognized arguments", "--batch-size"]),
    (["bench", "--per-category", "-1"], ["--per-category", "at least 1", "-1"]),
    (["bench", "--max-new-tokens", "0"], ["--max-new-tokens", "at least 1"]),
    (["bench", "--repeats", "0"], ["--repeats", "at least 1"]),
    (["bench", "--draft-layers", "0"], ["--draft-layers", "at least 1"]),
    (["bench", "--seed", "x"], ["--seed", "x"]),
    (["bench", "--methods", "vanilla,nope"], ["--methods", "nope", "choose from", "ngram"]),
    (["bench", "--categories", "nope"], ["--categories", "nope", "the question file has"]),
    (["bench", "--questions", "/nonexistent.jsonl"], ["--questions", "/nonexistent.jsonl", "does not exist"]),
    (["bench", "--no-greedy"], ["--no-greedy", "--do-sample"]),
    (["bench", "--out", "/dev/null"], ["--out", "/dev/null", "a file is there"]),
    (["train", "medusa", "--out", "x", "--threads", "0"], ["--threads", "at least 1"]),
    (["train", "medusa", "--out", "x", "--epochs", "0"], ["--epochs", "greater than 0"]),
    (["train", "medusa", "--out", "x", "--num-heads", "-1"], ["--num-heads", "at least 1", "-1"]),
    (["train", "medusa", "--out", "x", "--loss-vocab", "-5"], ["--loss-vocab", "0 or more", "-5"]),
    (["train", "medusa", "--out", "x", "--lr", "0"], ["--lr", "greater than 0"]),
    (["train", "eagle", "--out", "x", "--init-head", "no/such/head"], ["--init-head", "no/such/head", "EagleHead"]),
    (["demo", "--threads", "0"], ["--threads", "at least 1", "0"]),
    (["demo", "--port", "70000"], ["--port", "between 1 and 65535", "70000"]),
    (["demo", "--concurrency", "0"], ["--concurrency", "at least 1", "0"]),
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


@pytest.mark.parametrize("argv, words", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_values_are_refused_in_one_line_before_loading_a_model(capsys, monkeypatch, argv, words):
    def no_loading(*args, **kwargs):
        raise AssertionError(f"{argv}: a model was loaded before the arguments were checked")

    monkeypatch.setattr("hf_specdec.models.load_default_model", no_loading)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_loading)
    line = _error_line(capsys, argv)
    missing = [w for w in words if w not in line]
    assert not missing, f"{missing} not in {line!r}"


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"question_id": 1, "category": "qa"}\n', [":1:", "question_id, category and a non-empty turns"]),
        ("not json\n", ["--questions", "Expecting value"]),
    ],
)
def test_a_damaged_question_file_names_itself(capsys, tmp_path, text, words):
    path = tmp_path / "questions.jsonl"
    path.write_text(text)
    line = _error_line(capsys, ["bench", "--questions", str(path)])
    assert f"--questions {path}" in line and not [w for w in words if w not in line], line


@pytest.mark.parametrize("command", [["generate", "hi"], ["bench"]])
def test_the_installed_command_prints_no_traceback(command):
    proc = subprocess.run(
        [sys.executable, "-m", "hf_specdec.cli", *command, "--model", "/nonexistent"],
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


KERNEL_BENCH_CASES = [
    (["--batches", "8", "0"], ["--batches", "at least 1", "0"]),
    (["--iters", "0"], ["--iters", "at least 1"]),
    (["--warmup", "-1"], ["--warmup", "0 or more", "-1"]),
    (["--peak-bw", "-1"], ["--peak-bw", "greater than 0", "-1"]),
    (["--shapes", "gpt5"], ["--shapes", "gpt5"]),
]


@pytest.mark.parametrize("argv, words", KERNEL_BENCH_CASES, ids=[" ".join(c[0]) for c in KERNEL_BENCH_CASES])
def test_the_kernel_benchmark_refuses_bad_values_in_one_line(capsys, argv, words):
    from hf_specdec.bench.kernels import main as kernel_bench_main

    with pytest.raises(SystemExit) as info:
        kernel_bench_main(argv)
    assert info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1 and not [w for w in words if w not in lines[0]], lines
