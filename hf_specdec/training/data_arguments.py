"""The ``--data`` argument the ``hf-specdec train`` commands share: data folders, or a named source built first.

    hf-specdec train eagle --model ORG/NAME --data sharegpt               # ShareGPT, teacher-forced (the default)
    hf-specdec train eagle --data sharegpt --data-mode self --conversations 3000 --max-new-tokens 256
    hf-specdec train medusa --data OUT/data/fixed other/folder            # folders built before, as they are

A named source is built (resumably) into ``OUT/data/<source>/`` with the target being trained for, so the same
command continues an interrupted build and then trains.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .conversation_data import MODES, build_conversation_data
from .trainer_cli import SOURCES, non_negative_int, positive_int


def add_data_source_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a named ``--data`` source (the ``--data`` option itself is the command's own)."""
    group = parser.add_argument_group(f"--data {'|'.join(SOURCES)}: training data built from real conversations")
    group.add_argument(
        "--data-mode",
        choices=MODES,
        default="fixed",
        help="fixed: the conversations teacher-forced through the model (fast: prefill only), labels from the model; "
        "self: the model answers the conversations' user turns (slow: generation); default fixed",
    )
    group.add_argument("--conversations", type=positive_int, default=4000, help="conversations taken (default 4000)")
    group.add_argument(
        "--conversation-tokens",
        type=positive_int,
        default=1024,
        help="tokens kept per conversation / prompt (default 1024)",
    )
    group.add_argument(
        "--data-seed", type=non_negative_int, default=0, help="order the conversations are taken in (default 0)"
    )
    group.add_argument(
        "--turns", type=positive_int, choices=(1, 2), default=1, help="self: user turns answered (default 1)"
    )


def resolve_data(
    values: list[str] | None, args: argparse.Namespace, model, tokenizer, out: Path, aux_layers=()
) -> list[Path] | None:
    """The data folders ``--data`` names: a named source (built now, into ``out/data/<source>``) or folders; None
    when ``--data`` was not given (the command builds its own default data)."""
    if not values:
        return None
    folders: list[Path] = []
    for value in values:
        if value in SOURCES:
            folders += build_conversation_data(
                model,
                tokenizer,
                out / "data" / value,
                mode=args.data_mode,
                num_conversations=args.conversations,
                seed=args.data_seed,
                max_tokens=args.conversation_tokens,
                max_new_tokens=getattr(args, "max_new_tokens", None) or 256,
                turns=args.turns,
                aux_layers=aux_layers,
            )
        elif Path(value).is_dir():
            folders.append(Path(value))
        else:
            raise ValueError(f"--data {value}: neither a data folder nor a source ({', '.join(SOURCES)})")
    return folders


__all__ = ["SOURCES", "add_data_source_arguments", "resolve_data"]
