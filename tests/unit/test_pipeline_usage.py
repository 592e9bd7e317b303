"""transformers' ``pipeline("text-generation")`` passes ``assistant=`` through to ``generate``, so speculative
decoding works from a pipeline as docs/usage.md shows: the assistant is asked to draft, and the text is vanilla's."""

from __future__ import annotations

from transformers import pipeline

import hf_specdec
from hf_specdec.testing import char_tokenizer, tiny_causal_lm


class CountingNgram(hf_specdec.NgramAssistant):
    calls = 0

    def propose(self, rows):
        CountingNgram.calls += 1
        return super().propose(rows)


def test_a_text_generation_pipeline_drafts_with_the_assistant_and_keeps_vanilla_text():
    pipe = pipeline("text-generation", model=tiny_causal_lm(vocab_size=97), tokenizer=char_tokenizer(97))
    vanilla = pipe("abcabcabcab", max_new_tokens=16, do_sample=False)
    speculative = pipe("abcabcabcab", max_new_tokens=16, do_sample=False, assistant=CountingNgram())
    assert speculative == vanilla
    assert CountingNgram.calls > 0, "the pipeline did not reach the speculative loop"
