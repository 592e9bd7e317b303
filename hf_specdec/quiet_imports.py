"""Loads transformers' modeling code without the log lines that do not concern a CPU user.

transformers' modeling code imports torchao when it is installed (the ``quant`` extra). On a machine without CUDA,
torchao then logs a failed load of each of its CUDA kernel libraries, and torch a deprecation warning for each enum
torchao registers: a dozen lines on every ``import hf_specdec`` and every ``hf-specdec`` command. Importing this
module loads ``transformers.modeling_utils`` (which the attention backend needs anyway) with those two loggers raised
to ERROR, on machines without CUDA only; nothing else is silenced and the levels are restored afterwards.
"""

from __future__ import annotations

import logging

import torch

_NOISY = ("torchao", "torch.utils._pytree")


def load_transformers_modeling() -> None:
    """Import ``transformers.modeling_utils`` (once), quietly where CUDA is absent (see the module doc)."""
    if torch.cuda.is_available():
        import transformers.modeling_utils  # noqa: F401
        return
    loggers = [logging.getLogger(name) for name in _NOISY]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import transformers.modeling_utils  # noqa: F401
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


load_transformers_modeling()
