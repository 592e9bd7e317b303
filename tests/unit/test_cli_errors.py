"""Bad command-line values are one argparse-style error line and exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from hf_specdec.cli import build_parser, main
from hf_specdec.models import SHIPPED_HEAD_DIRS

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
    (["bench", "--head-dir", "eagle"], ["--head-dir", "'eagle'", "KIND=FOLDER"]),
    (["bench", "--head-dir", "eagle=/nonexistent"], ["--head-dir", "/nonexistent", "no saved head"]),
    (["bench", "--head-dir", f"medusa={SHIPPED_HEAD_DIRS['eagle']}"], ["--head-dir", "'eagle' head, not a 'medusa'"]),
    (["bench", "--head-dir", "beam=/tmp"], ["--head-dir", "unknown head kind 'beam'", "eagle"]),
    (["bench", "--candidate-head", "eagle"], ["--candidate-head", "'eagle'", "KIND=FOLDER"]),
    (["bench", "--candidate-head", "dflash=/nonexistent"], ["--candidate-head", "/nonexistent", "no saved head"]),
    (
        ["bench", "--methods", "ngram,medusa", "--candidate-head", f"eagle={SHIPPED_HEAD_DIRS['eagle']}"],
        ["--candidate-head", "no method chosen drafts with a eagle head", "--methods"],
    ),
    (["train", "medusa", "--out", "x", "--threads", "0"], ["--threads", "at least 1"]),
    (["train", "medusa", "--out", "x", "--epochs", "0"], ["--epochs", "greater than 0"]),
    (["train", "medusa", "--out", "x", "--num-heads", "-1"], ["--num-heads", "at least 1", "-1"]),
    (["train", "medusa", "--out", "x", "--loss-vocab", "-5"], ["--loss-vocab", "0 or more", "-5"]),
    (["train", "medusa", "--out", "x", "--lr", "0"], ["--lr", "greater than 0"]),
    (["train", "eagle", "--out", "x", "--init-head", "no/such/head"], ["--init-head", "no/such/head", "EagleHead"]),
    (["train", "eagle", "--out", "x", "--online"], ["--online", "--data sharegpt"]),
    (
        ["train", "eagle", "--out", "x", "--init-layer", "-1", "--version", "3"],
        ["--init-layer", "EAGLE-1", "--version 3"],
    ),
    (["train", "eagle", "--out", "x", "--init-layer", "-1", "--init-head", "shipped"], ["--init-layer", "--init-head"]),
    (["train", "eagle", "--out", "x", "--online", "--data", "sharegpt", "--data-mode", "self"], ["--online", "fixed"]),
    (["train", "dflash", "--out", "x", "--online", "--data", "sharegpt", "--data-only"], ["--online", "--data-only"]),
    (["train", "dflash", "--out", "x", "--init-head", "no/such"], ["--init-head", "no/such", "DFlashHead"]),
    (["train", "dflash", "--out", "x", "--init-layer", "-1", "--init-head", "shipped"], ["--init-layer", "--init-head"]),
    # an --out that cannot be made or written (a file in the way, a path under a file, /proc) fails before loading
    (["train", "medusa", "--out", "/dev/null"], ["--out", "/dev/null", "a file is there"]),
    (["train", "medusa", "--out", "/dev/null/heads"], ["--out", "/dev/null/heads", "cannot create", "write to"]),
    (["train", "medusa", "--out", "/proc/hf-specdec-heads"], ["--out", "/proc/hf-specdec-heads", "cannot create"]),
    (["train", "medusa", "--out", "ok", "--data-dir", "/dev/null/d"], ["--data-dir", "/dev/null/d", "cannot create"]),
    (["train", "mlp-speculator", "--out", "/dev/null/s"], ["--out", "/dev/null/s", "cannot create"]),
    (["train", "eagle", "--out", "/dev/null/e"], ["--out", "/dev/null/e", "cannot create"]),
    (["train", "dflash", "--out", "/dev/null/f"], ["--out", "/dev/null/f", "cannot create"]),
    (["export", "medusa", "--format", "medusa", "--out", "/dev/null/m"], ["--out", "/dev/null/m", "cannot create"]),
    (["export", "eagle", "--format", "eagle", "--out", "/proc/hf-specdec-x"], ["--out", "/proc/hf-specdec-x"]),
    # every number is checked by its argparse type, before any data are built: finite, positive where it must be
    (["train", "eagle", "--out", "x", "--lr", "nan"], ["--lr", "finite number greater than 0", "nan"]),
    (["train", "eagle", "--out", "x", "--lr", "inf"], ["--lr", "finite number greater than 0", "inf"]),
    (["train", "eagle", "--out", "x", "--num-seed", "0"], ["--num-seed", "at least 1", "0"]),
    (["train", "eagle", "--out", "x", "--window", "-4"], ["--window", "at least 1", "-4"]),
    (["train", "eagle", "--out", "x", "--draft-vocab", "-1"], ["--draft-vocab", "0 or more", "-1"]),
    (["train", "eagle", "--out", "x", "--seed", "-1"], ["--seed", "0 or more", "-1"]),
    (["train", "eagle", "--out", "x", "--unroll", "0"], ["--unroll", "at least 1"]),
    (["train", "eagle", "--out", "x", "--conversations", "0"], ["--conversations", "at least 1"]),
    (["train", "eagle", "--out", "x", "--epochs", "nan"], ["--epochs", "finite", "nan"]),
    (["train", "dflash", "--out", "x", "--decay=-inf"], ["--decay", "finite number greater than 0", "-inf"]),
    (["train", "dflash", "--out", "x", "--block-size", "1"], ["--block-size", "at least 2", "1"]),
    (["train", "dflash", "--out", "x", "--init-layer", "x"], ["--init-layer", "invalid integer value", "'x'"]),
    (["train", "mlp-speculator", "--out", "x", "--lr", "-0.1"], ["--lr", "greater than 0", "-0.1"]),
    (["train", "mlp-speculator", "--out", "x", "--n-predict", "0"], ["--n-predict", "at least 1"]),
    (["train", "mlp-speculator", "--out", "x", "--eval-every", "-1"], ["--eval-every", "0 or more"]),
    (["train", "medusa", "--out", "x", "--prompt-seed", "-2"], ["--prompt-seed", "0 or more", "-2"]),
    (["bench", "--do-sample", "--temperature", "inf"], ["--temperature", "finite", "inf"]),
    (["bench", "--seed", "-1"], ["--seed", "0 or more", "-1"]),
    (["generate", "hello", "--seed", "-3"], ["--seed", "0 or more", "-3"]),
    (["eval-heads", "--per-category", "0"], ["--per-category", "at least 1"]),
    (
        ["export", "eagle", "--format", "eagle", "--out", "x", "--verifier", "SmolLM2-135M-Instruct"],
        ["--verifier", "SmolLM2-135M-Instruct", "Hub id", "folder"],
    ),
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


def _numeric_options(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """``(subcommand, option, type)`` of every option of every subcommand that has an argparse type."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _numeric_options(sub, (*path, name))
        elif action.type is not None:
            yield " ".join(path), "/".join(action.option_strings) or action.dest, action.type


