"""Every kind of bad input, one table row each: the call, the error type it must raise, the words the message must
contain; after each, the model still gives vanilla's greedy output with an assistant (nothing was left behind)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import hf_specdec
from hf_specdec import DraftModelAssistant, MedusaHeads, NgramAssistant
from hf_specdec.testing import OracleProposer, random_medusa_heads, tiny_causal_lm

IDS = torch.tensor([[5, 6, 7, 8, 5, 6]])


@dataclass
class Case:
    name: str
    call: Callable  # (model, tmp_path) -> anything; must raise
    error: type[BaseException]
    words: tuple[str, ...]  # each must appear in the message (case-insensitive)


def _gen(ids=IDS, assistant=None, **kwargs):
    """A speculative call on the table's model with ``kwargs``."""

    def call(model, tmp_path):
        a = assistant(model) if callable(assistant) else (assistant or OracleProposer(model))
        return model.generate(ids, assistant=a, **{"max_new_tokens": 4, **kwargs})

    return call


def _heads_folder(tmp_path: Path, model, damage: Callable[[Path], None]) -> Path:
    """Medusa heads saved in our format to ``tmp_path/heads``, then damaged."""
    folder = tmp_path / "heads"
    random_medusa_heads(model, num_heads=2).save_pretrained(folder)
    damage(folder)
    return folder


def _truncate(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])


def _garbage(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"\x00\x01not a safetensors file at all" * 10)


def _bad_json(folder: Path) -> None:
    (folder / "config.json").write_text('{"medusa_num_heads": 2, ')


def _wrong_config(folder: Path) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["hidden_size"] = 12345
    (folder / "config.json").write_text(json.dumps(cfg))


def _foreign_tensors(folder: Path) -> None:
    save_file({"model.layers.0.weight": torch.zeros(4, 4)}, str(folder / "model.safetensors"))


class _Payload:
    """An object a weights_only unpickler must refuse to build."""


def _code_pickle(folder: Path) -> None:
    """FasterDecoding's upstream layout (medusa_lm_head.pt + its config), pickled with an object in it."""
    for name in ("model.safetensors", "config.json"):
        (folder / name).unlink()
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    torch.save({"0.0.linear.weight": torch.zeros(4, 4), "extra": _Payload()}, folder / "medusa_lm_head.pt")


def _load_heads(damage):
    def call(model, tmp_path):
        return MedusaHeads.from_pretrained(_heads_folder(tmp_path, model, damage))

    return call


