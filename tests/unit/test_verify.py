"""Unit tests of the verification rules (hf_specdec/generation/verify.py) on hand-computed 3-token examples.

Each rule is pinned down on one tree level by Monte Carlo against closed-form probabilities (docs/algorithms.md):
which child is accepted, and which token comes next when none is. Whole-sequence exactness is in
test_sampling_distribution.py.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from hf_specdec.generation import verify as verify_mod
from hf_specdec.generation.tree import DraftSampling, DraftTree
from hf_specdec.generation.verify import Verdict, sample_from_scores, verify_greedy, verify_tree
from hf_specdec.testing import torch_threads


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The rules run tiny per-row tensor ops: intra-op threads only add wake-up latency (badly so on a busy box)."""
    with torch_threads(1):
        yield


N_MC = 3000  # draws per Monte-Carlo check; 5 sigma on a probability of 0.5 is +-0.046


def _log(probs) -> torch.Tensor:
    """Scores whose softmax is ``probs`` (0 -> -inf, like a masked token)."""
    return torch.tensor(probs, dtype=torch.float64).log()


def _one_level(children, p_root, p_child=None, sampling=DraftSampling.DETERMINISTIC, q_root=None) -> tuple:
    """A tree of leaves under the root, its `[T + 1, V]` scores (every child has scores ``p_child``)."""
    V = len(p_root)
    tree = DraftTree.from_parents(children, [-1] * len(children), sampling=sampling)
    if q_root is not None:
        tree.draft_probs = torch.tensor([q_root] + [[1.0 / V] * V] * len(children), dtype=torch.float64)
    p_child = p_child if p_child is not None else [1.0 / V] * V
    scores = torch.stack([_log(p_root)] + [_log(p_child)] * len(children))
    return tree, scores


def _level_outcomes(tree, scores, n=N_MC, seed=0, **kwargs) -> Counter:
    """Counter of ("child", i) (node i accepted) and ("token", y) (no child accepted, next token y)."""
    g = torch.Generator().manual_seed(seed)
    out = Counter()
    for _ in range(n):
        v = verify_tree(tree, scores, do_sample=True, generator=g, **kwargs)
        out[("child", int(v.accepted[1]) - 1) if v.num_accepted else ("token", v.next_token)] += 1
    return out


def _assert_law(counts: Counter, law: dict, n=N_MC):
    """Every outcome within 5 sigma of its closed-form probability, nothing outside the law's support."""
    for key in counts:
        assert law.get(key, 0.0) > 0, f"outcome {key} has probability 0 but occurred {counts[key]} times"
    for key, prob in law.items():
        sigma = math.sqrt(max(prob * (1 - prob), 1e-12) / n)
        freq = counts.get(key, 0) / n
        assert abs(freq - prob) <= 5 * sigma + 1e-12, f"{key}: frequency {freq:.4f}, expected {prob:.4f}"
    keys = [k for k, prob in law.items() if prob > 0]
    if len(keys) < 2:
        return
    p_value = chisquare([counts.get(k, 0) for k in keys], [n * law[k] for k in keys]).pvalue
    assert p_value > 1e-4, f"chi-square p-value {p_value:.2e}: {dict(counts)} vs {law}"


def _reference_level_law(p, q, kids, sampling) -> dict:
    """The sequential rule of docs/algorithms.md, written out literally in float64 Python, as exact probabilities."""
    R = list(p)
    D = list(q) if q is not None else None
    law, reach = {}, 1.0  # reach = probability that every earlier child was rejected
    for i, x in enumerate(kids):
        if sampling == DraftSampling.DETERMINISTIC:
            tot = sum(R)
            a = R[x] / tot
            R[x] = 0.0
        else:
            if D[x] == 0:  # cannot have been drawn from D: skipped
                law[("child", i)] = 0.0
                continue
            a = min(1.0, R[x] / D[x])
            res = [max(0.0, r - d) for r, d in zip(R, D)]
            if sum(res) > 0:
                R = [r / sum(res) for r in res]
            if sampling == DraftSampling.WITHOUT_REPLACEMENT:
                D[x] = 0.0
                D = [d / sum(D) for d in D] if sum(D) > 0 else D
        law[("child", i)] = law.get(("child", i), 0.0) + reach * a
        reach *= 1 - a
    tot = sum(R)
    for y, r in enumerate(R):
        if r > 0:
            law[("token", y)] = reach * r / tot
    return {k: v for k, v in law.items() if v > 0}


