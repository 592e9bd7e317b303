"""SuffixStore (insertion, frequencies, eviction, memory bound, isolation, threads), the request suffix tree and
SuffixAssistant's trees (unit level, no model)."""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ngram import _assert_valid_tree, _first_path, _prefilled, _simulate, _state

from hf_specdec import SuffixAssistant, SuffixStore
from hf_specdec.generation.proposers.suffix import RequestSuffixTree


def _brute_continuations(docs: list[list[int]], context: list[int], max_match: int) -> tuple[int, Counter]:
    """The longest suffix of ``context`` (<= max_match) occurring in ``docs`` and the counts of what followed it."""
    for m in range(min(max_match, len(context)), 0, -1):
        pat = context[len(context) - m :]
        found, counts = False, Counter()
        for doc in docs:
            for i in range(len(doc) - m + 1):
                if doc[i : i + m] == pat:
                    found = True
                    if i + m < len(doc):
                        counts[doc[i + m]] += 1
        if found:
            return (m, counts) if counts else (0, Counter())
    return 0, Counter()


# ---------------------------------------------------------------------------------------------------- store
def test_store_counts_what_followed_the_longest_match():
    store = SuffixStore()
    for doc in ([1, 2, 3, 9], [1, 2, 3, 9], [7, 1, 2, 3, 5], [1, 2, 4]):
        store.add(doc)
    assert (store.num_documents, store.num_tokens) == (4, 16)
    assert store.continuations([8, 1, 2]) == (2, Counter({3: 3, 4: 1}))
    assert store.continuations([7, 1, 2, 3]) == (4, Counter({5: 1}))  # the longest match wins, however rare
    assert store.continuations([1, 2, 3]) == (3, Counter({9: 2, 5: 1}))
    assert store.continuations(torch.tensor([6, 6])) == (0, Counter())
    # a match never runs across documents, and the end of a document continues nothing
    assert store.continuations([9, 7]) == (1, Counter({1: 1}))
    assert store.continuations([2, 4]) == (0, Counter())


