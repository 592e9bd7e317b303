"""One command-line shape for every head trainer: ``hf-specdec train <kind>``.

Each kind (medusa, mlp-speculator, eagle, dflash) describes its command once, next to its trainer, as a
`TrainerCommand`: its name and help, a function adding its own options, an optional check of their values and its
main. `add_trainer_arguments` (the one builder) declares the options every trainer shares (`SHARED_OPTIONS`: same
names, types, defaults and help for every kind), then the kind's own; ``hf_specdec.cli`` builds ``hf-specdec train``
by looping over `hf_specdec.training.trainer_commands()` and checks the shared values (folders, model, device) before
the kind's check and main run.

    MEDUSA_COMMAND = TrainerCommand("medusa", "Medusa-1 heads by self-distillation", add_arguments, main)
    add_trainer_arguments(train_subparsers.add_parser(MEDUSA_COMMAND.name), MEDUSA_COMMAND)

The argument types below (`positive_int`, `non_negative_int`, `int_at_least`, `any_int`, `positive_float`) and
`UsageError` are the package's command-line vocabulary; they live here, in the lowest layer that has a command line,
so that the trainers' options can use them, and ``hf_specdec.cli_args`` re-exports them for the other subcommands.
Every number of every subcommand has one of them as its argparse type (never a bare ``int`` or ``float``: ``float``
takes ``nan`` and ``inf``), so that a value that cannot work is refused while the arguments are parsed, before any
data are built or a model is loaded (``tests/unit/test_cli_errors.py`` walks every subcommand's options).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

from .chat_template import PLAIN_RENDERING, check_chat_template, first_line, has_chat_template, read_chat_template

SOURCES = ("sharegpt",)  # the named ``--data`` sources (`data_arguments` builds them)


class UsageError(ValueError):
    """A command-line value that cannot work; ``hf_specdec.cli.main`` prints it as one ``hf-specdec: error:`` line
    (exit code 2)."""


def int_at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: an int >= ``minimum``."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # argparse's "invalid <name> value: 'abc'"
    return parse


positive_int = int_at_least(1)


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0 (seeds, counts where 0 means none or the default)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def any_int(text: str) -> int:
    """argparse type: any int, negative too (an index counted from the end)."""
    return int(text)


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0 (``nan`` and ``inf`` parse as floats, and are refused)."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number greater than 0, got {text}")
    return value


# how argparse names each type in its "invalid <name> value: 'abc'" message
positive_int.__name__ = "positive integer"
non_negative_int.__name__ = "non-negative integer"
any_int.__name__ = "integer"
positive_float.__name__ = "positive number"


def _no_check(args: argparse.Namespace) -> None:
    """A kind without values of its own to check before loading."""


@dataclass(frozen=True)
class TrainerCommand:
    """``hf-specdec train NAME``: one head kind's command.

    Args:
        name: the subcommand (``medusa``, ``mlp-speculator`` ...).
        help: one line for ``hf-specdec train --help`` (capitalised, it is also the command's description).
        add_arguments: adds the kind's own options (the shared ones are `add_trainer_arguments`').
        main: runs the command on the parsed options; returns the exit code.
        check: refuses values of the kind's own options that cannot work, raising `UsageError`, before any model
            is loaded (it may also resolve a value, e.g. a name into a folder).
        precisions: the values the shared ``--mixed-precision`` takes for this kind (the plain-torch trainers:
            ``no`` and ``bf16``, `run.step_precision`; Medusa trains through accelerate, which also has ``fp16``).
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    main: Callable[[argparse.Namespace], int]
    check: Callable[[argparse.Namespace], None] = _no_check
    precisions: tuple[str, ...] = ("no", "bf16")

    @property
    def description(self) -> str:
        """``help`` as the command's ``--help`` description: capitalised, with a full stop."""
        return self.help[0].upper() + self.help[1:] + "."


# ``--chat-template``: the trainers' (shared) and the bench's
CHAT_TEMPLATE_OPTION = dict(
    default=None,
    metavar="FILE_OR_STRING",
    help="a Jinja chat template (a file, or the template itself) set on the model's tokenizer; default: the "
    "tokenizer's own, or where it has none plain 'User: ...' / 'Assistant: ...' turns (docs/own_model.md)",
)

# the options every trainer shares: flags -> add_argument keywords (the same for every kind)
SHARED_OPTIONS: dict[tuple[str, ...], dict] = {
    ("--out",): dict(required=True, help="output folder: the trained head, training_report.json, data/, checkpoints/"),
    ("--model",): dict(
        default=None,
        help="the target: a local model folder or Hub id (default: the default model, SmolLM2-135M-Instruct)",
    ),
    ("--device",): dict(
        default=None,
        help="where the head trains and (but for mlp-speculator) the target answers (a torch device: cpu, cuda ...; "
        "default cpu, but medusa: the GPU when there is one)",
    ),
    ("--data",): dict(
        nargs="+",
        default=None,
        help="existing data folder(s) to train on as they are (no build); eagle and dflash also take "
        f"{' or '.join(SOURCES)}: real conversations built into OUT/data/ first",
    ),
    ("--data-dir",): dict(default=None, help="where the default data are built, or reused (default OUT/data)"),
    ("--epochs",): dict(type=positive_float, default=3.0, help="passes over the training data (default 3)"),
    ("--max-steps",): dict(type=positive_int, default=None, help="cap on optimizer steps"),
    ("--data-tokens",): dict(
        type=positive_int,
        default=None,
        help="train on the data's first N tokens only (whole sequences, in build order): one point of a "
        "data-scaling curve, the data a shorter build would have given",
    ),
    ("--mixed-precision",): dict(
        default="no",
        help="bf16: each training step under bfloat16 autocast (about half the step time on a CPU with AMX or "
        "AVX512-BF16; weights and held-out scores stay float32); fp16: medusa only (accelerate's)",
    ),
    ("--resume",): dict(action="store_true", help="continue from the latest checkpoint in OUT"),
    ("--threads",): dict(type=positive_int, default=None, help="torch CPU threads (default: torch's choice)"),
    ("--chat-template",): CHAT_TEMPLATE_OPTION,
}


