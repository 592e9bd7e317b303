"""How many draft nodes each row sends this step: the cut that maximises the batch's expected tokens per second.

Every assistant hands the budgeter a candidate `DraftTree` per row (nodes in topological order) and, when it has
them, a score per node: its estimate of the probability that the node is accepted (a path probability: a parent
never scores below its child). The budgeter

1. calibrates the scores online per assistant (``source``), per tree depth and per row (`AcceptanceCalibration`:
   predicted vs accepted nodes, so over-confident scores shrink the trees they produce),
2. ranks every row's nodes by calibrated probability and merges the rows: keeping the ``K`` best nodes of the batch
   is the allocation of ``K`` nodes with the most expected tokens ``E(K) = B + sum of their probabilities``,
3. predicts each ``K``'s step time from the measured cost curve (`StepCostModel`: verify forward of ``B + K`` packed
   tokens, the assistant's proposing time, the loop's bookkeeping) and keeps the ``K`` with the best
   ``E(K) / time(K)``. ``K = 0`` — drafting nothing, a plain decoding step through the same loop — is always an
   option and wins unless drafting is predicted to be faster by ``margin``. The proposing time is spent by the time
   of the cut, so it counts for every ``K``, ``0`` included: whether proposing pays at all is item 5's question,
4. now and then verifies the next larger size the cost curve has not measured yet, if it is predicted to lose at
   most ``1 - explore_tolerance`` of the best rate, so that a machine where big trees are cheap (a GPU) finds out;
   the next size above the best is verified whatever its prediction when it was measured too few times, long ago
   or never (`StepCostModel.needs_sample`), so that a slow stretch of the machine cannot lock the rows into
   drafting nothing,
5. stops asking for drafts from a row whose drafts stopped paying, when proposing costs something, and asks again
   after ``probe_every`` steps (doubling after every rejected probe, up to ``probe_max``; back to ``probe_every``
   after an accepted one); a probe verifies the row's best node so that its calibration can recover, and asks
   for depth 1 only (the best node is always there), so a probe costs an assistant one level of drafting.
   "Stopped paying" is a running mean, not one step: each step a row proposes, its *net value* is the expected
   tokens of its kept nodes minus what its share of the step's extra time (their verify cost and its share of
   proposing) would have produced in plain steps; a row is paused once the running mean of that value turns
   negative. A head confident on every other token thus keeps proposing through the steps it drafts nothing
   (pausing at the first such step lost the confident steps after it: docs/lab/measurements.md). A row of a free proposer (prompt
   lookup) keeps proposing and is probed on the same schedule while it drafts nothing: calibration learns only
   from verified nodes, so without probes a few early rejections would stop it for good,
6. while proposing costs something, lets a row draft one level deeper than the deepest node of its last cut
   (`depth_cap`), so an assistant that pays per level (EAGLE's head passes, a draft model's forwards) does not
   expand levels the budget keeps cutting away; the depth grows by one per step while the deepest nodes are kept.
   A level the budget cut is a *ceiling*: the row is not asked for it again (nor for anything deeper) for
   ``depth_retry_every`` steps, then once more; without it the row would draft, every step, the one level past its cut
   that the budget keeps cutting (an EAGLE head pass that never pays).
7. plans the depth of a proposer that pays per level and says so (`plan_proposing`: a draft model, whose every level
   is a forward of its layers and of its lm_head over the whole vocabulary). It reports each step's proposing
   seconds per level (`record_proposing`), kept in plain decoding steps of the target (`ProposingCost`: the median
   of recent samples), beside the conditional acceptance per depth of its verified nodes. Before proposing, every
   row is capped at the chain depth with the best predicted rate ``B (1 + sum of path acceptances) / (t_verify(B (1
   + d)) + t_other + d * level cost)``; depth 0, a plain step that runs no draft forward, unless a depth beats it
   by ``margin``. Until a level was measured the rows draft one level per step (the first steps of the first call;
   a backlog the draft fed, its prompt or tokens it skipped, is no sample). While drafting is off the rows probe
   at depth 1 (the best node verified) after 16 steps, then after twice the last interval (at most 512 steps) and
   at least after the probe's own cost over 1% of the time (a catch-up after a long pause costs more: a deep draft
   catching up on a new prompt may wait up to 8,192 steps, a few dozen calls); the
   cost, the acceptance and this schedule carry over calls and processes (the cost cache), so a later call of a
   draft that does not pay runs no draft forward from its first step. A sample a fifth cheaper than the
   median replaces the older samples: a draft that became cheap comes back at the next step.

Which nodes survive depends only on the scores and on earlier steps, never on the target's answer to this step, so
greedy output is unchanged. Trees whose children were *sampled* (`DraftSampling.WITHOUT_REPLACEMENT` / ``IID``) are
ranked by structure only (depth and sibling position, never the drawn tokens' probabilities) and siblings are kept
as a prefix of their draw order, which keeps exact sampling exact.

    budgeter = TreeBudgeter(cost_model_for(model))
    cap = budgeter.depth_cap(row, limit)                      # 0 while a row is paused, 1 when it probes
    cuts = budgeter.cut([RowCandidates(row, tree, scores, "ngram"), ...])
    ...verify cuts[i].tree...
    budgeter.record_verdicts([accepted node indices of cuts[i].tree, ...])
    budgeter.record_step(tokens, rows, verify_s, propose_s, other_s)
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from operator import itemgetter

import torch

from .cost_model import ProposingCost, StepCostModel, exploration_ladder
from .tensor_parallel import agreed_seconds
from .tree import DraftSampling, DraftTree

# Structural prior for nodes without a score: the rank-r child at any depth is accepted with probability
# _STRUCT_ACCEPT * _STRUCT_SIBLING ** r given its parent was; calibration rescales it per depth.
_STRUCT_ACCEPT = 0.5
_STRUCT_SIBLING = 0.5
_MAX_CALIBRATED_DEPTH = 12  # depths past this share the last depth's calibration
_EMA = 0.2  # weight of a new sample in the proposing-time mean
_VALUE_EMA = 0.2  # weight of a step in a row's running net value of proposing
_VALUE_PRIOR = 0.1  # a new row's running net value (tokens per step): it proposes a few steps before it may pause
# a proposer that pays per level (`ProposingCost`): its drafts' acceptance before evidence, and how many nodes of
# evidence outweigh it; the steps before the first probe once drafting is off, the most between two probes, and the
# share of the time probes may take (a probe's cost over this share is the least interval after it)
_PRIOR_ACCEPT = 0.6
_PRIOR_WEIGHT = 2.0
_FIRST_PROBE_AFTER = 16
_MAX_PROBE_INTERVAL = 512  # the doubling stops here...
_MAX_COSTLY_PROBE_INTERVAL = 8192  # ...but a probe costing over _PROBE_SHARE of 512 steps spaces the next one further
_PROBE_SHARE = 0.01
_PLAN_DEPTH = 16  # deepest level the plan weighs
PROPOSING_COST_ENV = "HF_SPECDEC_PROPOSING_COST"  # 0 / false / off / no: a draft model's cost is not planned for


def proposing_cost_enabled() -> bool:
    """Whether a proposer that pays per level plans its depth from its measured cost (`TreeBudgeter.plan_proposing`;
    ``HF_SPECDEC_PROPOSING_COST=0`` turns it off, the behaviour before it, for comparisons)."""
    return os.environ.get(PROPOSING_COST_ENV, "").strip().lower() not in ("0", "false", "off", "no")


@dataclass
class HostTree:
    """What the budget reads of a tree, on the host: parents, depths and (when it ranks by them) scores."""

    parent: list[int]
    depth: list[int]
    sampling: DraftSampling
    scores: list[float] | None = None


def read_trees(trees: Sequence[DraftTree], with_scores: Sequence[bool]) -> list[HostTree]:
    """Every tree's `HostTree`, read from the device in one copy for the whole batch (not one read per row)."""
    parts: list[torch.Tensor] = []
    for tree, scored in zip(trees, with_scores):
        parts += [tree.parent, tree.depth] + ([tree.scores] if scored else [])
    if not parts:
        return [HostTree([], [], t.sampling) for t in trees]
    device = parts[0].device
    flat = torch.cat([p.reshape(-1).to(device=device, dtype=torch.float64) for p in parts]).cpu().tolist()
    out, start = [], 0
    for tree, scored in zip(trees, with_scores):
        n = tree.num_nodes
        parent = [int(x) for x in flat[start : start + n]]
        depth = [int(x) for x in flat[start + n : start + 2 * n]]
        start += 2 * n
        scores = flat[start : start + n] if scored else None
        start += n if scored else 0
        out.append(HostTree(parent, depth, tree.sampling, scores))
    return out