def test_every_number_of_every_subcommand_has_a_checking_type():
    """No option of any subcommand takes a bare ``int`` (no range) or ``float`` (``nan`` and ``inf`` parse): each
    has one of the command line's types, so a value that cannot work fails while the arguments are parsed."""
    options = list(_numeric_options(build_parser()))
    assert any(command == "train eagle" and option == "--lr" for command, option, _ in options)
    bare = [f"{command} {option}" for command, option, kind in options if kind in (int, float)]
    assert not bare, f"options without a checking type: {bare}"


def test_a_hub_model_while_offline_fails_before_loading(capsys, monkeypatch, tmp_path):
    """``--model ORG/NAME`` with the Hub switched off and no copy cached: one line naming the local-folder way, at
    once (no model load, no retries)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: 1 / 0)
    for argv in (["generate", "hi"], ["bench"], ["train", "medusa", "--out", str(tmp_path / "o")]):
        line = _error_line(capsys, [*argv, "--model", "someone/some-model"])
        assert "--model someone/some-model" in line and "HF_HUB_OFFLINE" in line and "local folder" in line, line


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
        "hf-specdec: error: --model /nonexistent: no such folder or .gguf file (pass a local model folder, a .gguf "
        "file or a Hub id like org/name)"
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


# ----------------------------------------------------------------------------------------------- Ctrl-C in train
@pytest.fixture(scope="module")
def tiny_training_setup(tmp_path_factory):
    """A tiny model folder (with a tokenizer) and self-distillation data it answered, for `train medusa`."""
    from hf_specdec.testing import tiny_causal_lm, tiny_chat_tokenizer, torch_threads, toy_encode
    from hf_specdec.training import build_distillation_data, make_prompts, prompt_recipe

    root = tmp_path_factory.mktemp("tiny_train")
    model = tiny_causal_lm("llama", hidden_size=32)
    model.save_pretrained(root / "model")
    tiny_chat_tokenizer(["hello"]).save_pretrained(root / "model")
    prompts = make_prompts(24, seed=0)
    with torch_threads(1):
        build_distillation_data(
            model, [toy_encode(p) for p in prompts], root / "data", recipe=prompt_recipe(24, 0), max_new_tokens=16,
            batch_size=8, shard_size=8, base_model_name="tiny-llama", progress=False,
        )  # fmt: skip
    return root


def _train(root, out, *extra) -> list[str]:
    return ["train", "medusa", "--out", str(out), "--model", str(root / "model"), "--data", str(root / "data"),
            "--num-heads", "2", "--positions-per-step", "16", "--max-steps", "6", "--no-tune-tree", "--threads", "1",
            *extra]  # fmt: skip


@pytest.fixture
def ctrl_c_at_step():
    """Ctrl-C (KeyboardInterrupt) raised by a real optimizer hook when the n-th optimizer step of the run ends."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handles = []

    def arm(n: int) -> None:
        steps = [0]

        def hook(optimizer, args, kwargs):
            steps[0] += 1
            if steps[0] == n:
                raise KeyboardInterrupt

        handles.append(register_optimizer_step_post_hook(hook))

    yield arm
    for h in handles:
        h.remove()


