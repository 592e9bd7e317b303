"""The tree budgeter and the online cost model, on injected cost curves and simulated verdicts (no timing)."""

import gc
import itertools
import random
import threading
import weakref

import pytest
import torch

from hf_specdec.generation import cost_model as cost_module
from hf_specdec.generation.budget import (
    AcceptanceCalibration,
    RowCandidates,
    TreeBudgeter,
    calibrated_probs,
    conditional_scores,
    structural_scores,
)
from hf_specdec.generation.cost_model import PriorCurve, StepCostModel, cost_model_for
from hf_specdec.generation.tree import DraftSampling, DraftTree


def cpu_curve(n):  # steep: every verified token adds 12% of a decode step
    return 0.020 * (1 + 0.12 * (n - 1))


def gpu_curve(n):  # flat up to 64 tokens, then linear
    return 0.010 * (1 + 0.002 * (n - 1) + max(0, n - 64) * 0.02)


def measured(curve, sizes=range(1, 80), repeats=3) -> StepCostModel:
    cost = StepCostModel()
    for _ in range(repeats):
        for n in sizes:
            cost.record_verify(n, 1, curve(n))
    return cost


def chain(accept: float, length: int) -> tuple[DraftTree, list[float]]:
    """A chain whose depth-d node is accepted with probability ``accept ** d`` (and is scored so)."""
    return DraftTree.chain(list(range(10, 10 + length))), [accept ** (d + 1) for d in range(length)]


def quiet_budgeter(cost: StepCostModel, **kwargs) -> TreeBudgeter:
    """No margin and no exploration: the decision is the predicted optimum, comparable with brute force."""
    return TreeBudgeter(cost, margin=0.0, explore_every=10**9, **kwargs)


@pytest.mark.parametrize("curve", [cpu_curve, gpu_curve], ids=["cpu", "gpu"])
@pytest.mark.parametrize("accept", [0.2, 0.5, 0.8, 0.95])
def test_budgeter_picks_the_size_with_the_best_expected_rate(curve, accept):
    cost = measured(curve)
    tree, scores = chain(accept, 40)
    budgeter = quiet_budgeter(cost)
    budgeter.propose_seconds = 0.001
    k = budgeter.cut([RowCandidates(0, tree, scores)])[0].num_nodes

    def rate(j):  # the step's proposing time is spent whatever the cut
        return (1 + sum(scores[:j])) / (curve(1 + j) + 0.001)

    best = max(range(41), key=rate)
    assert rate(k) == pytest.approx(rate(best), rel=1e-3), (k, best)


def test_budgeter_drafts_nothing_when_nothing_pays():
    cost = measured(cpu_curve)
    tree, scores = chain(0.08, 16)
    budgeter = TreeBudgeter(cost)
    cut = budgeter.cut([RowCandidates(0, tree, scores)])[0]
    assert cut.num_nodes == 0 and cut.kept is not None and cut.kept.numel() == 0
    assert budgeter.summary()["draft_nothing_fraction"] == 1.0


def test_rows_are_budgeted_jointly():
    cost = measured(cpu_curve)
    rows = [chain(0.9, 12), chain(0.55, 12), chain(0.3, 12)]
    budgeter = quiet_budgeter(cost)
    cuts = budgeter.cut([RowCandidates(b, t, s) for b, (t, s) in enumerate(rows)])
    chosen = tuple(c.num_nodes for c in cuts)

    def rate(ks):
        tokens = len(rows) + sum(sum(s[:k]) for (_, s), k in zip(rows, ks))
        return tokens / cpu_curve(len(rows) + sum(ks))

    best = max(itertools.product(range(13), repeat=len(rows)), key=rate)
    assert rate(chosen) == pytest.approx(rate(best), rel=1e-6), (chosen, best)
    assert chosen[0] > chosen[1] > chosen[2]


def test_speedup_ranks_two_assistants_trees_for_a_row():
    cost = measured(cpu_curve)
    budgeter = quiet_budgeter(cost)
    strong, weak = chain(0.9, 8), chain(0.1, 8)
    s_strong = budgeter.speedup(RowCandidates(0, *strong))
    s_weak = budgeter.speedup(RowCandidates(0, *weak))
    assert s_strong > 1.5 and s_weak == 1.0


