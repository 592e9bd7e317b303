"""`load_default_assistant`: the ready-made assistant of each method for the default model."""

from __future__ import annotations

import functools
from pathlib import Path

from .generation.proposers.base import Proposer

_METHODS = ("ngram", "medusa", "ngram+medusa", "eagle", "mlp_speculator")
ASSETS = Path(__file__).resolve().parent / "assets"
DEFAULT_MEDUSA_DIR = ASSETS / "medusa-smollm2-135m-instruct"


@functools.lru_cache(maxsize=1)
def default_medusa_heads():
    """The Medusa heads trained for the default model that ship inside the package (loaded once, CPU, fp32).

    They share the default model's lm_head and carry their tuned tree (``tree_choices``); see the model card in
    ``hf_specdec/assets/medusa-smollm2-135m-instruct/README.md`` for how they were trained and what they reach.
    """
    from .heads.medusa import MedusaHeads

    if not (DEFAULT_MEDUSA_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the shipped Medusa heads are missing from {DEFAULT_MEDUSA_DIR} (broken install?)")
    return MedusaHeads.from_pretrained(DEFAULT_MEDUSA_DIR).eval()


def load_default_assistant(method: str = "ngram") -> Proposer:
    """The assistant of ``method`` tuned for the default model (SmolLM2-135M-Instruct), ready for ``assistant=``.

    Args:
        method: ``"ngram"`` (prompt lookup over token trees), ``"medusa"`` (the shipped Medusa-1 heads with their
            tuned tree) or ``"ngram+medusa"`` (a `FallbackAssistant`: prompt lookup where it finds a match, the heads
            for the other rows and steps; the fastest on the default model, docs/results.md); ``"eagle"`` and
            ``"mlp_speculator"`` raise until trained heads ship inside the package.
    Returns:
        a fresh assistant (a `Proposer`); the Medusa heads themselves are loaded once and shared.
    """
    if method == "ngram":
        from .generation.proposers.ngram import NgramAssistant

        return NgramAssistant()
    if method == "medusa":
        from .generation.proposers.medusa import MedusaAssistant

        return MedusaAssistant(default_medusa_heads())
    if method == "ngram+medusa":
        from .generation.proposers.fallback import FallbackAssistant

        return FallbackAssistant(load_default_assistant("ngram"), load_default_assistant("medusa"))
    if method in _METHODS:
        raise NotImplementedError(
            f"no trained {method} heads ship with hf-specdec yet; use load_default_assistant('medusa') or "
            "load_default_assistant('ngram')"
        )
    raise ValueError(f"unknown method {method!r}; choose one of {', '.join(_METHODS)}")
