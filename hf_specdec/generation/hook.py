"""Makes ``model.generate(..., assistant=X)`` work on every transformers model once ``hf_specdec`` is imported.

transformers' `generate` already accepts a ``custom_generate`` callable and prepares the generation config, logits
processors and stopping criteria for it exactly as for vanilla decoding. The hook only routes calls that carry
``assistant=`` (or ``custom_generate=hf_specdec.generate``) there, and passes along the two things transformers
drops for callable ``custom_generate``: the streamer and the tokenizer that ``stop_strings`` need. Calls without an
assistant reach the original `generate` untouched.
"""

from __future__ import annotations

import copy
import functools
import inspect
import types

from transformers.generation import GenerationMixin, StoppingCriteriaList, StopStringCriteria

from .inputs import check_prompt
from .loop import generate as speculative_generate

_ORIGINAL = GenerationMixin.generate


def _routed_generate(self, *args, assistant=None, **kwargs):
    custom = kwargs.get("custom_generate")
    if isinstance(custom, str):  # a Hub repo or folder's custom_generate/ (hf-specdec's own takes assistant= too)
        return (
            _ORIGINAL(self, *args, **kwargs)
            if assistant is None
            else _ORIGINAL(self, *args, assistant=assistant, **kwargs)
        )
    if assistant is None and custom is not speculative_generate:
        return _ORIGINAL(self, *args, **kwargs)
    if assistant is None:
        raise ValueError("custom_generate=hf_specdec.generate needs an assistant: pass assistant=...")
    if custom is not None and custom is not speculative_generate:
        raise ValueError("assistant= cannot be combined with another custom_generate")
    if kwargs.get("assistant_model") is not None:
        raise ValueError(
            "pass either assistant= (hf_specdec) or assistant_model= (transformers' assisted generation), not both"
        )
    if len(args) > 2:
        raise ValueError("with assistant=, pass generate's options after inputs and generation_config by keyword")
    config = (args[1] if len(args) > 1 else kwargs.get("generation_config")) or self.generation_config
    if kwargs.get("use_mtp") or (kwargs.get("use_mtp") is None and getattr(config, "use_mtp", False)):
        raise ValueError("use_mtp=True (transformers' MTP drafting) cannot be combined with assistant=: pass one of "
                         "them; assistant='mtp' drafts trees with the model's own MTP layers")  # fmt: skip
    inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if inputs is not None or kwargs.get("inputs_embeds") is not None:  # before transformers reads them
        check_prompt(self, inputs, kwargs.get("attention_mask"), kwargs.get("inputs_embeds"))
    kwargs["custom_generate"] = speculative_generate
    streamer = kwargs.pop("streamer", None)
    tokenizer = kwargs.pop("tokenizer", None)
    generation_config = args[1] if len(args) > 1 else kwargs.get("generation_config")
    stop_strings = kwargs.get("stop_strings")
    if stop_strings is None:
        cfg = generation_config if generation_config is not None else self.generation_config
        stop_strings = getattr(cfg, "stop_strings", None)
    if stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings need the tokenizer: pass tokenizer=... to generate (as in vanilla generate)")
        criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
        criteria.append(StopStringCriteria(stop_strings=stop_strings, tokenizer=tokenizer))
        kwargs["stopping_criteria"] = criteria
        if generation_config is not None and kwargs.get("stop_strings") is None:
            # the strings came from the caller's config: a copy without them (a stop_strings=None argument next to
            # a generation_config would make transformers warn about arguments the caller never passed)
            generation_config = copy.deepcopy(generation_config)
            generation_config.stop_strings = None
            args, kwargs["generation_config"] = args[:1], generation_config
        else:
            kwargs["stop_strings"] = None
    return _ORIGINAL(self, *args, assistant=assistant, hf_specdec_streamer=streamer, **kwargs)


_NOTE = """hf_specdec: ``assistant=`` (an hf_specdec assistant, a draft model or heads) routes this call to
speculative decoding (`hf_specdec.generate`); calls without it run transformers' own ``generate`` unchanged.
``hf_specdec.uninstall()`` restores the original.

"""


class _PatchedGenerate:
    """transformers' `generate` with the ``assistant=`` route: same signature, documented, restorable."""

    _hf_specdec = True

    def __init__(self, original):
        functools.update_wrapper(self, original)
        self.__doc__ = _NOTE + (original.__doc__ or "")
        self.__signature__ = inspect.signature(original)

    def __call__(self, model, *args, **kwargs):
        return _routed_generate(model, *args, **kwargs)

    def __get__(self, obj, objtype=None):
        return self if obj is None else types.MethodType(self, obj)

    def __repr__(self) -> str:
        return "<GenerationMixin.generate patched by hf_specdec: assistant= routes to hf_specdec.generate>"


def install() -> None:
    """Patch `GenerationMixin.generate` with the ``assistant=`` route (idempotent)."""
    if getattr(GenerationMixin.generate, "_hf_specdec", False):
        return
    GenerationMixin.generate = _PatchedGenerate(_ORIGINAL)


def uninstall() -> None:
    """Restore transformers' own `generate` (``hf_specdec.install()`` patches it again)."""
    GenerationMixin.generate = _ORIGINAL
