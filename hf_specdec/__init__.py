"""hf-specdec: speculative decoding with token trees inside transformers' ``model.generate()``.

``import hf_specdec`` registers the ``hf_specdec`` attention implementation and makes
``model.generate(ids, assistant=X)`` route to the speculative loop; calls without ``assistant`` are untouched.
``hf_specdec.uninstall()`` restores transformers' own ``generate`` (``hf_specdec.install()`` patches it again).
"""

from .attention.backend import register as _register_attention
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


def __getattr__(name):
    # heavier pieces load on first use
    if name == "NgramAssistant":
        from .generation.proposers.ngram import NgramAssistant

        return NgramAssistant
    if name == "DraftModelAssistant":
        from .generation.proposers.draft_model import DraftModelAssistant

        return DraftModelAssistant
    if name == "MedusaHeads":
        from .heads.medusa import MedusaHeads

        return MedusaHeads
    if name == "MedusaAssistant":
        from .generation.proposers.medusa import MedusaAssistant

        return MedusaAssistant
    if name == "FallbackAssistant":
        from .generation.proposers.fallback import FallbackAssistant

        return FallbackAssistant
    if name == "load_default_assistant":
        from .assistants import load_default_assistant

        return load_default_assistant
    if name in ("load_default_model", "default_model_dir", "chat_prompt_ids", "draft_model_from_layers"):
        from . import models

        return getattr(models, name)
    raise AttributeError(f"module 'hf_specdec' has no attribute {name!r}")


__all__ = [
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
    "DraftModelAssistant",
    "MedusaHeads",
    "MedusaAssistant",
    "FallbackAssistant",
    "load_default_model",
    "load_default_assistant",
]
