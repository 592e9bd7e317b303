"""The demo's start-up prints its own progress lines and nothing else: transformers' progress bars (the "Loading
weights" bar of every ``from_pretrained``, which fills in a few milliseconds for a local model) are off while the
demo loads its model and warms up, and come back afterwards. Warnings are left alone: one about a user's own model
(weights not initialised, a missing chat template) is worth reading."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def startup_quiet() -> Iterator[None]:
    """transformers' progress bars off for the block, then as they were."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
