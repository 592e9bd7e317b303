"""The registry of ready-made assistants for the default model (SmolLM2-135M-Instruct).

One list, read by `load_default_assistant`, the ``hf-specdec`` CLI (``--assistant`` choices), the benchmark
(``hf_specdec.bench.methods``) and the demo. A method whose trained head ships inside the package registers itself
here with `register_default_assistant`; ``requires`` says whether its assets are present, so a broken install shows
a shorter `available_assistants()` instead of failing later.

    >>> available_assistants()
    ['ngram+medusa', 'ngram', 'medusa', 'eagle', 'ngram+eagle', 'mlp_speculator']
    >>> model.generate(ids, assistant=load_default_assistant("ngram+medusa"))
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .generation.proposers.base import Proposer
from .generation.proposers.dflash import DFlashAssistant
from .generation.proposers.eagle import EagleAssistant
from .generation.proposers.fallback import FallbackAssistant
from .generation.proposers.medusa import MedusaAssistant
from .generation.proposers.mlp_speculator import MLPSpeculatorAssistant
from .generation.proposers.ngram import NgramAssistant
from .generation.proposers.suffix import SuffixAssistant
from .heads.dflash import DFlashHead
from .heads.eagle import EagleHead
from .heads.hub import PretrainedHead
from .heads.medusa import MedusaHeads
from .heads.mlp_speculator import MLPSpeculator
from .models import SHIPPED_HEAD_DIRS

DEFAULT_MEDUSA_DIR = SHIPPED_HEAD_DIRS["medusa"]
DEFAULT_ASSISTANT = "ngram"  # needs no trained weights, so it serves any model, not only the default one


@dataclass(frozen=True)
class _Registered:
    factory: Callable[[], Proposer]
    description: str
    requires: Callable[[], bool] | None
    heads: tuple[str, ...]


_REGISTRY: dict[str, _Registered] = {}  # in preference order: best first


def register_default_assistant(
    name: str,
    factory: Callable[[], Proposer],
    *,
    description: str,
    requires: Callable[[], bool] | None = None,
    heads: tuple[str, ...] = (),
) -> None:
    """Add a ready-made assistant for the default model under ``name``.

    Registration order is preference order: `available_assistants` lists the names in the order they were
    registered, so register the best method first.

    Args:
        name: the method name users pass to `load_default_assistant`, ``hf-specdec generate --assistant`` and
            ``hf-specdec bench --methods``.
        factory: builds a fresh assistant (a `Proposer`) on every call; heavy assets may be loaded once and shared.
        description: one line for ``--help``, the benchmark report and the demo.
        requires: returns True when the assets the factory needs (e.g. trained heads inside the package) are present;
            None: those of ``heads`` (none when ``heads`` is empty).
        heads: the kinds of shipped head (``SHIPPED_HEADS`` keys) the factory drafts with, which `heads_from_folders`
            replaces (`assistant_heads`); empty for an assistant without a shipped head.
    """
    if not isinstance(name, str) or not name or "," in name or name != name.strip():
        raise ValueError(f"assistant names are non-empty strings without commas or outer spaces, got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"a default assistant named {name!r} is already registered; pick another name")
    if not callable(factory) or (requires is not None and not callable(requires)):
        raise TypeError(f"register_default_assistant({name!r}): factory and requires must be callables")
    unknown = [kind for kind in heads if kind not in SHIPPED_HEADS]
    if isinstance(heads, str) or unknown:
        raise ValueError(f"register_default_assistant({name!r}): heads is a tuple of {', '.join(SHIPPED_HEADS)}")
    if requires is None and heads:
        requires = lambda: all(SHIPPED_HEADS[kind].ships() for kind in heads)  # noqa: E731
    _REGISTRY[name] = _Registered(factory, description, requires, tuple(heads))


def available_assistants() -> list[str]:
    """The names `load_default_assistant` can build now (their assets present), in preference order, best first."""
    return [name for name, entry in _REGISTRY.items() if entry.requires is None or entry.requires()]


def _registered(name: str) -> _Registered:
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(
            f"unknown assistant {name!r}; the ready-made assistants are: {', '.join(available_assistants())} "
            "(hf_specdec.assistants.available_assistants())"
        )
    return entry


def describe_assistant(name: str) -> str:
    """The one-line description ``name`` was registered with (ValueError listing the names if unknown)."""
    return _registered(name).description


def assistant_heads(name: str) -> tuple[str, ...]:
    """The kinds of shipped head the ready-made assistant ``name`` drafts with (``("eagle",)`` for ``ngram+eagle``;
    ValueError listing the names if unknown)."""
    return _registered(name).heads


def load_default_assistant(name: str = DEFAULT_ASSISTANT) -> Proposer:
    """A fresh ready-made assistant tuned for the default model (SmolLM2-135M-Instruct), ready for ``assistant=``.

    Args:
        name: one of `available_assistants()`: ``"ngram+medusa"`` / ``"ngram+eagle"`` (prompt lookup where it finds
            a match, the shipped Medusa heads / EAGLE head elsewhere: the fastest on the default model,
            docs/results.md), ``"ngram"`` (prompt lookup over token trees, no weights: any model), ``"medusa"`` (the
            shipped Medusa-1 heads drafting a candidate tree that the tree budget sizes), ``"eagle"`` (the shipped EAGLE-1/2 head drafting EAGLE-2
            dynamic trees), ``"mlp_speculator"`` (the shipped MLP speculator), ``"dflash"`` / ``"ngram+dflash"`` (the
            shipped DFlash block drafter drafting DDTrees, alone or behind prompt lookup), ``"suffix"`` (suffix decoding over the
            request and the assistant's store of earlier answers: keep the returned assistant and pass it to every
            call of a session) or ``"suffix+eagle"`` / ``"suffix+medusa"`` (`available_assistants`).
    Returns:
        a new `Proposer` for each call (trained heads are loaded once and shared).
    """
    entry = _registered(name)
    if entry.requires is not None and not entry.requires():
        raise FileNotFoundError(
            f"the assets of assistant {name!r} ({entry.description}) are missing from this install; reinstall "
            f"hf-specdec or use one of: {', '.join(available_assistants())}"
        )
    assistant = entry.factory()
    if not isinstance(assistant, Proposer):
        raise TypeError(f"the factory registered for {name!r} returned {type(assistant).__name__}, not a Proposer")
    return assistant


# ------------------------------------------------------------------------------------ the shipped assistants
@dataclass(frozen=True)
class ShippedHead:
    """A head trained for the default model that ships inside the package: its folder (config, weights, model card
    with how it was trained and what it reaches) and its class. Loaded once, on the CPU in fp32, with the tree
    defaults and measured step costs its config carries."""

    what: str  # for messages: "Medusa heads"
    folder: Path
    head_class: type[PretrainedHead]

    def ships(self) -> bool:
        """Whether the folder is present (a broken install lacks it)."""
        return (self.folder / "config.json").is_file()

    def load(self) -> PretrainedHead:
        """The head (the same object on every call); inside `heads_from_folders`, the one saved in the folder it
        names for this kind instead."""
        replacement = _REPLACED_HEADS.get(self.head_class.head_type)
        if replacement is not None:
            return _load_once(self.head_class, replacement)
        if not self.ships():
            raise FileNotFoundError(f"the shipped {self.what} are missing from {self.folder} (broken install?)")
        return _load_once(self.head_class, self.folder)


_REPLACED_HEADS: dict[str, Path] = {}  # head_type -> folder, while `heads_from_folders` is active


@contextlib.contextmanager
def heads_from_folders(folders: Mapping[str, str | os.PathLike]) -> Iterator[None]:
    """Within the block, the ready-made assistants built on a head of the kinds named load it from the folder given
    instead of the shipped one: a candidate head benched (``hf-specdec bench --head-dir eagle=FOLDER``) in every
    method that uses that kind (``eagle``, ``ngram+eagle``, ``suffix+eagle``) before it ships. Not thread-safe:
    one block at a time, in one thread.

    Args:
        folders: head kind (``eagle``, ``medusa``, ``mlp_speculator``, ``dflash``) -> a folder with a head saved by
            ``save_pretrained`` (its ``config.json`` must name that kind).
    Raises:
        ValueError: as `check_head_folders`, before anything changes.
    """
    checked = check_head_folders(folders)
    saved = dict(_REPLACED_HEADS)
    _REPLACED_HEADS.update(checked)
    try:
        yield
    finally:
        _REPLACED_HEADS.clear()
        _REPLACED_HEADS.update(saved)


def check_head_folders(folders: Mapping[str, str | os.PathLike]) -> dict[str, Path]:
    """``{kind: folder resolved}`` once each folder holds a saved head of its kind.

    Raises:
        ValueError: an unknown kind, a folder without ``config.json``, or a head of another kind in it.
    """
    checked = {}
    for kind, folder in folders.items():
        if kind not in SHIPPED_HEADS:
            raise ValueError(f"unknown head kind {kind!r}; expected one of {', '.join(SHIPPED_HEADS)}")
        found = saved_head_type(Path(folder))
        if found != kind:
            raise ValueError(f"{folder} holds a {found!r} head, not a {kind!r} head")
        checked[kind] = Path(folder).resolve()
    return checked


def saved_head_type(folder: Path) -> str | None:
    """The ``head_type`` a saved head's ``config.json`` names (ValueError when ``folder`` has no ``config.json``)."""
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(f"{folder} holds no saved head (no config.json); expected a folder save_pretrained wrote")
    return json.loads(config.read_text(encoding="utf-8")).get("head_type")


