"""SuffixAssistant inside generate(): greedy equality with vanilla over multi-call sessions whose store changes between
calls (batch 1 and a ragged batch of 4, tiny models and the real default model), and exact sampling (chi-square)."""

from __future__ import annotations

import pytest
import torch

import hf_specdec
from hf_specdec import SuffixAssistant, SuffixStore
from hf_specdec.assistants import load_default_assistant
from hf_specdec.testing import (
    SAMPLING_PROMPT,
    SAMPLING_WARPERS,
    assert_same_tokens,
    first_tokens_p_values,
    greedy_verification,
    left_pad,
    sample_first_tokens,
    sampling_target,
)

SESSION = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [3, 4, 5], [9, 9, 8, 7, 6, 5, 4], [12, 13, 12, 13, 12, 13, 12, 13, 12]]


def _session(model, batch: int, assistant, calls: int = 4, new: int = 24):
    """``calls`` greedy calls where each call's prompts are the previous call's outputs cut short and followed by the
    first prompt again (a later turn revisits earlier answers); every call is compared with vanilla.

    Returns:
        per call: (the store's tokens before the call, spec_stats).
    """
    prompts = [list(p) for p in SESSION[:batch]]
    log = []
    for call in range(calls):
        ids, mask = left_pad(prompts)
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        before = assistant.store.num_tokens if isinstance(assistant, SuffixAssistant) else None
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            do_sample=False,
            assistant=assistant,
            return_dict_in_generate=True,
        )
        assert_same_tokens(out.sequences, expected, f"batch={batch} call={call}")
        log.append((before, out.spec_stats))
        width = ids.shape[1]
        prompts = [
            [t for t, m in zip(row[:width].tolist(), mask[b].tolist()) if m][-6:] + row[width:].tolist()[: 4 + call] + p
            for b, (row, p) in enumerate(zip(expected, SESSION[:batch]))
        ]
    return log


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_vanilla_over_a_session_whose_store_grows(tiny_models, arch, batch):
    model = tiny_models[arch]
    store = SuffixStore(max_tokens=4096)
    log = _session(model, batch, SuffixAssistant(store=store))
    sizes = [before for before, _ in log]
    assert sizes[0] == 0 and all(a < b for a, b in zip(sizes, sizes[1:])), f"the store must grow every call: {sizes}"
    assert store.num_documents == 4 * batch  # every row of every call, once
    assert sum(s.accepted_tokens for _, s in log) > 0


def test_a_repeated_call_drafts_its_answer_from_the_store(tiny_models):
    """The second identical call finds the whole answer in the store; an assistant with an empty store does not."""
    model = tiny_models["llama"]
    ids = torch.tensor([[3, 17, 29, 41, 53]])  # nothing repeats inside the prompt
    kwargs = dict(max_new_tokens=40, do_sample=False, return_dict_in_generate=True, tree_budget=False)
    expected = model.generate(ids, max_new_tokens=40, do_sample=False)
    assistant = SuffixAssistant(store=SuffixStore())
    first = model.generate(ids, assistant=assistant, **kwargs)
    again = model.generate(ids, assistant=assistant, **kwargs)
    fresh = model.generate(ids, assistant=SuffixAssistant(store=SuffixStore()), **kwargs)
    for out in (first, again, fresh):
        assert_same_tokens(out.sequences, expected)
    assert again.spec_stats.steps < 0.5 * fresh.spec_stats.steps, (again.spec_stats, fresh.spec_stats)
    assert again.spec_stats.accepted_tokens > 30


def test_two_stores_never_share_text(tiny_models):
    model = tiny_models["llama"]
    ids = torch.tensor([[3, 17, 29, 41, 53]])
    kwargs = dict(max_new_tokens=40, do_sample=False, return_dict_in_generate=True, tree_budget=False)
    alice, bob = SuffixAssistant(store=SuffixStore()), SuffixAssistant(store=SuffixStore())
    model.generate(ids, assistant=alice, **kwargs)
    first_bob = model.generate(ids, assistant=bob, **kwargs)
    again_alice = model.generate(ids, assistant=alice, **kwargs)
    assert first_bob.spec_stats.steps > 2 * again_alice.spec_stats.steps  # bob did not see alice's answer
    assert bob.store.num_documents == 1 and alice.store.num_documents == 2


def test_ready_made_suffix_assistants(tiny_models):
    model = tiny_models["llama"]
    ids, mask = left_pad(SESSION)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    assistant = load_default_assistant("suffix")
    assert isinstance(assistant, SuffixAssistant) and load_default_assistant("suffix").store is not assistant.store
    for _ in range(2):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, assistant=assistant)
        assert_same_tokens(out, expected, "suffix")
    assert assistant.store.num_documents == 2 * len(SESSION)
    with_head = hf_specdec.FallbackAssistant(SuffixAssistant(), hf_specdec.NgramAssistant())
    out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, assistant=with_head)
    assert_same_tokens(out, expected, "suffix in a FallbackAssistant")
    assert with_head.proposers[0].store.num_documents == len(SESSION)


# -------------------------------------------------------------------------------------------------- sampling
@pytest.fixture(scope="module")
def sampling_model():
    return sampling_target()


def _store_of_answers(model, rows: int = 200) -> SuffixStore:
    """A store holding ``rows`` earlier sampled answers to the sampling prompt (what a session would have stored)."""
    store = SuffixStore()
    ids = torch.tensor([list(SAMPLING_PROMPT)] * rows)
    torch.manual_seed(1)
    out = model.generate(ids, do_sample=True, max_new_tokens=6, attention_mask=torch.ones_like(ids), **SAMPLING_WARPERS)
    for row in out.tolist():
        store.add(row)
    return store


def test_sampling_with_a_suffix_tree_follows_the_target_distribution(sampling_model):
    store = _store_of_answers(sampling_model)
    before = store.num_tokens
    counts = sample_first_tokens(sampling_model, SuffixAssistant(store=store), 3000, tree_budget=False)
    ps = first_tokens_p_values(counts, sampling_model)
    assert min(ps) > 1e-4, f"chi-square p-values {ps}"
    assert store.num_tokens > before  # the call's answers were added


def test_the_sampling_check_catches_greedy_verification_of_suffix_trees(sampling_model):
    with greedy_verification():
        counts = sample_first_tokens(
            sampling_model, SuffixAssistant(store=_store_of_answers(sampling_model)), 2500, tree_budget=False
        )
    assert min(first_tokens_p_values(counts, sampling_model)) < 1e-6


# -------------------------------------------------------------------------------------------------- real model
@pytest.mark.slow
def test_greedy_equals_vanilla_on_the_default_model_over_a_session(default_model):
    from hf_specdec.models import chat_prompt_ids

    model, tok = default_model
    assistant = SuffixAssistant(store=SuffixStore())
    answer = ""
    for turn in ("Write a JSON object describing a cat named Tom.", "Now the same JSON for a dog named Rex."):
        ids = chat_prompt_ids(tok, f"{answer}\n{turn}".strip())
        expected = model.generate(ids, max_new_tokens=48, do_sample=False)
        out = model.generate(ids, max_new_tokens=48, do_sample=False, assistant=assistant)
        assert_same_tokens(out, expected, turn)
        answer = tok.decode(expected[0, ids.shape[1] :], skip_special_tokens=True)
    assert assistant.store.num_documents == 2