def test_unscored_trees_are_verified_as_proposed_and_count_in_the_cost():
    cost = measured(lambda n: 0.02 * (1 + 0.02 * (n - 1) + 0.3 * max(0, n - 20)))  # cheap up to 20 tokens
    scored, scores = chain(0.7, 12)
    alone = quiet_budgeter(cost).cut([RowCandidates(0, scored, scores)])[0].num_nodes
    unscored = DraftTree.chain(list(range(30, 50)))
    cuts = quiet_budgeter(cost).cut([RowCandidates(0, scored, scores), RowCandidates(1, unscored, fixed=True)])
    assert cuts[1].tree is unscored and cuts[1].kept is None
    assert cuts[0].num_nodes < alone, "the fixed row's nodes make the scored row's nodes dearer"


def test_cut_keeps_the_best_nodes_as_a_tree_and_maps_them_back():
    # root -> a (0.9) -> b (0.5); root -> c (0.3) -> d (0.25)
    tree = DraftTree.from_parents([5, 6, 7, 8], [-1, 0, -1, 2])
    cost = measured(lambda n: 0.02 * (1 + 0.3 * (n - 1)))
    cut = quiet_budgeter(cost).cut([RowCandidates(0, tree, [0.9, 0.5, 0.3, 0.25])])[0]
    assert cut.num_nodes == 2
    assert cut.kept.tolist() == [0, 1]
    assert cut.tree.tokens.tolist() == [5, 6] and cut.tree.parent.tolist() == [-1, 0]


def test_sampled_trees_are_cut_by_structure_and_keep_siblings_a_draw_prefix():
    # root with three sampled children (draw order 0, 1, 2); the scores would favour the last draw
    q = torch.softmax(torch.randn(4, 20), -1)
    tree = DraftTree.from_parents([3, 4, 5], [-1, -1, -1], sampling=DraftSampling.WITHOUT_REPLACEMENT, draft_probs=q)
    probs = calibrated_probs(tree, conditional_scores(tree, structural_scores(tree)), [1.0] * 12)
    assert probs == sorted(probs, reverse=True)
    cost = measured(lambda n: 0.02 * (1 + 0.3 * (n - 1)))
    cut = quiet_budgeter(cost).cut([RowCandidates(0, tree, [0.01, 0.01, 0.99])])[0]
    assert 0 < cut.num_nodes < 3
    assert cut.kept.tolist() == list(range(cut.num_nodes))
    assert torch.equal(cut.tree.draft_probs, q[: cut.num_nodes + 1])


def test_cost_model_converges_to_an_injected_curve_from_noisy_samples():
    rng = random.Random(0)
    cost = StepCostModel()
    sizes = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
    for _ in range(40):
        for n in sizes:
            noise = rng.uniform(0.95, 1.1) * (6.0 if rng.random() < 0.1 else 1.0)  # jitter and preempted steps
            cost.record_verify(n, 1, cpu_curve(n) * noise)
    for n in sizes + [5, 10, 20]:  # measured buckets and sizes between them
        assert cost.predict(n) == pytest.approx(cpu_curve(n), rel=0.1), n
    curve = cost.predict_range(1, 200)
    assert all(b >= a for a, b in zip(curve, curve[1:])), "the cost curve must not decrease"


def test_a_one_off_slow_forward_does_not_poison_a_rarely_used_size():
    cost = measured(cpu_curve, sizes=[1, 2, 3, 4, 6, 8, 12, 16], repeats=3)
    cost.record_verify(5, 1, 60 * cpu_curve(5))  # weights packed inside this forward: once, 60x slower
    for n in (5, 6, 8):
        assert cost.predict(n) <= 1.5 * cpu_curve(n), n