@functools.cache
def _load_once(head_class: type[PretrainedHead], folder: Path) -> PretrainedHead:
    return head_class.from_pretrained(folder, dtype=torch.float32).eval()


MEDUSA = ShippedHead("Medusa heads", DEFAULT_MEDUSA_DIR, MedusaHeads)
EAGLE = ShippedHead("EAGLE head", SHIPPED_HEAD_DIRS["eagle"], EagleHead)
MLP_SPECULATOR = ShippedHead("MLP speculator", SHIPPED_HEAD_DIRS["mlp_speculator"], MLPSpeculator)
DFLASH = ShippedHead("DFlash head", SHIPPED_HEAD_DIRS["dflash"], DFlashHead)
DEFAULT_EAGLE_DIR, DEFAULT_MLP_SPECULATOR_DIR = EAGLE.folder, MLP_SPECULATOR.folder
SHIPPED_HEADS = {shipped.head_class.head_type: shipped for shipped in (EAGLE, MEDUSA, MLP_SPECULATOR, DFLASH)}


def _with_ngram(assistant: Callable[[], Proposer]) -> Callable[[], Proposer]:
    """Prompt lookup where it finds a match, else ``assistant``."""
    return lambda: FallbackAssistant(NgramAssistant(), assistant())


def _with_suffix(assistant: Callable[[], Proposer]) -> Callable[[], Proposer]:
    """Suffix decoding (this request and the assistant's own store of earlier answers) where it finds a match, else
    ``assistant``."""
    return lambda: FallbackAssistant(SuffixAssistant(), assistant())


