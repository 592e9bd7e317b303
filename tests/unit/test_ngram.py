"""NgramAssistant: prompt lookup trees, incremental index, adaptivity (unit level, no model)."""

from __future__ import annotations

import random
import statistics
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_specdec.generation.proposers import NgramAssistant
from hf_specdec.generation.proposers.base import RowFeedback, RowState
from hf_specdec.generation.proposers.ngram import prompt_lookup_predictions
from hf_specdec.generation.tree import DraftSampling, DraftTree


def _state(tokens, row: int = 0, max_depth: int = 100, prompt_len: int | None = None) -> RowState:
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    return RowState(
        row=row, tokens=tokens, prompt_len=len(tokens) if prompt_len is None else prompt_len, max_depth=max_depth
    )


def _prefilled(tokens, next_token: int) -> RowFeedback:
    """The feedback after prefill: ``tokens`` entered the target's cache, ``next_token`` is the new root."""
    return RowFeedback(torch.as_tensor(tokens, dtype=torch.long), torch.zeros(0, dtype=torch.long), next_token)


def _propose_once(proposer: NgramAssistant, tokens, **kwargs) -> DraftTree:
    """Prefill-observe ``tokens[:-1]`` (the last token is the root), then propose."""
    state = _state(tokens, **kwargs)
    proposer.start(None)
    proposer.observe([state], [_prefilled(state.tokens[:-1], state.root)])
    return proposer.propose([state])[0]


def _children_tokens(tree: DraftTree, node: int = -1) -> list[int]:
    return [int(tree.tokens[i]) for i in tree.children(node)]


def _first_path(tree: DraftTree) -> list[int]:
    """Tokens along the first child at every level (the proposer's best guess)."""
    out, node = [], -1
    while kids := tree.children(node):
        node = kids[0]
        out.append(int(tree.tokens[node]))
    return out


def _assert_valid_tree(tree: DraftTree) -> None:
    parent, depth = tree.parent.tolist(), tree.depth.tolist()
    for i, p in enumerate(parent):
        assert -1 <= p < i, f"node {i} has parent {p}; parents must precede children"
        assert depth[i] == (1 if p < 0 else depth[p] + 1), f"node {i} has depth {depth[i]}"
    for node in [-1, *range(tree.num_nodes)]:
        toks = _children_tokens(tree, node)
        assert len(toks) == len(set(toks)), f"siblings under {node} repeat a token: {toks}"
    assert tree.sampling is DraftSampling.DETERMINISTIC and tree.draft_probs is None


def _greedy_accepted(tree: DraftTree, future: list[int]) -> list[int]:
    """The nodes greedy verification accepts (in path order) when the target's next tokens are ``future``."""
    node, path = -1, []
    while len(path) < len(future):
        node = next((i for i in tree.children(node) if int(tree.tokens[i]) == future[len(path)]), None)
        if node is None:
            break
        path.append(node)
    return path


def _simulate(
    proposer: NgramAssistant,
    streams: dict[int, tuple[list[int], list[int]]],
    steps: int | None = None,
    finish: bool = True,
):
    """Run the loop's call sequence against fixed target outputs, greedy acceptance, several rows at once.

    Args:
        streams: row -> (prompt, output): the output is what the target generates.

    Returns:
        row -> list of (tree, accepted) per step.
    """
    proposer.start(None)
    pos = {row: 1 for row in streams}  # output[:pos] emitted; output[pos - 1] is the root
    states = [_state(p + o[:1], row=row, prompt_len=len(p)) for row, (p, o) in streams.items()]
    proposer.observe(states, [_prefilled(streams[s.row][0], s.root) for s in states])
    log: dict[int, list] = {row: [] for row in streams}
    step = 0
    while steps is None or step < steps:
        active = [row for row, (p, o) in streams.items() if pos[row] < len(o)]
        if not active:
            break
        states = [
            _state(streams[r][0] + streams[r][1][: pos[r]], row=r, max_depth=len(streams[r][1]) - pos[r] - 1)
            for r in active
        ]
        trees = proposer.propose(states)
        assert len(trees) == len(states)
        feedback = []
        for r, tree in zip(active, trees):
            out = streams[r][1]
            path = _greedy_accepted(tree, out[pos[r] :])
            k = len(path)
            log[r].append((tree, k))
            accepted = torch.tensor(path, dtype=torch.long)
            feedback.append(RowFeedback(torch.tensor(out[pos[r] - 1 : pos[r] + k]), accepted, out[pos[r] + k], tree))
            pos[r] += k + 1
        states = [_state(streams[r][0] + streams[r][1][: pos[r]], row=r) for r in active]
        proposer.observe(states, feedback)
        step += 1
    if finish:
        proposer.finish()
    return log


