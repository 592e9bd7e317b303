"""The recurrent state of the recurrent layers served on trees (Qwen3-Next's and Qwen3.5's gated delta nets, Mamba-1
and Mamba-2 mixers, MiniMax's lightning attention) per cache row: the state after the row's committed tokens, and the
states of the tokens forwards wrote since.

A tree node's state follows from its parent's, so a verify forward stages one state per tree token; committing the
accepted path keeps the state of its last token. A prompt's chunk stages only the state after its last token (the
chunk is committed whole). As with `ConvStates`, a forward that declares ``P`` pending tokens keeps the first ``P``
staged tokens (a draft model's earlier levels) and forgets the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class RecurrentStates:
    """Per layer `[rows, *state]` committed states (zeros before a row's first token); per row the staged tokens'
    states, in write order, as pieces ``(count, states)`` where ``states`` is `[count, *state]` (a tree) or `[1, *state]`
    (a chunk: the state after its last token only)."""

    def __init__(self):
        self._state: dict[int, torch.Tensor] = {}
        self._staged: dict[int, dict[int, list[tuple[int, torch.Tensor]]]] = {}

    def __bool__(self) -> bool:
        return bool(self._state)

    def committed(self, layer: int, rows: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        """`[B, *state]` committed states of ``rows`` (created as zeros shaped like ``like`` `[*state]`)."""
        state = self._state.get(layer)
        need = int(rows.max()) + 1 if rows.size else 0
        if state is None or state.shape[0] < need:
            grown = torch.zeros(max(need, 1), *like.shape, dtype=like.dtype, device=like.device)
            if state is not None:
                grown[: state.shape[0]] = state
            self._state[layer] = state = grown
        return state[torch.as_tensor(rows, device=state.device)]

    def _token_state(self, pieces: list[tuple[int, torch.Tensor]], index: int) -> torch.Tensor:
        start = 0
        for count, states in pieces:
            if index < start + count:
                if states.shape[0] == count:
                    return states[index - start]
                if index == start + count - 1:
                    return states[0]
                raise NotImplementedError("a prompt chunk of a recurrent layer is committed whole, not in part")
            start += count
        raise IndexError(f"staged token {index} of {start}")

    def pending(self, layer: int, row: int, count: int) -> torch.Tensor | None:
        """`[count, *state]` the states of the first ``count`` staged tokens of ``row`` (the rest forgotten), None for
        none."""
        staged = self._staged.get(layer, {})
        pieces = staged.pop(row, [])
        if not count:
            return None
        states = torch.stack([self._token_state(pieces, i) for i in range(count)])
        staged[row] = [(count, states)]
        return states

    def stage(self, layer: int, row: int, count: int, states: torch.Tensor) -> None:
        """Stage ``count`` new tokens of ``row``: their `[count, *state]` states, or `[1, *state]` after the last."""
        self._staged.setdefault(layer, {}).setdefault(row, []).append((count, states))

    def commit(self, rows: np.ndarray, keep: Sequence[torch.Tensor | slice]) -> None:
        """Each row's state becomes that of the last staged token ``keep[b]`` selects; the rest is forgotten."""
        for layer, staged in self._staged.items():
            state = self._state[layer]
            for b, row in enumerate(rows.tolist()):
                pieces = staged.pop(row, None)
                if not pieces:
                    continue
                total = sum(c for c, _ in pieces)
                k = keep[b].cpu() if isinstance(keep[b], torch.Tensor) else keep[b]
                kept = torch.arange(total)[k]
                if kept.numel():
                    state[row] = self._token_state(pieces, int(kept[-1])).to(state.dtype)

    def free(self, row: int) -> None:
        for layer, state in self._state.items():
            if row < state.shape[0]:
                state[row].zero_()
            self._staged.get(layer, {}).pop(row, None)