def test_cost_model_prior_is_replaced_by_measurements_and_scales_untried_sizes():
    cost = StepCostModel(PriorCurve.linear(0.1))
    assert cost.predict(11) == pytest.approx(2.0)  # prior units before any sample
    for _ in range(3):
        cost.record_verify(1, 1, 0.010)
        cost.record_verify(4, 1, 0.010)  # flat where measured
    assert cost.predict(2) == pytest.approx(0.010)
    # past the last measured size: the measured (flat) slope, but at least a quarter of the prior's from there
    by_prior_ratio = 0.010 * 2.1 / 1.3  # rel(12) / rel(4) applied to the measured 4-token cost
    assert cost.predict(12) == pytest.approx(0.010 + 0.25 * (by_prior_ratio - 0.010))
    steep = StepCostModel(PriorCurve.linear(0.1))
    for n in (1, 2, 4):
        steep.record_verify(n, 1, 0.010 * (1 + 0.5 * (n - 1)))  # steeper than the prior: the measured slope holds
    assert steep.predict(12) == pytest.approx(0.010 * (1 + 0.5 * 11))
    assert not cost.set_prior(PriorCurve.linear(0.5)), "a prior must not replace measurements"


def test_shipped_node_cost_table_becomes_the_prior():
    prior = PriorCurve.from_node_costs({"0": 1.0, "1": 1.12, "3": 1.61, "4": 1.57, "8": 1.98})
    assert prior(1) == 1.0 and prior(2) == pytest.approx(1.12)
    assert prior(5) >= prior(4), "a dip in a measured table is flattened"
    assert prior(12) > prior(9)


@pytest.mark.parametrize("curve", [cpu_curve, gpu_curve], ids=["cpu", "gpu"])
def test_exploration_finds_the_best_size_from_a_conservative_prior(curve):
    cost = StepCostModel()  # conservative CPU-like prior, nothing measured
    tree, scores = chain(0.93, 80)
    budgeter = TreeBudgeter(cost, explore_every=4)
    rng = random.Random(2)
    sizes = []
    for _ in range(200):
        k = budgeter.cut([RowCandidates(0, tree, scores)])[0].num_nodes
        sizes.append(k)
        depth = 0
        while depth < k and rng.random() < 0.93:  # the target accepts as the scores say
            depth += 1
        budgeter.record_verdicts([list(range(depth))])
        budgeter.record_step(1 + k, 1, curve(1 + k), 0.0005, 0.0)

    def rate(j):
        return (1 + sum(scores[:j])) / (curve(1 + j) + (0.0005 if j else 0.0))

    best = max(range(81), key=rate)
    assert sizes[0] <= 16
    assert rate(sizes[-1]) >= 0.97 * rate(best), (sizes[-10:], best)
    if curve is gpu_curve:
        assert sizes[-1] >= 40, "a flat (GPU) cost curve must end in big trees"
        assert budgeter.summary()["explorations"] > 0


def test_calibration_shrinks_over_confident_scores():
    cost = measured(cpu_curve)
    tree, scores = chain(0.9, 16)  # claims 90% per level
    budgeter = quiet_budgeter(cost)
    rng = random.Random(1)
    sizes = []
    for _ in range(60):
        cut = budgeter.cut([RowCandidates(0, tree, scores, source="overconfident")])[0]
        sizes.append(cut.num_nodes)
        depth = 0
        while depth < cut.num_nodes and rng.random() < 0.3:  # the target accepts 30% per level
            depth += 1
        budgeter.record_verdicts([list(range(depth))])
    assert sizes[0] >= 4
    assert sizes[-1] <= 1, sizes
    factors = budgeter.calibration.factors("overconfident", 0)
    assert factors[0] < 0.6


def test_calibration_lifts_under_confident_scores_quickly():
    cal = AcceptanceCalibration()
    for _ in range(5):
        cal.update("shy", 0, [1, 2], [0.05, 0.01], [True, True])
    factors = cal.factors("shy", 0)
    assert factors[0] * 0.05 > 0.5 and factors[1] * 0.01 > 0.5


def test_calibration_is_per_source_and_row_shrunk_to_the_source():
    cal = AcceptanceCalibration(weight=2.0, decay=1.0)
    for _ in range(20):
        cal.update("a", 0, [1], [0.8], [False])
    assert cal.factors("a", 0)[0] < 0.15
    assert cal.factors("a", 1)[0] == pytest.approx(cal.factors("a", -1)[0])  # a new row starts from its source
    assert cal.factors("b", 0)[0] == 1.0


