"""hf-specdec: speculative decoding with token trees inside transformers' ``model.generate()``.

``import hf_specdec`` registers the ``hf_specdec`` attention implementation and makes
``model.generate(ids, assistant=X)`` route to the speculative loop; calls without ``assistant`` are untouched.
``hf_specdec.uninstall()`` restores transformers' own ``generate`` (``hf_specdec.install()`` patches it again).

The call
--------
``model.generate(input_ids, assistant=..., **generate_kwargs)`` takes transformers' own arguments (``max_new_tokens``,
``do_sample``, ``temperature``, ``top_p``, logits processors, ``attention_mask`` for a left-padded batch,
``return_dict_in_generate``) and returns what vanilla ``generate`` returns; with ``return_dict_in_generate=True`` the
output also has ``spec_stats``, a `SpecStats` (τ, acceptance, per-depth acceptance, timings, the tree budget's
measurements). `generate` is the same loop as a function (transformers' ``custom_generate`` entry point).
Greedy output equals vanilla ``generate``'s token for token (fp32); sampled output follows the model's own
distribution. Which assistant to pass: `load_default_assistant` (ready-made names, `hf_specdec.assistants.available_assistants`)
or any of the classes below.

What ``assistant=`` accepts
---------------------------
- `NgramAssistant` (prompt lookup, any model), `SuffixAssistant` with a `SuffixStore` kept across calls;
- trained heads: `MedusaHeads`, `EagleHead`, `MLPSpeculator` (each ``from_pretrained`` a Hub repo or folder in the
  published layouts, ``save_pretrained`` / ``push_to_hub`` with a model card); a smaller model with the same
  tokenizer (`DraftModelAssistant`, or the model itself);
- `FallbackAssistant` (each row drafts with the first assistant that proposes something);
- your own `Proposer`, or any object a function given to `register_assistant_resolver` turns into one.

Writing your own proposer
-------------------------
A `Proposer` gets one `RowState` per active row (its committed ``tokens``, ``prompt_len`` and the deepest tree the
loop will verify now, ``max_depth``) and returns one `DraftTree` per row; the loop verifies the trees, so a wrong
guess costs time, never correctness::

    import hf_specdec
    from hf_specdec import DraftTree, Proposer

    class RepeatLast(Proposer):  # guesses that the last token repeats, up to two times
        def propose(self, rows):
            return [DraftTree.chain([int(r.tokens[-1])] * min(2, r.max_depth)) if r.max_depth > 0
                    else DraftTree.empty() for r in rows]

    out = model.generate(ids, assistant=RepeatLast(), max_new_tokens=16, do_sample=False)

`register_assistant_resolver` teaches ``assistant=`` a new kind of object: the function gets the object and the
target and returns a `Proposer`, or None to let the next resolver try::

    @hf_specdec.register_assistant_resolver
    def repeat_last_by_name(obj, target):
        return RepeatLast() if obj == "repeat-last" else None

    out = model.generate(ids, assistant="repeat-last", max_new_tokens=16, do_sample=False)

The user guide is docs/usage.md; the terms (τ, acceptance, tree budget) are defined in docs/glossary.md.
"""

import importlib

from . import quiet_imports  # noqa: F401 - first: transformers' modeling code loads without CPU-irrelevant noise
from .attention.backend import register as _register_attention
from .attention.unsupported import UnsupportedModelError
from .cache.paged import PagedCache
from .generation.hook import install, uninstall
from .generation.logits import register_per_node_processor
from .generation.loop import generate
from .generation.proposers import Proposer, ProposerSetup, RowState, register_assistant_resolver
from .generation.proposers import register_assistant_names as _register_assistant_names
from .generation.proposers.base import RowFeedback
from .generation.stats import SpecStats
from .generation.tree import DraftSampling, DraftTree
from .kinds import HEAD_KINDS, split_path
from .version import __version__ as __version__

_register_attention()
install()
# a string assistant= is told the ready-made names (the registry loads only then: it imports every head type)
_register_assistant_names(lambda: importlib.import_module(".assistants", __name__).available_assistants())


# Heavier pieces load on first use: public name -> the module (relative to this package) that defines it.
_LAZY = {
    "NgramAssistant": ".generation.proposers.ngram",
    "SuffixAssistant": ".generation.proposers.suffix",
    "SuffixStore": ".generation.proposers.suffix_store",
    "DraftModelAssistant": ".generation.proposers.draft_model",
    "FallbackAssistant": ".generation.proposers.fallback",
    "load_default_assistant": ".assistants",
    "load_default_model": ".models",
    "default_model_dir": ".models",
    "chat_prompt_ids": ".models",
    "draft_model_from_layers": ".models",
    "packed_weights": ".generation.packed_linears",
    "build_cpu_kernels": ".generation.packed_linears",
    "release_packed_weights": ".generation.packed_linears",
    "packed_bytes": ".generation.packed_linears",
}
# every head kind's head class and assistant (`hf_specdec.kinds.HEAD_KINDS`): EagleHead, EagleAssistant, MedusaHeads...
_KIND_NAMES = {name: module.removeprefix(__name__)
               for kind in HEAD_KINDS.values() for module, name in map(split_path, (kind.head, kind.assistant))}  # fmt: skip
_LAZY.update(_KIND_NAMES)


# Submodules reachable as attributes after ``import hf_specdec`` alone (``hf_specdec.assistants.available_assistants()``),
# imported on first use like the names above.
_SUBMODULES = {
    "assistants", "kinds", "models", "testing", "heads", "training", "bench", "demo", "cli", "cli_args", "export_cli",
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
    *_KIND_NAMES,
    "FallbackAssistant",
    "load_default_model",
    "load_default_assistant",
    "packed_weights",
    "build_cpu_kernels",
    "release_packed_weights",
    "packed_bytes",
]
