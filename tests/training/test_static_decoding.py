"""The data builder's static-cache greedy loop (`training.static_decoding`) gives the dynamic loop's answers and
states, on tiny models of several architectures and on the default model; its step traces as one graph (what a CUDA
graph capture needs: no host synchronisation, no data-dependent Python); models it cannot decode are refused by name
and the builder falls back to the dynamic loop with the same data."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.testing import tiny_causal_lm, torch_threads
from hf_specdec.training import static_decoding
from hf_specdec.training.chat_template import chat_ids
from hf_specdec.training.distillation_data import build_distillation_data
from hf_specdec.training.shards import load_distillation_data
from hf_specdec.training.static_decoding import check_static_decodable, greedy_answers_static
from hf_specdec.training.target_states import agreement_with_dynamic, greedy_answers_with_states


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    with torch_threads(1):
        yield


def ragged_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(2, 11, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(count)]  # fmt: skip


def assert_same_data(got, want, atol=1e-5):
    (answers, states), (ref_answers, ref_states) = got, want
    assert answers == ref_answers
    assert [s.shape for s in states] == [s.shape for s in ref_states]
    for s, r in zip(states, ref_states):
        torch.testing.assert_close(s, r, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma"])
def test_static_loop_gives_the_dynamic_loops_answers_and_states(arch):
    """Ragged left-padded rows, two stop ids (rows end at different steps, some at the cap), two aux layers."""
    model = tiny_causal_lm(arch, vocab_size=64, hidden_size=32, num_layers=4, seed=3)
    prompts = ragged_prompts(9, 64)
    eos = {5, 9}
    want = greedy_answers_with_states(model, prompts, 20, 0, eos, (1, 3))
    assert len({len(a) for a in want[0]}) > 1 or arch != "qwen2"  # the data end rows at different steps
    assert_same_data(greedy_answers_static(model, prompts, 20, 0, eos, (1, 3)), want)


def test_static_loop_stops_once_every_row_has_ended():
    """Rows that all end early stop the loop at the next check (`STOP_CHECK_EVERY`), not at the cap."""
    model = tiny_causal_lm("qwen2", vocab_size=64, hidden_size=32, num_layers=4, seed=3)
    prompts = ragged_prompts(6, 64, seed=1)
    first = greedy_answers_with_states(model, prompts, 1, 0, set(), ())[0]
    eos = {t for a in first for t in a}  # every row's first answer token stops it
    fed = []
    original = static_decoding.DecodeStep.set
    static_decoding.DecodeStep.set = lambda self, tokens, step: (fed.append(step), original(self, tokens, step))[1]
    try:
        got = greedy_answers_static(model, prompts, 64, 0, eos)
    finally:
        static_decoding.DecodeStep.set = original
    assert got[0] == first and len(fed) == static_decoding.STOP_CHECK_EVERY
    assert_same_data(got, greedy_answers_with_states(model, prompts, 64, 0, eos))


def test_the_step_traces_as_one_graph():
    """`DecodeStep.run` compiles with ``fullgraph=True``: no graph break, so no ``.item()``, no Python branch on a
    tensor and no host sync, which is what capturing it as a CUDA graph needs (this machine has no GPU to capture
    on); the traced steps decode the same answers."""
    model = tiny_causal_lm("llama", vocab_size=64, hidden_size=32, num_layers=4, seed=3)
    prompts, eos = ragged_prompts(5, 64, seed=2), {5}
    want = greedy_answers_static(model, prompts, 12, 0, eos, (1, 3))
    original = static_decoding._runner
    static_decoding._runner = lambda step, graphs: torch.compile(step.run, backend="eager", fullgraph=True)
    try:
        torch._dynamo.reset()
        got = greedy_answers_static(model, prompts, 12, 0, eos, (1, 3))
    finally:
        static_decoding._runner = original
        torch._dynamo.reset()
    assert_same_data(got, want)


def test_models_with_other_caches_are_refused_and_the_builder_falls_back(tmp_path):
    """A sliding-window model is refused by name; the builder warns once and writes the dynamic loop's data."""
    model = tiny_causal_lm("gemma2", vocab_size=64, hidden_size=32, num_layers=4, seed=3)
    with pytest.raises(ValueError, match="sliding"):
        check_static_decodable(model)
    prompts = ragged_prompts(6, 64, seed=4)
    kwargs = dict(max_new_tokens=12, batch_size=3, shard_size=6, hidden_dtype=torch.float32, progress=False)
    build_distillation_data(model, prompts, tmp_path / "dynamic", **kwargs)
    with pytest.warns(UserWarning, match="static decoding failed"):
        build_distillation_data(model, prompts, tmp_path / "static", static_decoding=True, **kwargs)
    want, got = load_distillation_data(tmp_path / "dynamic"), load_distillation_data(tmp_path / "static")
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.hidden, want.hidden)


def test_default_model_builds_the_same_data_with_the_static_loop(default_model, tmp_path):
    """The real target, its chat prompts of different lengths, its stop ids: the same shards either way."""
    model, tok = default_model
    questions = ["What is 2 + 2?", "Name a colour.", "Write one sentence about the sea and the wind in winter."]
    prompts = [chat_ids(tok, [{"role": "user", "content": q}]) for q in questions]
    assert len({len(p) for p in prompts}) == 3  # left padding is exercised
    kwargs = dict(max_new_tokens=24, batch_size=3, shard_size=3, hidden_dtype=torch.float32, progress=False)
    build_distillation_data(model, prompts, tmp_path / "dynamic", **kwargs)
    build_distillation_data(model, prompts, tmp_path / "static", static_decoding=True, **kwargs)
    want, got = load_distillation_data(tmp_path / "dynamic"), load_distillation_data(tmp_path / "static")
    assert torch.equal(got.input_ids, want.input_ids)
    torch.testing.assert_close(got.hidden, want.hidden, atol=2e-4, rtol=1e-3)


def test_agreement_check_tells_a_broken_step_from_a_working_one():
    """The recipe's pre-build check: 1.0 where the static loop works; a step that reads stale inputs (as a graph
    replay whose inputs were not written in place would) agrees far less."""
    model = tiny_causal_lm("llama", vocab_size=64, hidden_size=32, num_layers=4, seed=3)
    prompts = ragged_prompts(8, 64, seed=5)
    assert agreement_with_dynamic(model, prompts, 16, 0, set()) == 1.0
    original = static_decoding.DecodeStep.set
    static_decoding.DecodeStep.set = lambda self, tokens, step: original(self, tokens, 0)  # positions frozen
    try:
        assert agreement_with_dynamic(model, prompts, 16, 0, set()) < 0.7
    finally:
        static_decoding.DecodeStep.set = original
