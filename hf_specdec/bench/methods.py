"""The decoding methods the benchmark compares: each is a name plus the extra ``generate()`` keyword arguments it needs.

    vanilla           model.generate(ids)                                      the baseline
    NAME              model.generate(ids, assistant=load_default_assistant(NAME))   for each NAME in
                      hf_specdec.assistants.available_assistants() (ngram+eagle, suffix+eagle, ...)
    draft             model.generate(ids, assistant=draft_model)             hf_specdec DraftModelAssistant
    null              model.generate(ids, assistant=NullAssistant())         the loop's own overhead: drafts nothing
    hf-prompt-lookup  model.generate(ids, prompt_lookup_num_tokens=10)       transformers' prompt lookup decoding
    hf-assisted       model.generate(ids, assistant_model=draft_model)       transformers' assisted generation
    NAME@candidate    NAME drafting with a candidate head of its kind (``bench --candidate-head KIND=FOLDER``),
                      interleaved with NAME and the shipped head in one run (`candidate_methods`)
    arctic-suffix     model.generate(ids, assistant=ArcticSuffixAssistant())  Arctic Inference's SuffixDecoding drafts
                      (listed only where ``arctic-inference`` is installed; `hf_specdec.bench.arctic`)

The draft model is `hf_specdec.models.draft_model_from_layers` (the target's first k layers), built once per run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..assistants import (
    assistant_heads,
    available_assistants,
    describe_assistant,
    heads_from_folders,
    load_default_assistant,
)
from ..generation.proposers.base import Proposer, RowState
from ..generation.proposers.draft_model import DraftModelAssistant
from ..generation.tree import DraftTree
from .arctic import ArcticSuffixAssistant, arctic_available


class NullAssistant(Proposer):
    """Proposes an empty tree for every row: each step verifies only the root, i.e. plain decoding run through the
    speculative loop. Its speed against vanilla `generate` is the loop's own overhead."""

    def propose(self, rows: Sequence[RowState]) -> list[DraftTree]:
        return [DraftTree.empty(r.tokens.device) for r in rows]

    def __repr__(self) -> str:
        return "NullAssistant()"


@dataclass
class BenchContext:
    """What methods may need besides the target: the draft model (built lazily by the runner) and the draft
    vocabulary the ``draft`` method scores (`[V']` ids; None: its whole vocabulary)."""

    model: object
    draft_factory: Callable[[], object] | None = None
    draft_vocab: object | None = None
    _draft: object | None = None

    @property
    def draft(self):
        if self._draft is None:
            if self.draft_factory is None:
                raise RuntimeError("this benchmark run has no draft model")
            self._draft = self.draft_factory()
        return self._draft


@dataclass(frozen=True)
class Method:
    """A decoding method: ``kwargs(ctx)`` are the extra generate() arguments of one call (fresh assistant state).

    Attributes:
        name: the row label in the results.
        description: one line for ``--help`` and the report.
        spec_stats: whether the call returns ``spec_stats`` (hf_specdec assistants, with return_dict_in_generate).
        needs_draft: whether the method uses the draft model.
    """

    name: str
    description: str
    kwargs: Callable[[BenchContext], dict]
    spec_stats: bool = False
    needs_draft: bool = False


def _default_assistant(name: str) -> Callable[[BenchContext], dict]:
    """The kwargs of the ready-made assistant ``name`` (`load_default_assistant`), fresh for each call."""
    return lambda ctx: {"assistant": load_default_assistant(name)}