def test_paused_row_probes_again_and_resumes_when_drafts_pay():
    cost = measured(cpu_curve)
    tree, scores = chain(0.8, 8)
    budgeter = TreeBudgeter(cost, probe_every=3, probe_max=12)
    budgeter.propose_seconds = 0.005  # proposing costs a quarter of a step: pausing pays
    caps, sizes = [], []
    for step in range(40):
        cap = budgeter.depth_cap(0, 10)
        caps.append(cap)
        cand = RowCandidates(0, tree if cap else DraftTree.empty(), scores if cap else None)
        k = budgeter.cut([cand])[0].num_nodes
        sizes.append(k)
        accept_now = step >= 20  # rejected for 20 steps, then the text becomes predictable
        budgeter.record_verdicts([list(range(k)) if accept_now else []])
    paused = [i for i, c in enumerate(caps[:20]) if c == 0]
    assert paused, "a row whose drafts are all rejected must be paused"
    assert any(caps[i] == 1 and sizes[i] == 1 for i in range(paused[0], 20)), "a paused row must probe, at depth 1"
    assert sizes[-1] >= 3, f"the row must resume once its probes are accepted, got {sizes[-5:]}"
    assert budgeter.summary()["probes"] >= 1


def test_a_row_confident_on_every_third_token_keeps_proposing_between_them():
    """Pausing is decided on the running mean of a row's net value of proposing, not on one step: a head sure of
    every third token (and of nothing in between) pays for its passes on the other two, so it is never paused and
    drafts on its confident steps; a head sure of nothing is paused within a few steps."""
    cost = measured(cpu_curve)

    def run(confident):
        budgeter = TreeBudgeter(cost, explore_every=10**9)
        budgeter.propose_seconds = 0.001  # 5% of a plain step: pausing can pay
        drafted = []
        for step in range(60):
            cap = budgeter.depth_cap(0, 1)
            sure = confident(step)
            tree, scores = chain(0.95 if sure else 0.01, cap)
            k = budgeter.cut([RowCandidates(0, tree, scores if cap else None)])[0].num_nodes
            drafted.append((sure, cap, k))
            budgeter.record_verdicts([list(range(k)) if sure else []])
        return budgeter, drafted

    budgeter, drafted = run(lambda step: step % 3 == 0)
    assert budgeter.summary()["paused"] == 0, drafted
    assert sum(k > 0 for sure, _, k in drafted if sure) == 20, drafted
    budgeter, drafted = run(lambda step: False)
    assert [cap for _, cap, _ in drafted[10:]].count(0) >= 40, f"a row whose drafts never pay must pause: {drafted}"


def test_a_paying_row_grows_its_depth_one_level_per_step_when_proposing_costs():
    """A costly assistant is asked for one level more than the deepest node the budget kept last step: levels the
    budget cuts away are not expanded, and a row whose deep nodes pay reaches the full depth level by level."""
    cost = measured(cpu_curve)
    budgeter = TreeBudgeter(cost)
    budgeter.propose_seconds = 0.005
    caps = []
    for _ in range(8):
        cap = budgeter.depth_cap(0, 6)
        caps.append(cap)
        tree, scores = chain(0.95, cap)  # an assistant that honours the cap, sure of every level
        k = budgeter.cut([RowCandidates(0, tree, scores)])[0].num_nodes
        budgeter.record_verdicts([list(range(k))])
    assert caps[0] == 6, "nothing known yet: the full depth"
    assert caps[-1] == 6 and max(caps) == 6


def test_a_level_the_budget_cuts_is_not_drafted_again_until_it_is_explored():
    """Once the budget cut a level, a costly assistant is not asked for it (a head pass that never pays) for
    ``depth_retry_every`` steps; then it is asked once more, and a level that pays by then is kept and grown past."""
    cost = measured(cpu_curve)
    budgeter = TreeBudgeter(cost, explore_every=1000, depth_retry_every=5)  # no size exploration in the way
    budgeter.propose_seconds = 0.005
    tree, scores = chain(0.9, 6)
    scores = [scores[0]] + [1e-4] * 5  # only the first level pays
    assert budgeter.depth_cap(0, 6) == 6
    kept = budgeter.cut([RowCandidates(0, tree, scores)])[0].tree.max_depth
    assert kept == 1
    caps = []
    for step in range(12):
        cap = budgeter.depth_cap(0, 6)
        caps.append(cap)
        sub, sub_scores = chain(0.9, cap)
        sub_scores = [sub_scores[0]] + [1e-4] * (cap - 1) if step < 8 else sub_scores  # level 2 pays from step 8
        budgeter.cut([RowCandidates(0, sub, sub_scores)])
        budgeter.record_verdicts([[0]])
    assert caps[:4] == [1, 1, 1, 1], f"the cut level must not be drafted again at once, got {caps}"
    assert caps[4] == 2 and caps[5:9] == [1, 1, 1, 1], f"asked once more after depth_retry_every steps, got {caps}"
    assert caps[9] == 2 and caps[10] == 3, f"a level that pays is kept and the row grows past it, got {caps}"


