"""The base of the assistants that draft from the target's final normed hidden state (Medusa heads, the MLP
speculator).

The loop hands such an assistant the final normed hidden states (``hidden_state_layers = (-1,)``) of every token
entering the KV cache; `FinalStateAssistant` keeps the last one per row, the state the target's lm_head turned into
the row's current root, from which the heads or stages guess the tokens after the root.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Proposer, ProposerSetup, RowFeedback, RowState


class FinalStateAssistant(Proposer):
    """An assistant drafting from each row's last final hidden state (`_last_hidden`: row -> `[H]`)."""

    hidden_state_layers = (-1,)

    def start(self, setup: ProposerSetup) -> None:
        super().start(setup)
        self._last_hidden: dict[int, torch.Tensor] = {}

    def observe(self, rows: Sequence[RowState], feedback: Sequence[RowFeedback]) -> None:
        for row, fb in zip(rows, feedback):
            if fb.hidden_states is None or -1 not in fb.hidden_states:
                raise RuntimeError(
                    f"{type(self).__name__} needs the target's final hidden states (hidden_state_layers=(-1,))"
                )
            hidden = fb.hidden_states[-1]  # [m, H]
            if hidden.shape[0]:
                # [H] the state the target's lm_head turned into the new root; clone frees the step's [N, H] buffer
                self._last_hidden[row.row] = hidden[-1].detach().clone()

    def finish(self) -> None:
        self._last_hidden = {}