def available_methods() -> dict[str, Method]:
    """Every method the benchmark can run now, by name: vanilla, each of `available_assistants()` in preference
    order, then the draft-model, loop-overhead and transformers baselines."""
    ready_made = [
        Method(name, describe_assistant(name), _default_assistant(name), spec_stats=True)
        for name in available_assistants()
    ]
    methods = (
        Method("vanilla", "model.generate (the baseline)", lambda ctx: {}),
        *ready_made,
        Method(
            "draft",
            "hf_specdec DraftModelAssistant with the layer-skip draft",
            lambda ctx: {"assistant": DraftModelAssistant(ctx.draft, draft_vocab=ctx.draft_vocab)},
            spec_stats=True,
            needs_draft=True,
        ),
        Method(
            "null",
            "hf_specdec loop with an assistant that drafts nothing (loop overhead)",
            lambda ctx: {"assistant": NullAssistant()},
            spec_stats=True,
        ),
        Method(
            "hf-prompt-lookup",
            "transformers prompt lookup decoding (prompt_lookup_num_tokens=10)",
            lambda ctx: {"prompt_lookup_num_tokens": 10},
        ),
        Method(
            "hf-assisted",
            "transformers assisted generation (assistant_model=layer-skip draft)",
            lambda ctx: {"assistant_model": ctx.draft},
            needs_draft=True,
        ),
    )
    if arctic_available():
        methods += (
            Method(
                "arctic-suffix",
                "Arctic Inference's SuffixDecoding (vLLM's suffix method) drafting in the hf_specdec loop",
                lambda ctx: {"assistant": ArcticSuffixAssistant()},
                spec_stats=True,
            ),
        )
    return {m.name: m for m in methods}


CANDIDATE = "@candidate"  # suffix of a method drafting with a candidate head (`candidate_methods`)


def _candidate_assistant(name: str, folders: Mapping[str, Path]) -> Callable[[BenchContext], dict]:
    """The kwargs of the ready-made assistant ``name`` built with the heads saved in ``folders`` ({kind: folder})."""

    def kwargs(ctx: BenchContext) -> dict:
        with heads_from_folders(folders):  # the head is loaded (once) while the factory runs
            return {"assistant": load_default_assistant(name)}

    return kwargs


def candidate_methods(methods: Sequence[Method], folders: Mapping[str, Path]) -> list[Method]:
    """For each of ``methods`` that drafts with a shipped head of a kind in ``folders`` ({kind: checked folder,
    `check_head_folders`}), its twin ``NAME@candidate`` drafting with the head saved there instead: benched in the
    same run, interleaved prompt by prompt with the shipped head, so that a small change of a head is not lost in
    the drift between two runs.

    Raises:
        ValueError: a kind that none of ``methods`` drafts with (nothing to compare).
    """
    ready_made = set(available_assistants())
    kinds_of = {m.name: assistant_heads(m.name) for m in methods if m.name in ready_made}  # {method: head kinds}
    unused = sorted(set(folders) - {kind for kinds in kinds_of.values() for kind in kinds})
    if unused:
        raise ValueError(f"no method chosen drafts with a {' or '.join(unused)} head: add one to --methods")
    twins = []
    for method in methods:
        chosen = {kind: folders[kind] for kind in kinds_of.get(method.name, ()) if kind in folders}
        if chosen:
            twins.append(
                Method(
                    method.name + CANDIDATE,
                    f"{method.description}; the candidate {', '.join(chosen)} head from "
                    f"{', '.join(map(str, chosen.values()))}",
                    _candidate_assistant(method.name, chosen),
                    spec_stats=method.spec_stats,
                )
            )
    return twins


METHODS: dict[str, Method] = available_methods()  # as of import; `resolve_methods` re-reads the registry


def quick_methods() -> list[str]:
    """The quick benchmark's methods: vanilla, the best ready-made assistant and n-gram (prompt lookup)."""
    best = available_assistants()[:1]
    return list(dict.fromkeys(["vanilla", *best, "ngram"]))


def resolve_methods(names: Sequence[str] | str | None) -> list[Method]:
    """The methods named (comma-separated string or list), vanilla always first (it is every speedup's baseline)."""
    methods = available_methods()
    if names is None:
        names = list(methods)
    elif isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in names if n not in methods]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {', '.join(methods)}")
    ordered = ["vanilla"] + [n for n in dict.fromkeys(names) if n != "vanilla"]
    return [methods[n] for n in ordered]
