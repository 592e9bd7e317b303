"""Building self-distillation data: the one-pass greedy answers and states equal `generate` followed by a second
forward, rows that end early leave the batch without changing the others, and the six-task prompts are built in
blocks sorted by length."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.testing import tiny_causal_lm
from hf_specdec.training import target_states
from hf_specdec.training.distillation_data import build_distillation_data
from hf_specdec.training.shards import load_distillation_data
from hf_specdec.training.target_states import (
    Answering,
    _generate_answers,
    final_hidden_states,
    greedy_answers_with_states,
)
from hf_specdec.training.task_data import _length_sorted_blocks
from hf_specdec.training.template_prompts import distinct_prompts


@pytest.fixture(scope="module")
def tiny():
    model = tiny_causal_lm("llama", vocab_size=64, hidden_size=32, num_layers=2, seed=5)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 64, (int(n),), generator=gen).tolist() for n in (3, 9, 5, 12, 7, 4)]
    return model, prompts


@pytest.mark.parametrize("stop_early", [False, True])
def test_one_pass_equals_generate_then_forward(tiny, stop_early):
    model, prompts = tiny
    eos = set(torch.as_tensor(model.generation_config.eos_token_id).reshape(-1).tolist())  # generate stops there
    if stop_early:  # the token two rows choose third ends their answers: those rows leave the batch mid-way
        free = _generate_answers(model, prompts, 12, 0, eos, {"do_sample": False})
        eos |= {free[1][2], free[3][2]}
    expected = _generate_answers(model, prompts, 12, 0, eos, {"do_sample": False})
    states_expected = final_hidden_states(model, [p + a for p, a in zip(prompts, expected)])
    answers, states = greedy_answers_with_states(model, prompts, 12, 0, eos)
    assert answers == expected
    if stop_early:
        assert min(len(a) for a in answers) < 12 and max(len(a) for a in answers) == 12
    for p, a, s, ref in zip(prompts, answers, states, states_expected):
        assert s.shape == (len(p) + len(a), 32)
        torch.testing.assert_close(s, ref, atol=1e-4, rtol=1e-4)


def test_built_folder_holds_the_one_pass_states(tiny, tmp_path):
    model, prompts = tiny
    build_distillation_data(model, prompts, tmp_path, max_new_tokens=8, batch_size=4, shard_size=4,
                            hidden_dtype=torch.float32, progress=False)  # fmt: skip
    data = load_distillation_data(tmp_path)
    assert data.seq_bounds.shape == (len(prompts), 3)
    s, a, e = data.seq_bounds[3].tolist()
    assert data.input_ids[s:a].tolist() == prompts[3]
    ref = final_hidden_states(model, [data.input_ids[s:e].tolist()])[0]
    torch.testing.assert_close(data.hidden[s:e], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("do_sample", [False, True])
def test_aux_layers_are_stored_beside_the_final_states(tiny, tmp_path, do_sample):
    """EAGLE-3 data: the states of the chosen ``hidden_states`` entries, from the greedy pass (or the second forward
    of sampled answers), equal those of a plain forward over the finished sequence."""
    model, prompts = tiny
    build_distillation_data(model, prompts, tmp_path, max_new_tokens=6, batch_size=4, shard_size=4, do_sample=do_sample,
                            hidden_dtype=torch.float32, aux_layers=(0, 1), progress=False)  # fmt: skip
    data = load_distillation_data(tmp_path)
    assert data.aux_layers == (0, 1) and data.aux_hidden.shape == (data.input_ids.numel(), 64)
    for s, _, e in data.seq_bounds.tolist():
        with torch.no_grad():
            out = model(input_ids=data.input_ids[s:e][None], output_hidden_states=True)
        ref = torch.cat([out.hidden_states[0][0], out.hidden_states[1][0]], dim=-1)
        torch.testing.assert_close(data.features((0, 1))[s:e], ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(data.features((-1,))[s:e], out.hidden_states[-1][0], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"reads the target's hidden states \[0, 2\].*layers \[0, 1\]"):
        data.features((0, 2))
    plain = tmp_path / "plain"
    build_distillation_data(model, prompts, plain, max_new_tokens=4, batch_size=6, progress=False)
    with pytest.raises(ValueError, match="holds only the final states; build the data with aux_layers"):
        load_distillation_data(plain).features((0, 1))
    assert load_distillation_data([tmp_path, plain]).aux_hidden is None  # mixed folders: no aux states


def test_a_token_budget_cuts_batches_by_the_cache_they_grow_to():
    how = Answering(max_new_tokens=10, batch_size=4, do_sample=False, temperature=1.0, top_p=1.0, eos_ids=set(),
                    pad=0, tokens_per_batch=60)  # fmt: skip
    prompts = [[1] * n for n in (2, 3, 5, 20, 80, 4, 4, 4, 4, 4)]
    # rows x (longest prompt + 10) <= 60, at most 4 rows, one row even when it alone passes the budget
    assert [list(r) for r in how.batches(prompts)] == [[0, 1, 2], [3], [4], [5, 6, 7, 8], [9]]
    how.tokens_per_batch = None
    assert [list(r) for r in how.batches(prompts)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_prompts_are_batched_shortest_first_and_answered_in_their_own_order(monkeypatch):
    how = Answering(max_new_tokens=10, batch_size=2, do_sample=False, temperature=1.0, top_p=1.0, eos_ids=set(),
                    pad=0)  # fmt: skip
    prompts = [[7] * n for n in (9, 2, 30, 4, 3)]
    seen = []

    def answer_batch(model, batch):  # each prompt's answer: its own length, so the order is checkable
        seen.append([len(p) for p in batch])
        return [p + [len(p)] for p in batch], [torch.full((len(p) + 1, 1), float(len(p))) for p in batch]

    monkeypatch.setattr(how, "_answer_batch", answer_batch)
    seqs, states = how.answer(None, prompts, bar=type("Bar", (), {"update": lambda self, n: None})())
    assert seen == [[2, 3], [4, 9], [30]]  # batches of similar lengths: little padding
    assert [s[-1] for s in seqs] == [9, 2, 30, 4, 3] and [int(h[0, 0]) for h in states] == [9, 2, 30, 4, 3]


def test_a_batch_out_of_memory_is_answered_in_halves_with_the_same_result(tiny, tmp_path, monkeypatch):
    model, prompts = tiny
    whole = tmp_path / "whole"
    build_distillation_data(model, prompts, whole, max_new_tokens=6, batch_size=6, shard_size=6,
                            hidden_dtype=torch.float32, progress=False)  # fmt: skip
    real, sizes = target_states.greedy_answers_with_states, []

    def short_of_memory(model, batch, *args):  # a batch of more than 2 rows does not fit
        sizes.append(len(batch))
        if len(batch) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, batch, *args)

    monkeypatch.setattr(target_states, "greedy_answers_with_states", short_of_memory)
    halves = tmp_path / "halves"
    build_distillation_data(model, prompts, halves, max_new_tokens=6, batch_size=6, shard_size=6,
                            hidden_dtype=torch.float32, tokens_per_batch=10_000, progress=False)  # fmt: skip
    assert sizes == [6, 3, 1, 2, 3, 1, 2], sizes
    a, b = load_distillation_data(whole), load_distillation_data(halves)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.seq_bounds, b.seq_bounds)
    torch.testing.assert_close(a.hidden, b.hidden, atol=1e-4, rtol=1e-4)


def test_length_sorted_blocks_keep_blocks_and_sort_inside():
    ids = [[0] * n for n in (5, 1, 3, 9, 2, 7, 4)]
    order = _length_sorted_blocks(ids, 3)
    assert order == [1, 2, 0, 4, 5, 3, 6]
    assert sorted(order) == list(range(len(ids)))


def test_distinct_prompts_redraws_duplicates_and_refuses_too_few():
    counter = iter(range(10**6))
    out = distinct_prompts(5, ["a", "b"], lambda task: f"{task}{next(counter) % 3}", "prompts")
    assert len(set(out)) == 5
    with pytest.raises(ValueError, match="cannot make 7 distinct prompts"):
        distinct_prompts(7, ["a", "b"], lambda task: f"{task}{next(counter) % 3}", "prompts")
    keyed = distinct_prompts(2, ["x"], lambda task: (task, next(counter)), "pairs", key=lambda p: p[1] % 2)
    assert {p[1] % 2 for p in keyed} == {0, 1}


def test_description_of_a_partly_built_folder_counts_its_shards(tiny, tmp_path):
    from hf_specdec.training.run import data_description

    model, prompts = tiny
    manifest = build_distillation_data(model, prompts, tmp_path, max_new_tokens=4, batch_size=3, shard_size=3,
                                       hidden_dtype=torch.float32, progress=False)  # fmt: skip
    manifest["shards"], manifest["complete"] = manifest["shards"][:1], False  # as if the build was stopped
    for key in ("num_sequences", "num_answer_tokens"):
        manifest.pop(key)
    answers = manifest["shards"][0]["num_answer_tokens"]
    assert f"3 greedy answers (max 4 new tokens, {answers} answer tokens) to 3 of 6 planned" in data_description(
        manifest
    )


def test_description_sums_the_parts_built_the_same_way(tiny, tmp_path):
    """The GPU recipe writes one part per chunk of conversations: the model card names the data once, summed, and
    keeps apart what was built differently."""
    from hf_specdec.training.run import data_description

    model, prompts = tiny
    part = build_distillation_data(model, prompts, tmp_path, max_new_tokens=4, batch_size=3, shard_size=3,
                                   hidden_dtype=torch.float32, progress=False)  # fmt: skip
    sequences = sum(sh["num_sequences"] for sh in part["shards"])
    answers = sum(sh["num_answer_tokens"] for sh in part["shards"])
    longer = {**part, "generation": {**part["generation"], "max_new_tokens": 8}}
    text = data_description({"base_model": "m", "parts": [part, part, part, longer]})
    assert text.count("greedy answers") == 2, text
    assert f"{3 * sequences} greedy answers (max 4 new tokens, {3 * answers} answer tokens)" in text
    assert f"{sequences} greedy answers (max 8 new tokens, {answers} answer tokens)" in text
    reseeded = {**part, "prompt_recipe": {**(part.get("prompt_recipe") or {}), "seed": 1000}}  # a task chunk's own seed
    text = data_description({"base_model": "/root/.cache/hf_specdec/tiny-model", "parts": [part, reseeded]})
    assert text.count("greedy answers") == 1 and f"{2 * sequences} greedy answers" in text, text
    assert "seeds " in text and ", 1000)" in text and text.startswith("distillation of tiny-model:"), text


def test_a_token_budget_loads_the_leading_whole_sequences(tiny, tmp_path, monkeypatch):
    """``max_tokens`` gives what a build stopped there would have given: the first whole sequences, in build order,
    across folders, without reading the shards past it; the manifest says how much was taken."""
    import hf_specdec.training.shards as shards

    model, prompts = tiny
    for name, part in (("a", prompts), ("b", prompts[::-1])):
        build_distillation_data(model, part, tmp_path / name, max_new_tokens=6, batch_size=2, shard_size=2,
                                hidden_dtype=torch.float32, progress=False)  # fmt: skip
    folders = [tmp_path / "a", tmp_path / "b"]
    full = load_distillation_data(folders)
    ends = full.seq_bounds[:, 2].tolist()
    opened = []
    real_open = shards.safe_open
    monkeypatch.setattr(shards, "safe_open", lambda path, **kw: opened.append(path) or real_open(path, **kw))
    for budget, keep in ((ends[2], 3), (ends[2] + 1, 3), (ends[7] - 1, 7), (1, 1), (10**9, len(ends))):
        opened.clear()
        part = load_distillation_data(folders, max_tokens=budget)
        n = ends[keep - 1]
        assert part.seq_bounds.shape[0] == keep and part.input_ids.numel() == n, (budget, keep)
        assert torch.equal(part.seq_bounds, full.seq_bounds[:keep]) and torch.equal(part.hidden, full.hidden[:n])
        assert torch.equal(part.seq_end, full.seq_end[:n]) and torch.equal(part.answer_mask, full.answer_mask[:n])
        if keep <= 2:  # the first shard holds two sequences: nothing else is read
            assert set(opened) == {str(tmp_path / "a" / "shard-00000.safetensors")} and part.manifest["first_tokens"] == n
    with pytest.raises(ValueError, match="positive number of tokens"):
        load_distillation_data(folders, max_tokens=0)