def _with_scores(tree: DraftTree, scores) -> DraftTree:
    """``tree`` carrying ``scores`` (a caller's `RowCandidates.scores` other than the tree's own)."""
    return replace(tree, scores=torch.as_tensor(scores, dtype=torch.float32, device=tree.device).reshape(-1))


def _depth_bound(tree: DraftTree) -> int:
    """No node of ``tree`` is deeper (its `DraftTree.depth_bound`, else its node count): known without a read."""
    return tree.depth_bound if tree.depth_bound is not None else tree.num_nodes


def _as_list(values) -> list:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


@dataclass
class RowCandidates:
    """One row's candidate nodes.

    Attributes:
        row: the row's index in the caller's batch (stable for the call).
        tree: the candidate tree, nodes in topological order (parents before children).
        scores: `[T]` estimated probability that each node is accepted (path probability), or None for the
            structural prior. Ignored for sampled trees (see the module docstring).
        source: which assistant drafted the tree (calibration is kept per source).
        fixed: verify the tree as it is (it counts in the step's cost but is never cut).
        host: the tree (and its scores) already read to the host (`read_trees`), or None: read when needed.
    """

    row: int
    tree: DraftTree
    scores: torch.Tensor | Sequence[float] | None = None
    source: Hashable = "default"
    fixed: bool = False
    host: HostTree | None = None

    def read(self) -> HostTree:
        """The candidate tree on the host (read now unless `host` has it)."""
        if self.host is None:
            scored = self.scores is not None and self.tree.sampling == DraftSampling.DETERMINISTIC
            tree = self.tree
            self.host = HostTree(_as_list(tree.parent), _as_list(tree.depth), tree.sampling)
            if scored:
                self.host.scores = [float(x) for x in _as_list(torch.as_tensor(self.scores).reshape(-1))]
        return self.host


@dataclass
class BudgetCut:
    """The budgeter's decision for one row.

    Attributes:
        tree: the tree to verify (the candidate tree, or the subtree of its kept nodes).
        kept: `[T']` int64 the candidate tree's index of each node of ``tree``, or None when all were kept.
        probs: the calibrated acceptance probability of each node of ``tree`` (for reports).
        depths: the depth of each node of ``tree`` (known on the host; empty when the tree was not ranked).
    """

    tree: DraftTree
    kept: torch.Tensor | None
    probs: list[float]
    depths: list[int] = field(default_factory=list)

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes


