"""`text_config`: the decoder's text config of a model or a config, read one way in every layer of the package (it
imports nothing of the package)."""

from __future__ import annotations


def text_config(model_or_config):
    """The decoder's text config of ``model_or_config`` (a model or its config): a multimodal model's language model
    config, the config itself otherwise."""
    is_config = hasattr(model_or_config, "get_text_config") or not hasattr(model_or_config, "config")
    config = model_or_config if is_config else model_or_config.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
