import os

import pytest
import torch

import hf_specdec  # noqa: F401  (registers the attention and the assistant= route)
from hf_specdec.testing import tiny_causal_lm

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

ARCHS = ["llama", "qwen3", "mistral", "gemma"]


@pytest.fixture(scope="session")
def tiny_models():
    return {arch: tiny_causal_lm(arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def default_model():
    from hf_specdec.models import load_default_model

    return load_default_model()