class AcceptanceCalibration:
    """How far each assistant's scores are off, per (source, depth) and per (source, row, depth).

    The unit is the *conditional* score of a node, its score divided by its parent's (the proposer's estimate that it
    is accepted once its parent was), and only nodes whose parent was accepted count as evidence. For the nodes of
    one depth, ``N`` such nodes, ``P`` the sum of their conditional scores and ``A`` how many were accepted give the
    factor: the observed ratio ``A / P`` shrunk towards a parent factor by ``weight`` nodes, ``(N * A / P + weight *
    parent) / (N + weight)``. A source's depth-1 parent is 1 (scores start trusted), its depth-d parent its own
    depth d - 1 factor (a source that over-rates its first guesses over-rates the next ones); a row's parent is its
    source at the same depth (a new row starts from what the assistant showed on the others). Weighting by nodes,
    not by predicted mass, lets an under-confident source (scores of 0.05 that are always accepted) recover as fast
    as an over-confident one shrinks. Old evidence fades by ``decay`` per update.
    """

    def __init__(self, weight: float = 4.0, decay: float = 0.9):
        if weight <= 0 or not 0.0 < decay <= 1.0:
            raise ValueError(f"calibration needs weight > 0 and 0 < decay <= 1, got {weight} and {decay}")
        self.weight, self.decay = float(weight), float(decay)
        self._source: dict[Hashable, list[list[float]]] = {}  # source -> [accepted[d], predicted[d], nodes[d]]
        self._row: dict[tuple[Hashable, int], list[list[float]]] = {}

    def _table(self, store: dict, key) -> list[list[float]]:
        table = store.get(key)
        if table is None:
            table = store[key] = [[0.0] * _MAX_CALIBRATED_DEPTH for _ in range(3)]
        return table

    def _shrunk(self, table: list[list[float]] | None, d: int, parent: float) -> float:
        if table is None:
            return parent
        acc, pred, nodes = table[0][d], table[1][d], table[2][d]
        if nodes <= 0.0 or pred <= 0.0:
            return parent
        return (nodes * acc / pred + self.weight * parent) / (nodes + self.weight)

    def factors(self, source: Hashable, row: int) -> list[float]:
        """``factor[d - 1]``: the multiplier of the conditional scores of depth-d nodes of ``source`` for ``row``."""
        src, row_t = self._source.get(source), self._row.get((source, row))
        out, parent = [], 1.0
        for d in range(_MAX_CALIBRATED_DEPTH):
            parent = self._shrunk(src, d, parent)
            out.append(self._shrunk(row_t, d, parent))
        return out

    def update(self, source: Hashable, row: int, depths: Sequence[int], scores: Sequence[float], hits: Sequence[bool]):
        """One verified tree: for each node whose parent was accepted, its depth, its conditional score and whether
        it was accepted."""
        for table in (self._table(self._source, source), self._table(self._row, (source, row))):
            for column in table:
                for d in range(_MAX_CALIBRATED_DEPTH):
                    column[d] *= self.decay
            acc, pred, nodes = table
            for depth, s, hit in zip(depths, scores, hits):
                d = min(depth, _MAX_CALIBRATED_DEPTH) - 1
                acc[d] += float(hit)
                pred[d] += s
                nodes[d] += 1.0

    def source_evidence(self) -> dict[Hashable, list[list[float]]]:
        """A copy of the source-level evidence (accepted, predicted, nodes per depth), to seed a later call."""
        return {s: [column[:] for column in table] for s, table in self._source.items()}

    def seed(self, evidence: dict[Hashable, list[list[float]]], max_nodes: float = 8.0) -> None:
        """Start from an earlier call's source-level evidence, worth at most ``max_nodes`` nodes per depth (so this
        call's own verdicts take over within a few steps); rows start from their source as usual."""
        for source, (acc, pred, nodes) in evidence.items():
            scale = [min(1.0, max_nodes / n) if n > 0 else 0.0 for n in nodes]
            self._source[source] = [[a * k for a, k in zip(column, scale)] for column in (acc, pred, nodes)]

    def summary(self) -> dict:
        """``{source: [factor per depth]}`` at the source level."""
        return {str(s): [round(c, 3) for c in self.factors(s, -1)] for s in self._source}


def structural_scores(tree: DraftTree | HostTree) -> list[float]:
    """Prior path probability of each node from its position only: the product over its path of
    ``0.5 * 0.5 ** sibling_rank`` (sibling rank = how many earlier siblings it has)."""
    parents = _as_list(tree.parent)
    seen_children: Counter[int] = Counter()
    out: list[float] = []
    for p in parents:
        rank = seen_children[p]
        seen_children[p] += 1
        out.append((1.0 if p < 0 else out[p]) * _STRUCT_ACCEPT * _STRUCT_SIBLING**rank)
    return out


def conditional_scores(tree: DraftTree | HostTree, scores: Sequence[float]) -> list[float]:
    """Each node's score divided by its parent's (its estimated acceptance once the parent is accepted), in [0, 1]."""
    out = []
    for p, s in zip(_as_list(tree.parent), scores):
        base = 1.0 if p < 0 else scores[p]
        c = s / base if base > 0.0 else 0.0
        out.append(1.0 if c > 1.0 else (0.0 if c < 0.0 else c))
    return out