# ---------------------------------------------------------------------------------------------------- shape of trees
def test_repeated_text_drafts_what_followed_as_a_chain():
    text = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    tree = _propose_once(NgramAssistant(max_depth=5), [1, 2, *text, 3, 4, 11, 12, 13])
    _assert_valid_tree(tree)
    assert tree.tokens.tolist() == [14, 15, 16, 17, 18]
    assert tree.parent.tolist() == [-1, 0, 1, 2, 3]


def test_distinct_continuations_become_distinct_siblings():
    # "7 8" is followed by 1, 2 and 3 in three places
    tokens = [7, 8, 1, 40, 7, 8, 2, 41, 7, 8, 3, 42, 7, 8]
    tree = _propose_once(NgramAssistant(), tokens)
    _assert_valid_tree(tree)
    assert sorted(_children_tokens(tree)) == [1, 2, 3]
    # equally long matches: the most recent comes first
    assert _children_tokens(tree)[0] == 3
    for tok, follow in ((1, 40), (2, 41), (3, 42)):
        child = next(i for i in tree.children(-1) if int(tree.tokens[i]) == tok)
        assert _children_tokens(tree, child)[0] == follow


def test_longest_match_comes_first():
    # "9 5 6" was followed by 30 (once); "5 6" alone was followed by 20 (twice, more recently)
    tokens = [9, 5, 6, 30, 31, 32, 1, 5, 6, 20, 21, 2, 5, 6, 20, 22, 3, 9, 5, 6]
    tree = _propose_once(NgramAssistant(), tokens)
    _assert_valid_tree(tree)
    assert _children_tokens(tree)[0] == 30
    assert 20 in _children_tokens(tree)
    assert _first_path(tree)[:3] == [30, 31, 32]


def test_more_frequent_continuation_comes_first_among_equal_matches():
    tokens = [5, 6, 1, 0, 5, 6, 1, 0, 5, 6, 2, 0, 4, 5, 6]
    tree = _propose_once(NgramAssistant(), tokens)
    assert _children_tokens(tree)[:2] == [1, 2]


def test_no_match_gives_an_empty_tree():
    proposer = NgramAssistant()
    assert _propose_once(proposer, list(range(50))).num_nodes == 0
    # the root occurs before but only as a 1-gram, and min_ngram=2 asks for more
    assert _propose_once(NgramAssistant(min_ngram=2), [1, 2, 3, 4, 5, 3]).num_nodes == 0
    assert _propose_once(NgramAssistant(min_ngram=1), [1, 2, 3, 4, 5, 3]).num_nodes > 0
    assert _propose_once(proposer, [7]).num_nodes == 0


def test_a_match_running_into_the_present_repeats_periodically():
    tree = _propose_once(NgramAssistant(max_depth=7), [50, 1, 2, 3, 1, 2, 3, 1, 2, 3])
    assert _first_path(tree) == [1, 2, 3, 1, 2, 3, 1]


def test_depth_never_exceeds_the_row_budget_or_max_depth():
    text = list(range(100, 140))
    tokens = [*text, 7, *text[:5]]
    assert _propose_once(NgramAssistant(max_depth=10), tokens, max_depth=3).max_depth == 3
    assert _propose_once(NgramAssistant(max_depth=4), tokens, max_depth=50).max_depth == 4
    assert _propose_once(NgramAssistant(), tokens, max_depth=0).num_nodes == 0


def test_node_budget_is_respected():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(400)]
    for max_nodes in (1, 5, 16):
        tree = _propose_once(NgramAssistant(max_nodes=max_nodes, min_score=0.0), tokens)
        _assert_valid_tree(tree)
        assert 0 < tree.num_nodes <= max_nodes


def test_bad_parameters_are_refused_with_the_name():
    with pytest.raises(ValueError, match="min_ngram"):
        NgramAssistant(min_ngram=5, max_ngram=4)
    with pytest.raises(ValueError, match="max_nodes"):
        NgramAssistant(max_nodes=0)
    with pytest.raises(ValueError, match="min_score"):
        NgramAssistant(min_score=2.0)


