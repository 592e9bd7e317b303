"""Proposers (one file per method) and the resolution of ``assistant=`` objects to a proposer."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from .base import Proposer, ProposerSetup, RowState
from .ngram import NgramAssistant as NgramAssistant

# (module, function) pairs tried in order; each function maps an assistant object to a Proposer or returns None.
# Listed by path so that importing hf_specdec does not import every head type.
_RESOLVERS: list[tuple[str, str] | Callable] = [
    ("hf_specdec.generation.proposers.draft_model", "draft_model_proposer_for"),
    ("hf_specdec.generation.proposers.medusa", "medusa_proposer_for"),
    ("hf_specdec.generation.proposers.mlp_speculator", "mlp_speculator_proposer_for"),
    ("hf_specdec.generation.proposers.eagle", "eagle_proposer_for"),
]


def register_assistant_resolver(fn: Callable) -> Callable:
    """Teach ``assistant=`` a new object type: ``fn(obj, target) -> Proposer | None``."""
    _RESOLVERS.append(fn)
    return fn


def resolve_assistant(obj, target) -> Proposer:
    """The `Proposer` that serves ``assistant=obj`` for ``target``."""
    if isinstance(obj, Proposer):
        return obj
    if isinstance(obj, type):
        raise TypeError(f"assistant= got the class {obj.__name__}; pass an instance, e.g. {obj.__name__}()")
    for entry in _RESOLVERS:
        if isinstance(entry, tuple):
            try:
                fn = getattr(importlib.import_module(entry[0]), entry[1])
            except (ImportError, AttributeError):
                continue
        else:
            fn = entry
        proposer = fn(obj, target)
        if proposer is not None:
            return proposer
    raise TypeError(
        f"assistant= does not know how to draft with a {type(obj).__name__}. Pass a draft model (a "
        "PreTrainedModel sharing the target's vocabulary), hf_specdec.NgramAssistant(), MedusaHeads, or any "
        "hf_specdec Proposer."
    )


__all__ = ["Proposer", "ProposerSetup", "RowState", "resolve_assistant", "register_assistant_resolver"]
