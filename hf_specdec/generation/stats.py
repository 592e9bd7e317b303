"""Acceptance metrics of a speculative generate() call (the vLLM / Spec-Bench definitions, docs/algorithms.md)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpecStats:
    """What a speculative call did: ``out.spec_stats`` of ``model.generate(..., assistant=...,
    return_dict_in_generate=True)``, counters summed over the rows of the batch.

    ``print(out.spec_stats)`` shows the derived figures: `tau` (τ, the mean number of tokens each verify step
    emitted), `acceptance_rate` and `per_depth_acceptance` (docs/glossary.md defines each). ``to_dict()`` gives
    every field and those three as plain Python values (JSON-ready).

    Attributes:
        steps: verification steps (one per row per target forward that verified a tree for it).
        drafted_tokens: draft nodes verified.
        accepted_tokens: draft nodes accepted.
        emitted_tokens: tokens appended to the outputs (accepted + one correction/bonus per step + the prefill token).
        accepted_per_depth: entry d-1 counts the steps that accepted at least d drafted tokens.
        time_propose / time_verify / time_other: seconds in the proposer, in target forwards + acceptance, and in
            everything else (prefill included in verify).
        packed_weight_bytes: bytes held by the target's pre-packed CPU linear weights when the call ended (0 when
            it did not pack; kept for later calls unless ``keep_packed=False``; see ``generation/packed_linears.py``).
        budget: what the tree budget measured and chose (`TreeBudgeter.summary`): ``cost`` the verify cost curve
            of this machine (``curve`` {packed tokens: seconds}, ``relative`` {tokens: cost / cost of one token},
            ``samples``), ``nodes_per_row`` {nodes verified for a row in a step: how often},
            ``draft_nothing_fraction``, explorations, trial drafts (``probes``) and the acceptance calibration per
            assistant and depth. Empty when the call ran with ``tree_budget=False``.

    Example::

        out = model.generate(ids, assistant=hf_specdec.NgramAssistant(), max_new_tokens=64,
                             return_dict_in_generate=True)
        s = out.spec_stats
        print(f"τ {s.tau:.2f}, {s.accepted_tokens}/{s.drafted_tokens} drafted tokens accepted in {s.steps} steps")
    """

    steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    accepted_per_depth: list[int] = field(default_factory=list)
    time_propose: float = 0.0
    time_verify: float = 0.0
    time_other: float = 0.0
    packed_weight_bytes: int = 0
    budget: dict = field(default_factory=dict)

    @property
    def tau(self) -> float:
        """Mean accepted length: 1 + accepted draft tokens / verification steps."""
        return 1.0 + self.accepted_tokens / self.steps if self.steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def per_depth_acceptance(self) -> list[float]:
        """Fraction of steps that accepted at least d tokens, d = 1, 2, ..."""
        return [n / self.steps for n in self.accepted_per_depth] if self.steps else []

    def record_step(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        while len(self.accepted_per_depth) < accepted:
            self.accepted_per_depth.append(0)
        for d in range(accepted):
            self.accepted_per_depth[d] += 1

    def __repr__(self) -> str:
        """A few readable lines: τ and acceptance, per-depth acceptance, tokens, timings and the tree sizes; every
        counter is an attribute, the tree budget's detail is ``.budget`` and ``to_dict()`` has everything."""
        lines = [
            f"SpecStats: τ = {self.tau:.2f} tokens per verify step ({self.steps} steps), acceptance "
            f"{self.acceptance_rate:.2f} ({self.accepted_tokens} of {self.drafted_tokens} drafted tokens accepted)",
            "  accepted >= d drafted tokens: "
            + (" ".join(f"d={d} {p:.2f}" for d, p in enumerate(self.per_depth_acceptance[:8], 1)) or "never"),
            f"  tokens: {self.emitted_tokens} emitted, {self.accepted_tokens} of them accepted draft tokens",
            f"  time: {self.time_propose + self.time_verify + self.time_other:.3f} s = propose "
            f"{self.time_propose:.3f} + verify {self.time_verify:.3f} + other {self.time_other:.3f}",
        ]
        nodes = self.budget.get("nodes_per_row") or {}
        if nodes:
            row_steps = sum(nodes.values())
            mean = sum(int(n) * c for n, c in nodes.items()) / row_steps
            lines.append(
                f"  tree budget: {mean:.1f} nodes per row and step, drafted nothing in "
                f"{self.budget.get('draft_nothing_fraction', 0.0):.0%} (detail: .budget)"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """Every field and derived rate, JSON-ready (mapping keys such as the cost curve's token counts are strings)."""
        out = asdict(self)
        out.update(tau=self.tau, acceptance_rate=self.acceptance_rate, per_depth_acceptance=self.per_depth_acceptance)
        return _string_keys(out)


def _string_keys(value):
    """``value`` with every dict key turned into a string, recursively (JSON objects have string keys only)."""
    if isinstance(value, dict):
        return {str(k): _string_keys(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_string_keys(v) for v in value]
    return value