def test_free_proposers_are_never_paused():
    cost = measured(cpu_curve)
    budgeter = TreeBudgeter(cost)
    budgeter.propose_seconds = 1e-6
    tree, scores = chain(0.05, 4)
    for _ in range(10):
        assert budgeter.depth_cap(0, 5) == 5
        budgeter.cut([RowCandidates(0, tree, scores)])
        budgeter.record_verdicts([[]])


def test_summary_reports_the_curve_and_the_budgets():
    cost = measured(cpu_curve, sizes=[1, 2, 4])
    budgeter = quiet_budgeter(cost)
    tree, scores = chain(0.9, 6)
    budgeter.cut([RowCandidates(0, tree, scores), RowCandidates(1, DraftTree.empty(), None)])
    summary = budgeter.summary()
    assert summary["cost"]["curve"][4] == pytest.approx(cpu_curve(4))
    assert summary["cost"]["samples"] == {1: 3, 2: 3, 4: 3}
    assert sum(summary["nodes_per_row"].values()) == 2 and summary["nodes_per_row"][0] == 1
    assert summary["no_candidates"] == 1


def test_cost_model_is_shared_per_model_never_stored_on_it():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    before = dict(a.__dict__)
    assert cost_model_for(a) is cost_model_for(a)
    assert cost_model_for(a) is not cost_model_for(b)
    assert a.__dict__.keys() == before.keys()
    ref = weakref.ref(a)
    del a
    gc.collect()
    assert ref() is None
    assert all(m is not None for m in cost_module._MODELS.keys())


