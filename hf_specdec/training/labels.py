"""Labels read from stored data (`shards.DistillationData`), shared by the head trainers: which positions a head is
trained on, its draft vocabulary, the target's token k + 2 places ahead (Medusa heads, the MLP speculator's stages),
the windows EAGLE and DFlash heads read, and the target's next choice as an index into a draft vocabulary.

What the data say about the target's next token at each position is `DistillationData.next_tokens` and
`DistillationData.on_target_path`; everything here is built from those, the answer mask and the sequence bounds.
"""

from __future__ import annotations

import torch

from .shards import DistillationData

IGNORE = -100


# ---------------------------------------------------------------------------------------------------- positions
def head_positions(data: DistillationData, seq_ids: torch.Tensor) -> torch.Tensor:
    """`[P]` int64: every position t of the given sequences whose first guess (token t + 2) is an answer token
    (``data.answer_mask``: every assistant turn of a conversation)."""
    bounds = data.seq_bounds[seq_ids]  # [S, 3] start, answer start, end
    lo = torch.maximum(bounds[:, 0], bounds[:, 1] - 2)
    counts = (bounds[:, 2] - 2 - lo).clamp(min=0)
    offsets = counts.cumsum(0) - counts
    total = int(counts.sum())
    pos = lo.repeat_interleave(counts) + torch.arange(total) - offsets.repeat_interleave(counts)
    return pos[data.answer_mask[pos + 2]]


