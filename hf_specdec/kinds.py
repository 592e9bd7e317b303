"""The head kinds: one `HeadKind` per kind of drafter that reads the target's states (EAGLE, Medusa, MLP speculator,
DFlash, and a model's own MTP layers), the one place a kind is entered.

A descriptor is data: every piece of a kind is named by its import path (``"module:attribute"``) and imported only
when used, so this module imports nothing of the package and every layer may read it. Each field names a module of
the layer that reads it (the proposer resolver is read by ``generation``, the trainer by ``training`` and the
command line, the card's serving sections by ``heads``, the held-out scorer by ``bench``); the layer test checks
that no field points above its reader (tests/unit/test_import_layers.py). The tables that used to name kinds
(``assistant=`` resolution, ``hf-specdec train``'s commands, the shipped folders, the ready-made assistants, the
export formats, the speculators kinds, the serving sections, the held-out scorers) are built from `HEAD_KINDS`.

A new kind is its own files (head, proposer, optionally a trainer) plus one entry in `HEAD_KINDS`::

    HeadKind(name="mine", title="My head", drafts="chains", head="my_pkg.head:MyHead", resolver="my_pkg.proposer:mine_assistant_for")

    >>> from hf_specdec.kinds import HEAD_KINDS
    >>> HEAD_KINDS["eagle"].load("head")          # the class EagleHead
    >>> [k.name for k in HEAD_KINDS.values() if k.shipped]
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

ASSETS = Path(__file__).parent / "assets"  # the heads trained for the default model, shipped inside the package
# the fields of `HeadKind` holding an import path, with the layer of the package that reads each (docs/design.md)
PATH_FIELDS = {"head": "heads", "resolver": "generation", "assistant": "generation", "trainer": "training",
               "serving": "heads", "scorer": "bench"}  # fmt: skip


def split_path(path: str) -> tuple[str, str]:
    """``(module, attribute)`` of an import path ``"module:attribute"``."""
    module, _, attribute = path.partition(":")
    return module, attribute


@dataclass(frozen=True)
class ReadyMade:
    """A ready-made assistant over a kind's shipped head (`hf_specdec.assistants`): ``name`` (``{kind}`` stands for
    the kind's name), what it puts in front of the head (``front``: ``"ngram"`` or ``"suffix"`` drafting where they
    find a match, else the head; ``None``: the head alone), and its place in the preference order (``rank``: lower
    is better, as the results page measures them on the default model; the assistants without a head take ranks too)."""

    name: str
    rank: int
    front: str | None = None


@dataclass(frozen=True)
class HeadKind:
    """One kind of drafter and where each of its pieces lives (import paths, ``"module:attribute"``).

    Attributes:
        name: the kind's key: ``head_type`` in a saved head's ``config.json``, ``hf-specdec train <name>``,
            ``--head-dir <name>=FOLDER``.
        title: how messages name a head of the kind (``"EAGLE head"``).
        drafts: what its proposer drafts, for descriptions (``"EAGLE-2 dynamic trees"``).
        head: the head class (``from_pretrained`` / ``save_pretrained``; `hf_specdec.heads`).
        resolver: ``fn(obj, target) -> Proposer | None``: the kind's proposer for an ``assistant=`` object
            (`hf_specdec.generation.proposers`).
        assistant: the kind's `Proposer` class (``XAssistant(head)``).
        trainer: the kind's `TrainerKind` (`hf_specdec.training.head_kinds`): its trainer, config, held-out scorer
            and ``hf-specdec train`` command; None where the kind is not trained here (MTP layers ship with the model).
        shipped: the folder under ``hf_specdec/assets`` of the head trained for the default model, or None.
        ready_made: the ready-made assistants built on the shipped head.
        speculators_kinds: the ``speculators_model_type`` values of vLLM's speculators format the head class reads.
        serving: ``fn(head, fmt, where) -> [markdown sections]`` for the model card (`hf_specdec.heads.serving`).
        scorer: the kind's `HeadScorer` (`hf_specdec.bench.head_eval`): teacher-forced top-1 and chain acceptance on
            the bench's answers; None where ``hf-specdec eval-heads`` does not score the kind.
        recipe_share: the kind's share of the training time in the GPU recipe (tools/gpu_recipe.py).
    """

    name: str
    title: str
    drafts: str
    head: str
    resolver: str
    assistant: str
    trainer: str | None = None
    shipped: str | None = None
    ready_made: tuple[ReadyMade, ...] = ()
    speculators_kinds: tuple[str, ...] = ()
    serving: str | None = None
    scorer: str | None = None
    recipe_share: float = 0.0

    def load(self, piece: str):
        """The object the field ``piece`` names (``"head"``, ``"resolver"``, ``"assistant"``, ``"trainer"``,
        ``"serving"``, ``"scorer"``), imported now; None for a piece the kind has not. A module that fails to import
        raises that ImportError, naming the kind."""
        if piece not in PATH_FIELDS:
            raise ValueError(f"{piece!r} is not an import-path field of HeadKind; one of {', '.join(PATH_FIELDS)}")
        path = getattr(self, piece)
        if path is None:
            return None
        module, attribute = split_path(path)
        try:
            return getattr(importlib.import_module(module), attribute)
        except ImportError as err:
            raise ImportError(f"the {self.name!r} head kind's {piece} ({path}) failed to import: {err}") from err

    @property
    def head_class_name(self) -> str:
        """The head class's name (``"EagleHead"``), without importing it."""
        return split_path(self.head)[1]

    def shipped_dir(self) -> Path | None:
        """The shipped head's folder inside the package, or None for a kind that ships none."""
        return None if self.shipped is None else ASSETS / self.shipped