# ------------------------------------------------------------------------------------------------ greedy
def test_greedy_is_verify_greedy_whatever_the_acceptance_rule():
    torch.manual_seed(0)
    tree = DraftTree.from_parents([1, 2, 3, 0, 4], [-1, -1, 0, 0, 2])
    for _ in range(20):
        scores = torch.randn(tree.num_nodes + 1, 5)
        want = verify_greedy(tree, scores)
        for acceptance in ("exact", "typical"):
            got = verify_tree(tree, scores, do_sample=False, acceptance=acceptance)
            assert got.accepted.tolist() == want.accepted.tolist() and got.next_token == want.next_token


def test_greedy_accepts_the_argmax_path():
    tree = DraftTree.from_parents([0, 1, 2], [-1, -1, 1])
    scores = torch.stack([_log([0.2, 0.5, 0.3]), _log([0.1, 0.1, 0.8]), _log([0.1, 0.1, 0.8]), _log([0.6, 0.3, 0.1])])
    v = verify_tree(tree, scores, do_sample=False)
    assert v.accepted.tolist() == [0, 2, 3] and v.next_token == 0


# ---------------------------------------------------------------------------------------- deterministic
def test_deterministic_children_accepted_with_target_probability():
    """docs/algorithms.md: p = (0.5, 0.3, 0.2), children [0, 1] -> P(0) = 0.5, P(1) = 0.3, P(next = 2 at root) = 0.2."""
    tree, scores = _one_level([0, 1], [0.5, 0.3, 0.2])
    law = {("child", 0): 0.5, ("child", 1): 0.3, ("token", 2): 0.2}
    _assert_law(_level_outcomes(tree, scores), law)
    assert _reference_level_law([0.5, 0.3, 0.2], None, [0, 1], DraftSampling.DETERMINISTIC) == pytest.approx(law)


def test_deterministic_child_order_does_not_matter():
    tree, scores = _one_level([2, 0], [0.5, 0.3, 0.2])
    _assert_law(_level_outcomes(tree, scores), {("child", 0): 0.2, ("child", 1): 0.5, ("token", 1): 0.3})


def test_deterministic_duplicate_sibling_is_never_accepted():
    """After the first copy is rejected its residual mass is 0, so the second copy can never win."""
    tree, scores = _one_level([0, 0, 1], [0.5, 0.3, 0.2])
    _assert_law(_level_outcomes(tree, scores), {("child", 0): 0.5, ("child", 2): 0.3, ("token", 2): 0.2})


def test_deterministic_zero_probability_child_is_never_accepted():
    tree, scores = _one_level([2, 0], [0.5, 0.5, 0.0])  # token 2 masked (-inf) by a warper
    _assert_law(_level_outcomes(tree, scores), {("child", 1): 0.5, ("token", 1): 0.5})


def test_deterministic_rule_ignores_draft_probs():
    """The known bug: min(1, p/q) with the draft's softmax q = (0.9, 0.1) would accept A with 5/9 instead of 1/2."""
    tree, scores = _one_level([0], [0.5, 0.5], q_root=[0.9, 0.1])
    _assert_law(_level_outcomes(tree, scores), {("child", 0): 0.5, ("token", 1): 0.5})


def test_leaf_bonus_token_comes_from_the_leaf_distribution():
    tree = DraftTree.chain([1])
    scores = torch.stack([_log([0.0, 1.0, 0.0]), _log([0.6, 0.1, 0.3])])
    g = torch.Generator().manual_seed(0)
    counts = Counter()
    for _ in range(N_MC):
        v = verify_tree(tree, scores, do_sample=True, generator=g)
        assert v.accepted.tolist() == [0, 1]
        counts[("token", v.next_token)] += 1
    _assert_law(counts, {("token", 0): 0.6, ("token", 1): 0.1, ("token", 2): 0.3})