# ---------------------------------------------------------------------------------------------------- adaptivity
def _random_stream(seed: int, vocab: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def test_drafts_less_after_rejections():
    # every token occurs before, so there is always a match, but the text never repeats: drafts keep failing
    prompt = list(range(20)) * 2
    output = _random_stream(1, 20, 300)
    # the scores (estimated acceptance of each node) fall, so the loop's tree budget keeps fewer of the candidates
    adaptive = _simulate(NgramAssistant(), {0: (prompt, output)})[0]
    expected = [
        float(t.scores.sum()) if t.num_nodes else 0.0 for t, _ in adaptive
    ]  # expected accepted tokens per proposed tree
    assert statistics.mean(expected[-100:]) < 0.5 * statistics.mean(expected[:3]), expected[:3] + expected[-3:]
    # with a score threshold of its own (how it sizes its trees with tree_budget=False) it drafts fewer nodes
    adaptive = _simulate(NgramAssistant(min_score=0.1), {0: (prompt, output)})[0]
    fixed = _simulate(NgramAssistant(adaptive=False, min_score=0.1), {0: (prompt, output)})[0]
    early = statistics.mean(t.num_nodes for t, _ in adaptive[:3])
    late = statistics.mean(t.num_nodes for t, _ in adaptive[-100:])
    late_fixed = statistics.mean(t.num_nodes for t, _ in fixed[-100:])
    assert late < 0.5 * early, f"drafted {late:.2f} nodes per step late vs {early:.2f} early"
    assert late < 0.5 * late_fixed, f"adaptive {late:.2f} vs fixed {late_fixed:.2f} nodes per step"


def test_drafts_more_after_acceptances():
    # the output copies the prompt: every draft is accepted, so the adaptive trees grow past what the prior allows
    text = _random_stream(2, 1000, 150)
    stream = {0: ([5000, *text, 5001], text)}
    adaptive = _simulate(NgramAssistant(min_score=0.6, max_depth=10), stream)[0]
    fixed = _simulate(NgramAssistant(min_score=0.6, max_depth=10, adaptive=False), stream)[0]
    late = max(t.max_depth for t, _ in adaptive[-6:-2])
    late_fixed = max(t.max_depth for t, _ in fixed[-6:-2])
    assert late == 10 and late_fixed < 10, f"late tree depth {late} adaptive, {late_fixed} fixed"
    assert len(adaptive) < len(fixed), "deeper trees on a copy must take fewer steps"
    assert all(k == t.max_depth for t, k in adaptive), "a copy accepts every drafted level"


def test_acceptance_estimates_fall_after_rejections_rise_after_acceptances_and_reset_in_start():
    fresh = NgramAssistant().acceptance_estimates(0)
    bad = NgramAssistant()
    _simulate(bad, {0: (list(range(20)) * 2, _random_stream(1, 20, 100))}, finish=False)
    good = NgramAssistant()
    text = _random_stream(3, 1000, 150)
    _simulate(good, {0: ([9999, *text], text)}, finish=False)
    assert bad.acceptance_estimates(0)[0] < fresh[0]
    assert good.acceptance_estimates(0)[-1] > fresh[-1]
    good.start(None)
    assert good.acceptance_estimates(0) == fresh


# ---------------------------------------------------------------------------------------------------- index
def _brute_force_matches(seq: list[int], min_ngram: int, max_extend: int = 16) -> list[tuple[int, int]]:
    """Every earlier end position whose preceding tokens match the suffix of ``seq``, with the match length."""
    last = len(seq) - 1
    out = []
    for pos in range(last):
        length = 0
        while length < max_extend and pos - length >= 0 and seq[pos - length] == seq[last - length]:
            length += 1
        if length >= min_ngram:
            out.append((length, pos))
    return sorted(out, reverse=True)


@settings(max_examples=60, deadline=None)
@given(
    seq=st.lists(st.integers(0, 4), min_size=1, max_size=80),
    chunks=st.lists(st.integers(1, 9), min_size=1, max_size=30),
    max_ngram=st.integers(1, 5),
    min_ngram=st.integers(1, 3),
)
def test_incremental_index_equals_a_brute_force_scan(seq, chunks, max_ngram, min_ngram):
    min_ngram = min(min_ngram, max_ngram)
    proposer = NgramAssistant(max_ngram=max_ngram, min_ngram=min_ngram, max_matches=200)
    proposer.start(None)
    # feed the sequence in chunks, as prefill + accepted steps would
    cut, i = [], 0
    for c in chunks:
        i += c
        if i >= len(seq):
            break
        cut.append(i)
    cut.append(len(seq))
    for end in cut:
        state = _state(seq[:end])
        proposer.observe([state], [_prefilled(state.tokens, state.root)])
        lookup = proposer._rows[0]
        assert lookup.seq == seq[:end]
        for n in range(1, max_ngram + 1):
            for p in range(end):
                earlier = [
                    q for q in range(n - 1, p) if p >= n - 1 and seq[q - n + 1 : q + 1] == seq[p - n + 1 : p + 1]
                ]
                assert lookup.previous[n - 1][p] == (earlier[-1] if earlier else -1), f"{n}-gram ending at {p}"
        assert proposer.find_matches(lookup) == _brute_force_matches(seq[:end], min_ngram)
    # and the tree equals the one a fresh proposer builds from the whole sequence at once
    incremental = proposer.propose([_state(seq)])[0]
    fresh = _propose_once(NgramAssistant(max_ngram=max_ngram, min_ngram=min_ngram, max_matches=200), seq)
    assert incremental.tokens.tolist() == fresh.tokens.tolist()
    assert incremental.parent.tolist() == fresh.parent.tolist()
    _assert_valid_tree(incremental)


@settings(max_examples=40, deadline=None)
@given(seq=st.lists(st.integers(0, 3), min_size=2, max_size=120))
def test_matches_are_real_and_the_longest_comes_first(seq):
    proposer = NgramAssistant()
    tree = _propose_once(proposer, seq)
    _assert_valid_tree(tree)
    lookup = proposer._rows[0]
    found = proposer.find_matches(lookup)
    brute = _brute_force_matches(seq, proposer.min_ngram)
    assert set(found) <= set(brute), "every match must be real"
    assert found == sorted(found, reverse=True)
    assert len(found) == min(len(brute), proposer.max_matches)
    if brute:
        assert found[0][0] >= min(brute[0][0], proposer.max_ngram), "a longest n-gram match must come first"
    else:
        assert tree.num_nodes == 0


# ---------------------------------------------------------------------------------------------------- predictions
def _first_draft(tokens: list[int], **kwargs) -> int | None:
    """The first token a fresh NgramAssistant drafts after ``tokens`` (None: an empty tree)."""
    tree = _propose_once(NgramAssistant(**kwargs), tokens)
    return int(tree.tokens[0]) if tree.num_nodes else None


@pytest.mark.parametrize(
    "vocab, options",
    [
        (3, {}),
        (6, {"min_score": 0.1}),
        (12, {"max_ngram": 2, "min_ngram": 2}),
        (5, {"max_ngram": 6, "max_matches": 3, "min_score": 0.3}),
    ],
)
def test_prompt_lookup_predictions_are_the_assistants_first_draft_token(vocab, options):
    for seed in range(3):
        tokens = _random_stream(100 * vocab + seed, vocab, 70)
        predicted = prompt_lookup_predictions(tokens, **options)
        kwargs = {"min_score": 0.02, **options}  # 0.02: the assistant's threshold under the loop's tree budget
        expected = [_first_draft(tokens[: t + 1], **kwargs) for t in range(len(tokens))]
        assert predicted == expected
        assert any(p is not None for p in predicted) and predicted[0] is None
    # a tensor gives the same, and a repeated text is predicted once it has been seen
    text = _random_stream(7, 1000, 30)
    assert prompt_lookup_predictions(torch.tensor(text + text)) == prompt_lookup_predictions(text + text)
    assert prompt_lookup_predictions(text + text)[30:59] == text[1:30]


def test_prompt_lookup_predictions_refuse_bad_options_by_name():
    with pytest.raises(ValueError, match="min_ngram"):
        prompt_lookup_predictions([1, 2], min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError, match="min_score"):
        prompt_lookup_predictions([1, 2], min_score=1.5)
    with pytest.raises(TypeError, match="max_matches"):
        prompt_lookup_predictions([1, 2], max_matches=2.5)


# ---------------------------------------------------------------------------------------------------- rows
def test_rows_are_independent_and_may_leave_the_batch():
    text = _random_stream(4, 1000, 80)
    streams = {
        0: ([5000, *text, 5001], text[:40]),  # copies: long trees
        3: (list(range(20)) * 2, _random_stream(5, 20, 150)),  # noise: small trees
        7: ([1, 2, 3] * 5, [1, 2, 3] * 30),  # a loop
    }
    together = _simulate(NgramAssistant(), streams)
    for row, stream in streams.items():
        alone = _simulate(NgramAssistant(), {row: stream})[row]
        assert len(alone) == len(together[row])
        for (a, ka), (b, kb) in zip(alone, together[row]):
            assert a.tokens.tolist() == b.tokens.tolist() and a.parent.tolist() == b.parent.tolist() and ka == kb
    # row 0 finishes long before the others: later steps only see rows 3 and 7
    assert len(together[0]) < len(together[3])


def test_a_reused_row_index_with_a_different_sequence_is_reindexed():
    proposer = NgramAssistant()
    _propose_once(proposer, [1, 2, 3, 1, 2])
    # same row index, unrelated tokens, no start(): must not reuse the stale index
    tree = proposer.propose([_state([9, 8, 7, 9])])[0]
    assert _first_path(tree)[:2] == [8, 7]


# ---------------------------------------------------------------------------------------------------- speed
def test_propose_is_fast_on_a_long_sequence():
    rng = random.Random(0)
    words = [rng.randrange(5000) for _ in range(300)]
    seq = [rng.choice(words) for _ in range(2000)]  # a natural-ish sequence with many short repeats
    proposer = NgramAssistant()
    state = _state(seq)
    proposer.start(None)
    proposer.observe([state], [_prefilled(state.tokens[:-1], state.root)])
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        proposer.propose([state])
        times.append(time.perf_counter() - t0)
    assert statistics.median(times) < 2e-3, f"propose took {1e3 * statistics.median(times):.2f} ms (median)"
