"""What a decoding step costs on the machine at hand, learned while decoding: seconds of one target verify forward as
a function of the packed token count, plus the loop's bookkeeping per row.

The verify cost of n tokens relative to one differs a lot between machines (MKL's fp32 GEMM re-packs weights from 4
rows on, a GPU verifies 64 tokens for about the price of one), so tree sizes cannot be tuned once and shipped.
`StepCostModel` starts from a prior curve (a shipped cost table, or ``1 + slope * (n - 1)`` with a conservative
slope) and lets measurements take over as soon as they exist:

- samples go to buckets: one per n up to 64, then a log-spaced grid of eight points per doubling (a sample between
  grid points is moved onto the nearest one with the prior's local ratio);
- each bucket keeps its last ``window`` samples and is summarised by their median (robust to a preempted step);
  once the curve has a few samples, a new one is clipped to within 3x of what the curve expects there, so that a
  one-off (weights packed inside that forward) cannot poison a rarely visited size through the isotonic fit;
- a bucket not sampled during the last ``stale_after`` samples of the model is *stale*: what it says may be from
  another state of the machine (another process on the cores for a while, weights not packed yet). `needs_sample`
  tells the budgeter to verify such a size again; when the fresh sample disagrees with the stale median by more than
  ``_DISAGREE`` either way, the machine has changed and every stale bucket is forgotten (fresh samples and the
  prior take over), so one slow stretch cannot lock a row into drafting nothing;
- the bucket medians are made non-decreasing in n (weighted isotonic regression, pool-adjacent-violators);
- between measured buckets the cost is interpolated linearly; below them it is the smallest measured bucket scaled
  by the prior's ratio; above them it grows with the measured slope (over at least a doubling of n), never slower
  than a quarter of the prior's. Exploring larger sizes (`TreeBudgeter`) is what confirms that they are cheap.

One model per (target model, device, dtype), shared by every call and every assistant that uses that model:
`cost_model_for(model)` keeps them in a `weakref.WeakKeyDictionary` keyed by the model (nothing is written into the
model or its config) and every method takes the model's own lock, so two threads may decode with one model.

Across processes: `cost_model_for` starts a model from the curve an earlier process learnt for the same machine and
model (`cost_cache`: a JSON file per key, ``HF_SPECDEC_COST_CACHE=0`` turns it off) and the loop writes the curve back
at the end of a call (`save_learnt_curve`, throttled). A loaded curve's buckets start *stale* (`load_state`): they
are what the machine did in another process, so they are re-measured and, if the first re-measure disagrees,
forgotten, exactly as buckets that went stale within a process.

    cost = cost_model_for(model)
    cost.record_verify(tokens=6, rows=1, seconds=0.031)
    cost.predict(12)              # seconds of a 12-token verify forward, learnt or interpolated
"""

from __future__ import annotations

import atexit
import bisect
import math
import statistics
import threading
import weakref
from collections import deque
from collections.abc import Mapping, Sequence

import torch

from .cost_cache import CurveFile, curve_file, proposing_file, proposing_key

GENERIC_PRIOR_SLOPE = 0.1  # a verify token costs 10% of a decode step: about this CPU's fp32 GEMM; conservative on GPUs
DEFAULT_WINDOW = 16  # samples kept per bucket (the median of these is the bucket's cost)
_MIN_SLOPE_FRACTION = 0.25  # extrapolation past the measured sizes grows at least this fraction as fast as the prior
_CLIP_AFTER = 8  # samples before new ones are clipped to the curve's range ...
_CLIP_FACTOR = 3.0  # ... of [expected / 3, expected * 3]
_EMA = 0.2  # weight of a new sample in the running means (bookkeeping seconds per row)
DEFAULT_STALE_AFTER = 48  # a bucket not sampled during this many of the model's samples is stale
_DISAGREE = 1.25  # a stale bucket re-measured off by more than this factor: the machine changed, stale data goes


