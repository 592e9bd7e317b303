"""Quantized targets (torchao weight-only int8 and int4 on the CPU): speculative greedy output equals vanilla
``generate`` of the same quantized model, token for token, with prompt lookup and with a draft head.

Both run the same quantized linears (torchao's tensor subclasses dispatch their own kernels); hf_specdec's packed CPU
linears leave them alone (only plain fp32 weights are packed), so a verify forward differs from a decode step only
in how many rows each quantized GEMM multiplies, as in fp32. torchao 0.18's ``Int4WeightOnlyConfig`` has no CPU
layout (its formats need CUDA or the mslk kernels, for vanilla as for us); int4 on the CPU is
``IntxWeightOnlyConfig(weight_dtype=torch.int4)``, tested here (docs/multi_device.md).
"""

from __future__ import annotations

import pytest
import torch

import hf_specdec
from hf_specdec.generation.packed_linears import packed_linears
from hf_specdec.testing import assert_same_tokens, left_pad, random_medusa_heads, spec_bench_batch, tiny_causal_lm

torchao = pytest.importorskip("torchao", reason="torchao is the `quant` extra: pip install -e '.[quant]'")
from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, PerGroup, quantize_  # noqa: E402
from transformers import AutoModelForCausalLM, TorchAoConfig  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9], [3, 4, 5], [12, 13, 12, 13, 12, 13, 12, 13, 12]]
QUANTIZERS = {
    "int8": lambda: Int8WeightOnlyConfig(),
    "int4": lambda: IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
}


def _quantized_linears(model) -> list[torch.nn.Linear]:
    """The model's linear layers whose weight is a torchao tensor subclass."""
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear) and type(m.weight.data) is not torch.Tensor]


def _check_equal(model, ids, mask, assistants: dict, new_tokens: int, label: str) -> None:
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    for name, assistant in assistants.items():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             assistant=assistant, return_dict_in_generate=True)  # fmt: skip
        assert_same_tokens(out.sequences, expected, f"{label} assistant={name}")
        assert out.spec_stats.drafted_tokens > 0, f"{label} assistant={name} drafted nothing: no tree was verified"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny Llama saved to a folder (hidden 128: int4 groups of 32 fit every matrix)."""
    folder = tmp_path_factory.mktemp("tiny_llama_quant")
    tiny_causal_lm("llama", hidden_size=128, num_layers=2).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("quant", sorted(QUANTIZERS))
def test_tiny_target_loaded_with_quantization_config(tiny_folder, quant):
    """The transformers way: ``from_pretrained(..., quantization_config=TorchAoConfig(...))``."""
    model = AutoModelForCausalLM.from_pretrained(tiny_folder, quantization_config=TorchAoConfig(QUANTIZERS[quant]()))
    model.eval()
    quantized = _quantized_linears(model.model)
    assert len(quantized) == 2 * 7, f"{quant}: expected every decoder linear quantized, got {len(quantized)}"
    with packed_linears(model, enabled=True) as patched:  # only the plain fp32 lm_head may be packed
        assert patched == sum(isinstance(m, torch.nn.Linear) for m in model.modules()) - len(quantized)
        assert all("forward" not in m.__dict__ for m in quantized)
    ids, mask = left_pad(PROMPTS)
    assistants = {"ngram": hf_specdec.NgramAssistant(), "medusa": random_medusa_heads(model, share_lm_head=True)}
    _check_equal(model, ids, mask, assistants, 24, f"tiny {quant}")


@pytest.mark.parametrize("quant", sorted(QUANTIZERS))
def test_tiny_target_quantized_in_place_lm_head_included(quant):
    """``quantize_`` on the whole model, the lm_head too: the heads project through a quantized lm_head."""
    model = tiny_causal_lm("llama", hidden_size=128, num_layers=2)
    quantize_(model, QUANTIZERS[quant]())
    assert type(model.lm_head.weight.data) is not torch.Tensor
    ids, mask = left_pad(PROMPTS)
    assistants = {"ngram": hf_specdec.NgramAssistant(), "medusa": random_medusa_heads(model, share_lm_head=True)}
    _check_equal(model, ids, mask, assistants, 24, f"tiny {quant} (quantize_)")


@pytest.mark.slow
@pytest.mark.parametrize("quant", sorted(QUANTIZERS))
def test_default_model_quantized_matches_its_own_vanilla(quant):
    """The default model loaded with ``TorchAoConfig``, a chat prompt, prompt lookup and the shipped EAGLE head (a
    quantized linear runs ~1 ms per call on one core here: a longer run would take minutes)."""
    from hf_specdec.models import load_default_model

    model, tokenizer = load_default_model(quantization_config=TorchAoConfig(QUANTIZERS[quant]()))
    assert len(_quantized_linears(model.model)) == 30 * 7
    ids, mask = spec_bench_batch(tokenizer, 1)
    assistants = {name: hf_specdec.load_default_assistant(name) for name in ("ngram", "eagle")}
    _check_equal(model, ids, mask, assistants, 16, f"default model {quant}")


@pytest.mark.parametrize("quant", sorted(QUANTIZERS))
def test_fresh_heads_copy_a_quantized_lm_head(quant):
    """Heads with lm_heads of their own start as copies of the target's: a quantized lm_head is dequantized for the
    copy (it cannot be copied into a plain tensor as it is), so the copies equal the dequantized weight, and the heads
    draft for the quantized target with greedy output equal to vanilla."""
    model = tiny_causal_lm("llama", hidden_size=128, num_layers=2)
    quantize_(model, QUANTIZERS[quant]())
    dense = model.lm_head.weight.dequantize()  # [V, H]
    medusa = random_medusa_heads(model, share_lm_head=False)
    fresh = hf_specdec.MedusaHeads.for_model(model, num_heads=2, share_lm_head=False)
    assert all(torch.equal(w, dense) for w in fresh.lm_head_weight)
    rows = torch.arange(0, dense.shape[0], 2)  # an EAGLE-3 head over a draft vocabulary copies those rows
    eagle = hf_specdec.EagleHead.for_model(model, version=3, draft_vocab=rows)
    assert torch.equal(eagle.lm_head.weight, dense[rows])
    ids, mask = left_pad(PROMPTS)
    _check_equal(model, ids, mask, {"medusa": medusa, "eagle": eagle}, 16, f"tiny {quant} own lm_heads")


def test_the_cli_loads_a_quantized_model_the_transformers_way():
    """``--quantization int8`` (generate, bench) loads the default model through ``TorchAoConfig``: its linears hold
    torchao weights, and the config records the quantizer."""
    from hf_specdec.cli_args import load_model_argument

    model, _tokenizer, _name = load_model_argument(None, quantization="int8")
    assert _quantized_linears(model)
    assert model.config.quantization_config.quant_method == "torchao"