def test_cost_model_takes_samples_from_two_threads():
    cost = StepCostModel(window=10_000)

    def feed():
        for i in range(2000):
            cost.record_verify(1 + i % 8, 1, 0.01)
            cost.predict(5)

    threads = [threading.Thread(target=feed) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cost.num_samples == 4000


def _decode(budgeter, tree, scores, accept, steps, slow, rng, propose_s=0.0005):
    """``steps`` simulated decoding steps; verify forwards that draft (k > 0) take ``slow`` times the CPU curve."""
    sizes = []
    for _ in range(steps):
        k = budgeter.cut([RowCandidates(0, tree, scores)])[0].num_nodes
        sizes.append(k)
        depth = 0
        while depth < k and rng.random() < accept:
            depth += 1
        budgeter.record_verdicts([list(range(depth))])
        budgeter.record_step(1 + k, 1, cpu_curve(1 + k) * (slow if k else 1.0), propose_s if k else 0.0, 0.0)
    return sizes


@pytest.mark.parametrize("slow", [1.8, 3.0, 6.0])
def test_a_burst_of_slow_drafting_steps_does_not_lock_the_row_into_drafting_nothing(slow):
    """Drafting steps measured slow for a while (weights not packed yet, another process on the core) make every
    tree look expensive; once the machine is quiet again the budgeter must find the paying size again (re-measuring
    sizes whose measurements disagree with what the rest of the curve says), not keep drafting nothing forever."""
    tree, scores = chain(0.8, 12)
    budgeter = TreeBudgeter(measured(cpu_curve, sizes=[1], repeats=3))
    rng = random.Random(3)
    _decode(budgeter, tree, scores, 0.8, 40, slow, rng)  # the burst
    sizes = _decode(budgeter, tree, scores, 0.8, 300, 1.0, rng)  # quiet again

    def rate(j):
        return (1 + sum(scores[:j])) / (cpu_curve(1 + j) + (0.0005 if j else 0.0))

    best = max(range(13), key=rate)
    tail = sizes[-50:]
    assert min(rate(k) for k in tail[-10:]) >= 0.9 * rate(best), (tail, best)
    assert sum(k > 0 for k in tail) >= 45, f"the row must draft again after the burst: {tail}"


def test_a_free_proposers_row_recovers_from_early_rejections():
    """Calibration learns only from verified nodes: a free proposer's row whose first drafts were all rejected must
    still be probed while it drafts nothing, and draft again once its drafts would be accepted."""
    cost = measured(cpu_curve)
    tree, scores = chain(0.7, 8)
    budgeter = TreeBudgeter(cost, probe_every=3, probe_max=12)
    budgeter.propose_seconds = 1e-6  # prompt lookup: never paused
    sizes = []
    for step in range(80):
        assert budgeter.depth_cap(0, 8) == 8
        k = budgeter.cut([RowCandidates(0, tree, scores)])[0].num_nodes
        sizes.append(k)
        budgeter.record_verdicts([list(range(k)) if step >= 30 else []])  # rejected, then predictable text
    assert 0 in sizes[:30], "early rejections must shrink the trees to nothing"
    assert sizes[-1] >= 3, f"the row must draft again once its probes are accepted: {sizes[-20:]}"
    assert budgeter.summary()["probes"] >= 1


def test_calibration_carries_over_to_the_next_call_on_the_same_model_with_bounded_weight():
    from hf_specdec.generation.budget import carried_calibration, keep_calibration

    model = torch.nn.Linear(2, 2)
    first = carried_calibration(model)
    assert first.factors("medusa", 0)[0] == pytest.approx(1.0), "nothing known yet: scores start trusted"
    for _ in range(40):  # the heads' depth-1 scores of 0.8 are accepted a quarter of the time
        first.update("medusa", 0, [1, 1, 1, 1], [0.8] * 4, [True, False, False, False])
    keep_calibration(model, first)
    second = carried_calibration(model)
    assert second.factors("medusa", 3)[0] < 0.6, "a new call starts from what the scores were worth"
    assert carried_calibration(torch.nn.Linear(2, 2)).factors("medusa", 0)[0] == pytest.approx(1.0)
    for _ in range(6):  # this call's own verdicts take over within a few steps
        second.update("medusa", 0, [1, 1, 1, 1], [0.8] * 4, [True] * 4)
    assert second.factors("medusa", 0)[0] > 0.9


def test_a_step_without_a_fair_verify_time_teaches_the_curve_nothing():
    """``verify_s=None`` (the CPU GEMM tuner timed slower forms inside that forward): proposing and bookkeeping are
    recorded, the verify-cost curve is not."""
    budgeter = TreeBudgeter(StepCostModel())
    budgeter.record_step(3, 1, 0.05, 0.002, 0.001)
    before = budgeter.cost.summary()
    budgeter.record_step(3, 1, None, 0.002, 0.001)
    budgeter.record_step(5, 1, None, 0.002, 0.001)
    after = budgeter.cost.summary()
    assert after["samples"] == before["samples"] and after["curve"] == before["curve"]
    assert budgeter.summary()["unfair_samples"] == 2
    assert budgeter.propose_seconds == pytest.approx(0.002)


def test_steps_whose_drafting_or_bookkeeping_ran_the_gemm_tuner_do_not_teach_those_costs():
    """``propose_s=None`` / ``other_s=None``: a draft head's GEMMs timed slower forms while it proposed, or while the
    step's feedback ran it (DFlash's context): those times are left out, the verify time is still learnt."""
    budgeter = TreeBudgeter(StepCostModel())
    budgeter.record_step(3, 1, 0.05, 0.002, 0.001)
    other = budgeter.cost.other_seconds(1)
    budgeter.record_step(3, 1, 0.05, None, 0.5)
    assert budgeter.propose_seconds == pytest.approx(0.002)
    assert budgeter.cost.other_seconds(1) > other  # the bookkeeping was fair there
    other = budgeter.cost.other_seconds(1)
    samples = sum(budgeter.cost.summary()["samples"].values())
    budgeter.record_step(3, 1, 0.05, 0.9, None)
    assert budgeter.cost.other_seconds(1) == pytest.approx(other)
    assert budgeter.propose_seconds > 0.002
    assert sum(budgeter.cost.summary()["samples"].values()) > samples