def calibrated_probs(tree: DraftTree | HostTree, cond: Sequence[float], factors: Sequence[float]) -> list[float]:
    """Path probability of each node: the product down its path of ``min(1, conditional score * factor[depth])``
    (non-increasing down every path); for sampled trees also non-increasing along each node's children in draw order,
    so that any best-first prefix of the nodes is a tree whose siblings are a prefix of their draws."""
    parents, depths = _as_list(tree.parent), _as_list(tree.depth)
    sampled = tree.sampling != DraftSampling.DETERMINISTIC
    last = len(factors) - 1
    last_child: dict[int, int] = {}
    out: list[float] = []
    for i, (p, d, c) in enumerate(zip(parents, depths, cond)):
        x = c * factors[d - 1 if d <= last else last]
        x = (1.0 if x > 1.0 else x) * (1.0 if p < 0 else out[p])
        if sampled:
            prev = last_child.get(p)
            if prev is not None and out[prev] < x:
                x = out[prev]
            last_child[p] = i
        out.append(x)
    return out


# what each source's scores were worth in the last call on a model: the next call's calibration starts from it
_EVIDENCE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_EVIDENCE_LOCK = threading.Lock()


def carried_calibration(model: torch.nn.Module) -> AcceptanceCalibration:
    """A fresh calibration for a call on ``model``, seeded with what the assistants' scores were worth in earlier
    calls on it (kept beside the model, never on it), so that a call does not start by trusting over-confident
    scores again."""
    calibration = AcceptanceCalibration()
    with _EVIDENCE_LOCK:
        evidence = _EVIDENCE.get(model)
    if evidence:
        calibration.seed(evidence)
    return calibration


def keep_calibration(model: torch.nn.Module, calibration: AcceptanceCalibration) -> None:
    """Remember ``calibration``'s source-level evidence for the next call on ``model`` (`carried_calibration`)."""
    evidence = calibration.source_evidence()
    with _EVIDENCE_LOCK:
        _EVIDENCE[model] = {**_EVIDENCE.get(model, {}), **evidence}


@dataclass
class _RowGate:
    """Whether a row is paused (drafts stopped paying) and when it probes again."""

    paused: bool = False
    idle: int = 0
    interval: int = 0
    probing: bool = False  # asked for a draft this step although paused
    probed: bool = False  # verified a forced node this step (its verdict sets the next interval)
    kept_depth: int = 0  # the deepest node of the row's last cut (0: nothing verified)
    ceiling: int = 0  # a depth the budget cut (0: none): not asked for until ``ceiling_age`` reaches depth_retry_every
    ceiling_age: int = 0
    value: float = _VALUE_PRIOR  # running mean of the row's net value of proposing (tokens per step)


