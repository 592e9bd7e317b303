"""The error every refusal of a model hf_specdec cannot verify exactly raises (see ``generation/support.py``)."""

from __future__ import annotations


class UnsupportedModelError(NotImplementedError):
    """A model (target or draft) whose state hf_specdec cannot page and roll back: refused by name, never run.

    Attributes:
        reason: what is unsupported, in a few words (the message says it in full, with the model and what works).
    """

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message
