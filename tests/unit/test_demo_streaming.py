"""The demo's token following: per-step groups, token origins, cancellation, the per-model lock, token texts."""

from __future__ import annotations

import threading

import torch

from hf_specdec.demo.streaming import DRAFTED, TARGET, IncrementalText, follow_generate, mark_origins
from hf_specdec.generation.proposers.ngram import NgramAssistant
from hf_specdec.testing import tiny_causal_lm


def repeating_prompt() -> torch.Tensor:
    return torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]])  # [1, 17]


def run(model, kwargs, cancel=None, lock=None):
    ids = repeating_prompt()
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    progress = list(follow_generate(model, inputs, kwargs, cancel, lock))[-1]
    assert progress.done and progress.error is None, progress.error
    return progress


def test_speculative_groups_rebuild_the_output_and_give_each_tokens_origin():
    model = tiny_causal_lm("llama")
    kwargs = {"max_new_tokens": 40, "do_sample": False, "return_dict_in_generate": True}
    vanilla = run(model, kwargs)
    spec = run(model, {**kwargs, "assistant": NgramAssistant()})
    ids = repeating_prompt()
    generated = spec.output.sequences[0, ids.shape[1] :].tolist()
    assert spec.tokens == generated == vanilla.tokens
    assert all(len(g) == 1 for g in vanilla.steps)
    stats = spec.output.spec_stats
    origins = mark_origins(spec.steps, True, stats.accepted_tokens)
    assert len(origins) == len(generated)
    assert origins.count(DRAFTED) == stats.accepted_tokens > 0
    assert origins.count(TARGET) == len(generated) - stats.accepted_tokens
    assert mark_origins(vanilla.steps, False) == [TARGET] * len(vanilla.tokens)


def test_a_last_step_cut_short_is_marked_as_drafted():
    # steps: prefill token, then 3 drafted + own, then a step cut after 2 drafted tokens by the token budget
    steps = [[1], [2, 3, 4, 5], [6, 7]]
    assert mark_origins(steps, True, accepted_tokens=5) == [TARGET] + [DRAFTED] * 3 + [TARGET] + [DRAFTED] * 2
    assert mark_origins(steps, True, accepted_tokens=4) == [TARGET] + [DRAFTED] * 3 + [TARGET, DRAFTED, TARGET]


def test_cancel_stops_the_call_within_a_step():
    model = tiny_causal_lm("llama")
    cancel = threading.Event()
    cancel.set()
    progress = run(model, {"max_new_tokens": 200, "do_sample": False, "assistant": NgramAssistant()}, cancel)
    assert 1 <= len(progress.tokens) < 200


def test_a_held_lock_makes_the_call_wait_and_reports_waiting():
    model = tiny_causal_lm("llama")
    lock = threading.Lock()
    lock.acquire()
    ids = repeating_prompt()
    follow = follow_generate(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                             {"max_new_tokens": 8, "do_sample": False}, None, lock)  # fmt: skip
    first = next(follow)
    assert not first.started and not first.tokens
    lock.release()
    last = list(follow)[-1]
    assert last.done and last.started and len(last.tokens) == 8


def test_an_abandoned_follow_cancels_its_call():
    model = tiny_causal_lm("llama")
    cancel = threading.Event()
    ids = repeating_prompt()
    follow = follow_generate(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                             {"max_new_tokens": 500, "do_sample": False}, cancel)  # fmt: skip
    next(follow)
    follow.close()
    assert cancel.is_set()


class ByteTokenizer:
    """Tokens are UTF-8 bytes: a multi-byte character spans several tokens, as in byte-level BPE."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_incremental_text_keeps_multibyte_characters_whole():
    text = IncrementalText(ByteTokenizer())
    ids = list("añb€".encode())
    pieces = text.extend(ids[:2]) + text.extend(ids[2:])
    assert pieces == ["a", "", "ñ", "b", "", "", "€"]
    assert "".join(pieces) == text.text == "añb€"
