"""The decoding methods the benchmark compares: each is a name plus the extra ``generate()`` keyword arguments it needs.

    vanilla           model.generate(ids)                                      the baseline
    ngram             model.generate(ids, assistant=hf_specdec.NgramAssistant())
    medusa            model.generate(ids, assistant=load_default_assistant("medusa"))   the shipped Medusa heads
    ngram+medusa      model.generate(ids, assistant=load_default_assistant("ngram+medusa"))   n-gram, else Medusa
    draft             model.generate(ids, assistant=draft_model)             hf_specdec DraftModelAssistant
    null              model.generate(ids, assistant=NullAssistant())         the loop's own overhead: drafts nothing
    hf-prompt-lookup  model.generate(ids, prompt_lookup_num_tokens=10)       transformers' prompt lookup decoding
    hf-assisted       model.generate(ids, assistant_model=draft_model)       transformers' assisted generation

The draft model is `hf_specdec.models.draft_model_from_layers` (the target's first k layers), built once per run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..generation.proposers.base import Proposer, RowState
from ..generation.tree import DraftTree


class NullAssistant(Proposer):
    """Proposes an empty tree for every row: each step verifies only the root, i.e. plain decoding run through the
    speculative loop. Its speed against vanilla `generate` is the loop's own overhead."""

    def propose(self, rows: Sequence[RowState]) -> list[DraftTree]:
        return [DraftTree.empty(r.tokens.device) for r in rows]

    def __repr__(self) -> str:
        return "NullAssistant()"


@dataclass
class BenchContext:
    """What methods may need besides the target: the draft model (built lazily by the runner)."""

    model: object
    draft_factory: Callable[[], object] | None = None
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


def _default_assistant(method: str) -> Callable[[BenchContext], dict]:
    """The kwargs of ``method``'s ready-made assistant for the default model (`load_default_assistant`)."""

    def kwargs(ctx: BenchContext) -> dict:
        from ..assistants import load_default_assistant

        return {"assistant": load_default_assistant(method)}

    return kwargs


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("vanilla", "model.generate (the baseline)", lambda ctx: {}),
        Method(
            "ngram",
            "hf_specdec NgramAssistant (prompt lookup, token trees)",
            _default_assistant("ngram"),
            spec_stats=True,
        ),
        Method(
            "medusa",
            "hf_specdec MedusaAssistant with the shipped Medusa-1 heads",
            _default_assistant("medusa"),
            spec_stats=True,
        ),
        Method(
            "ngram+medusa",
            "hf_specdec FallbackAssistant: NgramAssistant where it drafts, else the shipped Medusa heads",
            _default_assistant("ngram+medusa"),
            spec_stats=True,
        ),
        Method(
            "draft",
            "hf_specdec DraftModelAssistant with the layer-skip draft",
            lambda ctx: {"assistant": ctx.draft},
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
}


def resolve_methods(names: Sequence[str] | str | None) -> list[Method]:
    """The methods named (comma-separated string or list), vanilla always first (it is every speedup's baseline)."""
    if names is None:
        names = list(METHODS)
    elif isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    ordered = ["vanilla"] + [n for n in dict.fromkeys(names) if n != "vanilla"]
    return [METHODS[n] for n in ordered]