@settings(max_examples=40, deadline=None)
@given(
    docs=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=30), min_size=1, max_size=25),
    context=st.lists(st.integers(0, 5), min_size=1, max_size=12),
    max_tokens=st.integers(20, 200),
)
def test_store_equals_a_brute_force_scan_of_the_documents_it_keeps(docs, context, max_tokens):
    store = SuffixStore(max_tokens=max_tokens)
    kept: list[list[int]] = []
    for doc in docs:
        store.add(doc)
        kept.append(doc[-(max_tokens // 2) :])
        if sum(map(len, kept)) > max_tokens:  # first in, first out, down to three quarters
            while sum(map(len, kept)) > max_tokens * 3 // 4 and len(kept) > 1:
                kept.pop(0)
        assert store.num_tokens == sum(map(len, kept)) <= max_tokens
        assert store.continuations(context, max_match=8) == _brute_continuations(kept, context, 8)


def test_store_evicts_the_oldest_documents_first_and_stays_bounded():
    store = SuffixStore(max_tokens=200)
    docs = [[1000 * d + i for i in range(30)] for d in range(20)]
    for doc in docs:
        store.add(doc)
        assert store.num_tokens <= 200
    assert store.evicted_tokens == 20 * 30 - store.num_tokens
    assert store.continuations([19_000, 19_001])[1] == Counter({19_002: 1})  # the newest is there
    assert store.continuations([0, 1]) == (0, Counter())  # the oldest is gone
    assert store.nbytes == 12 * store.num_tokens + 8 * store.num_documents  # text, array, kept docs; separators


def test_store_memory_is_bounded_and_levels_stay_few():
    rng = random.Random(0)
    store = SuffixStore(max_tokens=20_000)
    for _ in range(300):
        store.add([rng.randrange(50) for _ in range(rng.randrange(20, 200))])
        assert store.num_tokens <= 20_000
        assert store.nbytes == 12 * store.num_tokens + 8 * store.num_documents
        assert len(store.snapshot().levels) <= 6
    store.clear()
    assert (store.num_tokens, store.num_documents, store.nbytes) == (0, 0, 0)


def test_a_document_longer_than_half_the_store_keeps_its_end_and_zero_keeps_nothing():
    store = SuffixStore(max_tokens=10)
    store.add(list(range(100, 130)))
    assert store.num_tokens == 5 and store.continuations([126])[1] == Counter({127: 1})
    off = SuffixStore(max_tokens=0)
    off.add([1, 2, 3])
    assert off.num_tokens == 0 and off.continuations([1]) == (0, Counter())


def test_stores_are_isolated():
    alice, bob = SuffixStore(), SuffixStore()
    alice.add([5, 6, 7, 8])
    assert alice.continuations([5, 6])[1] == Counter({7: 1})
    assert bob.continuations([5, 6]) == (0, Counter())
    a1, a2 = SuffixAssistant(store=alice), SuffixAssistant(store=alice)
    assert a1.store is a2.store is alice and SuffixAssistant().store is not SuffixAssistant().store


def test_store_is_thread_safe():
    store = SuffixStore(max_tokens=50_000)
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            for i in range(40):
                store.add([w, i, 7, 8, 9, w, i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def reader() -> None:
        try:
            for _ in range(200):
                m, counts = store.continuations([7, 8])
                assert m in (0, 2) and set(counts) <= {9}
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(6)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert store.num_documents == 240 and store.num_tokens == 240 * 7
    assert store.continuations([7, 8]) == (2, Counter({9: 240}))


def test_store_refuses_what_is_not_token_ids():
    store = SuffixStore()
    for bad in ([1, -2], [1.5], [True], torch.zeros(2, 2, dtype=torch.long), torch.ones(3)):
        with pytest.raises(ValueError, match="token ids"):
            store.add(bad)
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixStore(max_tokens=-1)
    with pytest.raises(TypeError, match="SuffixStore"):
        SuffixAssistant(store={"not": "a store"})


# ---------------------------------------------------------------------------------------------------- request tree
@settings(max_examples=40, deadline=None)
@given(seq=st.lists(st.integers(0, 3), min_size=1, max_size=60), max_match=st.integers(2, 6))
def test_request_tree_matches_and_counts_like_a_brute_force_scan(seq, max_match):
    tree = RequestSuffixTree(max_match)
    for end in range(1, len(seq) + 1):
        tree.extend(seq[end - 1 : end])
        prefix = seq[:end]
        # the longest suffix (< max_match) that also occurs ending earlier, and what followed its earlier occurrences
        m = next(
            (
                k
                for k in range(min(max_match - 1, end - 1), 0, -1)
                if any(prefix[i - k + 1 : i + 1] == prefix[end - k :] for i in range(k - 1, end - 1))
            ),
            0,
        )
        assert tree.depth[tree.match] == m
        if m:
            expected = Counter(
                prefix[i + 1] for i in range(m - 1, end - 1) if prefix[i - m + 1 : i + 1] == prefix[end - m :]
            )
            total, kids = tree.continuations((tree.match, -1, 0))
            assert total == sum(expected.values())
            assert {tok: c for tok, c, _ in kids} == dict(expected)


def test_request_tree_leaves_read_on_and_repeat_periodically():
    tree = RequestSuffixTree(4)
    tree.extend([50, 1, 2, 3, 1, 2, 3, 1, 2])
    m, children = tree.walk_from_match()
    assert m == 3  # "2 3 1 2" repeats, but matches are shorter than max_match
    state, out = (tree.match, -1, 0), []
    for drafted in range(7):
        _, kids = children(state, drafted)
        tok, _, state = kids[0]
        out.append(tok)
    assert out == [3, 1, 2, 3, 1, 2, 3]


# ---------------------------------------------------------------------------------------------------- assistant
def _text(seed: int, n: int, vocab: int = 1000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def test_a_copy_from_the_prompt_is_drafted_deep():
    text = _text(0, 120)
    log = _simulate(SuffixAssistant(store=SuffixStore()), {0: ([5000, *text, 5001], text)})[0]
    assert max(t.max_depth for t, _ in log) > 10  # deeper than the n-gram assistant's default max_depth
    assert len(log) <= 8 and all(k == t.max_depth for t, k in log[1:])


def test_a_later_call_drafts_an_earlier_answer_from_the_store_after_the_lead_in():
    store = SuffixStore()
    answer = _text(1, 60)
    header = [9001, 9002, 9003]  # the end of every prompt (a chat template's assistant header)
    _simulate(SuffixAssistant(store=store, lead_in=3), {0: ([11, 12, *header], answer)})
    assert store.num_documents == 1 and store.num_tokens == 3 + 60  # the lead-in, then the answer
    # a new call, another prompt with the same header: its first draft already is the earlier answer
    again = SuffixAssistant(store=store)
    log = _simulate(again, {0: ([21, 22, 23, *header], answer)})[0]
    assert _first_path(log[0][0])[:5] == answer[1:6]
    assert len(log) <= 5
    fresh = _simulate(SuffixAssistant(store=SuffixStore()), {0: ([21, 22, 23, *header], answer)})[0]
    assert len(fresh) > 5 * len(log)


def test_trees_are_valid_scored_and_rows_independent():
    store = SuffixStore()
    for seed in range(5):
        store.add(_text(seed, 200, vocab=8))
    streams = {
        0: (_text(10, 50, 8), _text(11, 80, 8)),
        2: ([1, 2, 3] * 4, [1, 2, 3] * 20),
        5: (_text(12, 9), _text(13, 40)),
    }
    together = _simulate(SuffixAssistant(store=store), streams, finish=False)
    for row, stream in streams.items():
        alone = _simulate(SuffixAssistant(store=store), {row: stream}, finish=False)[row]
        assert [(t.tokens.tolist(), t.parent.tolist(), k) for t, k in alone] == [
            (t.tokens.tolist(), t.parent.tolist(), k) for t, k in together[row]
        ]
        for tree, _ in alone:
            if tree.num_nodes:
                _assert_valid_tree(tree)
                scores, parents = tree.scores.tolist(), tree.parent.tolist()
                assert tree.source == "suffix" and all(0 < s <= 1 for s in scores)
                assert all(p < 0 or scores[p] > s for p, s in zip(parents, scores))


def test_finish_adds_every_row_and_depth_limits_hold():
    store = SuffixStore()
    assistant = SuffixAssistant(store=store, max_depth=5)
    text = _text(3, 40)
    log = _simulate(assistant, {0: ([7, *text], text), 1: ([8, *text], text[:20])})
    assert store.num_documents == 2 and store.num_tokens == (8 + 40) + (8 + 20)
    assert max(t.max_depth for t, _ in log[0]) == 5
    with pytest.raises(ValueError, match="max_depth"):
        SuffixAssistant(max_depth=0)
    with pytest.raises(ValueError, match="min_score"):
        SuffixAssistant(min_score=3.0)


def test_propose_is_fast_with_a_long_request_and_a_full_store():
    rng = random.Random(0)
    words = [rng.randrange(5000) for _ in range(300)]
    store = SuffixStore(max_tokens=200_000)
    for _ in range(100):
        store.add([rng.choice(words) for _ in range(1000)])
    seq = [rng.choice(words) for _ in range(2000)]
    proposer = SuffixAssistant(store=store)
    state = _state(seq)
    proposer.start(None)
    proposer.observe([state], [_prefilled(state.tokens[:-1], state.root)])
    times = []
    for _ in range(100):
        t0 = time.perf_counter()
        proposer.propose([state])
        times.append(time.perf_counter() - t0)
    assert statistics.median(times) < 3e-3, f"propose took {1e3 * statistics.median(times):.2f} ms (median)"