class TreeBudgeter:
    """Chooses, every step, how many of each row's candidate nodes the target verifies (see the module docstring).

    Args:
        cost: the target's `StepCostModel` (``cost_model_for(model)``), shared across calls.
        calibration: acceptance calibration (default: a fresh `AcceptanceCalibration`, i.e. per call).
        max_nodes_per_row: most nodes one row may send.
        margin: drafting must be predicted faster than drafting nothing by this fraction.
        explore_every: steps between two verifications of an unmeasured larger size.
        explore_tolerance: an exploration may be predicted to reach this fraction of the best rate, no less.
        explore_samples: a size counts as measured once its cost bucket holds this many samples.
        probe_every / probe_max: a paused row is asked again after ``probe_every`` steps, doubling per failed probe
            up to ``probe_max``.
        pause_fraction: rows are paused only when proposing costs at least this fraction of a plain step (a free
            proposer, such as prompt lookup, is simply asked every step).
        depth_retry_every: steps a row is not asked for a level the budget cut from its tree (while proposing costs
            something), before that level is drafted once more.
        cuts: size the trees (the default). False: every tree is verified exactly as its assistant proposed it
            (``generate(..., tree_budget=False)``) and nothing else changes: no row is paused or capped, while the
            cost curve still learns from every step and `speedup` still answers (an assistant choosing between two
            trees asks it either way).
    """

    def __init__(
        self,
        cost: StepCostModel,
        calibration: AcceptanceCalibration | None = None,
        max_nodes_per_row: int = 64,
        margin: float = 0.02,
        explore_every: int = 16,
        explore_tolerance: float = 0.85,
        explore_samples: int = 3,
        probe_every: int = 4,
        probe_max: int = 64,
        pause_fraction: float = 0.02,
        depth_retry_every: int = 16,
        cuts: bool = True,
    ):
        if max_nodes_per_row < 0 or margin < 0 or not 0 < explore_tolerance <= 1:
            raise ValueError(
                f"TreeBudgeter needs max_nodes_per_row >= 0, margin >= 0 and 0 < explore_tolerance <= 1, got "
                f"{max_nodes_per_row}, {margin}, {explore_tolerance}"
            )
        if probe_every < 1 or probe_max < probe_every or explore_every < 1 or depth_retry_every < 1:
            raise ValueError(
                f"TreeBudgeter needs 1 <= probe_every <= probe_max, explore_every >= 1 and depth_retry_every >= 1, "
                f"got {probe_every}, {probe_max}, {explore_every}, {depth_retry_every}"
            )
        self.cost = cost
        self.cuts = bool(cuts)
        self.calibration = calibration or AcceptanceCalibration()
        self.max_nodes_per_row = max_nodes_per_row
        self.margin, self.explore_every, self.explore_tolerance = margin, explore_every, explore_tolerance
        self.explore_samples, self.probe_every, self.probe_max = explore_samples, probe_every, probe_max
        self.pause_fraction, self.depth_retry_every = pause_fraction, depth_retry_every
        self.propose_seconds: float | None = None  # running mean of a step's proposing time while drafting
        self._ladder = exploration_ladder()
        self._gates: dict[int, _RowGate] = {}
        # the last cut, per row: (row, source, kept nodes' depths, conditional scores, parents among the kept)
        self._pending: list[tuple[int, Hashable, list[int], list[float], list[int]]] = []
        self._steps = self._last_explore = 0
        self._nodes: Counter[int] = Counter()  # nodes per row per step -> how often
        self._no_candidates = self._paused = self._explorations = self._probes = 0
        self._unfair_samples = 0  # verify times not recorded (the CPU GEMM tuner ran inside the forward)
        # a proposer that pays per level and measures it (`plan_proposing`): its cost, its trees' source, this
        # step's plan (levels that pay; 0: drafting is off), whether this step probes, what each step drafted
        self.proposing: ProposingCost | None = None
        self.tp_group = None  # a tensor-parallel target's ranks (set by the loop): they agree on proposing times
        self._proposing_source: Hashable = None
        self._plan_step, self._plan, self._probe_now = -1, None, False
        self._batch = 1  # rows of the last cut
        self._step_levels, self._levels_log = 0, []
        self._off_steps = self._proposing_probes = 0

    # ------------------------------------------------------------------ before proposing
    def depth_cap(self, row: int, limit: int) -> int:
        """How deep ``row`` may draft this step, at most ``limit``.

        0 while the row is paused; 1 when a paused row probes (a probe verifies the row's best node, which is always
        at depth 1: a child never scores above its parent); and while proposing costs something, one more than the
        deepest node of the row's last cut, so that an assistant that pays per depth (EAGLE, a draft model) does
        not expand levels the budget has been cutting away. A row grows by one level per step while its deepest
        nodes are kept."""
        if self.proposing is not None and self.cuts and limit > 0:
            plan = self._planned_levels()
            if plan == 0:
                return self._off_cap(row, limit)
            limit = min(limit, plan)
        gate = self._gates.get(row)
        if gate is None or limit <= 0 or not self.cuts:
            return limit
        if gate.paused:
            gate.idle += 1
            gate.probing = gate.idle >= gate.interval
            return min(limit, 1) if gate.probing else 0
        if self._proposing_counts():
            cap = gate.kept_depth + 1
            if gate.ceiling:
                gate.ceiling_age += 1
                if gate.ceiling_age < self.depth_retry_every:
                    cap = min(cap, gate.ceiling - 1)  # the level the budget cut stays undrafted for a while
            return min(limit, max(cap, 1))
        return limit

    # ------------------------------------------------------------------ what proposing costs
    def plan_proposing(self, cost: ProposingCost, source: Hashable) -> None:
        """Plan the depth of a proposer that pays per level (a draft model) from ``cost``, which the proposer feeds
        with `record_proposing`, and the acceptance of its trees (those of ``source``): each step the rows draft the
        number of levels with the best predicted rate, none while no level pays (see `_planned_levels`)."""
        self.proposing, self._proposing_source = cost, source

    def record_proposing(self, seconds: float | None, levels: int, catching_up: bool = False) -> None:
        """The proposer drafted ``levels`` levels in ``seconds`` this step (None: no fair sample; ``catching_up``: it
        also fed a backlog, see `ProposingCost.record_level`). Counted in plain steps of the target once its cost
        curve has a sample. The ranks of a tensor-parallel target record the slowest rank's seconds (None on every
        rank when one has none), so that they plan the same depths and draft the same trees."""
        if self.proposing is None or levels < 1:
            return
        if self.tp_group is not None:
            seconds = agreed_seconds(self.tp_group, None, seconds, None)[1]
        if seconds is None:
            return
        self._step_levels = levels
        if self.cost.num_samples == 0:
            return  # no unit yet: the curve is still the prior
        plain = self.cost.predict(1) + self.cost.other_seconds(1)
        self.proposing.record_level(seconds / levels / plain, catching_up)
        if self._probe_now:  # the next probe waits until this one's cost is at most _PROBE_SHARE of the time
            least = int(seconds / plain / _PROBE_SHARE)
            cost = self.proposing
            cost.probe_interval = max(cost.probe_interval, min(_MAX_COSTLY_PROBE_INTERVAL, least))

    def _planned_levels(self) -> int:
        """This step's levels for every row (computed once per step): 1 while a level's cost is not measured, 0 when
        no depth pays (drafting is off; `_off_cap` probes now and then), else the depth of the best predicted rate."""
        if self._plan_step == self._steps:
            return self._plan
        self._plan_step, self._probe_now = self._steps, False
        ratio = self.proposing.ratio()
        self._plan = 1 if ratio is None else self._levels_that_pay(ratio)
        if self._plan == 0:
            self._count_off_step()
        return self._plan

    def _count_off_step(self) -> None:
        """A step with drafting off: probe when ``probe_interval`` steps passed since the last probe (the interval
        doubles per probe, at least `_FIRST_PROBE_AFTER`, at most `_MAX_PROBE_INTERVAL`; kept across calls)."""
        cost = self.proposing
        self._off_steps += 1
        cost.off_steps += 1
        if cost.probe_interval == 0:
            cost.probe_interval = _FIRST_PROBE_AFTER
        if cost.off_steps >= cost.probe_interval:
            self._probe_now, self._proposing_probes = True, self._proposing_probes + 1
            cost.off_steps = 0
            cost.probe_interval = min(_MAX_PROBE_INTERVAL, 2 * cost.probe_interval)

    def _off_cap(self, row: int, limit: int) -> int:
        """Depth cap of a row while drafting is off: 1 on a probe step (its best node is verified), else 0."""
        if not self._probe_now:
            return 0
        self._gates.setdefault(row, _RowGate()).probing = True
        return min(limit, 1)

    def _levels_that_pay(self, ratio: float) -> int:
        """Levels of a chain per row with the best predicted rate, with a level costing ``ratio`` plain steps (for
        the batch) and the acceptance the proposer's drafts showed; 0 unless that rate beats a plain step by
        ``margin``."""
        rows, curve, other = self._batch, self.cost.curve(), self.cost.other_seconds
        level = ratio * (curve(1) + other(1))
        accept = self.proposing.acceptance(_PLAN_DEPTH, _PRIOR_ACCEPT, _PRIOR_WEIGHT)
        best = rows / (curve(rows) + other(rows)) * (1.0 + self.margin)
        best_depth, expected, reach = 0, float(rows), 1.0
        for depth, a in enumerate(accept, start=1):
            reach *= a
            expected += rows * reach
            rate = expected / (curve(rows * (1 + depth)) + other(rows) + level * depth)
            if rate > best:
                best, best_depth = rate, depth
        return best_depth

    # ------------------------------------------------------------------ the decision
    def cut(self, candidates: Sequence[RowCandidates]) -> list[BudgetCut]:
        """The trees to verify this step, one per row of ``candidates`` (same order)."""
        self._steps += 1
        self._batch = max(1, len(candidates))
        if self.proposing is not None:
            self._levels_log.append(self._step_levels)
            self._step_levels = 0
        if not self.cuts:  # the trees as proposed
            self._pending = [(c.row, c.source, [], [], []) for c in candidates]
            for c in candidates:
                self._nodes[c.tree.num_nodes] += 1
            return [BudgetCut(c.tree, None, []) for c in candidates]
        self.read_candidates(candidates)
        probs, raw = zip(*[self._row_probs(c) for c in candidates]) if candidates else ((), ())
        # best first, ties in node order (a stable sort): parents before their children
        order = [sorted(range(len(p)), key=p.__getitem__, reverse=True)[: self.max_nodes_per_row] for p in probs]
        fixed = sum(c.tree.num_nodes for c in candidates if c.fixed)
        counts = self._counts(probs, order, fixed)
        values = self._net_values(candidates, probs, order, counts, fixed)
        cuts, self._pending = [], []
        for c, p, r, o, k, v in zip(candidates, probs, raw, order, counts, values):
            if c.fixed:
                self._pending.append((c.row, c.source, [], [], []))
                cut = BudgetCut(c.tree, None, [])
                offered = kept = _depth_bound(c.tree)  # verified whole, never read
            else:
                k = self._gate(c.row, k, has_candidates=bool(o), value=v)
                cut = self._cut_row(c, p, r, o[:k])
                offered, kept = max(c.host.depth, default=0) if c.host else 0, max(cut.depths, default=0)
            self._nodes[cut.num_nodes] += 1
            self._record_depths(c.row, offered, kept)
            cuts.append(cut)
        return cuts

    def _record_depths(self, row: int, offered: int, kept: int) -> None:
        """The row's deepest kept node, and its ceiling: the first level the budget cut from a deeper offer (cleared
        once a node at or past the ceiling is kept)."""
        gate = self._gates.setdefault(row, _RowGate())
        gate.kept_depth = kept
        if gate.ceiling and kept >= gate.ceiling:
            gate.ceiling = gate.ceiling_age = 0
        if kept and offered > kept:
            gate.ceiling, gate.ceiling_age = kept + 1, 0

    def cut_trees(self, rows: Sequence[int], trees: Sequence[DraftTree]) -> list[BudgetCut]:
        """`cut` for trees that carry their own ``scores`` and ``source``; a tree without scores is verified as
        proposed (an assistant opts in to the budget by scoring its nodes)."""
        cands = []
        for row, tree in zip(rows, trees):
            scores = getattr(tree, "scores", None)
            source = getattr(tree, "source", None) or "default"
            cands.append(RowCandidates(row, tree, scores, source, fixed=scores is None and tree.num_nodes > 0))
        return self.cut(cands)

    def speedup(self, candidates: RowCandidates) -> float:
        """Predicted speedup over a plain step of verifying the best cut of one row's candidates on their own (1.0:
        drafting does not pay); lets a caller choose between two assistants' trees for a row."""
        probs, _ = self._row_probs(candidates)
        gains = [g for g in sorted(probs, reverse=True)[: self.max_nodes_per_row] if g > 0.0]
        rates = self.predicted_rates(1, gains, stop_below=0.5)
        return max(rates) / rates[0]

    @staticmethod
    def read_candidates(candidates: Sequence[RowCandidates]) -> None:
        """Read every candidate tree that will be ranked to the host (`RowCandidates.host`), in one copy for the
        batch: the budget's only read of a step."""
        todo = [c for c in candidates if c.host is None and not c.fixed and c.tree.num_nodes]
        for c in todo:
            if c.scores is not None and len(c.scores) != c.tree.num_nodes:
                raise ValueError(f"row {c.row}: {len(c.scores)} scores for a tree of {c.tree.num_nodes} nodes")
        scored = [c.scores is not None and c.tree.sampling == DraftSampling.DETERMINISTIC for c in todo]
        trees = [
            c.tree if not s or c.tree.scores is c.scores else _with_scores(c.tree, c.scores)
            for c, s in zip(todo, scored)
        ]
        for c, host in zip(todo, read_trees(trees, scored)):
            c.host = host

    def _row_probs(self, c: RowCandidates) -> tuple[list[float], list[float]]:
        if c.tree.num_nodes == 0 or c.fixed:
            return [], []
        host = c.read()
        raw = host.scores if host.scores is not None else structural_scores(host)
        if len(raw) != c.tree.num_nodes:
            raise ValueError(f"row {c.row}: {len(raw)} scores for a tree of {c.tree.num_nodes} nodes")
        cond = conditional_scores(host, raw)
        return calibrated_probs(host, cond, self.calibration.factors(c.source, c.row)), cond

    def _counts(self, probs: Sequence[list[float]], order: Sequence[list[int]], fixed: int = 0) -> list[int]:
        """Nodes per row: the best ``K`` nodes of the batch for the ``K`` with the best predicted rate (``fixed``
        more nodes are verified anyway)."""
        rows = len(probs)
        merged = sorted(((probs[b][i], b) for b, o in enumerate(order) for i in o), key=itemgetter(0), reverse=True)
        merged = [m for m in merged if m[0] > 0.0]
        gains = [p for p, _ in merged]
        # the proposing time is spent by now: the cut weighs the nodes' verify cost alone (`_net_values` prices
        # the proposing, and pauses a row whose proposals do not pay for themselves)
        rate = self.predicted_rates(rows, gains, stop_below=0.75 * self.explore_tolerance, fixed=fixed, sunk=True)
        best = max(range(len(rate)), key=lambda k: (rate[k], -k))
        if best and rate[best] < rate[0] * (1.0 + self.margin):
            best = 0
        best = self._explore(rows + fixed, best, rate, len(gains))
        counts = [0] * rows
        for _, b in merged[:best]:
            counts[b] += 1
        return counts

    def _net_values(
        self,
        candidates: Sequence[RowCandidates],
        probs: Sequence[list[float]],
        order: Sequence[list[int]],
        counts: Sequence[int],
        fixed: int,
    ) -> list[float]:
        """Each row's net value of proposing this step, in tokens: the expected tokens of its kept nodes minus what
        its share of the step's extra time (the kept nodes' verify cost, split by node, and its share of the
        proposing time) would have produced in plain steps. Negative on a step the row drafts nothing."""
        rows, proposing = len(candidates), sum(1 for c, o in zip(candidates, order) if o and not c.fixed)
        curve = self.cost.curve()
        base = curve(rows + fixed)
        plain_rate = rows / (base + self.cost.other_seconds(rows))  # tokens per second of a plain step
        total = sum(counts)
        extra = curve(rows + fixed + total) - base if total else 0.0
        share = (self.propose_seconds or 0.0) / max(1, proposing)
        values = []
        for p, o, k in zip(probs, order, counts):
            gain = sum(p[i] for i in o[:k])
            values.append(gain - (extra * k / (total or 1) + share) * plain_rate)
        return values

    def predicted_rates(
        self, rows: int, gains: Sequence[float], stop_below: float = 0.0, fixed: int = 0, sunk: bool = False
    ) -> list[float]:
        """``rate[K]``: predicted tokens per second when the ``K`` nodes with acceptance probabilities ``gains[:K]``
        are verified together with ``rows`` roots (``rate[0]`` = drafting nothing, no proposing time unless
        ``sunk``: the step's trees are drafted already, so drafting nothing pays for them too). With ``stop_below``
        > 0 the list ends once the rate falls below that fraction of the best so far (``gains`` are non-increasing
        and the cost grows, so larger ``K`` only lose more). ``fixed`` nodes are verified anyway."""
        curve = self.cost.curve()
        other = self.cost.other_seconds(rows)
        propose = self.propose_seconds or 0.0
        rates = [rows / (curve(rows + fixed) + other + (propose if fixed or sunk else 0.0))]
        best, expected = rates[0], float(rows)
        for k, g in enumerate(gains, start=1):
            expected += g
            rate = expected / (curve(rows + fixed + k) + other + propose)
            rates.append(rate)
            best = max(best, rate)
            if rate < stop_below * best:
                break
        return rates

    def _explore(self, base: int, best: int, rate: list[float], available: int) -> int:
        """Now and then a size of the exploration ladder above ``best`` whose cost is not well known. The next one
        up is verified whatever its prediction says when it was measured too few times, long ago or never (that
        prediction is what is in doubt, and a neighbour of the best size loses little); larger ones only when never
        measured and predicted to lose little. ``available`` nodes exist."""
        if self._steps - self._last_explore < self.explore_every:
            return best
        neighbour = True
        for n in self._ladder:
            k = n - base
            if k <= best:
                continue
            if k > available:
                break
            why = self.cost.needs_sample(n, self.explore_samples)
            if why is not None and (neighbour or (why == "unmeasured" and k < len(rate))):
                if neighbour or rate[k] >= self.explore_tolerance * rate[best]:
                    self._last_explore = self._steps
                    self._explorations += 1
                    return k
                break  # larger sizes are predicted to lose more still
            neighbour = False
        return best

    def _gate(self, row: int, k: int, has_candidates: bool, value: float) -> int:
        """Pause / resume ``row`` after its decision ``k`` and its net value of proposing this step (`_net_values`);
        a probing row verifies at least its best node."""
        gate = self._gates.setdefault(row, _RowGate())
        probing, gate.probing = gate.probing, False
        if not has_candidates:
            if gate.paused and not probing:
                self._paused += 1
            else:
                self._no_candidates += 1
            return 0
        gate.value += _VALUE_EMA * (value - gate.value)
        if gate.paused and gate.value >= 0.0:  # proposing pays on average again
            gate.paused, gate.idle, gate.interval = False, 0, 0
            return k
        if k > 0:  # verified; a row still paused (its mean below zero) is asked again soon
            gate.idle, gate.interval = 0, self.probe_every if gate.paused else 0
            return k
        if probing:
            return self._probe(gate)
        if not gate.paused and self._proposing_counts():
            if gate.value < 0.0:
                gate.paused, gate.idle, gate.interval = True, 0, self.probe_every
            return 0
        # a free proposer's row is never paused, but its calibration only learns from verified nodes: after
        # ``interval`` steps of drafting nothing it verifies its best node once, so that it can recover
        gate.idle += 1
        gate.interval = gate.interval or self.probe_every
        return self._probe(gate) if gate.idle >= gate.interval else 0

    def _probe(self, gate: _RowGate) -> int:
        """Verify the row's best node; the interval to the next probe doubles unless this one is accepted."""
        self._probes += 1
        gate.idle, gate.interval, gate.probed = 0, min(self.probe_max, gate.interval * 2), True
        return 1

    def _proposing_counts(self) -> bool:
        return self.propose_seconds is not None and self.propose_seconds >= self.pause_fraction * self.cost.predict(1)

    def _cut_row(self, c: RowCandidates, probs: list[float], raw: list[float], keep: list[int]) -> BudgetCut:
        tree, host = c.tree, c.host
        keep = sorted(keep)  # parents before children, as in the candidate tree
        depths = [host.depth[i] for i in keep] if keep else []
        position = {node: j for j, node in enumerate(keep)}
        kept_parents = [position[host.parent[i]] if host.parent[i] >= 0 else -1 for i in keep]
        self._pending.append((c.row, c.source, depths, [raw[i] for i in keep], kept_parents))
        if len(keep) == tree.num_nodes:
            return BudgetCut(tree, None, probs, depths)
        kept = torch.tensor(keep, dtype=torch.long).to(tree.device, non_blocking=True)
        if not keep:
            return BudgetCut(DraftTree.empty(tree.device), kept, [], [])
        return BudgetCut(tree.subtree_nodes(kept, kept_parents), kept, [probs[i] for i in keep], depths)

    # ------------------------------------------------------------------ after verifying
    def record_verdicts(self, accepted: Sequence[torch.Tensor | Sequence[int]]) -> None:
        """The target's verdicts on the last `cut`: ``accepted[i]`` = accepted node indices of ``cuts[i].tree``."""
        if len(accepted) != len(self._pending):
            raise ValueError(f"{len(accepted)} verdicts for the {len(self._pending)} rows of the last cut")
        for (row, source, depths, cond, parents), acc in zip(self._pending, accepted):
            if not depths:
                continue
            hit = set(torch.as_tensor(acc).reshape(-1).tolist())
            gate = self._gates.get(row)
            if gate is not None and gate.probed:  # an accepted probe: ask again soon
                gate.probed = False
                gate.interval = self.probe_every if hit else gate.interval
            reached = [i for i, p in enumerate(parents) if p < 0 or p in hit]  # verified with an accepted parent
            if self.proposing is not None and source == self._proposing_source:
                self.proposing.record_tree([depths[i] for i in reached], [i in hit for i in reached])
            self.calibration.update(
                source, row, [depths[i] for i in reached], [cond[i] for i in reached], [i in hit for i in reached]
            )
        self._pending = []

    def record_step(
        self, tokens: int, rows: int, verify_s: float | None, propose_s: float | None, other_s: float | None
    ) -> None:
        """A step's measured times: verify forward over ``tokens`` packed tokens of ``rows`` rows, proposing (only
        counted when something was drafted), and the loop's bookkeeping; None where a time is not a fair sample (the
        CPU GEMM tuner timed slower forms inside it)."""
        if verify_s is not None:
            self.cost.record_verify(tokens, rows, verify_s)
        else:
            self._unfair_samples += 1
        if other_s is not None:
            self.cost.record_other(rows, other_s)
        if tokens > rows and propose_s is not None and propose_s >= 0:
            prev = self.propose_seconds
            self.propose_seconds = propose_s if prev is None else (1 - _EMA) * prev + _EMA * propose_s

    def summary(self) -> dict:
        """What `spec_stats` reports: the cost curve, nodes per row per step, how often nothing was drafted (empty
        when the budget does not cut: the trees were verified as proposed)."""
        if not self.cuts:
            return {}
        row_steps = sum(self._nodes.values())
        return {
            "cost": self.cost.summary(),
            "steps": self._steps,
            "nodes_per_row": dict(sorted(self._nodes.items())),
            "draft_nothing_fraction": self._nodes[0] / row_steps if row_steps else 0.0,
            "no_candidates": self._no_candidates,
            "paused": self._paused,
            "explorations": self._explorations,
            "probes": self._probes,
            "unfair_samples": self._unfair_samples,
            "propose_s": self.propose_seconds,
            "calibration": self.calibration.summary(),
            **({"proposing": self._proposing_summary()} if self.proposing is not None else {}),
        }

    def _proposing_summary(self) -> dict:
        """What the plan of a proposer that pays per level saw: its cost and acceptance (`ProposingCost.summary`),
        the levels it drafted each step of this call, the steps drafting was off and the probes."""
        return {
            **self.proposing.summary(),
            "levels_per_step": self._levels_log[:],
            "steps_off": self._off_steps,
            "probes": self._proposing_probes,
        }
