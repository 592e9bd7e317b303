"""Checks of one speculative ``generate`` call's inputs before anything runs, and where each row's prompt starts.

Everything transformers' vanilla decoding would do differently (beam search, contrastive search, guidance, extra
model inputs, ...) is refused by name, so an assistant never silently changes what ``generate`` means.
"""

from __future__ import annotations

import torch

from ..cache.model_arg import USER_CACHE_KEYS, user_cache

# GenerationConfig fields that change vanilla decoding and that the loop does not implement. Each is refused by name.
UNSUPPORTED_FLAGS = ("output_attentions", "output_hidden_states", "low_memory", "token_healing")
# model inputs the loop understands (the rest is refused)
ALLOWED_MODEL_INPUTS = {
    "attention_mask",
    "position_ids",
    "logits_to_keep",
    "use_cache",
    *USER_CACHE_KEYS,
    "cache_position",
}


def validate_call(model, input_ids: torch.Tensor, generation_config, model_kwargs: dict) -> None:
    """Raise a clear error for anything in the call that the speculative loop cannot honour exactly."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder model; hf_specdec's assistant= supports decoder-only "
            "causal language models"
        )
    check_prompt(model, input_ids, model_kwargs.get("attention_mask"), model_kwargs.get("inputs_embeds"))
    _validate_generation_config(generation_config)
    name, cache = user_cache(model_kwargs)
    if cache is not None and getattr(cache, "_is_user_defined", False) and cache.get_seq_length() > 0:
        raise ValueError(f"{name} with cached tokens cannot be continued with an assistant; pass the full prompt")
    extra = sorted(k for k, v in model_kwargs.items() if k not in ALLOWED_MODEL_INPUTS and v is not None)
    if extra:
        raise ValueError(
            f"model inputs {extra} are not supported with an assistant (only input_ids and attention_mask)"
        )


def check_prompt(model, input_ids, attention_mask=None, inputs_embeds=None) -> None:
    """Refuse, with a message naming the argument, its shape/dtype and what is expected, a prompt vanilla would
    reject (or silently misread): no ids, ``inputs_embeds``, ids that are not a 2-D integer tensor, ids outside the
    vocabulary, an ``attention_mask`` of another shape or with values other than 0/1.

    Runs before transformers prepares the call (the ``assistant=`` hook) and again inside `validate_call`.

    Args:
        model: the target model (its input embedding gives the vocabulary size).
        input_ids: `[B, W]` integer prompt ids.
        attention_mask: `[B, W]` 0/1 (left padding), or None.
        inputs_embeds: must be None (not supported with an assistant).
    """
    if inputs_embeds is not None:
        raise ValueError(
            f"inputs_embeds (shape {_shape(inputs_embeds)}) is not supported with an assistant: speculative decoding "
            "drafts and verifies token ids; pass input_ids (the tokenizer's output) instead"
        )
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(
            f"input_ids must be a torch.Tensor of shape [batch, length], got {type(input_ids).__name__}; "
            "pass tokenizer(..., return_tensors='pt').input_ids"
        )
    if input_ids.dim() != 2:
        hint = "; add the batch dimension: ids[None] (or ids.unsqueeze(0))" if input_ids.dim() == 1 else ""
        raise ValueError(
            f"input_ids must have shape [batch, length], got a {input_ids.dim()}-D tensor of shape "
            f"{_shape(input_ids)}{hint}"
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(
            f"input_ids must hold integer token ids (torch.long), got dtype {input_ids.dtype} of shape "
            f"{_shape(input_ids)}; token ids are not rounded: pass the tokenizer's ids (or .long() them yourself)"
        )
    if input_ids.dtype not in (torch.long, torch.int32):
        # the embedding takes int64 / int32 indices only (vanilla generate fails inside it); a narrower type may
        # already have wrapped ids above its range
        raise TypeError(
            f"input_ids must hold token ids as torch.long (int64) or torch.int32, got dtype {input_ids.dtype} of "
            f"shape {_shape(input_ids)}; a narrower integer type cannot hold every id of a large vocabulary (and "
            "may have wrapped them already): pass the tokenizer's ids, or convert ids that are still exact with "
            ".long()"
        )
    if input_ids.numel() == 0:
        raise ValueError(
            f"empty prompt: input_ids has shape {_shape(input_ids)}; pass at least one token per row "
            "(a BOS token for an unconditional start)"
        )
    _check_vocabulary(model, input_ids)
    if attention_mask is not None:
        _check_attention_mask(attention_mask, input_ids)


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _check_vocabulary(model, input_ids: torch.Tensor) -> None:
    """Every id must index the model's input embedding `[V, H]`."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(embedding, "num_embeddings", None)
    if vocab is None:
        return
    bad = (input_ids < 0) | (input_ids >= vocab)  # [B, W]
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"input_ids row {row} holds token id {int(input_ids[row, col])} (position {col}) outside the model's "
            f"vocabulary of {vocab} ids (0..{vocab - 1}); were the ids made by another model's tokenizer?"
        )


