"""GenerationConfig options with an assistant behave exactly as in vanilla generate."""

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, TextIteratorStreamer, TextStreamer

import hf_specdec
from hf_specdec.testing import OracleProposer, RandomTreeProposer, assert_same_tokens, char_tokenizer, left_pad

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [3, 4, 5], [9, 9, 8, 7, 6, 5, 4], [12, 13, 12, 13, 12]]


def _both(model, assistant, batch=2, **kwargs):
    ids, mask = left_pad(PROMPTS[:batch])
    expected = model.generate(ids, attention_mask=mask, do_sample=False, **kwargs)
    out = model.generate(ids, attention_mask=mask, do_sample=False, assistant=assistant, **kwargs)
    return out, expected


def _eos_candidates(model, n=2):
    """Tokens that vanilla greedy emits early for the first prompt: good EOS ids for the tests."""
    ids = torch.tensor([PROMPTS[0]])
    gen = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :].tolist()
    return gen[3 : 3 + n]


@pytest.mark.parametrize("which", ["oracle", "random"])
def test_eos_token_id_list_stops_rows_and_pads_like_vanilla(tiny_models, which):
    model = tiny_models["llama"]
    eos = _eos_candidates(model)
    assistant = OracleProposer(model) if which == "oracle" else RandomTreeProposer(model.config.vocab_size)
    out, expected = _both(model, assistant, batch=4, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    assert_same_tokens(out, expected, "eos list")
    generated = out[:, max(len(p) for p in PROMPTS) :]
    assert any(t in eos for t in generated.flatten().tolist()), "the test should make some row stop on an EOS id"


def test_max_length_and_min_new_tokens(tiny_models):
    model = tiny_models["gemma"]
    eos = _eos_candidates(model, 1)
    out, expected = _both(model, OracleProposer(model), max_length=21)
    assert_same_tokens(out, expected, "max_length")
    out, expected = _both(model, OracleProposer(model), max_new_tokens=20, min_new_tokens=10, eos_token_id=eos)
    assert_same_tokens(out, expected, "min_new_tokens")


def test_repetition_penalty_and_no_repeat_ngram_apply_per_node(tiny_models):
    model = tiny_models["qwen3"]
    for kwargs in [dict(repetition_penalty=1.5), dict(no_repeat_ngram_size=2), dict(bad_words_ids=[[45], [81]])]:
        out, expected = _both(model, OracleProposer(model, depth=4), batch=4, max_new_tokens=20, **kwargs)
        assert_same_tokens(out, expected, str(kwargs))


def test_output_scores_and_logits_match_vanilla(tiny_models):
    model = tiny_models["llama"]
    ids = torch.tensor([PROMPTS[0]])
    kw = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_scores=True, output_logits=True)
    ref = model.generate(ids, repetition_penalty=1.3, **kw)
    out = model.generate(ids, repetition_penalty=1.3, assistant=OracleProposer(model), **kw)
    assert_same_tokens(out.sequences, ref.sequences, "sequences")
    assert len(out.scores) == len(ref.scores) == 10
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    stats = out.spec_stats
    assert stats.steps > 0 and stats.emitted_tokens == 10
    assert 1.0 <= stats.tau and 0.0 <= stats.acceptance_rate <= 1.0
    assert set(stats.to_dict()) >= {"steps", "drafted_tokens", "accepted_tokens", "tau", "acceptance_rate"}


class _Tok:
    """A minimal tokenizer: token i decodes to a two-letter word."""

    def __init__(self, vocab):
        self.words = [chr(97 + i % 26) + chr(97 + (i // 26) % 26) for i in range(vocab)]

    def decode(self, ids, skip_special_tokens=False, **kwargs):
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        return " ".join(self.words[i] for i in ids)


def test_streamer_receives_the_committed_tokens(tiny_models):
    model = tiny_models["llama"]
    tok = _Tok(model.config.vocab_size)
    ids = torch.tensor([PROMPTS[0]])
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    out = model.generate(ids, max_new_tokens=12, do_sample=False, assistant=OracleProposer(model), streamer=streamer)
    text = "".join(list(streamer))
    assert text.split() == tok.decode(out[0, ids.shape[1] :]).split()
    plain = TextStreamer(tok)
    model.generate(ids, max_new_tokens=4, do_sample=False, assistant=OracleProposer(model), streamer=plain)


def test_stop_strings_need_tokenizer_and_stop_like_vanilla(tiny_models):
    model = tiny_models["llama"]
    tok = char_tokenizer(model.config.vocab_size)  # one printable character per token
    ids = torch.tensor([PROMPTS[0]])
    gen = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :].tolist()
    stop = tok.convert_ids_to_tokens(gen[5])
    kw = dict(max_new_tokens=12, do_sample=False, stop_strings=[stop], tokenizer=tok)
    expected = model.generate(ids, **kw)
    out = model.generate(ids, assistant=OracleProposer(model), **kw)
    assert_same_tokens(out, expected, "stop_strings")
    assert out.shape[1] < ids.shape[1] + 12
    with pytest.raises(ValueError, match="tokenizer"):
        model.generate(ids, max_new_tokens=4, stop_strings=["x"], assistant=OracleProposer(model))


class _AddBias(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores + (input_ids[:, -1:] % 3 == 0).float()


def test_custom_processors_are_refused_unless_declared_pure(tiny_models):
    model = tiny_models["llama"]
    ids = torch.tensor([PROMPTS[0]])
    procs = LogitsProcessorList([_AddBias()])
    with pytest.raises(ValueError, match="_AddBias"):
        model.generate(ids, max_new_tokens=4, logits_processor=procs, assistant=OracleProposer(model))
    hf_specdec.register_per_node_processor(_AddBias)
    expected = model.generate(ids, max_new_tokens=10, do_sample=False, logits_processor=procs)
    out = model.generate(
        ids, max_new_tokens=10, do_sample=False, logits_processor=procs, assistant=OracleProposer(model)
    )
    assert_same_tokens(out, expected, "declared processor")