def test_accepted_child_is_verified_with_its_own_distribution():
    """Root p forces child 1; node 1's p forces its child 0; the bonus comes from node 2's p."""
    tree = DraftTree.from_parents([0, 1, 0, 2], [-1, -1, 1, 1])
    scores = torch.stack(
        [_log([0.0, 1.0, 0.0]), _log([1.0, 0.0, 0.0]), _log([1.0, 0.0, 0.0]), _log([0.0, 0.0, 1.0]), _log([0, 1, 0])]
    )
    for seed in range(20):
        v = verify_tree(tree, scores, do_sample=True, generator=torch.Generator().manual_seed(seed))
        assert v.accepted.tolist() == [0, 2, 3] and v.next_token == 2


# ------------------------------------------------------------------------------------------------ sampled
def test_sampled_chain_is_leviathan_chen():
    """q = (0.9, 0.1), p = (0.5, 0.5): a drafted A is kept w.p. 5/9, otherwise the correction is B (= norm(p - q)+)."""
    for sampling in (DraftSampling.WITHOUT_REPLACEMENT, DraftSampling.IID):
        tree, scores = _one_level([0], [0.5, 0.5, 0.0], sampling=sampling, q_root=[0.9, 0.1, 0.0])
        _assert_law(_level_outcomes(tree, scores), {("child", 0): 5 / 9, ("token", 1): 4 / 9})
        tree, scores = _one_level([1], [0.5, 0.5, 0.0], sampling=sampling, q_root=[0.9, 0.1, 0.0])
        _assert_law(_level_outcomes(tree, scores, n=300), {("child", 0): 1.0}, n=300)


def test_sampled_without_replacement_two_children():
    """p = (0.2, 0.5, 0.3), q = (0.5, 0.3, 0.2), children [0, 2].

    Child 0: accept 0.2/0.5 = 0.4. Rejected: R = (0, 2/3, 1/3), D = (0, 0.6, 0.4). Child 2: accept (1/3)/0.4 = 5/6,
    so P = 0.6 * 5/6 = 0.5. Rejected: R = norm(max(0, R - D)) = (0, 1, 0), P(next = 1) = 0.6 * 1/6 = 0.1.
    """
    p, q = [0.2, 0.5, 0.3], [0.5, 0.3, 0.2]
    law = {("child", 0): 0.4, ("child", 1): 0.5, ("token", 1): 0.1}
    assert _reference_level_law(p, q, [0, 2], DraftSampling.WITHOUT_REPLACEMENT) == pytest.approx(law)
    tree, scores = _one_level([0, 2], p, sampling=DraftSampling.WITHOUT_REPLACEMENT, q_root=q)
    _assert_law(_level_outcomes(tree, scores), law)


def test_sampled_iid_two_children():
    """Same as above but D stays q: child 2 is accepted w.p. min(1, (1/3)/0.2) = 1 after child 0's rejection."""
    p, q = [0.2, 0.5, 0.3], [0.5, 0.3, 0.2]
    law = {("child", 0): 0.4, ("child", 1): 0.6}
    assert _reference_level_law(p, q, [0, 2], DraftSampling.IID) == pytest.approx(law)
    tree, scores = _one_level([0, 2], p, sampling=DraftSampling.IID, q_root=q)
    _assert_law(_level_outcomes(tree, scores), law)


@pytest.mark.parametrize("sampling", [DraftSampling.WITHOUT_REPLACEMENT, DraftSampling.IID])
@pytest.mark.parametrize("kids", [[1, 0, 3], [2, 2, 1], [3, 1]])
def test_sampled_rule_matches_the_sequential_reference(sampling, kids):
    p, q = [0.1, 0.35, 0.25, 0.3], [0.4, 0.2, 0.15, 0.25]
    tree, scores = _one_level(kids, p, sampling=sampling, q_root=q)
    _assert_law(_level_outcomes(tree, scores, n=2000), _reference_level_law(p, q, kids, sampling), n=2000)


def test_sampled_child_with_zero_draft_probability_is_skipped():
    """q(0) = 0: child 0 cannot have been drawn; it is skipped and the rest is the one-child rule on child 1."""
    p, q = [0.5, 0.3, 0.2], [0.0, 1.0, 0.0]
    for sampling in (DraftSampling.WITHOUT_REPLACEMENT, DraftSampling.IID):
        tree, scores = _one_level([0, 1], p, sampling=sampling, q_root=q)
        law = {("child", 1): 0.3, ("token", 0): 0.5, ("token", 2): 0.2}
        _assert_law(_level_outcomes(tree, scores), law)


