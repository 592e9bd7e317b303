import os

import pytest
import torch

import hf_specdec  # noqa: F401  (registers the attention and the assistant= route)
from hf_specdec.testing import CORE_ARCHS, tiny_causal_lm

# scripts/test.sh runs the suite in parallel processes (pytest-xdist) and sets each one's share of the cores in
# OMP_NUM_THREADS; a plain `pytest` run uses up to two threads.
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or max(1, min(2, os.cpu_count() or 1))))
# No test reads or writes a cost curve learnt by another run (a developer's cache, an earlier test): budgets and
# their reports start from the prior; tests of the cache point HF_SPECDEC_COST_CACHE at a tmp_path themselves.
os.environ["HF_SPECDEC_COST_CACHE"] = "0"


@pytest.fixture(scope="session")
def tiny_models():
    return {arch: tiny_causal_lm(arch) for arch in CORE_ARCHS}


@pytest.fixture(scope="session")
def default_model():
    from hf_specdec.models import load_default_model

    return load_default_model()


@pytest.fixture(scope="module")
def saved_tiny_llama(tmp_path_factory):
    """A tiny 8-layer Llama (EAGLE-3's default feature layers 2, 4, 5 are distinct) saved to a folder, its config
    naming that folder: what a checkpoint's verifier name must point to for readers of the verifier's files."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    model = tiny_causal_lm("llama", num_layers=8)
    model.save_pretrained(folder)
    model.config._name_or_path = str(folder)
    return model
