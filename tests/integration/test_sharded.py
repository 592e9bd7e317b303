"""A target dispatched by accelerate (``device_map``) with layers offloaded to disk: accelerate's hooks load each
offloaded layer's weights for its forward and drop them afterwards, and speculative greedy output equals vanilla's
on the same dispatched model, token for token, with prompt lookup and with a draft head.

hf_specdec runs the model as it is: its attention goes through the plan whatever device a layer's weights come
from, and the packed CPU linears skip every layer that carries an accelerate hook (an instance ``forward``) or whose
weight is on the meta device (docs/multi_device.md).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_specdec
from hf_specdec.generation.packed_linears import packed_linears
from hf_specdec.testing import assert_same_tokens, left_pad, random_medusa_heads, spec_bench_batch, tiny_causal_lm

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9], [3, 4, 5], [12, 13, 12, 13, 12, 13, 12, 13, 12]]


def _device_map(num_layers: int, on_disk: set[int]) -> dict[str, str]:
    """Embeddings, norm and lm_head on the CPU; the layers in ``on_disk`` offloaded to disk, the others on the CPU."""
    dm = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    dm.update({f"model.layers.{i}": "disk" if i in on_disk else "cpu" for i in range(num_layers)})
    return dm


def _dispatched(folder, num_layers: int, on_disk: set[int], offload_folder):
    model = AutoModelForCausalLM.from_pretrained(
        folder, device_map=_device_map(num_layers, on_disk), offload_folder=str(offload_folder)
    ).eval()
    _check_offloaded(model, on_disk)
    return model


def _check_offloaded(model, on_disk: set[int]) -> None:
    offloaded = [i for i, layer in enumerate(model.model.layers) if layer.mlp.up_proj.weight.device.type == "meta"]
    assert offloaded == sorted(on_disk), f"expected layers {sorted(on_disk)} on disk, got {offloaded}"
    assert all(hasattr(model.model.layers[i], "_hf_hook") for i in on_disk)


def _check_equal(model, ids, mask, assistants: dict, new_tokens: int, label: str) -> None:
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    for name, assistant in assistants.items():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             assistant=assistant, return_dict_in_generate=True)  # fmt: skip
        assert_same_tokens(out.sequences, expected, f"{label} assistant={name}")
        assert out.spec_stats.drafted_tokens > 0, f"{label} assistant={name} drafted nothing: no tree was verified"


def test_tiny_target_with_layers_on_disk(tmp_path):
    folder = tmp_path / "tiny"
    tiny_causal_lm("llama", num_layers=4).save_pretrained(folder)
    model = _dispatched(folder, 4, {1, 3}, tmp_path / "offload")
    # offloaded layers (meta weights) are never patched (nor, today, any layer under an accelerate hook)
    with packed_linears(model, enabled=True):
        ours = [n for n, m in model.named_modules() if getattr(m.__dict__.get("forward"), "hf_specdec_packed", False)]
        assert not any(n.startswith(("model.layers.1.", "model.layers.3.")) for n in ours), ours
    ids, mask = left_pad(PROMPTS)
    assistants = {"ngram": hf_specdec.NgramAssistant(), "medusa": random_medusa_heads(model, share_lm_head=True)}
    _check_equal(model, ids, mask, assistants, 24, "tiny, layers 1 and 3 on disk")
    for i in (1, 3):  # the hooks dropped the offloaded weights again
        assert model.model.layers[i].mlp.up_proj.weight.device.type == "meta"


@pytest.mark.slow
def test_default_model_with_layers_on_disk(tmp_path):
    from hf_specdec.models import load_default_model

    on_disk = {4, 15, 27}
    model, tokenizer = load_default_model(device_map=_device_map(30, on_disk), offload_folder=str(tmp_path / "off"))
    _check_offloaded(model, on_disk)
    ids, mask = spec_bench_batch(tokenizer, 2)
    assistants = {name: hf_specdec.load_default_assistant(name) for name in ("ngram", "medusa", "eagle")}
    _check_equal(model, ids, mask, assistants, 16, "default model, 3 layers on disk")


def test_a_dispatched_model_keeps_its_device_map_after_generate(tmp_path):
    """Nothing of the dispatch changes: same hooks, same devices, offloaded weights back on meta after a call."""
    folder = tmp_path / "tiny"
    tiny_causal_lm("llama", num_layers=2, seed=3).save_pretrained(folder)
    model = _dispatched(folder, 2, {0}, tmp_path / "offload")
    before = {n: p.device.type for n, p in model.named_parameters()}
    hooks = {n: type(getattr(m, "_hf_hook", None)) for n, m in model.named_modules()}
    ids = torch.tensor([PROMPTS[0]])
    model.generate(ids, max_new_tokens=12, do_sample=False, assistant=hf_specdec.NgramAssistant())
    assert {n: p.device.type for n, p in model.named_parameters()} == before
    assert {n: type(getattr(m, "_hf_hook", None)) for n, m in model.named_modules()} == hooks