def test_sampled_p_equal_q_accepts_everything():
    p = [0.5, 0.3, 0.2]
    tree, scores = _one_level([1, 0], p, sampling=DraftSampling.WITHOUT_REPLACEMENT, q_root=p)
    assert _level_outcomes(tree, scores, n=300) == Counter({("child", 0): 300})


def test_sampled_rejection_with_empty_residual_gives_a_valid_token(monkeypatch):
    """Force a rejection where p == q (probability ~0 in reality): the residual is empty; no NaN, no crash."""
    p = [0.5, 0.3, 0.2, 0.0]
    monkeypatch.setattr(verify_mod, "_uniform", lambda shape, device, generator: torch.ones(shape, dtype=torch.float64))
    for sampling in (DraftSampling.WITHOUT_REPLACEMENT, DraftSampling.IID):
        tree, scores = _one_level([1, 0], p, sampling=sampling, q_root=p)
        for seed in range(20):
            v = verify_tree(tree, scores, do_sample=True, generator=torch.Generator().manual_seed(seed))
            assert v.num_accepted == 0 and v.next_token in (0, 1, 2)


def test_sampled_tree_without_matching_draft_probs_is_refused():
    tree, scores = _one_level([0], [0.5, 0.5], sampling=DraftSampling.IID)
    with pytest.raises(ValueError, match="needs draft_probs"):
        verify_tree(tree, scores, do_sample=True)
    tree.draft_probs = torch.full((2, 3), 1 / 3)  # a draft vocabulary of 3 for a target of 2
    with pytest.raises(ValueError, match="shape"):
        verify_tree(tree, scores, do_sample=True)


# ----------------------------------------------------------------------------------------------- errors
def test_fully_masked_position_raises_only_when_reached():
    tree = DraftTree.from_parents([0, 1], [-1, -1])
    masked = torch.full((3,), -torch.inf, dtype=torch.float64)
    scores = torch.stack([_log([1.0, 0.0, 0.0]), _log([0.2, 0.3, 0.5]), masked])  # node 1 (token 1) never accepted
    for seed in range(10):
        assert verify_tree(
            tree, scores, do_sample=True, generator=torch.Generator().manual_seed(seed)
        ).accepted.tolist() == [0, 1]
    with pytest.raises(ValueError, match="mask every token"):
        verify_tree(tree, torch.stack([masked, scores[1], scores[2]]), do_sample=True)
    with pytest.raises(ValueError, match="mask every token"):
        sample_from_scores(torch.stack([scores[0], masked]))


def test_bad_arguments_are_refused():
    tree, scores = _one_level([0], [0.5, 0.5])
    with pytest.raises(ValueError, match="acceptance"):
        verify_tree(tree, scores, do_sample=True, acceptance="lossy")
    with pytest.raises(ValueError, match=r"\[T \+ 1, V\]"):
        verify_tree(tree, scores[:1], do_sample=True)


# ---------------------------------------------------------------------------------------------- typical
def _entropy(p):
    return -sum(x * math.log(x) for x in p if x > 0)


def test_typical_threshold_is_min_of_epsilon_and_entropy_term():
    p = [0.9, 0.06, 0.04]  # H = 0.394, 0.3 exp(-H) = 0.202 > 0.09: threshold = epsilon = 0.09
    assert 0.3 * math.exp(-_entropy(p)) > 0.09
    for child, accepted in [(0, True), (1, False), (2, False)]:
        tree, scores = _one_level([child], p)
        v = verify_tree(tree, scores, do_sample=True, acceptance="typical", generator=torch.Generator().manual_seed(0))
        assert v.num_accepted == int(accepted), child
    # with a larger epsilon the entropy term 0.3 exp(-H) = 0.202 binds
    tree, scores = _one_level([1], p)
    assert verify_tree(tree, scores, do_sample=True, acceptance="typical", typical_epsilon=0.05).num_accepted == 1
    assert verify_tree(tree, scores, do_sample=True, acceptance="typical", typical_epsilon=0.5).num_accepted == 0
    flat = [0.4, 0.35, 0.25]  # delta exp(-H) with delta = 1: exp(-1.08) = 0.34 -> only token 0 (0.4) and 1 (0.35)
    threshold = math.exp(-_entropy(flat))
    for child in range(3):
        tree, scores = _one_level([child], flat)
        v = verify_tree(tree, scores, do_sample=True, acceptance="typical", typical_epsilon=1.0, typical_delta=1.0)
        assert v.num_accepted == int(flat[child] > threshold), (child, threshold)