def cost_grid(limit: int = 1 << 16) -> list[int]:
    """Bucket sizes: every n up to 64, then eight log-spaced points per doubling (72, 80, ..., 128, 144, ...)."""
    grid = list(range(1, 65))
    base = 64
    while base < limit:
        grid += [base + base * i // 8 for i in range(1, 9)]
        base *= 2
    return grid


def exploration_ladder(limit: int = 1 << 16) -> list[int]:
    """Sizes worth measuring when exploring: 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (steps of about 1.5x)."""
    ladder, n = [1, 2, 3], 4
    while n <= limit:
        ladder += [n, n * 3 // 2]
        n *= 2
    return ladder


_GRID = cost_grid()


class PriorCurve:
    """A relative cost curve ``rel(n)`` (``rel(1) = 1``): piecewise linear through ``points``, extended linearly past
    the last point with the last segment's slope (never decreasing).

    Args:
        points: ``{n: cost of an n-token verify step / cost of a 1-token step}``; n >= 1.
    """

    def __init__(self, points: Mapping[int, float]):
        if not points:
            raise ValueError("a prior cost curve needs at least one point {tokens: relative cost}")
        pts = sorted((int(n), float(c)) for n, c in points.items())
        if pts[0][0] < 1 or any(c <= 0 or not math.isfinite(c) for _, c in pts):
            raise ValueError(f"prior cost points must have n >= 1 and finite costs > 0, got {dict(pts)}")
        ns, cs = [n for n, _ in pts], [c for _, c in pts]
        for i in range(1, len(cs)):  # a cost table measured once may dip; the prior must not
            cs[i] = max(cs[i], cs[i - 1])
        self.ns, self.cs = ns, cs

    @classmethod
    def linear(cls, slope: float = GENERIC_PRIOR_SLOPE) -> PriorCurve:
        """``rel(n) = 1 + slope * (n - 1)``."""
        if slope < 0:
            raise ValueError(f"a prior slope must be >= 0, got {slope}")
        return cls({1: 1.0, 2: 1.0 + slope})

    @classmethod
    def from_node_costs(cls, step_cost: Mapping[int | str, float]) -> PriorCurve:
        """From a shipped table ``{draft nodes: step cost / plain decoding step}`` (Medusa's model card): n = nodes + 1."""
        points = {int(k) + 1: float(v) for k, v in step_cost.items()}
        points.setdefault(1, 1.0)
        return cls(points)

    def __call__(self, n: float) -> float:
        ns, cs = self.ns, self.cs
        if len(ns) == 1:
            return cs[0]
        if len(ns) == 2 and n >= ns[0]:
            return cs[0] + (cs[1] - cs[0]) * (n - ns[0]) / (ns[1] - ns[0])
        if n <= ns[0]:
            return cs[0]
        i = bisect.bisect_left(ns, n)
        if i >= len(ns):
            slope = max(0.0, (cs[-1] - cs[-2]) / (ns[-1] - ns[-2]))
            return cs[-1] + slope * (n - ns[-1])
        n0, n1, c0, c1 = ns[i - 1], ns[i], cs[i - 1], cs[i]
        return c0 + (c1 - c0) * (n - n0) / (n1 - n0)


def _isotonic(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in weighted least squares (pool-adjacent-violators)."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    out: list[float] = []
    for v, _, n in blocks:
        out += [v] * int(n)
    return out


def _parsed_state(state: Mapping) -> tuple[dict[int, list[float]], float | None, PriorCurve]:
    """``(bucket -> seconds, bookkeeping seconds per row, prior)`` of a `StepCostModel.state()`; ValueError when it
    is not one (a grid point per bucket, positive finite seconds)."""
    try:
        samples = {int(g): [float(v) for v in values] for g, values in state["samples"].items()}
        other = state.get("other_s_per_row")
        other = None if other is None else float(other)
        prior = PriorCurve({int(n): float(c) for n, c in state["prior"]})
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"not a StepCostModel.state(): {err!r}") from None
    for g, values in samples.items():
        if StepCostModel.bucket(g) != g or not values or not all(v > 0 and math.isfinite(v) for v in values):
            raise ValueError(f"bucket {g} of a saved cost curve: expected a grid point and seconds > 0, got {values}")
    if other is not None and not (other >= 0 and math.isfinite(other)):
        raise ValueError(f"bookkeeping seconds per row of a saved cost curve must be >= 0, got {other}")
    return samples, other, prior


class CostCurve:
    """A snapshot of the learnt curve: verify seconds at any n from the measured (isotonic) bucket costs.

    Linear between measured sizes; below the smallest, that one scaled by the prior's ratio; above the largest, the
    measured slope (over at least a doubling of n) but at least ``_MIN_SLOPE_FRACTION`` of the prior's, so that a flat
    stretch of measurements does not promise that every larger size is free (the prior's ratio when too little was
    measured). Before any measurement: the prior itself (units of one 1-token step).

    Args:
        grid: measured sizes, increasing.
        cost: `len(grid)` non-decreasing seconds.
        prior: the relative prior curve.
    """

    def __init__(self, grid: list[int], cost: list[float], prior: PriorCurve):
        self.grid, self.cost, self.prior = grid, cost, prior
        if grid:
            top = grid[-1]
            self._prior_low, self._prior_top = prior(grid[0]), prior(top)
            low = bisect.bisect_right(grid, top / 2) - 1
            self._slope = None if low < 0 else (cost[-1] - cost[low]) / (top - grid[low])

    def __call__(self, n: float) -> float:
        grid, cost = self.grid, self.cost
        if not grid:
            return self.prior(n)
        if n <= grid[0]:
            return cost[0] * self.prior(n) / self._prior_low
        top, t_top = grid[-1], cost[-1]
        if n >= top:
            by_ratio = t_top * self.prior(n) / self._prior_top
            if self._slope is None:
                return by_ratio
            return t_top + max(self._slope * (n - top), _MIN_SLOPE_FRACTION * (by_ratio - t_top))
        i = bisect.bisect_left(grid, n)
        n0, n1 = grid[i - 1], grid[i]
        return cost[i - 1] + (cost[i] - cost[i - 1]) * (n - n0) / (n1 - n0)


class StepCostModel:
    """Online estimate of a verify forward's seconds vs its packed token count, and of the loop's other seconds.

    Args:
        prior: the relative curve used before (and around) measurements; default `PriorCurve.linear`.
        window: samples kept per bucket.
    """

    def __init__(
        self, prior: PriorCurve | None = None, window: int = DEFAULT_WINDOW, stale_after: int = DEFAULT_STALE_AFTER
    ):
        if window < 1 or stale_after < 1:
            raise ValueError(f"window and stale_after must be >= 1, got {window} and {stale_after}")
        self.prior = prior or PriorCurve.linear()
        self.window, self.stale_after = window, stale_after
        self._count = 0  # samples taken so far (the model's clock for staleness)
        self._last: dict[int, int] = {}  # bucket -> `_count` at its latest sample
        self.forgotten = 0  # how often stale measurements were dropped because the machine changed
        self.loaded = 0  # samples the model started from (`load_state`: a curve learnt by an earlier process)
        self._samples: dict[int, deque[float]] = {}
        self._medians: dict[int, float] = {}  # bucket -> median of its samples
        self._rows: dict[int, int] = {}  # bucket -> largest row count seen (reported only)
        self._other_per_row: float | None = None
        self._curve: tuple[list[int], list[float]] | None = None  # cached (grid points, isotonic seconds)
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ measurements
    @property
    def num_samples(self) -> int:
        with self._lock:
            return sum(len(s) for s in self._samples.values())

    def set_prior(self, prior: PriorCurve) -> bool:
        """Use ``prior`` while nothing was measured yet (a shipped table); returns whether it was taken."""
        with self._lock:
            if self._samples:
                return False
            self.prior = prior
            self._curve = None
            return True

    @property
    def samples_taken(self) -> int:
        """The model's sample clock: how many samples it took (a loaded curve starts it at ``stale_after``)."""
        with self._lock:
            return self._count

    def state(self) -> dict:
        """The learnt curve as JSON-ready data for `load_state` (in another process): every bucket's samples in
        seconds, oldest first, the bookkeeping seconds per row and the prior's points."""
        with self._lock:
            return {
                "samples": {str(g): list(s) for g, s in sorted(self._samples.items())},
                "other_s_per_row": self._other_per_row,
                "prior": [[n, c] for n, c in zip(self.prior.ns, self.prior.cs)],
            }

    def load_state(self, state: Mapping) -> bool:
        """Start from a curve learnt earlier (`state`) while nothing was measured yet; returns whether it was taken.

        Its buckets start stale: `needs_sample` asks for them again, and the first re-measure that disagrees with
        one by more than ``_DISAGREE`` forgets them all (the machine is not in the state it was), so a loaded curve
        cannot lock the budget. Raises ValueError when ``state`` is not a `state()`."""
        samples, other, prior = _parsed_state(state)
        with self._lock:
            if self._samples:
                return False
            self.prior, self._curve = prior, None
            self._count = max(self._count, self.stale_after)
            for g, values in samples.items():
                self._samples[g] = deque(values, maxlen=self.window)
                self._medians[g] = statistics.median(self._samples[g])
                self._last[g] = self._count - self.stale_after
            self._other_per_row = other if self._other_per_row is None else self._other_per_row
            self.loaded = sum(len(s) for s in self._samples.values())
            return True

    @staticmethod
    def bucket(n: int) -> int:
        """The grid point a sample of ``n`` packed tokens is filed under (nearest in log scale)."""
        if n <= _GRID[0]:
            return _GRID[0]
        i = bisect.bisect_left(_GRID, n)
        if i >= len(_GRID):
            return _GRID[-1]
        lo, hi = _GRID[i - 1], _GRID[i]
        return hi if math.log(n / lo) > math.log(hi / n) else lo

    def record_verify(self, tokens: int, rows: int, seconds: float) -> None:
        """One verify forward over ``tokens`` packed tokens of ``rows`` rows took ``seconds``."""
        if tokens < 1 or not (seconds > 0 and math.isfinite(seconds)):
            return  # nothing verified, or a clock that did not move: no information
        g = self.bucket(tokens)
        with self._lock:
            if self._count >= _CLIP_AFTER:
                # a one-off (weights packed inside this forward, a preempted thread) must not poison a rarely
                # visited size through the isotonic fit: one sample moves the curve by at most _CLIP_FACTOR
                expected = self._curve_locked()(g)
                seconds = min(max(seconds, expected / _CLIP_FACTOR), expected * _CLIP_FACTOR)
            value = seconds * self.prior(g) / self.prior(tokens)
            if self._is_stale(g) and not 1 / _DISAGREE <= value / self._medians[g] <= _DISAGREE:
                self._forget_stale()
            self._count += 1
            self._last[g] = self._count
            samples = self._samples.setdefault(g, deque(maxlen=self.window))
            samples.append(value)
            self._medians[g] = statistics.median(samples)
            self._rows[g] = max(self._rows.get(g, 0), rows)
            self._curve = None

    def _is_stale(self, g: int) -> bool:
        return g in self._samples and self._count - self._last[g] >= self.stale_after

    def _forget_stale(self) -> None:
        """The machine changed (a stale size re-measured disagrees): drop every stale bucket."""
        for g in [g for g in self._samples if self._is_stale(g)]:
            del self._samples[g], self._medians[g], self._last[g]
        self.forgotten += 1

    def needs_sample(self, n: int, min_samples: int) -> str | None:
        """Why a verify over ``n`` tokens should be measured: ``"unmeasured"`` (never, or forgotten), ``"stale"`` (not
        sampled recently: it may describe another state of the machine), ``"few"`` (fewer than ``min_samples``), or
        None when its bucket is well measured."""
        g = self.bucket(n)
        with self._lock:
            if g not in self._samples:
                return "unmeasured"
            if self._is_stale(g):
                return "stale"
            return "few" if len(self._samples[g]) < min_samples else None

    def record_other(self, rows: int, seconds: float) -> None:
        """The loop's bookkeeping of one step with ``rows`` rows (emit, feedback) took ``seconds``."""
        if rows < 1 or not (seconds >= 0 and math.isfinite(seconds)):
            return
        with self._lock:
            x = seconds / rows
            prev = self._other_per_row
            self._other_per_row = x if prev is None else (1 - _EMA) * prev + _EMA * x

    def samples(self, n: int) -> int:
        """How many samples the bucket of ``n`` holds."""
        with self._lock:
            return len(self._samples.get(self.bucket(n), ()))

    # ------------------------------------------------------------------ predictions
    def _measured(self) -> tuple[list[int], list[float]]:
        if self._curve is None:
            grid = sorted(self._samples)
            medians = [self._medians[g] for g in grid]
            self._curve = grid, _isotonic(medians, [len(self._samples[g]) for g in grid])
        return self._curve

    def curve(self) -> CostCurve:
        """A snapshot of the current curve (cheap to evaluate at many n; later samples do not change it)."""
        with self._lock:
            return self._curve_locked()

    def _curve_locked(self) -> CostCurve:
        grid, cost = self._measured()
        return CostCurve(grid, cost, self.prior)

    def predict(self, n: float) -> float:
        """Seconds of a verify forward over ``n`` packed tokens (prior units, 1.0 = one token, before any sample)."""
        return self.curve()(n)

    def predict_range(self, start: int, stop: int) -> list[float]:
        """``[predict(n) for n in range(start, stop)]``."""
        curve = self.curve()
        return [curve(n) for n in range(start, stop)]

    def other_seconds(self, rows: int) -> float:
        """Predicted bookkeeping seconds of a step with ``rows`` rows (0 before any measurement)."""
        with self._lock:
            return 0.0 if self._other_per_row is None else self._other_per_row * rows

    def summary(self) -> dict:
        """The measured curve for reports: ``{"curve": {n: seconds}, "samples": {n: count}, "relative": {n: cost /
        cost of 1 token}, "max_rows": {n: rows}, "other_s_per_row": s, "prior": {n: rel}}``."""
        with self._lock:
            grid, cost = self._measured()
            one = self.predict(1)
            return {
                "curve": {g: c for g, c in zip(grid, cost)},
                "samples": {g: len(self._samples[g]) for g in grid},
                "relative": {g: c / one for g, c in zip(grid, cost)} if grid else {},
                "max_rows": dict(sorted(self._rows.items())),
                "other_s_per_row": self._other_per_row,
                "prior": dict(zip(self.prior.ns, self.prior.cs)),
                "stale": [g for g in grid if self._is_stale(g)],
                "forgotten": self.forgotten,
                "loaded_samples": self.loaded,
            }


# ---------------------------------------------------------------------------- one model per target model
_MODELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MODELS_LOCK = threading.Lock()
# cost model -> (the file of its curve, a weak reference to its model): what `save_learnt_curve` writes where
_FILES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cost_model_for(model: torch.nn.Module, prior: PriorCurve | None = None) -> StepCostModel:
    """The `StepCostModel` of ``model`` on its current device and dtype, created on first use and shared by every
    later call (also from other threads). A new one starts from the curve an earlier process saved for this machine
    and model (`cost_cache`), else from ``prior``; ``prior`` applies while nothing was measured for it yet."""
    param = next(model.parameters(), None)
    key = (str(param.device), str(param.dtype)) if param is not None else ("cpu", "none")
    with _MODELS_LOCK:
        per_model = _MODELS.get(model)
        if per_model is None:
            per_model = _MODELS[model] = {}
        cost = per_model.get(key)
        if cost is None:
            cost = per_model[key] = _started(model, prior)
            return cost
    if prior is not None:
        cost.set_prior(prior)
    return cost


def _started(model: torch.nn.Module, prior: PriorCurve | None) -> StepCostModel:
    """A new cost model for ``model``: from its saved curve when the cache holds one, and registered for saving."""
    cost = StepCostModel(prior)
    file = curve_file(model)
    if file is None:
        return cost
    _restore(cost, file)
    _FILES[cost] = (file, weakref.ref(model))
    return cost


def _restore(cost: StepCostModel | ProposingCost, file: CurveFile) -> None:
    """``cost`` from the state ``file`` saved (a malformed file is no state: the next save replaces it), its save
    clock started where the restored samples end."""
    state = file.read()
    if state is not None:
        try:
            cost.load_state(state)
        except ValueError:
            pass
    file.saved_clock = cost.samples_taken


def save_learnt_curve(cost: StepCostModel, force: bool = False) -> bool:
    """Write ``cost``'s curve to this machine's cache when it learnt something since the last write and that write
    is `cost_cache.SAVE_EVERY_S` old (``force``: whatever its age); returns whether it wrote. A no-op for a cost model
    that `cost_model_for` did not make, or while the cache is off; never raises for an unwritable folder."""
    entry: tuple[CurveFile, weakref.ref] | None = _FILES.get(cost)
    model = entry[1]() if entry is not None else None
    if model is None:
        return False
    return entry[0].save(model, cost, force)


@atexit.register
def _save_learnt_curves() -> None:
    """At exit, what the curves learnt since their last (throttled) write."""
    for cost in list(_FILES.keys()):
        save_learnt_curve(cost, force=True)


# ---------------------------------------------------------------------------- what proposing costs
PROPOSING_WINDOW = 9  # per-level cost samples kept (their median is the cost)
_CHEAPER = 1.25  # a sample this much below the median: the draft became cheap, the older samples go
_ACCEPT_DECAY = 0.98  # weight of old acceptance evidence per verified tree (about the last 50 trees count)
_MAX_EVIDENCE_DEPTH = 16


class ProposingCost:
    """What one level of drafting costs a proposer that pays per level (a draft model's forward: its layers, its
    lm_head over the vocabulary, its cache upkeep), in units of one plain decoding step of the target (the 1-row
    verify forward plus the loop's bookkeeping), and the conditional acceptance per depth its drafts showed.

    One per (draft, target) pair, shared by the calls of a process (`proposing_cost_for`) and kept between processes
    in the cost cache (`cost_cache.proposing_file`), so a call starts knowing whether drafting can pay. The cost is the
    median of the last `PROPOSING_WINDOW` samples; a sample `_CHEAPER` below that median drops the older ones (a
    draft that became cheap comes back at once; one slow, preempted level only moves the median). Acceptance is
    decayed counts per depth of verified nodes whose parent was accepted. The probe schedule of a draft that does not
    pay (`TreeBudgeter`) lives here too, so it carries over calls: ``off_steps`` steps since its last probe, the next
    probe after ``probe_interval`` steps.
    """

    def __init__(self, window: int = PROPOSING_WINDOW):
        self._ratios: deque[float] = deque(maxlen=window)
        self.accepted = [0.0] * _MAX_EVIDENCE_DEPTH  # decayed accepted nodes per depth (parent accepted)
        self.verified = [0.0] * _MAX_EVIDENCE_DEPTH  # decayed verified nodes per depth (parent accepted)
        self.off_steps = 0
        self.probe_interval = 0  # 0: not off yet (the first interval is the budgeter's)
        self._count = 0  # samples taken (the cache file's clock)
        self._lock = threading.RLock()

    @property
    def samples_taken(self) -> int:
        with self._lock:
            return self._count

    def ratio(self) -> float | None:
        """One drafted level's cost in plain decoding steps (median of the recent samples), None before any."""
        with self._lock:
            return statistics.median(self._ratios) if self._ratios else None

    def record_level(self, ratio: float, catching_up: bool = False) -> None:
        """One step's proposing cost per level, in plain steps. ``catching_up``: the draft fed a backlog (its cache
        caught up after a pause, or its prefill), which is no sample of a level unless it is cheaper still."""
        if not (ratio > 0 and math.isfinite(ratio)):
            return
        with self._lock:
            median = statistics.median(self._ratios) if self._ratios else None
            if median is not None and ratio * _CHEAPER < median:
                self._ratios.clear()
            elif catching_up:
                return
            self._ratios.append(ratio)
            self._count += 1

    def record_tree(self, depths: Sequence[int], hits: Sequence[bool]) -> None:
        """One verified tree: the depth of each node whose parent was accepted, and whether it was accepted."""
        with self._lock:
            for d in range(_MAX_EVIDENCE_DEPTH):
                self.accepted[d] *= _ACCEPT_DECAY
                self.verified[d] *= _ACCEPT_DECAY
            for depth, hit in zip(depths, hits):
                d = min(depth, _MAX_EVIDENCE_DEPTH) - 1
                self.accepted[d] += float(hit)
                self.verified[d] += 1.0
            self._count += 1

    def acceptance(self, depths: int, prior: float, weight: float) -> list[float]:
        """``a[d - 1]``: estimated acceptance of a depth-d node once its parent is accepted, d = 1..``depths``: the
        evidence shrunk towards ``prior`` (depth 1) or the depth above (deeper) by ``weight`` nodes."""
        out, parent = [], prior
        with self._lock:
            for d in range(depths):
                i = min(d, _MAX_EVIDENCE_DEPTH - 1)
                parent = (self.accepted[i] + weight * parent) / (self.verified[i] + weight)
                out.append(parent)
        return out

    def state(self) -> dict:
        """JSON-ready: the level samples (plain steps), the acceptance evidence and the probe schedule."""
        with self._lock:
            return {
                "level_ratios": list(self._ratios),
                "accepted": self.accepted[:],
                "verified": self.verified[:],
                "off_steps": self.off_steps,
                "probe_interval": self.probe_interval,
            }

    def load_state(self, state: Mapping) -> None:
        """Start from a `state()` (another process's); ValueError when it is not one."""
        try:
            ratios = [float(x) for x in state["level_ratios"]]
            accepted, verified = ([float(x) for x in state[k]] for k in ("accepted", "verified"))
            off, interval = int(state["off_steps"]), int(state["probe_interval"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"not a ProposingCost.state(): {err!r}") from None
        values = ratios + accepted + verified
        if not all(v >= 0 and math.isfinite(v) for v in values) or len(accepted) != len(verified) or off < 0:
            raise ValueError("a saved proposing cost holds negative or non-finite values")
        with self._lock:
            self._ratios.extend(r for r in ratios if r > 0)
            n = min(len(accepted), _MAX_EVIDENCE_DEPTH)
            self.accepted[:n], self.verified[:n] = accepted[:n], verified[:n]
            self.off_steps, self.probe_interval = off, max(0, interval)

    def summary(self) -> dict:
        with self._lock:
            ratio = self.ratio()
            return {
                "level_ratio": ratio,
                "level_samples": len(self._ratios),
                "acceptance": [round(a, 3) for a in self.acceptance(4, 0.0, 1e-9)],
                "off_steps": self.off_steps,
                "probe_interval": self.probe_interval,
            }


# (draft module) -> (target module) -> {(target dtype/device, draft dtype/device, variant): ProposingCost}
_PROPOSING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# ProposingCost -> (its file, weak refs to the target and the draft, the variant)
_PROPOSING_FILES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _placement(model: torch.nn.Module) -> tuple[str, str]:
    param = next(model.parameters(), None)
    return (str(param.device), str(param.dtype)) if param is not None else ("cpu", "none")


def proposing_cost_for(target: torch.nn.Module, draft: torch.nn.Module, variant: str | None = None) -> ProposingCost:
    """The `ProposingCost` of ``draft`` drafting for ``target`` (on their current devices and dtypes; ``variant``: how
    the draft runs, e.g. over a draft vocabulary of some size): shared by every call of this process, started from
    what an earlier process saved on this machine (`cost_cache`)."""
    key = (_placement(target), _placement(draft), variant)
    with _MODELS_LOCK:
        per_draft = _PROPOSING.setdefault(draft, weakref.WeakKeyDictionary())
        per_pair = per_draft.setdefault(target, {})
        cost = per_pair.get(key)
        if cost is None:
            cost = per_pair[key] = _started_proposing(target, draft, variant)
    return cost


def _started_proposing(target: torch.nn.Module, draft: torch.nn.Module, variant: str | None) -> ProposingCost:
    cost = ProposingCost()
    file = proposing_file(target, draft, variant)
    if file is None:
        return cost
    _restore(cost, file)
    _PROPOSING_FILES[cost] = (file, weakref.ref(target), weakref.ref(draft), variant)
    return cost


def save_proposing_cost(cost: ProposingCost, force: bool = False) -> bool:
    """Write ``cost`` to this machine's cache when due (`CurveFile.due`); returns whether it wrote. Never raises for
    an unwritable folder; a no-op for a cost `proposing_cost_for` did not make or while the cache is off."""
    entry = _PROPOSING_FILES.get(cost)
    target, draft = (entry[1](), entry[2]()) if entry is not None else (None, None)
    if target is None or draft is None:
        return False
    return entry[0].save(target, cost, force, current_key=proposing_key(target, draft, entry[3]))


@atexit.register
def _save_proposing_costs() -> None:
    for cost in list(_PROPOSING_FILES.keys()):
        save_proposing_cost(cost, force=True)
