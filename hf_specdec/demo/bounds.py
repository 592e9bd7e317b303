"""What a measured speedup can be: the bound that τ and the measured costs put on it, and the spread of repeated
timings (plain Python: the page's renderers and the tests use it without a model).

The bound. Vanilla `generate` spends ``T_v = P + D·t`` on a prompt: a prefill ``P`` (it gives the first token) and
``D`` decode forwards of cost ``t`` each (one per further token). The speculative call runs the same prefill and
then ``S`` verification steps; each runs the target once over the cache (on the root and the drafted tokens, plus
the assistant's drafting), so it costs at least one decode forward: ``T_s >= P + S·t``. Whatever ``P`` and ``t`` are,
``T_s >= T_v · min(1, S / D)``, hence

    speedup = (N_s / T_s) / (N_v / T_v)  <=  (N_s / N_v) · max(1, D / S)

with ``N_s`` / ``N_v`` the tokens each produced. For a greedy call (``N_s = N_v = 1 + S + accepted``, ``D = N_v - 1``)
the bound is exactly τ = 1 + accepted / S. Over several prompts the times add up, and the bound is the same
argument summed (`speedup_bound`). A figure above its bound cannot come from drafting: one of the two timings was
disturbed (the machine was busy, a cache was cold), and the page flags it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Pair:
    """What one prompt measured: vanilla's call and the speculative call on it.

    Attributes:
        vanilla_s: vanilla's seconds (the time the speedup divides by; it weighs this prompt in a sum).
        vanilla_tokens: tokens vanilla produced (``N_v``).
        vanilla_forwards: vanilla's decode forwards after the prefill (``D``; ``N_v - 1`` for one prompt).
        spec_tokens: tokens the speculative call produced (``N_s``).
        spec_steps: its verification steps (``S``, ``spec_stats.steps``).
    """

    vanilla_s: float
    vanilla_tokens: int
    vanilla_forwards: int
    spec_tokens: int
    spec_steps: int


def speedup_bound(pairs: Iterable[Pair]) -> float | None:
    """The largest speedup (total tokens / total time over vanilla's) drafting can give on these prompts.

    Each prompt's speculative time is at least ``vanilla_s · min(1, S / D)`` (module docstring), so the sum of
    speculative times is at least the sum of those floors. None when nothing bounds it (a prompt without
    verification steps but with decode forwards, or no tokens).
    """
    pairs = list(pairs)
    spent = floor = 0.0
    for p in pairs:
        if p.vanilla_tokens <= 0 or p.vanilla_s <= 0 or (p.spec_steps <= 0 < p.vanilla_forwards):
            return None
        share = 1.0 if p.vanilla_forwards <= 0 else min(1.0, p.spec_steps / p.vanilla_forwards)
        spent += p.vanilla_s
        floor += p.vanilla_s * share
    if not pairs or floor <= 0:
        return None
    tokens = sum(p.spec_tokens for p in pairs) / sum(p.vanilla_tokens for p in pairs)
    return tokens * spent / floor


def above(value: float | None, bound: float | None) -> bool:
    """Whether a speedup is above its bound (as rendered: to two decimals)."""
    return value is not None and bound is not None and round(value, 2) > round(bound, 2)


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
