"""Tiny random-weight models of real architectures, for tests and examples that must run anywhere in seconds."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

# Small but structurally faithful: GQA where the architecture has it, several layers, a real head_dim.
_ARCH_KWARGS = {
    "llama": dict(num_attention_heads=4, num_key_value_heads=2),
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "mistral": dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=None),
    "gemma": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16),
}


def tiny_causal_lm(
    arch: str = "llama",
    vocab_size: int = 97,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides,
):
    """A randomly initialised decoder-only model of ``arch`` (llama, qwen2, qwen3, mistral, gemma), eval mode.

    The weights are drawn with a larger-than-usual std so that logits are peaked enough to give non-trivial
    greedy continuations (a near-uniform model would make every draft fail).
    """
    if arch not in _ARCH_KWARGS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {sorted(_ARCH_KWARGS)}")
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    kwargs.update(_ARCH_KWARGS[arch])
    kwargs.update(overrides)
    config = AutoConfig.for_model(arch, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    return model.eval()