CASES = [
    # prompts vanilla rejects or misreads
    Case("float input_ids", _gen(IDS.float()), TypeError, ("input_ids", "torch.float32", "[1, 6]", "torch.long")),
    Case("1-D input_ids", _gen(IDS[0]), ValueError, ("input_ids", "[batch, length]", "[6]", "ids[None]")),
    Case("empty input_ids", _gen(IDS[:, :0]), ValueError, ("empty prompt", "[1, 0]")),
    Case("id above the vocabulary", _gen(torch.tensor([[5, 6, 200]])), ValueError, ("200", "row 0", "97")),
    Case("negative id", _gen(torch.tensor([[5, 6], [7, -1]])), ValueError, ("-1", "row 1", "97")),
    Case(
        "mask narrower than the ids",
        _gen(attention_mask=torch.tensor([[0, 1, 1, 1]])),
        ValueError,
        ("attention_mask", "[1, 4]", "[1, 6]", "must match"),
    ),
    Case(
        "mask of 0.5s",
        _gen(attention_mask=torch.full((1, 6), 0.5)),
        ValueError,
        ("attention_mask", "0.5", "only 0 and 1", "torch.float32"),
    ),
    Case(
        "inputs_embeds",
        lambda m, _: m.generate(inputs_embeds=torch.randn(1, 3, 64), assistant=OracleProposer(m), max_new_tokens=4),
        ValueError,
        ("inputs_embeds", "not supported with an assistant", "input_ids"),
    ),
    Case(
        "all-padding row",
        _gen(torch.tensor([[0, 0], [5, 6]]), attention_mask=torch.tensor([[0, 0], [1, 1]])),
        ValueError,
        ("empty prompt", "row 0"),
    ),
    Case(
        "right padding",
        _gen(torch.tensor([[5, 6, 0], [5, 6, 7]]), attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]])),
        ValueError,
        ("row 0", "left"),
    ),
    # generation options the loop does not implement
    Case("beam search", _gen(num_beams=2), ValueError, ("beam search", "num_beams=2")),
    Case(
        "output_attentions",
        _gen(output_attentions=True, return_dict_in_generate=True),
        ValueError,
        ("output_attentions",),
    ),
    Case("assistant_model as well", _gen(assistant_model="x"), ValueError, ("assistant_model", "not both")),
    Case("prompt lookup", _gen(prompt_lookup_num_tokens=3), ValueError, ("prompt_lookup_num_tokens", "NgramAssistant")),
    Case("contrastive search", _gen(penalty_alpha=0.5, top_k=4), ValueError, ("contrastive",)),
    Case("streamer with a batch", _gen(IDS.repeat(2, 1), streamer=object()), ValueError, ("streamer", "batch")),
    # assistants
    Case("a string assistant", _gen(assistant="medusa"), TypeError, ("str",)),
    Case("an assistant class", _gen(assistant=lambda m: DraftModelAssistant), TypeError, ("pass an instance",)),
    Case(
        "draft model with another vocabulary",
        _gen(assistant=lambda m: tiny_causal_lm("llama", vocab_size=50)),
        ValueError,
        ("50 tokens", "97 tokens"),
    ),
    Case("NgramAssistant(max_depth=2.5)", lambda m, _: NgramAssistant(max_depth=2.5), TypeError, ("max_depth", "2.5")),
    Case("NgramAssistant(max_ngram='4')", lambda m, _: NgramAssistant(max_ngram="4"), TypeError, ("max_ngram", "'4'")),
    Case("NgramAssistant(max_nodes=0)", lambda m, _: NgramAssistant(max_nodes=0), ValueError, ("max_nodes", "1")),
    Case(
        "NgramAssistant(min_ngram > max_ngram)",
        lambda m, _: NgramAssistant(max_ngram=2, min_ngram=3),
        ValueError,
        ("min_ngram", "max_ngram"),
    ),
    # head folders
    Case("truncated model.safetensors", _load_heads(_truncate), ValueError, ("model.safetensors",)),
    Case("garbage model.safetensors", _load_heads(_garbage), ValueError, ("model.safetensors",)),
    Case("invalid config.json", _load_heads(_bad_json), ValueError, ("config.json",)),
    Case(
        "config.json that does not match the weights",
        _load_heads(_wrong_config),
        ValueError,
        ("model.safetensors", "shape", "12345"),
    ),
    Case("foreign tensors in model.safetensors", _load_heads(_foreign_tensors), ValueError, ("model.safetensors",)),
    Case(
        "pickle that needs code to load", _load_heads(_code_pickle), ValueError, ("weights_only", "medusa_lm_head.pt")
    ),
    Case(
        "heads for another hidden size",
        _gen(assistant=lambda m: random_medusa_heads(tiny_causal_lm("llama", hidden_size=32), num_heads=2)),
        ValueError,
        ("32", "64"),
    ),
    Case("missing heads folder", lambda m, t: MedusaHeads.from_pretrained(t / "nowhere"), OSError, ("nowhere",)),
]


@pytest.fixture(scope="module")
def model():
    return tiny_causal_lm("llama", num_layers=2)


@pytest.fixture(scope="module")
def vanilla(model):
    return model.generate(IDS, max_new_tokens=8, do_sample=False)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_a_clear_error_and_leaves_the_model_exact(case, model, vanilla, tmp_path):
    with pytest.raises(case.error) as info:
        case.call(model, tmp_path)
    message = str(info.value).lower()
    missing = [w for w in case.words if w.lower() not in message]
    assert not missing, f"{case.name}: {missing} not in {info.value!s}"
    for assistant in (NgramAssistant(), OracleProposer(model)):
        out = model.generate(IDS, max_new_tokens=8, do_sample=False, assistant=assistant)
        assert torch.equal(out, vanilla), f"after {case.name}: {type(assistant).__name__} differs from vanilla"
    assert model.config._attn_implementation == "sdpa"


def test_integer_masks_of_any_dtype_are_accepted(model, vanilla):
    """0/1 masks as bool, int or float are what tokenizers and users pass: not errors."""
    for mask in (torch.ones(1, 6, dtype=torch.bool), torch.ones(1, 6), torch.ones(1, 6, dtype=torch.int32)):
        out = model.generate(IDS, attention_mask=mask, max_new_tokens=8, do_sample=False, assistant=NgramAssistant())
        assert torch.equal(out, vanilla)


def test_int32_input_ids_are_accepted(model, vanilla):
    out = model.generate(IDS.int(), max_new_tokens=8, do_sample=False, assistant=NgramAssistant())
    assert out[0].tolist() == vanilla[0].tolist()


def test_the_wrapped_generate_is_still_vanilla_without_an_assistant(model):
    """The checks run only for calls with ``assistant=``: vanilla's own behaviour is not changed."""
    assert hf_specdec.generate is not None
    out = model.generate(IDS, attention_mask=torch.full((1, 6), 0.5), max_new_tokens=2, do_sample=False)
    assert out.shape == (1, 8)
