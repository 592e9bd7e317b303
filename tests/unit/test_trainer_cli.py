"""Every ``hf-specdec train <kind>`` has one shape (`hf_specdec.training.trainer_cli`): the options every trainer
shares read the same on every kind (flags, dest, default, type, help), the kind adds only its own, and ``hf-specdec
train`` lists exactly the registered commands. A fifth kind whose descriptor names a trainer is held to the same."""

from __future__ import annotations

import argparse
import json

import pytest

from hf_specdec.cli import build_parser, main
from hf_specdec.training import trainer_commands
from hf_specdec.training.trainer_cli import SHARED_OPTIONS, TrainerCommand, UsageError, add_trainer_arguments

SHARED_FLAGS = [flags[0] for flags in SHARED_OPTIONS]


def _train_parsers() -> dict[str, argparse.ArgumentParser]:
    """``hf-specdec train``'s subcommand parsers, by name."""
    top = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    train = top.choices["train"]
    return next(a for a in train._actions if isinstance(a, argparse._SubParsersAction)).choices


def _option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


def _shape(action: argparse.Action) -> tuple:
    return (tuple(action.option_strings), action.dest, action.default, action.type, action.nargs, action.required,
            type(action).__name__, action.help)  # fmt: skip


def test_train_lists_the_registered_commands_with_their_help():
    parsers = _train_parsers()
    assert list(parsers) == [c.name for c in trainer_commands()] == ["eagle", "medusa", "mlp-speculator", "dflash"]
    for command in trainer_commands():
        assert isinstance(command, TrainerCommand)
        assert parsers[command.name].description == command.description
        assert parsers[command.name].get_default("trainer") is command


@pytest.mark.parametrize("flag", SHARED_FLAGS)
def test_every_trainer_declares_the_shared_option_the_same_way(flag):
    shapes = {name: _shape(_option(parser, flag)) for name, parser in _train_parsers().items()}
    first = next(iter(shapes.values()))
    assert all(shape == first for shape in shapes.values()), shapes


def test_no_kind_redeclares_a_shared_option():
    """A kind's ``add_arguments`` adds only its own options (argparse refuses a flag declared twice; this also catches
    one spelled as an alias of a shared option)."""
    shared = {flag for flags in SHARED_OPTIONS for flag in flags}
    for command in trainer_commands():
        own = argparse.ArgumentParser()
        command.add_arguments(own)
        assert not shared & {s for a in own._actions for s in a.option_strings}, command.name


def test_the_trainers_that_tune_a_tree_skip_it_with_one_flag():
    """``--no-tune-tree`` on every kind that tunes its tree; eagle's older ``--no-tune`` still works, hidden."""
    parsers = _train_parsers()
    for name in ("medusa", "mlp-speculator", "eagle"):
        assert parsers[name].parse_args(["--out", "x", "--no-tune-tree"]).no_tune_tree, name
    assert parsers["eagle"].parse_args(["--out", "x", "--no-tune"]).no_tune_tree
    assert "--no-tune " not in parsers["eagle"].format_help()


def test_mixed_precision_is_every_trainers_and_fp16_only_medusas(capsys):
    """``--mixed-precision bf16`` (autocast steps) on every kind; ``fp16`` only where accelerate trains (Medusa): the
    plain-torch trainers refuse it when the command line is parsed, naming the values they take."""
    parsers = _train_parsers()
    for name, parser in parsers.items():
        assert parser.parse_args(["--out", "x"]).mixed_precision == "no", name
        assert parser.parse_args(["--out", "x", "--mixed-precision", "bf16"]).mixed_precision == "bf16", name
    assert parsers["medusa"].parse_args(["--out", "x", "--mixed-precision", "fp16"]).mixed_precision == "fp16"
    for name in ("mlp-speculator", "eagle", "dflash"):
        with pytest.raises(SystemExit):
            parsers[name].parse_args(["--out", "x", "--mixed-precision", "fp16"])
        assert "invalid choice: 'fp16' (choose from no, bf16)" in capsys.readouterr().err.replace("'no', 'bf16'", "no, bf16")


def test_a_new_kind_gets_the_shared_options_and_its_own():
    def add_arguments(parser):
        parser.add_argument("--width", type=int, default=2)

    def check(args):
        if args.width > 8:
            raise UsageError(f"--width {args.width}: at most 8")

    command = TrainerCommand("toy", "a toy head", add_arguments, lambda args: 0, check)
    parser = argparse.ArgumentParser()
    add_trainer_arguments(parser, command)
    args = parser.parse_args(["--out", "x", "--width", "9", "--max-steps", "3"])
    assert (args.out, args.width, args.max_steps, args.epochs, args.model, args.data) == ("x", 9, 3, 3.0, None, None)
    with pytest.raises(UsageError, match="--width 9"):
        command.check(args)
    assert command.description == "A toy head."


@pytest.fixture(scope="module")
def tiny_model_and_data(tmp_path_factory):
    """A tiny model folder (with a tokenizer) and self-distillation data it answered."""
    from hf_specdec.testing import tiny_causal_lm, tiny_chat_tokenizer, torch_threads, toy_encode
    from hf_specdec.training import build_distillation_data, make_prompts, prompt_recipe

    root = tmp_path_factory.mktemp("tiny_trainer_cli")
    model = tiny_causal_lm("llama", hidden_size=32)
    model.save_pretrained(root / "model")
    tiny_chat_tokenizer(["hello"]).save_pretrained(root / "model")
    with torch_threads(1):
        build_distillation_data(
            model, [toy_encode(p) for p in make_prompts(16, seed=0)], root / "data", recipe=prompt_recipe(16, 0),
            max_new_tokens=12, batch_size=8, shard_size=8, base_model_name="tiny-llama", progress=False,
        )  # fmt: skip
    return root


def test_the_mlp_speculator_trains_for_the_model_named_by_the_shared_model_option(tiny_model_and_data, tmp_path):
    """``--model`` is every trainer's: ``train mlp-speculator --model FOLDER`` trains a speculator for that model
    and names it in what it saves."""
    root, out = tiny_model_and_data, tmp_path / "spec"
    argv = ["train", "mlp-speculator", "--out", str(out), "--model", str(root / "model"), "--data", str(root / "data"),
            "--inner-dim", "16", "--positions-per-step", "16", "--max-steps", "2", "--no-tune-tree", "--threads", "1",
            "--mixed-precision", "bf16"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((out / "training_report.json").read_text())
    assert report["steps"] == 2 and report["config"]["mixed_precision"] == "bf16"
    assert json.loads((out / "config.json").read_text())["base_model_name_or_path"] == str(root / "model")