def _medusa() -> Proposer:
    return MedusaAssistant(MEDUSA.load())


def _eagle() -> Proposer:
    return EagleAssistant(EAGLE.load())


def _mlp_speculator() -> Proposer:
    return MLPSpeculatorAssistant(MLP_SPECULATOR.load())


def _dflash() -> Proposer:
    return DFlashAssistant(DFLASH.load())


register_default_assistant(
    "ngram+medusa",
    _with_ngram(_medusa),
    description="FallbackAssistant: prompt lookup (NgramAssistant) where it finds a match, else the shipped Medusa "
    "heads",
    heads=("medusa",),
)
register_default_assistant(
    "ngram", NgramAssistant, description="NgramAssistant: prompt lookup over token trees (no trained weights)"
)
register_default_assistant(
    "medusa",
    _medusa,
    description="MedusaAssistant with the shipped Medusa-1 heads drafting a candidate tree the tree budget sizes",
    heads=("medusa",),
)
register_default_assistant(
    "eagle",
    _eagle,
    description="EagleAssistant: the shipped EAGLE-1/2 head drafting EAGLE-2 dynamic trees",
    heads=("eagle",),
)
register_default_assistant(
    "ngram+eagle",
    _with_ngram(_eagle),
    description="FallbackAssistant: prompt lookup (NgramAssistant) where it finds a match, else the shipped EAGLE head",
    heads=("eagle",),
)
register_default_assistant(
    "mlp_speculator",
    _mlp_speculator,
    description="MLPSpeculatorAssistant: the shipped MLP speculator (IBM accelerator architecture) drafting trimmed "
    "product trees",
    heads=("mlp_speculator",),
)
register_default_assistant(
    "dflash",
    _dflash,
    description="DFlashAssistant: the shipped DFlash block drafter drafting DDTrees (one block of per-depth "
    "distributions, best paths first)",
    heads=("dflash",),
)
register_default_assistant(
    "ngram+dflash",
    _with_ngram(_dflash),
    description="FallbackAssistant: prompt lookup (NgramAssistant) where it finds a match, else the shipped DFlash "
    "head",
    heads=("dflash",),
)
register_default_assistant(
    "suffix",
    SuffixAssistant,
    description="SuffixAssistant: suffix trees over this request and a store of earlier answers (no trained weights; "
    "reuse one assistant across calls for the store)",
)
register_default_assistant(
    "suffix+eagle",
    _with_suffix(_eagle),
    description="FallbackAssistant: suffix decoding (SuffixAssistant) where it finds a match, else the shipped EAGLE head",
    heads=("eagle",),
)
register_default_assistant(
    "suffix+medusa",
    _with_suffix(_medusa),
    description="FallbackAssistant: suffix decoding (SuffixAssistant) where it finds a match, else the shipped Medusa "
    "heads",
    heads=("medusa",),
)
