"""`load_default_assistant`: the ready-made assistant of each method for the default model."""

from __future__ import annotations

from .generation.proposers.base import Proposer

_METHODS = ("ngram", "medusa", "eagle", "mlp_speculator")


def load_default_assistant(method: str = "ngram") -> Proposer:
    """The assistant of ``method`` tuned for the default model (SmolLM2-135M-Instruct), ready for ``assistant=``.

    Args:
        method: ``"ngram"``; the head-based methods (``"medusa"``, ``"eagle"``, ``"mlp_speculator"``) raise until
            trained heads ship inside the package.
    """
    if method == "ngram":
        from .generation.proposers.ngram import NgramAssistant

        return NgramAssistant()
    if method in _METHODS:
        raise NotImplementedError(
            f"no trained {method} heads ship with hf-specdec yet; train them with `hf-specdec train {method}` "
            "(Medusa) or load published heads with from_pretrained"
        )
    raise ValueError(f"unknown method {method!r}; choose one of {', '.join(_METHODS)}")
