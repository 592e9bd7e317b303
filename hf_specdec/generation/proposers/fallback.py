"""`FallbackAssistant`: several assistants in order of preference; each row drafts with the first that has a draft.

Prompt lookup drafts long, cheap, often-right trees where the answer repeats the prompt or itself, and nothing
elsewhere; a trained head (Medusa) drafts a little everywhere. ``FallbackAssistant(NgramAssistant(), heads)`` asks
the n-gram assistant first and, for the rows where it found no match this step, the heads:

    model.generate(ids, assistant=hf_specdec.FallbackAssistant(hf_specdec.NgramAssistant(), MedusaHeads...))

Every assistant sees every step's accepted tokens (``observe``), so each stays in sync whether or not it drafted;
only the rows an assistant drafts for reach its ``propose``, and each sees the verdict of the tree *it* proposed (a
row it was not asked about arrives with ``tree=None``). Target hidden states are requested once for the union of the
layers the assistants need and each gets the layers it asked for. Each row's tree keeps its own drafting rule
(``DraftTree.sampling``), so greedy and exact sampling stay exact: which assistant drafts depends only on the
context, never on the target's answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import torch

from ..budget import RowCandidates
from ..tree import DraftTree
from . import as_proposer
from .base import Proposer, ProposerSetup, RowFeedback, RowState, checked_proposals


class FallbackAssistant(Proposer):
    """Draft each row with the first of ``assistants`` that proposes a non-empty tree for it.

    A row whose tree predicts less than ``handoff`` times the speed of a plain step (the call's tree budget's
    `TreeBudgeter.speedup`: the measured cost curve and the calibrated scores) asks the next assistant too, and the
    tree that predicts more wins; whether the budget then cuts that tree (``tree_budget``) does not change which
    tree is proposed. A row the budget paused (a paid assistant's drafts stopped paying)
    is still offered to the assistants that propose for free (`Proposer.proposes_for_free`: prompt lookup), so
    pausing the trained head never silences the lookup.

    Args:
        *assistants: two or more assistants, most preferred first: `Proposer` instances, or anything ``assistant=``
            accepts (a draft model, `MedusaHeads`, ...), resolved against the target when generation starts.
        handoff: predicted speedup below which the next assistant is asked as well.
    """

    def __init__(self, *assistants, handoff: float = 1.3) -> None:
        for a in assistants:
            if isinstance(a, (list, tuple)):
                raise TypeError("pass the assistants as separate arguments: FallbackAssistant(first, second, ...)")
        if len(assistants) < 2:
            raise ValueError(f"FallbackAssistant needs at least two assistants, got {len(assistants)}")
        _refuse_repeats(assistants)
        self.assistants = assistants
        self.handoff = float(handoff)
        self.proposers: list[Proposer] = [a for a in assistants if isinstance(a, Proposer)]
        if len(self.proposers) != len(assistants):
            self.proposers = []  # resolved in validate(), once the target is known
        self.hidden_state_layers = self._layers()
        # this step's trees: (assistant index, caller's row) -> the tree that assistant proposed for the row
        self._proposed: dict[tuple[int, int], DraftTree] = {}

    def __repr__(self) -> str:
        return f"FallbackAssistant({', '.join(repr(a) for a in (self.proposers or self.assistants))})"

    def _layers(self) -> tuple[int, ...] | None:
        layers: list[int] = []
        for p in self.proposers:
            for layer in p.hidden_state_layers or ():
                if layer not in layers:
                    layers.append(layer)
        return tuple(layers) or None

    # ------------------------------------------------------------------ lifecycle
    def validate(self, target: torch.nn.Module) -> None:
        self.proposers = [as_proposer(a, target) for a in self.assistants]
        for p in self.proposers:
            p.validate(target)
        self.hidden_state_layers = self._layers()

    @contextlib.contextmanager
    def claimed(self) -> Iterator[None]:
        """Claims this object and every assistant object passed to it (see `Proposer.claimed`), before anything is
        resolved: `validate` replaces ``proposers``, which another thread's call may be using. The proposers that
        `validate` resolves from heads or draft models are this object's own, so its claim covers them."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(super().claimed())
            for a in self.assistants:
                if isinstance(a, Proposer):
                    stack.enter_context(a.claimed())
            yield

    def start(self, setup: ProposerSetup) -> None:
        super().start(setup)
        self._proposed = {}
        for p in self.proposers:
            p.start(setup)

    def drafting_modules(self) -> tuple[torch.nn.Module, ...]:
        return tuple(m for p in self.proposers for m in p.drafting_modules())

    def finish(self) -> None:
        self._proposed = {}
        error: BaseException | None = None
        for p in self.proposers:
            try:
                p.finish()
            except BaseException as exc:  # noqa: BLE001 - every assistant must be finished; the first error wins
                error = error or exc
        if error is not None:
            raise error

    # ------------------------------------------------------------------ drafting
    @property
    def prior_cost(self):
        """The first of the assistants' prior step costs (`Proposer.prior_cost`), if any has them."""
        return next((p.prior_cost for p in self.proposers if p.prior_cost is not None), None)

    def propose(self, rows: Sequence[RowState]) -> list[DraftTree]:
        budget = self.budget
        trees: list[DraftTree | None] = [None] * len(rows)
        speedup = [0.0] * len(rows)
        waiting = list(range(len(rows)))
        self._proposed = {}
        for a, p in enumerate(self.proposers):
            if not waiting:
                break
            proposed = checked_proposals(p, p.propose([_row_for(p, rows[i]) for i in waiting]), len(waiting))
            candidates = {i: _candidates(rows[i].row, tree) for i, tree in zip(waiting, proposed) if tree.num_nodes}
            budget.read_candidates(list(candidates.values()))  # one read of every row's tree
            for i, tree in zip(waiting, proposed):
                self._proposed[a, rows[i].row] = tree
                if i not in candidates:
                    continue
                value = budget.speedup(candidates[i])
                if value > speedup[i]:
                    trees[i], speedup[i] = tree, value
            # a row whose best tree so far predicts little asks the next assistant too
            waiting = [i for i in waiting if speedup[i] < self.handoff]
        for i, tree in enumerate(trees):
            if tree is None:
                trees[i] = DraftTree.empty(rows[i].tokens.device)
        return trees

    def observe(self, rows: Sequence[RowState], feedback: Sequence[RowFeedback]) -> None:
        for a, p in enumerate(self.proposers):
            p.observe(rows, [self._feedback_for(a, p, row, fb) for row, fb in zip(rows, feedback)])

    def _feedback_for(self, a: int, p: Proposer, row: RowState, fb: RowFeedback) -> RowFeedback:
        """Assistant ``a``'s view of a row's verdict: its own tree (None if not asked) and the layers it asked for."""
        tree = self._proposed.get((a, row.row)) if fb.tree is not None else None
        used = tree is fb.tree
        accepted = fb.accepted if used else fb.accepted[:0]
        verified = fb.verified if used else fb.accepted[:0]  # a tree that was not used was not verified
        layers = p.hidden_state_layers
        hidden = None if not layers or fb.hidden_states is None else {k: fb.hidden_states[k] for k in layers}
        return RowFeedback(fb.new_tokens, accepted, fb.next_token, tree, hidden, verified)


def _refuse_repeats(assistants: Sequence) -> None:
    """One `Proposer` object twice (directly or inside a nested `FallbackAssistant`) would be asked for every row
    twice and claimed twice by one call: refuse it by its positions."""
    seen: dict[int, str] = {}

    def walk(items: Sequence, prefix: str) -> None:
        for i, a in enumerate(items):
            if not isinstance(a, Proposer):  # heads or a draft model: each place resolves to its own proposer
                continue
            where = f"{prefix}{i}"
            if id(a) in seen:
                raise ValueError(
                    f"FallbackAssistant got the same {type(a).__name__} object twice (assistants {seen[id(a)]} and "
                    f"{where}); an assistant keeps per-call state, so one object cannot take two places: pass it "
                    f"once, or a second instance (e.g. {type(a).__name__}(...) again)"
                )
            seen[id(a)] = where
            if isinstance(a, FallbackAssistant):
                walk(a.assistants, f"{where}.")

    walk(assistants, "")


def _row_for(p: Proposer, row: RowState) -> RowState:
    """The row as ``p`` sees it: a row the budget paused or capped drafts as deep as it may with an assistant that
    proposes for free."""
    if row.free_depth and p.proposes_for_free:
        return dataclasses.replace(row, max_depth=row.free_depth, free_depth=0)
    return row


def _candidates(row: int, tree: DraftTree) -> RowCandidates:
    """A tree as the budget's candidates (its own scores and source)."""
    return RowCandidates(row, tree, tree.scores, tree.source or "default")
