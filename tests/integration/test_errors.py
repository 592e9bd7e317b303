"""Bad input gets a clear error and leaves the model usable."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM

import hf_specdec
from hf_specdec import DraftModelAssistant
from hf_specdec.testing import OracleProposer, assert_same_tokens, tiny_causal_lm

IDS = torch.tensor([[5, 6, 7, 8]])


def _still_works(model):
    expected = model.generate(IDS, max_new_tokens=6, do_sample=False)
    out = model.generate(IDS, max_new_tokens=6, do_sample=False, assistant=OracleProposer(model))
    assert_same_tokens(out, expected, "after error")
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_beams=2), "beam search"),
        (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
        (dict(output_hidden_states=True, return_dict_in_generate=True), "output_hidden_states"),
        (dict(assistant_model="x"), "not both"),
        (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
        (dict(penalty_alpha=0.5, top_k=4), "contrastive"),
    ],
)
def test_unsupported_options_are_refused_by_name(tiny_models, kwargs, match):
    model = tiny_models["llama"]
    with pytest.raises(ValueError, match=match):
        model.generate(IDS, max_new_tokens=4, assistant=OracleProposer(model), **kwargs)
    _still_works(model)


def test_empty_prompt_is_refused(tiny_models):
    model = tiny_models["llama"]
    with pytest.raises(ValueError, match="empty prompt"):
        model.generate(
            torch.tensor([[0, 0], [5, 6]]),
            attention_mask=torch.tensor([[0, 0], [1, 1]]),
            max_new_tokens=3,
            assistant=OracleProposer(model),
        )
    _still_works(model)


def test_right_padding_is_refused(tiny_models):
    model = tiny_models["llama"]
    with pytest.raises(ValueError, match="left"):
        model.generate(
            torch.tensor([[5, 6, 0], [5, 6, 7]]),
            attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]),
            max_new_tokens=3,
            assistant=OracleProposer(model),
        )


def test_vocabulary_mismatch_names_both_sizes(tiny_models):
    model = tiny_models["llama"]
    draft = tiny_causal_lm("llama", vocab_size=50)
    with pytest.raises(ValueError, match=r"50 tokens.*97 tokens"):
        model.generate(IDS, max_new_tokens=3, assistant=draft)
    _still_works(model)


def test_unknown_assistant_objects_are_refused(tiny_models):
    model = tiny_models["llama"]
    with pytest.raises(TypeError, match="does not know how to draft with a str"):
        model.generate(IDS, max_new_tokens=3, assistant="medusa")
    with pytest.raises(TypeError, match="pass an instance"):
        model.generate(IDS, max_new_tokens=3, assistant=DraftModelAssistant)
    _still_works(model)


def test_encoder_decoder_target_is_refused():
    cfg = AutoConfig.for_model(
        "t5", vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0
    )
    model = AutoModelForSeq2SeqLM.from_config(cfg).eval()
    with pytest.raises(ValueError, match="encoder-decoder"):
        model.generate(IDS, max_new_tokens=3, assistant=OracleProposer(model))


def test_failing_proposer_leaves_model_usable(tiny_models):
    model = tiny_models["llama"]

    class Broken(hf_specdec.Proposer):
        def propose(self, rows):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.generate(IDS, max_new_tokens=5, assistant=Broken())
    _still_works(model)


def test_out_of_vocabulary_drafts_are_refused(tiny_models):
    model = tiny_models["llama"]

    class Wild(hf_specdec.Proposer):
        def propose(self, rows):
            return [hf_specdec.DraftTree.chain([1000]) for _ in rows]

    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        model.generate(IDS, max_new_tokens=5, assistant=Wild())
    _still_works(model)