def test_typical_prefers_the_longest_path_then_the_likeliest():
    # root children: 0 (p .5), 1 (p .4); node 0 -> child 2 (p .45 at node 0); node 1 -> child 2 (p .9 at node 1)
    tree = DraftTree.from_parents([0, 1, 2, 2], [-1, -1, 0, 1])
    scores = torch.stack(
        [_log([0.5, 0.4, 0.1]), _log([0.3, 0.25, 0.45]), _log([0.05, 0.05, 0.9]), _log([0, 0, 1]), _log([0, 1, 0])]
    )
    v = verify_tree(tree, scores, do_sample=True, acceptance="typical")
    # both depth-2 paths pass; log(.4 * .9) > log(.5 * .45), so the path through node 1 wins
    assert v.accepted.tolist() == [0, 2, 4] and v.next_token == 1
    # a deeper path wins over a likelier shorter one
    tree = DraftTree.from_parents([0, 1, 2], [-1, -1, 1])
    scores = torch.stack([_log([0.6, 0.3, 0.1]), _log([0, 0, 1]), _log([0.05, 0.05, 0.9]), _log([1, 0, 0])])
    v = verify_tree(tree, scores, do_sample=True, acceptance="typical")
    assert v.accepted.tolist() == [0, 2, 3] and v.next_token == 0


def test_typical_next_token_is_sampled_from_p_at_the_last_accepted_node():
    p = [0.6, 0.3, 0.1]
    assert 0.1 > min(0.09, 0.3 * math.exp(-_entropy(p)))  # child 2 passes; the child's own p is uniform
    tree, scores = _one_level([2], p)
    counts = Counter(("token", v.next_token) for v in _verdicts(tree, scores, acceptance="typical"))
    _assert_law(counts, {("token", y): 1 / 3 for y in range(3)})
    tree, scores = _one_level([1], [0.9, 0.06, 0.04])  # child 1 fails: the next token comes from the root's p
    counts = Counter(("token", v.next_token) for v in _verdicts(tree, scores, acceptance="typical"))
    _assert_law(counts, {("token", 0): 0.9, ("token", 1): 0.06, ("token", 2): 0.04})


def test_typical_acceptance_is_lossy():
    """p = (0.5, 0.3, 0.2), child [0]: exact sampling keeps it half the time, typical acceptance always."""
    tree, scores = _one_level([0], [0.5, 0.3, 0.2])
    assert all(v.num_accepted == 1 for v in _verdicts(tree, scores, n=50, acceptance="typical"))
    exact = sum(v.num_accepted for v in _verdicts(tree, scores, n=400))
    assert 150 < exact < 250


def _verdicts(tree, scores, n=N_MC, seed=0, **kwargs) -> list[Verdict]:
    g = torch.Generator().manual_seed(seed)
    return [verify_tree(tree, scores, do_sample=True, generator=g, **kwargs) for _ in range(n)]


# ------------------------------------------------------------------------------------------ reproducibility
@pytest.mark.parametrize("acceptance", ["exact", "typical"])
@pytest.mark.parametrize("sampling", list(DraftSampling))
def test_a_seeded_generator_reproduces_the_verdicts(sampling, acceptance):
    torch.manual_seed(0)
    tree = DraftTree.from_parents([0, 1, 2, 0, 3], [-1, -1, -1, 0, 1], sampling=sampling)
    tree.draft_probs = torch.softmax(torch.randn(tree.num_nodes + 1, 4, dtype=torch.float64), -1)
    scores = torch.randn(tree.num_nodes + 1, 4)

    def run(seed):
        return [
            (v.accepted.tolist(), v.next_token) for v in _verdicts(tree, scores, n=40, seed=seed, acceptance=acceptance)
        ]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_sample_from_scores_matches_torch_multinomial():
    scores = torch.randn(6, 5)
    scores[0, :3] = -torch.inf
    want = torch.multinomial(torch.softmax(scores, -1), 1, generator=torch.Generator().manual_seed(3)).squeeze(1)
    got = sample_from_scores(scores, torch.Generator().manual_seed(3))
    assert got.tolist() == want.tolist() and got.shape == (6,)
    assert int(got[0]) in (3, 4)