def _check_attention_mask(attention_mask, input_ids: torch.Tensor) -> None:
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor like input_ids, got {type(attention_mask).__name__}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {_shape(attention_mask)} but input_ids has shape {_shape(input_ids)}; they "
            "must match (one 0/1 entry per token: 1 = prompt token, 0 = left padding)"
        )
    if attention_mask.dtype != torch.bool:
        values = attention_mask.unique()
        odd = values[(values != 0) & (values != 1)]
        if odd.numel():
            raise ValueError(
                f"attention_mask (dtype {attention_mask.dtype}, shape {_shape(attention_mask)}) must hold only 0 and "
                f"1 (1 = prompt token, 0 = left padding), got {odd[:4].tolist()}; hf_specdec does not take soft masks"
            )


def _validate_generation_config(generation_config) -> None:
    if generation_config.num_beams not in (None, 1):
        raise ValueError(
            f"beam search (num_beams={generation_config.num_beams}) cannot be combined with an assistant; "
            "use num_beams=1 (greedy or sampling)"
        )
    if getattr(generation_config, "num_beam_groups", 1) not in (None, 1):
        raise ValueError("diverse beam search (num_beam_groups) cannot be combined with an assistant")
    for flag in UNSUPPORTED_FLAGS:
        if getattr(generation_config, flag, False):
            raise ValueError(f"generation option {flag}=True is not supported with an assistant")
    if getattr(generation_config, "penalty_alpha", None):
        raise ValueError("contrastive search (penalty_alpha) cannot be combined with an assistant")
    if getattr(generation_config, "guidance_scale", None) not in (None, 1, 1.0):
        raise ValueError("classifier-free guidance (guidance_scale) is not supported with an assistant")
    if getattr(generation_config, "prompt_lookup_num_tokens", None):
        raise ValueError(
            "prompt_lookup_num_tokens is transformers' own n-gram assistant; with assistant= use "
            "hf_specdec.NgramAssistant() instead"
        )


# Why a caller who passed no attention_mask may still see one (transformers builds it from the pad token id).
_INFERRED = (
    ". Without an attention_mask argument, transformers marks every pad_token_id in input_ids as padding: if that "
    "id is a real token of the prompt, pass attention_mask (1 for every real token)"
)


def prompt_starts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    """Index of each row's first prompt token in the left-padded `[B, W]` ``input_ids``.

    Raises a clear error for a row that is all padding or padded on the right.
    """
    bsz, width = input_ids.shape
    if attention_mask is None:
        return [0] * bsz
    starts = []
    for b in range(bsz):
        keep = attention_mask[b].bool()
        n = int(keep.sum())
        if n == 0:
            raise ValueError(
                f"empty prompt: row {b} of the batch is all padding (its attention_mask is all zeros){_INFERRED}"
            )
        if not bool(keep[width - n :].all()):
            raise ValueError(
                f"row {b} is not left-padded (its attention_mask has zeros after tokens); set "
                f"tokenizer.padding_side='left' for decoder-only generation{_INFERRED}"
            )
        starts.append(width - n)
    return starts


def check_generator(generator, model) -> None:
    """``generator=``: None, or a ``torch.Generator`` on the model's device (sampling draws on that device)."""
    if generator is None:
        return
    device = _model_device(model)
    where = "" if device is None else f" on the model's device ({device})"
    example = f"torch.Generator(device={str(device or 'cpu')!r}).manual_seed(0)"
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator{where}, e.g. {example}, or None; got {generator!r} "
            f"({type(generator).__name__})"
        )
    if device is not None and torch.device(generator.device).type != device.type:
        raise ValueError(
            f"generator is a torch.Generator on {generator.device}, but the model runs on {device}: sampling draws "
            f"on the model's device, so pass a generator there, e.g. {example}"
        )


def _model_device(model) -> torch.device | None:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return None if param is None else param.device


def check_int(owner: str, name: str, value, minimum: int | None = None) -> None:
    """Refuse a constructor argument that is not an int (bools and floats such as 2.5 included) or is too small."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner} {name} must be an int, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{owner} {name} must be at least {minimum}, got {value}")


def check_number(owner: str, name: str, value, low: float, high: float) -> None:
    """Refuse a constructor argument that is not a real number in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner} {name} must be a number in [{low}, {high}], got {value!r} ({type(value).__name__})")
    if not low <= value <= high:
        raise ValueError(f"{owner} {name} must be in [{low}, {high}], got {value}")
