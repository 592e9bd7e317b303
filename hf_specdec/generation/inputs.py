"""Checks of one speculative ``generate`` call's inputs before anything runs, and where each row's prompt starts.

Everything transformers' vanilla decoding would do differently (beam search, contrastive search, guidance, extra
model inputs, ...) is refused by name, so an assistant never silently changes what ``generate`` means.
"""

from __future__ import annotations

import torch

# GenerationConfig fields that change vanilla decoding and that the loop does not implement. Each is refused by name.
UNSUPPORTED_FLAGS = ("output_attentions", "output_hidden_states", "low_memory", "token_healing")
# model inputs the loop understands (the rest is refused)
ALLOWED_MODEL_INPUTS = {
    "attention_mask",
    "position_ids",
    "logits_to_keep",
    "use_cache",
    "past_key_values",
    "cache_position",
}


def validate_call(model, input_ids: torch.Tensor, generation_config, model_kwargs: dict) -> None:
    """Raise a clear error for anything in the call that the speculative loop cannot honour exactly."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder model; hf_specdec's assistant= supports decoder-only "
            "causal language models"
        )
    if input_ids is None or input_ids.dim() != 2:
        raise ValueError("hf_specdec needs input_ids of shape [batch, length] (inputs_embeds is not supported)")
    if input_ids.shape[1] == 0 or input_ids.shape[0] == 0:
        raise ValueError("empty prompt: input_ids has no tokens; pass at least one token per row")
    _validate_generation_config(generation_config)
    cache = model_kwargs.get("past_key_values")
    if cache is not None and getattr(cache, "_is_user_defined", False) and cache.get_seq_length() > 0:
        raise ValueError(
            "past_key_values with cached tokens cannot be continued with an assistant; pass the full prompt"
        )
    extra = sorted(k for k, v in model_kwargs.items() if k not in ALLOWED_MODEL_INPUTS and v is not None)
    if extra:
        raise ValueError(
            f"model inputs {extra} are not supported with an assistant (only input_ids and attention_mask)"
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
            raise ValueError(f"empty prompt: row {b} of the batch is all padding")
        if not bool(keep[width - n :].all()):
            raise ValueError(
                f"row {b} is not left-padded (its attention_mask has zeros after tokens); set "
                "tokenizer.padding_side='left' for decoder-only generation"
            )
        starts.append(width - n)
    return starts
