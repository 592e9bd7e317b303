"""docs/own_model.md's story on a model that is not the default one: ``hf-specdec train medusa --model FOLDER`` trains
heads for it, and those heads draft for it through ``assistant=`` with vanilla's greedy output."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_specdec
from hf_specdec.cli import main
from hf_specdec.testing import tiny_causal_lm

pytestmark = pytest.mark.slow  # borrows the default model's tokenizer (chat template)


def test_train_medusa_for_your_own_model_and_use_the_heads(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(hf_specdec.default_model_dir())
    own = tiny_causal_lm("llama", vocab_size=len(tokenizer), hidden_size=64)
    own.generation_config.eos_token_id = tokenizer.eos_token_id
    own.save_pretrained(tmp_path / "my-model")
    tokenizer.save_pretrained(tmp_path / "my-model")
    out = tmp_path / "heads"
    code = main(["train", "medusa", "--model", str(tmp_path / "my-model"), "--out", str(out), "--num-prompts", "8",
                 "--num-context-prompts", "0", "--max-new-tokens", "8", "--max-steps", "2", "--num-heads", "2",
                 "--no-tune-tree", "--device", "cpu", "--threads", "1"])  # fmt: skip
    assert code == 0
    config = json.loads((out / "config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "my-model")

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "my-model").eval()
    heads = hf_specdec.MedusaHeads.from_pretrained(out, base_model=model)
    ids = hf_specdec.chat_prompt_ids(tokenizer, "Name three colours.")  # [1, W]
    vanilla = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    spec = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          assistant=heads, return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(spec.sequences, vanilla) and spec.spec_stats.steps >= 1