def test_ctrl_c_in_train_keeps_the_checkpoints_and_says_how_to_resume(capsys, tmp_path, tiny_training_setup,
                                                                      ctrl_c_at_step):  # fmt: skip
    out = tmp_path / "run"
    ctrl_c_at_step(3)  # steps 1 and 2 were checkpointed
    with pytest.raises(SystemExit) as info:
        main(_train(tiny_training_setup, out, "--checkpoint-every", "1"))
    assert info.value.code == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("hf-specdec:")]
    assert len(lines) == 1, err
    assert f"kept {out}" in lines[0] and "step-0000002.pt (step 2)" in lines[0] and "--resume" in lines[0], lines[0]
    # the line's advice works: the same command with --resume finishes the run
    assert main(_train(tiny_training_setup, out, "--checkpoint-every", "1", "--resume")) == 0
    report = json.loads((out / "training_report.json").read_text())
    assert report["steps"] == 6


def test_ctrl_c_before_anything_was_written_removes_the_folder_the_run_made(capsys, tmp_path, tiny_training_setup,
                                                                             ctrl_c_at_step):  # fmt: skip
    out = tmp_path / "new" / "run"  # neither folder exists yet
    ctrl_c_at_step(1)
    with pytest.raises(SystemExit) as info:
        main(_train(tiny_training_setup, out, "--checkpoint-every", "0"))
    assert info.value.code == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("hf-specdec:")]
    assert len(lines) == 1 and "removed the empty folder" in lines[0], err
    assert not (tmp_path / "new").exists()
    assert tmp_path.exists()  # what existed before the run stays
