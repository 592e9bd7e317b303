"""The base of the assistants that draft from the target's final normed hidden state (Medusa heads, the MLP
speculator), and the per-row run-time cut of their fixed-shape trees (`AdaptiveDepth`).

The loop hands such an assistant the final normed hidden states (``hidden_state_layers = (-1,)``) of every token
entering the KV cache; `FinalStateAssistant` keeps the last one per row, the state the target's lm_head turned into
the row's current root, from which the heads or stages guess the tokens after the root.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Proposer, ProposerSetup, RowFeedback, RowState


class AdaptiveDepth:
    """Per-row choice of how deep to cut a static tree, from that row's measured acceptance and the step cost.

    For each row it counts, per depth k, the steps where depth k + 1 was reachable (depth k accepted and the tree went
    deeper) and those where it was accepted; the conditional rate ``q[k]`` (with ``prior`` worth ``prior_weight``
    steps) gives the expected tokens of the cut at depth d, ``1 + sum_{k<d} prod_{j<=k} q[j]``, and the cut with the
    best ``tau / cost`` wins — depth 0, drafting nothing, included. A row that stopped drafting probes depth 1 every
    ``probe_every`` steps so that its estimate can recover. Only *what is drafted* changes: verification, and so the
    output, is untouched.

    Args:
        nodes_at_depth: ``nodes_at_depth[d]`` = nodes of the tree cut at depth d (index 0 = 0 nodes).
        step_cost: ``{nodes: cost of a step with that many nodes / a plain decoding step}`` measured on the machine.
        prior: ``prior[k]`` the conditional acceptance of depth k + 1 expected before any measurement.
    """

    def __init__(
        self,
        nodes_at_depth: Sequence[int],
        step_cost: dict[int, float],
        prior: Sequence[float],
        prior_weight: float = 4.0,
        probe_every: int = 8,
    ):
        self.nodes = [int(n) for n in nodes_at_depth]
        self.cost = [float(step_cost.get(n, step_cost[max(step_cost)])) if n else 1.0 for n in self.nodes]
        self.prior = [float(p) for p in prior] + [0.0] * max(0, len(self.nodes) - 1 - len(prior))
        self.prior_weight = float(prior_weight)
        self.probe_every = int(probe_every)
        self._reach: dict[int, list[float]] = {}
        self._hit: dict[int, list[float]] = {}
        self._idle: dict[int, int] = {}

    def reset(self) -> None:
        self._reach, self._hit, self._idle = {}, {}, {}

    def record(self, row: int, tree_depth: int, accepted_depth: int) -> None:
        """One verified step of ``row``: its tree was ``tree_depth`` deep, ``accepted_depth`` drafts were accepted."""
        depth = len(self.nodes) - 1
        reach = self._reach.setdefault(row, [0.0] * depth)
        hit = self._hit.setdefault(row, [0.0] * depth)
        for k in range(min(tree_depth, accepted_depth + 1, depth)):
            reach[k] += 1
            hit[k] += k < accepted_depth

    def depth(self, row: int, limit: int) -> int:
        """The cut depth for ``row``'s next step (at most ``limit``)."""
        depth = min(limit, len(self.nodes) - 1)
        reach, hit = self._reach.get(row), self._hit.get(row)
        w = self.prior_weight
        best, best_value, tau, path = 0, 1.0, 1.0, 1.0
        for d in range(1, depth + 1):
            k = d - 1
            q = (self.prior[k] * w + (hit[k] if hit else 0.0)) / (w + (reach[k] if reach else 0.0))
            path *= q
            tau += path
            if tau / self.cost[d] > best_value + 1e-12:
                best, best_value = d, tau / self.cost[d]
        if best == 0 and depth > 0:
            self._idle[row] = self._idle.get(row, 0) + 1
            if self._idle[row] % self.probe_every == 0:
                return 1
        else:
            self._idle[row] = 0
        return best


class FinalStateAssistant(Proposer):
    """An assistant drafting from each row's last final hidden state (`_last_hidden`: row -> `[H]`), whose tree may
    be cut per row by ``adaptive`` (an `AdaptiveDepth`, or None), which learns from every verdict."""

    hidden_state_layers = (-1,)
    adaptive: AdaptiveDepth | None = None

    def start(self, setup: ProposerSetup) -> None:
        super().start(setup)
        self._last_hidden: dict[int, torch.Tensor] = {}
        if self.adaptive is not None:
            self.adaptive.reset()

    def observe(self, rows: Sequence[RowState], feedback: Sequence[RowFeedback]) -> None:
        for row, fb in zip(rows, feedback):
            if fb.hidden_states is None or -1 not in fb.hidden_states:
                raise RuntimeError(
                    f"{type(self).__name__} needs the target's final hidden states (hidden_state_layers=(-1,))"
                )
            if self.adaptive is not None and fb.tree is not None:
                self.adaptive.record(row.row, fb.tree.max_depth, fb.num_accepted)
            hidden = fb.hidden_states[-1]  # [m, H]
            if hidden.shape[0]:
                # [H] the state the target's lm_head turned into the new root; clone frees the step's [N, H] buffer
                self._last_hidden[row.row] = hidden[-1].detach().clone()

    def finish(self) -> None:
        self._last_hidden = {}
