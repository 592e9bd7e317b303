"""hf-specdec: speculative decoding with token trees inside transformers' ``model.generate()``.

``import hf_specdec`` registers the ``hf_specdec`` attention implementation and makes
``model.generate(ids, assistant=X)`` route to the speculative loop; calls without ``assistant`` are untouched.
``hf_specdec.uninstall()`` restores transformers' own ``generate`` (``hf_specdec.install()`` patches it again).
"""

import importlib

from .attention.backend import register as _register_attention
from .attention.unsupported import UnsupportedModelError
from .cache.paged import PagedCache
from .generation.hook import install, uninstall
from .generation.logits import register_per_node_processor
from .generation.loop import generate
from .generation.proposers import Proposer, ProposerSetup, RowState, register_assistant_resolver
from .generation.proposers.base import RowFeedback
from .generation.stats import SpecStats
from .generation.tree import DraftSampling, DraftTree

_register_attention()
install()

__version__ = "0.1.0"


# Heavier pieces load on first use: public name -> the module (relative to this package) that defines it.
_LAZY = {
    "NgramAssistant": ".generation.proposers.ngram",
    "SuffixAssistant": ".generation.proposers.suffix",
    "SuffixStore": ".generation.proposers.suffix_store",
    "DraftModelAssistant": ".generation.proposers.draft_model",
    "MedusaHeads": ".heads.medusa",
    "MedusaAssistant": ".generation.proposers.medusa",
    "EagleHead": ".heads.eagle",
    "EagleAssistant": ".generation.proposers.eagle",
    "MLPSpeculator": ".heads.mlp_speculator",
    "MLPSpeculatorAssistant": ".generation.proposers.mlp_speculator",
    "FallbackAssistant": ".generation.proposers.fallback",
    "load_default_assistant": ".assistants",
    "load_default_model": ".models",
    "default_model_dir": ".models",
    "chat_prompt_ids": ".models",
    "draft_model_from_layers": ".models",
    "packed_weights": ".generation.packed_linears",
    "release_packed_weights": ".generation.packed_linears",
}


# Submodules reachable as attributes after ``import hf_specdec`` alone (``hf_specdec.assistants.available_assistants()``),
# imported on first use like the names above.
_SUBMODULES = {
    "assistants", "models", "testing", "heads", "training", "bench", "demo", "cli", "cli_args", "export_cli",
    "kernels",
}  # fmt: skip


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name not in _LAZY:
        raise AttributeError(f"module 'hf_specdec' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name], __name__), name)


__all__ = [
    "UnsupportedModelError",
    "DraftSampling",
    "DraftTree",
    "PagedCache",
    "Proposer",
    "ProposerSetup",
    "RowFeedback",
    "RowState",
    "SpecStats",
    "generate",
    "install",
    "uninstall",
    "register_assistant_resolver",
    "register_per_node_processor",
    "NgramAssistant",
    "SuffixAssistant",
    "SuffixStore",
    "DraftModelAssistant",
    "MedusaHeads",
    "MedusaAssistant",
    "EagleHead",
    "EagleAssistant",
    "MLPSpeculator",
    "MLPSpeculatorAssistant",
    "FallbackAssistant",
    "load_default_model",
    "load_default_assistant",
    "packed_weights",
    "release_packed_weights",
]
