"""What a training step reads, from stored data or from `OnlineTeacherForcing` alike: the one place the trainers
that take either (EAGLE, DFlash) tell them apart.

    data, online = split_source(data)                      # the ids and masks; the online source or None
    batch_of = step_data(data, online, lm_weight, vocab, lookahead)
    part, labels, windows = batch_of(windows)              # a step's data, its labels, its windows re-indexed
    held_out, held_ids = with_states(data, online, eval_seqs)
    report.update(online_report(online))

Stored data are read as they are and labelled once; online, each step's prefixes are computed by the target and
labelled as stored data would be (`online_states`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .labels import token_targets
from .online_states import OnlineTeacherForcing
from .shards import DistillationData

StepData = Callable[[torch.Tensor], tuple[DistillationData, torch.Tensor, torch.Tensor]]


def split_source(data: DistillationData | OnlineTeacherForcing) -> tuple[DistillationData, OnlineTeacherForcing | None]:
    """``(tokens, online)``: stored data as they are and None, or the online data's ids and masks (states computed per
    step: `DistillationData` with ``hidden`` `[N, 0]`) and the online data."""
    if isinstance(data, OnlineTeacherForcing):
        return data.tokens, data
    return data, None


def step_data(
    data: DistillationData,
    online: OnlineTeacherForcing | None,
    lm_weight: torch.Tensor,
    vocab: torch.Tensor,
    lookahead: int,
) -> StepData:
    """``windows -> (data, labels, windows)``: what a training step's loss reads for its ``(start, end)`` windows
    `[B, 2]`. Stored data: the data, their `token_targets` over the draft vocabulary ``vocab`` `[V']` (computed
    once) and the windows as they are; ``online``: the prefixes the windows read with the target's states
    (`OnlineTeacherForcing.window_data`, ``lookahead`` tokens past each window), their labels and the windows
    re-indexed into them."""
    if online is None:
        labels = token_targets(data, lm_weight, vocab)  # [N]
        return lambda windows: (data, labels, windows)

    def computed(windows: torch.Tensor) -> tuple[DistillationData, torch.Tensor, torch.Tensor]:
        part, moved = online.window_data(windows, lookahead)
        return part, token_targets(part, lm_weight, vocab), moved

    return computed


def with_states(
    data: DistillationData, online: OnlineTeacherForcing | None, seq_ids: torch.Tensor
) -> tuple[DistillationData, torch.Tensor]:
    """``(data, ids [S'])``: the sequences ``seq_ids`` `[S']` with the target's states: stored data and the ids as
    they are, or online those sequences computed now, as data of their own (the held-out set, once; a sample)."""
    if online is None or not seq_ids.numel():
        return data, seq_ids
    return online.sequences_data(seq_ids), torch.arange(seq_ids.numel())


def online_report(online: OnlineTeacherForcing | None) -> dict:
    """The training report's fields of an online run (none for stored data)."""
    return {} if online is None else {"online": True, "target_forward_tokens": online.computed_tokens}


__all__ = ["StepData", "online_report", "split_source", "step_data", "with_states"]
