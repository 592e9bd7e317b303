"""Proposers (one file per method) and the resolution of ``assistant=`` objects to a proposer."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator

from ...kinds import HEAD_KINDS
from .base import Proposer, ProposerSetup, RowState
from .ngram import NgramAssistant as NgramAssistant

# (module, function) pairs tried after the head kinds' resolvers (`hf_specdec.kinds.HEAD_KINDS`), then the functions
# given to `register_assistant_resolver`; each `<method>_assistant_for(obj, target)` returns the ready assistant (a
# Proposer) when ``obj`` is that method's object (a draft model, ...), else None.
# Listed by path so that importing hf_specdec does not import every head type.
_RESOLVERS: list[tuple[str, str] | Callable] = [
    ("hf_specdec.generation.proposers.draft_model", "draft_model_assistant_for"),
]


def register_assistant_resolver(fn: Callable) -> Callable:
    """Teach ``assistant=`` a new object type: ``fn(obj, target) -> Proposer | None``."""
    _RESOLVERS.append(fn)
    return fn


# functions listing the names of ready-made assistants (``hf_specdec.assistants``, a layer above, registers its own
# through the package's __init__), for the error a string ``assistant=`` gets
_NAME_LISTS: list[Callable[[], list[str]]] = []


def register_assistant_names(fn: Callable[[], list[str]]) -> Callable[[], list[str]]:
    """``fn()`` lists names of ready-made assistants: an ``assistant=`` string names them in its error."""
    _NAME_LISTS.append(fn)
    return fn


def _not_an_assistant(obj) -> str:
    """The error of an ``assistant=`` nothing can draft with; a string lists the ready-made assistants' names."""
    usual = ("a draft model (a PreTrainedModel sharing the target's vocabulary), hf_specdec.NgramAssistant(), "
             "MedusaHeads, or any hf_specdec Proposer")  # fmt: skip
    if not isinstance(obj, str):
        return f"assistant= does not know how to draft with a {type(obj).__name__}. Pass {usual}."
    names = [name for fn in _NAME_LISTS for name in fn()]
    known = ", ".join(names) or "none registered"
    hint = f"hf_specdec.load_default_assistant({obj!r})" if obj in names else "hf_specdec.load_default_assistant(name)"
    return (f"assistant= does not know how to draft with a str ({obj!r}): a ready-made assistant is built by name "
            f"with {hint} (names: {known}); or pass {usual}.")  # fmt: skip


def _resolvers() -> Iterator[Callable]:
    """Every resolver, in the order they are tried: the head kinds', the built-in ones, the registered ones. A module
    that fails to import raises that ImportError (naming the kind), not "does not know how to draft with"."""
    for kind in HEAD_KINDS.values():
        yield kind.load("resolver")
    for entry in _RESOLVERS:
        yield getattr(importlib.import_module(entry[0]), entry[1]) if isinstance(entry, tuple) else entry


def as_proposer(obj, target) -> Proposer:
    """Turn whatever the user passed as ``assistant=`` into the `Proposer` that drafts for ``target``.

    Args:
        obj: a `Proposer` (returned as is), a draft `PreTrainedModel`, `MedusaHeads`, an `MLPSpeculator`, an
            `EagleHead`, a `DFlashHead`, or any object a `register_assistant_resolver` function knows.
        target: the model being generated from.
    Returns:
        The `Proposer`; a `TypeError` names the object when nothing can draft with it.
    """
    if isinstance(obj, Proposer):
        return obj
    if isinstance(obj, type):
        raise TypeError(f"assistant= got the class {obj.__name__}; pass an instance, e.g. {obj.__name__}()")
    for fn in _resolvers():
        proposer = fn(obj, target)
        if proposer is not None:
            return proposer
    raise TypeError(_not_an_assistant(obj))


__all__ = [
    "Proposer",
    "ProposerSetup",
    "RowState",
    "as_proposer",
    "register_assistant_names",
    "register_assistant_resolver",
]
