"""The state of short-convolution layers (LFM2's ``ShortConv``) per cache row: the last ``K - 1`` inputs of the row's
committed tokens, and the inputs that forwards wrote since and nobody committed yet.

A convolution over a token tree reads, for each node, the inputs of its ``K - 1`` nearest ancestors: inside the tree
they are the *staged* inputs of this forward (and of the uncommitted, pending tokens of earlier forwards), before it
the committed state. Committing a prefill chunk appends its inputs; committing a verified tree appends the accepted
path's; everything else staged is forgotten, as the rejected nodes' K/V are.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class ConvStates:
    """Per layer, `[rows, K - 1, C]` committed inputs (zeros before a row's first token) and per row the staged
    `[m, C]` inputs of uncommitted tokens, in the order the row's forwards wrote them (a forward that declares ``P``
    pending tokens keeps the first ``P`` and forgets the rest: `pending`)."""

    def __init__(self):
        self._state: dict[int, torch.Tensor] = {}  # layer -> [rows, K - 1, C]
        self._staged: dict[int, dict[int, list[torch.Tensor]]] = {}  # layer -> row -> [m_i, C] pieces

    def __bool__(self) -> bool:
        return bool(self._state)

    def committed(self, layer: int, rows: np.ndarray, width: int, like: torch.Tensor) -> torch.Tensor:
        """`[B, width, C]` committed inputs of ``rows`` (``width`` = K - 1; created as zeros like ``like`` `[*, C]`)."""
        state = self._state.get(layer)
        need = int(rows.max()) + 1 if rows.size else 0
        if state is None or state.shape[0] < need:
            grown = torch.zeros(max(need, 1), width, like.shape[-1], dtype=like.dtype, device=like.device)
            if state is not None:
                grown[: state.shape[0]] = state
            self._state[layer] = state = grown
        return state[torch.as_tensor(rows, device=state.device)]

    def pending(self, layer: int, row: int, count: int) -> torch.Tensor | None:
        """`[count, C]` the first ``count`` staged inputs of ``row`` (the tokens a forward declares pending), the rest
        forgotten as the K/V of a tree the next forward overwrites are (None when ``count`` is 0)."""
        staged = self._staged.get(layer, {})
        pieces = staged.pop(row, None)
        if not count:
            return None
        kept = torch.cat(pieces)[:count] if pieces else None
        if kept is None or kept.shape[0] != count:
            raise RuntimeError(
                f"row {row}: {count} pending tokens declared, {0 if kept is None else kept.shape[0]} staged"
            )
        staged[row] = [kept]
        return kept

    def stage(self, layer: int, rows: np.ndarray, inputs: torch.Tensor, cu_seqlens: np.ndarray) -> None:
        """Append each row's new inputs (``inputs`` `[N, C]`, row b's at ``cu_seqlens[b]:cu_seqlens[b + 1]``)."""
        staged = self._staged.setdefault(layer, {})
        for b, row in enumerate(rows.tolist()):
            staged.setdefault(row, []).append(inputs[int(cu_seqlens[b]) : int(cu_seqlens[b + 1])])

    def commit(self, rows: np.ndarray, keep: Sequence[torch.Tensor | slice]) -> None:
        """Append to each row's state the staged inputs ``keep[b]`` selects (a chunk's first tokens, or a tree's
        accepted path), and forget the rest of what was staged."""
        for layer, staged in self._staged.items():
            state = self._state[layer]
            width = state.shape[1]
            for b, row in enumerate(rows.tolist()):
                pieces = staged.pop(row, None)
                if not pieces:
                    continue
                kept = torch.cat(pieces)[keep[b]]
                state[row] = torch.cat([state[row], kept.to(state.dtype)])[-width:] if width else state[row]

    def free(self, row: int) -> None:
        """Forget ``row``: zero its state, drop what it staged."""
        for layer, state in self._state.items():
            if row < state.shape[0]:
                state[row].zero_()
            self._staged.get(layer, {}).pop(row, None)
