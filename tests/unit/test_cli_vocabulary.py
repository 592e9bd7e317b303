"""One command-line vocabulary: the same flag for the same thing on every subcommand, spelled as transformers'
generate() arguments; the older spellings still work but are not shown; ``hf-specdec --version``."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

import hf_specdec
from hf_specdec.cli import build_parser

REQUIRED = {"train medusa": ["--out", "x"], "train mlp-speculator": ["--out", "x"], "train eagle": ["--out", "x"],
            "train dflash": ["--out", "x"], "export": ["--format", "eagle", "--out", "x"],
            "tune": ["--model", "x", "--out", "x"]}  # fmt: skip
POSITIONAL = {"generate": ["hello"], "export": ["eagle"]}

# which subcommands share which flag (every subcommand that runs a model takes --threads)
SHARED = {
    "--threads": ["generate", "bench", "eval-heads", "train medusa", "train mlp-speculator", "train eagle",
                  "train dflash", "demo", "tune"],
    "--device": ["generate", "bench", "train medusa", "train mlp-speculator", "train eagle", "train dflash", "demo",
                 "tune"],
    "--model": ["generate", "bench", "train medusa", "train mlp-speculator", "train eagle", "train dflash", "export",
                "demo", "tune"],
    "--dtype": ["generate", "bench", "demo"],
    "--quantization": ["generate", "bench"],
    "--max-new-tokens": ["generate", "bench", "eval-heads", "train medusa", "train mlp-speculator", "train eagle",
                         "train dflash", "tune"],
    "--do-sample": ["generate", "bench", "train medusa"],
    "--temperature": ["generate", "bench"],
    "--top-p": ["generate", "bench"],
    "--chat-template": ["bench", "train medusa", "train mlp-speculator", "train eagle", "train dflash", "tune"],
}
VALUES = {"--threads": "2", "--device": "cpu", "--model": "org/name", "--dtype": "bfloat16", "--quantization": "int8", "--max-new-tokens": "16", "--temperature": "0.5",
          "--top-p": "0.8", "--chat-template": "chat.jinja"}  # fmt: skip
# spellings that must not be the visible name of anything (the vocabulary's words are the ones above)
NOT_THE_VOCABULARY = {"--sample", "--num-threads", "--max-tokens", "--new-tokens", "--temp", "--topp", "--cuda",
                      "--model-name", "--model-dir"}  # fmt: skip
OLD_SPELLINGS = [("bench", "--sample"), ("train medusa", "--sample")]


def subcommands(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                full = f"{prefix}{name}"
                nested = subcommands(sub, full + " ")
                out.update(nested or {full: sub})
    return out


def parse(command: str, *extra: str) -> argparse.Namespace:
    argv = [*command.split(), *POSITIONAL.get(command, []), *REQUIRED.get(command, []), *extra]
    return build_parser().parse_args(argv)


def test_the_subcommands_are_the_ones_the_table_knows():
    names = set(subcommands(build_parser()))
    assert names == {"generate", "bench", "eval-heads", "convert", "build-kernels", "train medusa", "train mlp-speculator",
                     "train eagle", "train dflash", "export", "demo", "tune"}  # fmt: skip
    for commands in SHARED.values():
        assert set(commands) <= names


@pytest.mark.parametrize("flag", list(SHARED))
def test_every_subcommand_that_has_the_thing_takes_the_same_flag(flag):
    dest = flag.lstrip("-").replace("-", "_")
    for command in SHARED[flag]:
        if flag == "--do-sample":
            assert parse(command, flag).do_sample is True, command
        else:
            args = parse(command, flag, VALUES[flag])
            assert str(getattr(args, dest)) == VALUES[flag], (command, flag)


def test_no_subcommand_shows_another_spelling():
    for command, parser in subcommands(build_parser()).items():
        visible = {s for a in parser._actions if a.help != argparse.SUPPRESS for s in a.option_strings}
        assert not visible & NOT_THE_VOCABULARY, (command, visible & NOT_THE_VOCABULARY)
        help_text = parser.format_help()
        assert "--sample " not in help_text and "--sample\n" not in help_text, command


@pytest.mark.parametrize("command, old", OLD_SPELLINGS)
def test_old_spellings_still_work(command, old):
    assert parse(command, old).do_sample is True
    assert parse(command).do_sample is False


def test_the_bench_samples_at_the_given_temperature_and_top_p():
    from hf_specdec.bench.spec_bench import _checked_arguments

    args = parse("bench", "--do-sample", "--no-greedy", "--temperature", "0.5", "--top-p", "0.8")
    _methods, settings, _path, _questions = _checked_arguments(args)
    assert [s.kwargs for s in settings] == [{"do_sample": True, "temperature": 0.5, "top_p": 0.8}]


def test_version_and_the_eagle_trainers_help():
    out = subprocess.run([sys.executable, "-m", "hf_specdec.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"hf-specdec {hf_specdec.__version__}"
    eagle = subcommands(build_parser())["train eagle"].format_help()
    assert "EAGLE-3" in eagle
    assert parse("train eagle", "--version", "3").version == 3  # the subcommand's own --version: EAGLE's


@pytest.mark.parametrize("command", ["generate", "bench", "train medusa", "demo"])
def test_an_unknown_device_is_one_error_line_before_loading(command, capsys, monkeypatch):
    from hf_specdec.cli import main

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before --device was checked")

    monkeypatch.setattr("hf_specdec.models.load_default_model", no_loading)
    with pytest.raises(SystemExit) as info:
        main([*command.split(), *POSITIONAL.get(command, []), *REQUIRED.get(command, []), "--device", "nope"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error: --device nope: not a torch device" in err and "Traceback" not in err