def spread_sample(per_sequence: list[torch.Tensor], budget: int | None) -> list[torch.Tensor]:
    """At most ``budget`` of the positions in ``per_sequence`` (`[P_i]` each), shared out over every sequence (each
    gets an equal share, the ones with fewer positions give theirs to the others) and evenly spaced inside each; all
    of them when ``budget`` is None or not smaller. A held-out score over the first sequences only would rest on a few
    conversations."""
    counts = [int(p.numel()) for p in per_sequence]
    if budget is None or sum(counts) <= budget:
        return list(per_sequence)
    shares, left = [0] * len(counts), int(budget)
    order = sorted(range(len(counts)), key=counts.__getitem__)
    for done, i in enumerate(order):
        shares[i] = min(counts[i], left // (len(order) - done))
        left -= shares[i]
    return [p[torch.linspace(0, p.numel() - 1, k).round().long()] if k else p[:0] for p, k in zip(per_sequence, shares)]


def draft_vocabulary(data: DistillationData, positions: torch.Tensor, size: int) -> tuple[torch.Tensor, float]:
    """`[size]` a head's draft vocabulary: the first-guess labels (the target's token after t + 1) of ``positions``
    by decreasing count, then (a small data set holds fewer distinct tokens than ``size``) the lowest unseen ids
    (byte-pair merges rank frequent tokens first), sorted; and the share of the labels it covers. Every trainer
    (Medusa, EAGLE, the MLP speculator) draws its vocabulary this way."""
    vocab = int(data.manifest["vocab_size"])
    labels = data.next_tokens()[positions + 1]
    return _most_counted(torch.bincount(labels[labels >= 0], minlength=vocab).double(), size)


def _most_counted(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, float]:
    """`[size]` the ids of the highest `[V]` fp64 ``counts`` (ties and uncounted ids: the lower id first), sorted,
    and the share of the counts they hold."""
    vocab = counts.numel()
    key = counts * vocab - torch.arange(vocab, dtype=torch.float64)  # count first, then the lower id
    top = key.topk(min(size, vocab)).indices.sort().values
    return top, float(counts[top].sum() / counts.sum().clamp(min=1))


def frequent_token_ids(tokenizer, texts, size: int) -> tuple[torch.Tensor, float]:
    """`[size]` the ids ``tokenizer`` writes most often in ``texts`` (ties: the lower id; a text holding fewer distinct
    tokens fills up with the lowest unseen ids), sorted, and the share of those texts' tokens they cover: a draft
    vocabulary for a draft model (`DraftModelAssistant(draft_vocab=...)`)."""
    vocab = len(tokenizer)
    counts = torch.zeros(vocab, dtype=torch.float64)
    for text in texts:
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        counts += torch.bincount(ids, minlength=vocab)[:vocab].double()
    return _most_counted(counts, size)


def label_coverage(data: DistillationData, positions: torch.Tensor, vocab: torch.Tensor) -> float:
    """The share of the first-guess labels of ``positions`` `[P]` (as `draft_vocabulary` counts them) that the draft
    vocabulary ``vocab`` `[V']` holds: what a fine-tuned head's kept vocabulary covers of new data."""
    return float(torch.isin(data.next_tokens()[positions + 1], vocab).float().mean())


def on_path_runs(data: DistillationData, starts: torch.Tensor, count: int) -> torch.Tensor:
    """`[*S, count]` bool: whether the tokens after ``starts`` `[*S]` are on the target's path for ``j + 1`` tokens
    in a row (`DistillationData.on_target_path` at ``start .. start + j``), for j = 0 .. count - 1: the tokens a
    guess ``j + 2`` places past a start must see right for its label to be the loop's."""
    after = data.on_target_path()[(starts.unsqueeze(-1) + torch.arange(count)).clamp(max=data.input_ids.numel() - 1)]
    return torch.cumprod(after.long(), dim=-1).bool()


def medusa_labels(data: DistillationData, positions: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`[n, P]` int64: the target's token t + k + 2 for head k at position t (its choice after t + k + 1, given the
    data's tokens up to there: in greedy self-distilled answers, the answer's own token t + k + 2), ``IGNORE`` where
    it is past the sequence's end, outside an answer, unknown, or off the target's path: in teacher-forced text, a
    token between t and the label that the target would not have written (`DistillationData.on_target_path`)."""
    k = torch.arange(num_heads).unsqueeze(1)  # [n, 1]
    target = positions.unsqueeze(0) + k + 2  # [n, P]
    inside = target < data.seq_end[positions]
    target = target.clamp(max=data.input_ids.numel() - 1)
    ids = data.next_tokens()[target - 1]
    on_path = on_path_runs(data, positions, num_heads).T  # [n, P] head k: tokens t + 1 .. t + k + 1 on the path
    valid = inside & data.answer_mask[target] & (ids >= 0) & on_path
    return torch.where(valid, ids, torch.full_like(ids, IGNORE))


# ---------------------------------------------------------------------------------------------------- windows
def window_starts(data: DistillationData, seq_ids: torch.Tensor, window: int) -> torch.Tensor:
    """`[Wn, 2]` flat ``(start, end)`` pair ranges of the windows of at most ``window`` pairs that tile the given
    sequences (pairs ``t = start .. end - 1``: feature t beside token t + 1, next feature t + 1).

    The tiling is aligned to each sequence's *end*: the window holding the answer reaches as far back into the prompt
    as it can, as the head's cache does at run time (it covers the whole prompt); start-aligned windows left the
    first answer tokens of a long prompt with a few prompt pairs to attend to. Only a sequence's first window is
    shorter than ``window``.
    """
    ranges = []
    for s, _, e in data.seq_bounds[seq_ids].tolist():
        ranges += [(max(s, end - window), end) for end in range(e - 1, s, -window)]
    return torch.tensor(ranges, dtype=torch.long).reshape(-1, 2)


def window_positions(data: DistillationData, windows: torch.Tensor, window: int) -> tuple[torch.Tensor, ...]:
    """``(t, valid)``: `[B, W]` flat pair positions of the windows ``(start, end)`` `[B, 2]` (clamped) and which are
    real pairs."""
    start, end = windows[:, 0], windows[:, 1]
    t = start[:, None] + torch.arange(window)[None, :]  # [B, W]
    valid = t < end[:, None]
    return torch.where(valid, t, start[:, None]), valid


def token_targets(data: DistillationData, lm_weight: torch.Tensor, vocab: torch.Tensor, chunk: int = 4096):
    """`[N]` the target's choice at t + 1 per position t, as an index into ``vocab`` (-100 = outside it / none).

    Where the data know it (`DistillationData.next_tokens`: greedy answers, teacher-forced text) that token;
    elsewhere (prompts of self-distilled data) the arg-max of the target's lm_head rows ``vocab`` over ``f_{t+1}``.
    """
    n = data.input_ids.numel()
    index = torch.full((int(lm_weight.shape[0]),), -100, dtype=torch.long)
    index[vocab] = torch.arange(vocab.numel())
    labels = torch.full((n,), -100, dtype=torch.long)
    pos = torch.arange(n - 1)
    nxt = data.next_tokens()[1:]  # [N - 1] the target's token after t + 1
    inside = pos + 2 < data.seq_end[:-1]
    known = inside & (nxt >= 0)
    labels[:-1][known] = index[nxt[known]]
    prompt = ((~known) & (pos + 1 < data.seq_end[:-1])).nonzero().flatten()
    rows = lm_weight[vocab].float()  # [V', H]
    for i in range(0, prompt.numel(), chunk):
        p = prompt[i : i + chunk]
        labels[p] = (data.hidden[p + 1].to(rows.device).float() @ rows.T).argmax(-1).cpu()
    return labels


__all__ = [
    "IGNORE",
    "draft_vocabulary",
    "frequent_token_ids",
    "head_positions",
    "medusa_labels",
    "on_path_runs",
    "token_targets",
    "window_positions",
    "window_starts",
]
