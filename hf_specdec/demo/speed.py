"""What a measured speedup is made of: τ and the measured cost of a speculative step, and the spread of repeated
timings (plain Python: the page's renderers and the tests use it without a model).

The step cost. Vanilla `generate` spends ``T_v`` on ``N_v`` tokens; the speculative call spends ``T_s`` on ``N_s``
tokens in ``S`` verification steps (each: the assistant drafts, the target verifies the draft in one forward). With
the step cost ``c = (T_s / S) / (T_v / N_v)`` (the time of a speculative step, drafting and verifying, over vanilla's
time per token, both with their prefill spread over the call), the speedup is exactly

    speedup = (N_s / T_s) / (N_v / T_v) = (N_s / S) / c  ≈  τ / c

(``N_s / S`` is τ give or take the prefill's token and accepted draft tokens cut after the end of the answer). τ is
not an upper bound on the speedup: ``c`` can be below 1. On a CPU a verify forward over a few tokens runs the
few-rows GEMM on pre-packed weights, which can cost less than vanilla's one-token decode forward on stock kernels
(docs/results/amd_few_rows_forward.json measures it), so a speedup above τ is a
measurement, not an error. Over several prompts the times and counts add up (`step_cost`).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Pair:
    """What one prompt measured: vanilla's call and the speculative call on it.

    Attributes:
        vanilla_s: vanilla's seconds (``T_v``).
        vanilla_tokens: tokens vanilla produced (``N_v``).
        spec_s: the speculative call's seconds (``T_s``).
        spec_steps: its verification steps (``S``, ``spec_stats.steps``).
    """

    vanilla_s: float
    vanilla_tokens: int
    spec_s: float
    spec_steps: int


def step_cost(pairs: Iterable[Pair]) -> float | None:
    """A speculative step's time over vanilla's time per token, summed over ``pairs``: ``(ΣT_s / ΣS) / (ΣT_v /
    ΣN_v)`` (module docstring). None when it is not measured (no steps, no tokens or no time)."""
    pairs = list(pairs)
    spec_s, steps = sum(p.spec_s for p in pairs), sum(p.spec_steps for p in pairs)
    van_s, tokens = sum(p.vanilla_s for p in pairs), sum(p.vanilla_tokens for p in pairs)
    if steps <= 0 or tokens <= 0 or van_s <= 0 or spec_s <= 0:
        return None
    return (spec_s / steps) / (van_s / tokens)


@dataclass(frozen=True)
class Spread:
    """The low, median and high of repeated measurements of one figure."""

    low: float
    median: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread | None:
        values = [v for v in values if v is not None]
        if not values:
            return None
        return cls(min(values), statistics.median(values), max(values), len(values))

    def relative_width(self) -> float:
        """(high - low) / median: how far apart the repeats were."""
        return (self.high - self.low) / self.median if self.median else 0.0