_EAGLE, _MEDUSA = "hf_specdec.{}.eagle", "hf_specdec.{}.medusa"
_MLP, _DFLASH = "hf_specdec.{}.mlp_speculator", "hf_specdec.{}.dflash"
_PROPOSERS, _SERVING, _SCORERS = "generation.proposers", "hf_specdec.heads.serving", "hf_specdec.bench.head_eval"
_TRAINERS = "hf_specdec.training.head_kinds"

# in the order `hf-specdec train --help`, `--head-dir` and the docs list them
HEAD_KINDS: dict[str, HeadKind] = {
    kind.name: kind
    for kind in (
        HeadKind(
            name="eagle",
            title="EAGLE head",
            drafts="EAGLE-2 dynamic trees",
            head=_EAGLE.format("heads") + ":EagleHead",
            resolver=_EAGLE.format(_PROPOSERS) + ":eagle_assistant_for",
            assistant=_EAGLE.format(_PROPOSERS) + ":EagleAssistant",
            trainer=f"{_TRAINERS}:EAGLE_TRAINER",
            shipped="eagle-smollm2-135m-instruct",
            ready_made=(ReadyMade("ngram+{kind}", 1, "ngram"), ReadyMade("suffix+{kind}", 2, "suffix"),
                        ReadyMade("{kind}", 8)),  # fmt: skip
            speculators_kinds=("eagle3", "eagle"),
            serving=f"{_SERVING}:eagle_sections",
            scorer=f"{_SCORERS}:EAGLE_SCORER",
            recipe_share=0.4,
        ),
        HeadKind(
            name="medusa",
            title="Medusa heads",
            drafts="a candidate tree the tree budget sizes",
            head=_MEDUSA.format("heads") + ":MedusaHeads",
            resolver=_MEDUSA.format(_PROPOSERS) + ":medusa_assistant_for",
            assistant=_MEDUSA.format(_PROPOSERS) + ":MedusaAssistant",
            trainer=f"{_TRAINERS}:MEDUSA_TRAINER",
            shipped="medusa-smollm2-135m-instruct",
            ready_made=(ReadyMade("suffix+{kind}", 3, "suffix"), ReadyMade("ngram+{kind}", 7, "ngram"),
                        ReadyMade("{kind}", 10)),  # fmt: skip
            serving=f"{_SERVING}:medusa_sections",
            scorer=f"{_SCORERS}:MEDUSA_SCORER",
            recipe_share=0.15,
        ),
        HeadKind(
            name="mlp_speculator",
            title="MLP speculator",
            drafts="trimmed product trees",
            head=_MLP.format("heads") + ":MLPSpeculator",
            resolver=_MLP.format(_PROPOSERS) + ":mlp_speculator_assistant_for",
            assistant=_MLP.format(_PROPOSERS) + ":MLPSpeculatorAssistant",
            trainer=f"{_TRAINERS}:MLP_SPECULATOR_TRAINER",
            shipped="mlp-speculator-smollm2-135m-instruct",
            ready_made=(ReadyMade("{kind}", 9),),
            scorer=f"{_SCORERS}:MLP_SPECULATOR_SCORER",
            recipe_share=0.15,
        ),
        HeadKind(
            name="dflash",
            title="DFlash head",
            drafts="DDTrees (one block of per-depth distributions, best paths first)",
            head=_DFLASH.format("heads") + ":DFlashHead",
            resolver=_DFLASH.format(_PROPOSERS) + ":dflash_assistant_for",
            assistant=_DFLASH.format(_PROPOSERS) + ":DFlashAssistant",
            trainer=f"{_TRAINERS}:DFLASH_TRAINER",
            shipped="dflash-smollm2-135m-instruct",
            ready_made=(ReadyMade("ngram+{kind}", 6, "ngram"), ReadyMade("{kind}", 11)),
            speculators_kinds=("dflash",),
            serving=f"{_SERVING}:dflash_sections",
            scorer=f"{_SCORERS}:DFLASH_SCORER",
            recipe_share=0.3,
        ),
        HeadKind(  # the model's own multi-token-prediction layers: nothing to train, ship or export
            name="mtp",
            title="MTP layers",
            drafts="EAGLE-2 dynamic trees",
            head="hf_specdec.heads.mtp:MTPHead",
            resolver="hf_specdec.generation.proposers.mtp:mtp_assistant_for",
            assistant="hf_specdec.generation.proposers.mtp:MTPAssistant",
        ),
    )
}


def kind_of(head_type: str | None) -> HeadKind | None:
    """The kind a saved head's ``head_type`` names, or None."""
    return HEAD_KINDS.get(head_type) if head_type else None


def shipped_kinds() -> list[HeadKind]:
    """The kinds with a head shipped for the default model, in `HEAD_KINDS` order."""
    return [kind for kind in HEAD_KINDS.values() if kind.shipped is not None]


__all__ = ["ASSETS", "PATH_FIELDS", "HEAD_KINDS", "HeadKind", "ReadyMade", "kind_of", "shipped_kinds", "split_path"]
