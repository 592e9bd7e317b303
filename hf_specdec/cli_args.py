"""Argument types and checks shared by the ``hf-specdec`` subcommands (generate, bench, train).

A value that cannot work is refused before any model is loaded, as one ``hf-specdec: error: ...`` line naming the
option, the value and what is expected (exit code 2, argparse's convention): argparse reports the types below itself,
and `UsageError` carries the checks argparse cannot make alone (combinations, folders) to ``hf_specdec.cli.main``.
"""

from __future__ import annotations

import argparse
from pathlib import Path


class UsageError(ValueError):
    """A command-line value that cannot work; ``hf_specdec.cli.main`` prints it as one ``hf-specdec: error:`` line
    (exit code 2)."""


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a float > 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


# how argparse names each type in its "invalid <name> value: 'abc'" message
positive_int.__name__ = "positive integer"
non_negative_int.__name__ = "non-negative integer"
positive_float.__name__ = "positive number"


def check_model_argument(name: str | None) -> None:
    """``--model``: a path that looks like a folder must exist (else transformers reports a Hub repo-id error)."""
    if name is None:
        return
    path = Path(name).expanduser()
    looks_local = path.is_absolute() or name.startswith((".", "~")) or name.count("/") > 1  # Hub ids: org/name
    if looks_local and not path.is_dir():
        raise UsageError(f"--model {name}: no such folder (pass a local model folder or a Hub id like org/name)")


def load_model_argument(name: str | None):
    """``(model, tokenizer, name)`` of ``--model`` (`models.load_causal_lm`: fp32, eval mode), or of the default
    model when None.

    Raises:
        UsageError: transformers cannot load ``name`` (not a model folder, an unknown Hub id, offline); the first line
            of its message names why.
    """
    from .models import load_causal_lm

    check_model_argument(name)
    try:
        return load_causal_lm(name)
    except OSError as err:  # transformers' "not a local folder nor a Hub repo" / offline messages
        raise UsageError(f"--model {name}: {str(err).splitlines()[0]}") from err


def check_draft_layers(draft_layers: int, model) -> None:
    """``--draft-layers``: a layer-skip draft keeps fewer decoder layers than ``model`` has."""
    layers = model.config.num_hidden_layers
    if draft_layers >= layers:
        raise UsageError(f"--draft-layers {draft_layers}: the model has {layers} layers; pass 1..{layers - 1}")
