"""Defects a tester found in how one speculative call treats its inputs, each checked against vanilla `generate` on a
tiny model: the scores of a batch row after it finished, the warning for a prompt past the model's positions, id
dtypes, a fractional ``max_new_tokens``, a ``generator`` that is not one, and ``hf_specdec.assistants`` after a plain
``import hf_specdec``."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.utils import logging as hf_logging

import hf_specdec
from hf_specdec import NgramAssistant
from hf_specdec.testing import random_medusa_heads, tiny_causal_lm

# row 0 (left-padded) ends with EOS (id 2) after three tokens; row 1 runs to max_new_tokens
PROMPTS = torch.tensor([[0, 0, 6, 87, 72, 19, 4], [11, 12, 13, 14, 15, 16, 17]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])


@pytest.fixture(scope="module")
def model():
    return tiny_causal_lm("llama")


@pytest.mark.parametrize("assistant", ["ngram", "medusa"])
@pytest.mark.parametrize("processors", [{}, {"repetition_penalty": 1.3, "top_k": 20}])
def test_scores_and_logits_of_a_finished_row_match_vanilla(model, assistant, processors):
    """Vanilla keeps a finished row in its forwards (pad tokens after its EOS) and returns those scores; they were
    zeros here."""
    kwargs = dict(
        attention_mask=MASK, max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_scores=True,
        output_logits=True, **processors,
    )  # fmt: skip
    vanilla = model.generate(PROMPTS, **kwargs)
    helper = NgramAssistant() if assistant == "ngram" else random_medusa_heads(model, num_heads=2)
    ours = model.generate(PROMPTS, assistant=helper, **kwargs)
    assert torch.equal(ours.sequences, vanilla.sequences)
    row0 = ours.sequences[0, PROMPTS.shape[1] :].tolist()
    assert 2 in row0 and row0.index(2) < len(row0) - 1, "row 0 must finish before row 1 for this test"
    for name in ("scores", "logits"):
        torch.testing.assert_close(torch.stack(getattr(ours, name)), torch.stack(getattr(vanilla, name)))


class _StopAfter(StoppingCriteria):
    """Stops a row when it generates ``token`` (a criterion without an EOS id: vanilla then keeps decoding it)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("assistant", ["ngram", "medusa"])
def test_without_an_eos_criterion_a_stopped_row_keeps_decoding_as_in_vanilla(model, assistant):
    """Vanilla replaces a finished row's tokens by pad only when an EOS criterion is present; without one the row's
    own tokens (and their scores) go on until the last row is done."""
    kwargs = dict(
        attention_mask=MASK, max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True,
        output_logits=True, eos_token_id=None, stopping_criteria=StoppingCriteriaList([_StopAfter(58)]),
    )  # fmt: skip
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        vanilla = model.generate(PROMPTS, **kwargs)
        helper = NgramAssistant() if assistant == "ngram" else random_medusa_heads(model, num_heads=2)
        ours = model.generate(PROMPTS, assistant=helper, **kwargs)
    finally:
        model.generation_config.eos_token_id = saved
    assert 58 in vanilla.sequences[0, PROMPTS.shape[1] : -1].tolist(), "row 0 must stop before the end"
    assert torch.equal(ours.sequences, vanilla.sequences)
    for name in ("scores", "logits"):
        torch.testing.assert_close(torch.stack(getattr(ours, name)), torch.stack(getattr(vanilla, name)))


def _captured_warnings(model, caplog, **kwargs) -> list[str]:
    hf_logging.warning_once.cache_clear()  # vanilla logs it once per process
    logger = hf_logging.get_logger("transformers.generation.stopping_criteria")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="transformers.generation.stopping_criteria"):
            caplog.clear()
            model.generate(torch.arange(3, 15)[None], max_new_tokens=4, do_sample=False, **kwargs)
            return [r.getMessage() for r in caplog.records if "maximum length" in r.getMessage()]
    finally:
        logger.removeHandler(caplog.handler)


def test_a_prompt_past_max_position_embeddings_warns_as_vanilla(caplog):
    small = tiny_causal_lm("llama", max_position_embeddings=8)
    vanilla = _captured_warnings(small, caplog)
    assert vanilla and "maximum length (8)" in vanilla[0]
    assert _captured_warnings(small, caplog, assistant=NgramAssistant()) == vanilla
    assert _captured_warnings(tiny_causal_lm("llama"), caplog, assistant=NgramAssistant()) == []


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.int8])
def test_narrow_integer_ids_are_refused_by_dtype(model, dtype):
    ids = torch.tensor([[1, 5, 7, 9]], dtype=dtype)
    with pytest.raises(RuntimeError, match="Long, Int"):  # vanilla fails inside the embedding
        model.generate(ids, max_new_tokens=3, do_sample=False)
    with pytest.raises(TypeError, match=rf"input_ids must hold token ids as torch.long.*got dtype {dtype}"):
        model.generate(ids, max_new_tokens=3, do_sample=False, assistant=NgramAssistant())


def test_int32_ids_work_as_in_vanilla(model):
    ids = torch.tensor([[1, 5, 7, 9]], dtype=torch.int32)
    expected = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False, assistant=NgramAssistant()), expected)


def test_a_fractional_max_new_tokens_is_treated_as_vanilla_does(model):
    ids = torch.tensor([[1, 5, 7, 9]])
    expected = model.generate(ids, max_new_tokens=2.5, do_sample=False)  # vanilla: 3 new tokens
    ours = model.generate(ids, max_new_tokens=2.5, do_sample=False, assistant=NgramAssistant())
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("generator", [123, "cuda", 7.5])
def test_a_bad_generator_is_refused_before_anything_runs(model, generator):
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises((TypeError, ValueError), match=r"generator.*torch.Generator.*device"):
            model.generate(
                torch.tensor([[1, 5, 7]]), max_new_tokens=3, do_sample=True, generator=generator,
                assistant=NgramAssistant(),
            )  # fmt: skip
    finally:
        handle.remove()
    assert calls == [], "the model ran before the generator was checked"


def test_a_generator_on_the_models_device_works(model):
    ids = torch.tensor([[1, 5, 7]])
    outs = [
        model.generate(ids, max_new_tokens=5, do_sample=True, assistant=NgramAssistant(),
                       generator=torch.Generator().manual_seed(3))
        for _ in range(2)
    ]  # fmt: skip
    assert torch.equal(outs[0], outs[1])


def test_submodules_are_reachable_after_a_plain_import():
    code = "import hf_specdec; print(hf_specdec.assistants.available_assistants()[:1], hf_specdec.models.__name__)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "hf_specdec.models" in proc.stdout
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hf_specdec.nope  # noqa: B018
