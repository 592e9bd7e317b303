"""`FallbackAssistant`: several assistants in order of preference; each row drafts with the first that has a draft.

Prompt lookup drafts long, cheap, often-right trees where the answer repeats the prompt or itself, and nothing
elsewhere; a trained head (Medusa) drafts a little everywhere. ``FallbackAssistant(NgramAssistant(), heads)`` asks
the n-gram assistant first and, for the rows where it found no match this step, the heads:

    model.generate(ids, assistant=hf_specdec.FallbackAssistant(hf_specdec.NgramAssistant(), MedusaHeads...))

Every assistant sees every step's accepted tokens (``observe``), so each stays in sync whether or not it drafted;
only the rows an assistant drafts for reach its ``propose``. Target hidden states are requested once for the union
of the layers the assistants need and each gets its own columns. Each row's tree keeps its own drafting rule
(``DraftTree.sampling``), so greedy and exact sampling stay exact: which assistant drafts depends only on the
context, never on the target's answer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..tree import DraftTree
from .base import Proposer, ProposerSetup, RowState


class FallbackAssistant(Proposer):
    """Draft each row with the first of ``assistants`` that proposes a non-empty tree for it.

    Args:
        *assistants: two or more assistants, most preferred first: `Proposer` instances, or anything ``assistant=``
            accepts (a draft model, `MedusaHeads`, ...), resolved against the target when generation starts.
    """

    def __init__(self, *assistants) -> None:
        for a in assistants:
            if isinstance(a, (list, tuple)):
                raise TypeError("pass the assistants as separate arguments: FallbackAssistant(first, second, ...)")
        if len(assistants) < 2:
            raise ValueError(f"FallbackAssistant needs at least two assistants, got {len(assistants)}")
        self.assistants = assistants
        self.proposers: list[Proposer] = [a for a in assistants if isinstance(a, Proposer)]
        if len(self.proposers) != len(assistants):
            self.proposers = []  # resolved in validate(), once the target is known
        self.hidden_state_layers = self._layers()
        # per assistant: "none" (needs no hidden states), "all" (needs exactly the union) or the union's columns
        self._hidden_views: list[str | torch.Tensor] = []

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
        from . import resolve_assistant

        self.proposers = [resolve_assistant(a, target) for a in self.assistants]
        for p in self.proposers:
            p.validate(target)
        self.hidden_state_layers = self._layers()
        union = self.hidden_state_layers or ()
        h = int(target.config.get_text_config().hidden_size) if union else 0
        self._hidden_views = []
        for p in self.proposers:
            if not p.hidden_state_layers:
                self._hidden_views.append("none")
            elif tuple(p.hidden_state_layers) == union:
                self._hidden_views.append("all")
            else:
                blocks = [union.index(layer) for layer in p.hidden_state_layers]
                self._hidden_views.append(torch.cat([torch.arange(b * h, (b + 1) * h) for b in blocks]))

    def start(self, setup: ProposerSetup) -> None:
        super().start(setup)
        for p in self.proposers:
            p.start(setup)

    def finish(self) -> None:
        error: BaseException | None = None
        for p in self.proposers:
            try:
                p.finish()
            except BaseException as exc:  # noqa: BLE001 - every assistant must be finished; the first error wins
                error = error or exc
        if error is not None:
            raise error

    # ------------------------------------------------------------------ drafting
    def propose(self, rows: Sequence[RowState]) -> list[DraftTree]:
        trees: list[DraftTree | None] = [None] * len(rows)
        waiting = list(range(len(rows)))
        for p in self.proposers:
            if not waiting:
                break
            for i, tree in zip(waiting, p.propose([rows[i] for i in waiting])):
                if tree.num_nodes:
                    trees[i] = tree
            waiting = [i for i in waiting if trees[i] is None]
        for i in waiting:
            trees[i] = DraftTree.empty(rows[i].tokens.device)
        return trees

    def observe(
        self,
        rows: Sequence[RowState],
        new_tokens: Sequence[torch.Tensor],
        hidden_states: Sequence[torch.Tensor] | None,
    ) -> None:
        for p, view in zip(self.proposers, self._hidden_views):
            p.observe(rows, new_tokens, self._view(hidden_states, view))

    @staticmethod
    def _view(hidden_states, view: str | torch.Tensor):
        """One assistant's hidden states out of the union's `[m, H * len(union)]` per row."""
        if isinstance(view, str):
            return hidden_states if view == "all" else None
        if hidden_states is None:
            return None
        return [None if x is None else x[:, view.to(x.device)] for x in hidden_states]
