"""The registry of ready-made assistants for the default model (SmolLM2-135M-Instruct).

One list, read by `load_default_assistant`, the ``hf-specdec`` CLI (``--assistant`` choices), the benchmark
(``hf_specdec.bench.methods``) and the demo. A method whose trained head ships inside the package registers itself
here with `register_default_assistant`; ``requires`` says whether its assets are present, so a broken install shows
a shorter `available_assistants()` instead of failing later.

    >>> available_assistants()[:4]
    ['ngram+eagle', 'suffix+eagle', 'suffix+medusa', 'suffix']
    >>> model.generate(ids, assistant=load_default_assistant("ngram+eagle"))

The assistants over a shipped head come from the head kinds' descriptors (`hf_specdec.kinds.HeadKind.ready_made`),
ranked as the results page measures them on the default model.
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
from .generation.proposers.fallback import FallbackAssistant
from .generation.proposers.ngram import NgramAssistant
from .generation.proposers.suffix import SuffixAssistant
from .heads.hub import PretrainedHead
from .kinds import HeadKind, ReadyMade, shipped_kinds

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
        name: one of `available_assistants()` (best first on the default model, docs/results.md), e.g.
            ``"ngram+eagle"`` (prompt lookup where it finds a match, the shipped EAGLE head elsewhere), ``"ngram"``
            (prompt lookup over token trees, no weights: any model), ``"suffix"`` (suffix decoding over the request
            and the assistant's store of earlier answers: keep the returned assistant and pass it to every call of a
            session), or a shipped head alone (``"eagle"``, ``"medusa"``, ``"mlp_speculator"``, ``"dflash"``);
            `describe_assistant` says what each one is.
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
    """A head trained for the default model that ships inside the package (a kind's ``shipped`` folder: config,
    weights, model card with how it was trained and what it reaches). Loaded once, on the CPU in fp32, with the tree
    defaults and measured step costs its config carries."""

    kind: HeadKind

    @property
    def what(self) -> str:  # for messages: "Medusa heads"
        return self.kind.title

    @property
    def folder(self) -> Path:
        return self.kind.shipped_dir()

    @property
    def head_class(self) -> type[PretrainedHead]:
        return self.kind.load("head")

    def ships(self) -> bool:
        """Whether the folder is present (a broken install lacks it)."""
        return (self.folder / "config.json").is_file()

    def load(self) -> PretrainedHead:
        """The head (the same object on every call); inside `heads_from_folders`, the one saved in the folder it
        names for this kind instead."""
        replacement = _REPLACED_HEADS.get(self.kind.name)
        if replacement is not None:
            return _load_once(self.head_class, replacement)
        if not self.ships():
            raise FileNotFoundError(f"the shipped {self.what} are missing from {self.folder} (broken install?)")
        return _load_once(self.head_class, self.folder)

    def assistant(self) -> Proposer:
        """A fresh assistant of the kind drafting with the shipped head."""
        return self.kind.load("assistant")(self.load())


_REPLACED_HEADS: dict[str, Path] = {}  # head_type -> folder, while `heads_from_folders` is active


@contextlib.contextmanager
def heads_from_folders(folders: Mapping[str, str | os.PathLike]) -> Iterator[None]:
    """Within the block, the ready-made assistants built on a head of the kinds named load it from the folder given
    instead of the shipped one: a candidate head benched (``hf-specdec bench --head-dir eagle=FOLDER``) in every
    method that uses that kind (``eagle``, ``ngram+eagle``, ``suffix+eagle``) before it ships. Not thread-safe:
    one block at a time, in one thread.

    Args:
        folders: head kind (a key of `SHIPPED_HEADS`) -> a folder with a head saved by ``save_pretrained`` (its
            ``config.json`` must name that kind).
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


# the heads shipped for the default model, by kind, in `HEAD_KINDS` order
SHIPPED_HEADS: dict[str, ShippedHead] = {kind.name: ShippedHead(kind) for kind in shipped_kinds()}
# names the shipped heads' model cards use (``from hf_specdec.assistants import DEFAULT_EAGLE_DIR``): aliases only
EAGLE, MEDUSA = SHIPPED_HEADS["eagle"], SHIPPED_HEADS["medusa"]
MLP_SPECULATOR, DFLASH = SHIPPED_HEADS["mlp_speculator"], SHIPPED_HEADS["dflash"]
DEFAULT_EAGLE_DIR, DEFAULT_MEDUSA_DIR, DEFAULT_MLP_SPECULATOR_DIR = EAGLE.folder, MEDUSA.folder, MLP_SPECULATOR.folder

# what goes in front of a head (`ReadyMade.front`): drafts where it finds a match, the head elsewhere
_FRONTS: dict[str, tuple[Callable[[], Proposer], str]] = {
    "ngram": (NgramAssistant, "prompt lookup (NgramAssistant)"),
    "suffix": (SuffixAssistant, "suffix decoding (SuffixAssistant)"),
}
# the ready-made assistants without a head: (name, rank as in `ReadyMade`, factory, description)
_HEADLESS = (
    ("suffix", 4, SuffixAssistant, "SuffixAssistant: suffix trees over this request and a store of earlier answers "
     "(no trained weights; reuse one assistant across calls for the store)"),
    ("ngram", 5, NgramAssistant, "NgramAssistant: prompt lookup over token trees (no trained weights)"),
)  # fmt: skip


def _ready_made(shipped: ShippedHead, made: ReadyMade) -> tuple[str, int, Callable[[], Proposer], str]:
    """``(name, rank, factory, description)`` of a ready-made assistant over a shipped head."""
    if made.front is None:
        return made.name.format(kind=shipped.kind.name), made.rank, shipped.assistant, (
            f"{shipped.kind.load('assistant').__name__}: the shipped {shipped.what} drafting {shipped.kind.drafts}")
    front, said = _FRONTS[made.front]
    factory = functools.partial(lambda f, s: FallbackAssistant(f(), s.assistant()), front, shipped)
    return (made.name.format(kind=shipped.kind.name), made.rank, factory,
            f"FallbackAssistant: {said} where it finds a match, else the shipped {shipped.what}")  # fmt: skip


def _register_shipped() -> None:
    """Register every ready-made assistant, the heads' (`HeadKind.ready_made`) and the headless ones, best first."""
    entries = [(name, rank, factory, description, ()) for name, rank, factory, description in _HEADLESS]
    for shipped in SHIPPED_HEADS.values():
        entries += [(*_ready_made(shipped, made), (shipped.kind.name,)) for made in shipped.kind.ready_made]
    for name, _, factory, description, heads in sorted(entries, key=lambda entry: entry[1]):
        register_default_assistant(name, factory, description=description, heads=heads)


_register_shipped()