def add_trainer_arguments(parser: argparse.ArgumentParser, command: TrainerCommand) -> None:
    """The one builder of a ``hf-specdec train`` command: the options every trainer shares (`SHARED_OPTIONS`), then
    ``command``'s own (``command.add_arguments``)."""
    for flags, kwargs in SHARED_OPTIONS.items():
        if flags == ("--mixed-precision",):
            kwargs = {**kwargs, "choices": command.precisions}
        parser.add_argument(*flags, **kwargs)
    command.add_arguments(parser)


def load_model_option(name: str | None, device: str | None = None, chat_template: str | None = None, **load_kwargs):
    """``(model, tokenizer, name)`` of ``--model NAME`` (`models.load_causal_lm` with ``load_kwargs``: fp32 unless
    ``dtype=``, eval mode, on ``device`` when given), or of the default model when None; ``--chat-template``
    (`read_chat_template`) set on the tokenizer when given.

    Raises:
        UsageError: transformers cannot load ``name`` (not a model folder, an unknown Hub id, offline); the first line
            of its message names why.
    """
    from ..models import load_causal_lm

    try:
        model, tokenizer, name = load_causal_lm(name, device, **load_kwargs)
    except OSError as err:  # transformers' "not a local folder nor a Hub repo" / offline messages
        raise UsageError(f"--model {name}: {first_line(err)}") from err
    if chat_template:
        tokenizer.chat_template = read_chat_template(chat_template)
    return model, tokenizer, name


def load_tokenizer_option(name: str | None):
    """The tokenizer of ``--model NAME`` (seconds: no weights), or of the default model once it is converted (None
    before: it has a chat template). Raises `UsageError` where transformers cannot load it."""
    from transformers import AutoTokenizer

    from ..models import default_model_dir

    folder = default_model_dir(convert=False) if name is None else name
    if name is None and not (folder / "tokenizer_config.json").is_file():
        return None
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise UsageError(f"--model {name}: {first_line(err)}") from err


def check_chat_template_option(args: argparse.Namespace) -> None:
    """Before any weights load: ``--chat-template`` must render a conversation with the tokenizer's special tokens
    (`check_chat_template`); without it, a tokenizer with no chat template is announced on stderr (its conversations
    go as plain text); ``--data sharegpt`` (assistant turns found by character offsets) needs a fast tokenizer.
    Raises `UsageError` naming the option."""
    value, data = getattr(args, "chat_template", None), getattr(args, "data", None) or ()
    tokenizer = load_tokenizer_option(args.model) if value or args.model else None
    if value:
        _check_template_value(value, tokenizer)
    elif tokenizer is not None and not has_chat_template(tokenizer):
        print(f"[--model {args.model}: no chat template, conversations rendered as {PLAIN_RENDERING}; "
              "--chat-template names one]", file=sys.stderr)  # fmt: skip
    if tokenizer is not None and set(data) & set(SOURCES) and not tokenizer.is_fast:
        raise UsageError(f"--data {' '.join(data)}: the tokenizer of --model {args.model} is not a fast one (no "
                         "character offsets to find the assistant's turns by); pass --data FOLDER instead")  # fmt: skip


def _check_template_value(value: str, tokenizer) -> None:
    """``--chat-template VALUE`` read (`read_chat_template`) and, given ``tokenizer``, rendered once."""
    try:
        template = read_chat_template(value)
        if tokenizer is not None:
            check_chat_template(tokenizer, template)
    except (OSError, ValueError) as err:
        shown = value if len(value) <= 60 and "\n" not in value else value.splitlines()[0][:57] + "..."
        raise UsageError(f"--chat-template {shown}: {err}") from err


def load_target(args: argparse.Namespace, device: str | None = None):
    """A trainer's target: ``--model`` (`load_model_option`) in fp32, on ``device`` when given (a kind passes
    ``args.device`` or keeps the target where it loads)."""
    return load_model_option(args.model, device, getattr(args, "chat_template", None))


__all__ = [
    "CHAT_TEMPLATE_OPTION",
    "SHARED_OPTIONS",
    "SOURCES",
    "TrainerCommand",
    "UsageError",
    "add_trainer_arguments",
    "any_int",
    "check_chat_template_option",
    "int_at_least",
    "load_model_option",
    "load_target",
    "load_tokenizer_option",
    "non_negative_int",
    "positive_float",
    "positive_int",
]
