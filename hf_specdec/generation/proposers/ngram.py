"""Prompt lookup as a tree: draft what followed earlier occurrences of the context's suffix in prompt + output.

`NgramAssistant` needs no model. Each step, for every row, it looks up the last ``n`` tokens (the suffix that ends
with the root) in an index of everything the row has seen, takes up to ``max_matches`` earlier occurrences (longest
match first, then most recent), and merges what followed them into one trie. Every node gets a score, an estimate of
the probability that the target accepts it:

    score(child) = score(parent) * A[bucket(child)] * weight(child) / weight(children of parent)

``weight`` sums ``match_len ** 2`` over the occurrences whose continuation passes through the node (more and longer
matches = more likely), and ``A[b]`` is the row's running estimate of the probability that a tree level whose best
node has effective match length ``b`` (the matched n-gram plus the drafted tokens above the node) is accepted. The
tree keeps the ``max_nodes`` best nodes with a score of at least ``min_score`` (the expected accepted length of a tree
is the sum of its scores, Sequoia); parents always outscore their children, so that set is a tree, and siblings come
best first. ``A`` starts from a prior and follows what the target accepts, per row: after rejections the trees get
shallow and narrow, after acceptances deep, up to ``max_depth``.

Compared with the references (docs/algorithms.md, "n-gram trees"): transformers' prompt lookup drafts one chain from the
leftmost match of the last <= 2 tokens, vLLM one chain from the longest match; SuffixDecoding merges several matches
into a frequency-scored tree. This does the latter over prompt + output, ranks matches by their full matched length
(extended past ``max_ngram``, up to 16 tokens back), continues a match that runs into the present periodically (the
text after the match *is* the text being generated), and sizes the tree by acceptance it observed.

The lookup is incremental: per row and n-gram length, a linked list of occurrences (each position points to the
previous end of the same n-gram) extended by the new tokens in `observe`, so a step walks a few links instead of
scanning the sequence.

The matcher (index, matches, scored continuation trie) is `PromptLookup`, one per row; `prompt_lookup_predictions`
runs the same matcher over a whole sequence and returns, per position, the token the assistant would draft first:

    >>> prompt_lookup_predictions([5, 6, 7, 1, 5, 6])
    [None, None, None, None, 6, 7]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..inputs import check_int, check_number
from ..tree import DraftSampling, DraftTree, subset_parents
from .base import Proposer, ProposerSetup, RowFeedback, RowState

# Acceptance statistics are kept per effective match length 1 .. _BUCKETS (the last bucket: that many or more).
_BUCKETS = 8
# Prior acceptance probability of a tree level per bucket, before a row has shown anything: the per-level acceptance
# measured (rounded down a little) with greedy SmolLM2-135M-Instruct on Spec-Bench prompts, all categories pooled.
# Short matches of chatty text often miss; long ones (copying from the prompt, a repetition loop) rarely do.
_PRIOR = (0.4, 0.55, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9)
# A match of length l counts l ** _MATCH_WEIGHT_POWER towards the continuation it proposes.
_MATCH_WEIGHT_POWER = 2
# The candidates proposed (the loop's tree budget keeps those that pay on the machine at hand).
_BUDGET_MIN_SCORE = 0.02
_BUDGET_MAX_NODES = 48
# How far back a candidate match is compared to rank it (beyond max_ngram, which only bounds the index).
_MAX_EXTEND = 16


class PromptLookup:
    """The prompt-lookup matcher of one sequence: an incremental n-gram index, the earlier occurrences of the
    sequence's suffix, and the scored trie of what followed them (what `NgramAssistant` drafts from, one per row).

    The index is a linked list of occurrences per n-gram length: ``previous[n - 1][p]`` is the last position before
    ``p`` where the n-gram ending at ``p`` also ends (-1: none), so the occurrences of the context's suffix, most
    recent first, are ``previous[n - 1][last]``, ``previous[n - 1][that]``, ... without computing any key.

    Args:
        max_ngram / min_ngram / max_matches: as in `NgramAssistant`.
    """

    __slots__ = ("max_ngram", "min_ngram", "max_matches", "seq", "previous", "_last_end")

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_matches: int = 8) -> None:
        self.max_ngram, self.min_ngram, self.max_matches = max_ngram, min_ngram, max_matches
        self.seq: list[int] = []
        self.previous: list[list[int]] = [[] for _ in range(max_ngram)]
        # per n: n-gram (packed in one int, 32 bits per token) -> last position where it ends
        self._last_end: list[dict[int, int]] = [{} for _ in range(max_ngram)]

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the sequence and index them."""
        seq, previous, last_end = self.seq, self.previous, self._last_end
        for tok in tokens:
            seq.append(tok)
            end = len(seq) - 1
            key = 0
            for n, (prev, ends) in enumerate(zip(previous, last_end)):
                if n > end:
                    prev.append(-1)
                    continue
                key = (key << 32) | seq[end - n]
                prev.append(ends.get(key, -1))
                ends[key] = end

    def matches(self) -> list[tuple[int, int]]:
        """Earlier occurrences of the sequence's suffix: ``(match_len, end position)``, best first.

        Longest suffix first; among equally long matches the most recent first. The last position (the suffix
        itself) is never a match. ``match_len`` is compared up to 16 tokens back, past ``max_ngram``.
        """
        seq = self.seq
        last = len(seq) - 1
        seen: set[int] = set()
        found: list[tuple[int, int]] = []
        scan = 2 * self.max_matches
        for n in range(min(self.max_ngram, last), self.min_ngram - 1, -1):
            previous = self.previous[n - 1]
            pos = previous[last]
            taken = 0
            while pos >= 0 and taken < scan:
                if pos not in seen:
                    seen.add(pos)
                    length = n  # extend the match backwards past n to rank it
                    while length < _MAX_EXTEND and pos - length >= 0 and seq[pos - length] == seq[last - length]:
                        length += 1
                    found.append((length, pos))
                    taken += 1
                pos = previous[pos]
            if len(found) >= self.max_matches:
                break
        found.sort(reverse=True)
        return found[: self.max_matches]

    def candidates(self, accept: Sequence[float], depth_cap: int) -> LookupCandidates:
        """The trie of the continuations of `matches`, up to ``depth_cap`` tokens deep, every node scored.

        Args:
            accept: ``accept[b]``: the estimated probability that a tree level whose best node has effective match
                length ``b + 1`` is accepted (``_BUCKETS`` entries; see the module docstring).
            depth_cap: most tokens drafted after one match.
        """
        seq = self.seq
        end = len(seq)
        out = LookupCandidates([], [], [], [])
        tokens, parent, bucket = out.tokens, out.parent, out.bucket
        node_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node; nodes in creation order (parents first)
        weight: list[float] = []
        child_weight: dict[int, float] = {}  # parent (-1 = root) -> summed weight of its children
        for length, pos in self.matches():
            w = float(length) ** _MATCH_WEIGHT_POWER
            period = end - 1 - pos
            cont = seq[pos + 1 : pos + 1 + depth_cap]
            while len(cont) < depth_cap:  # the match runs into the present: the text repeats with this period
                cont.append(cont[len(cont) - period])
            node = -1
            for d, tok in enumerate(cont):
                child_weight[node] = child_weight.get(node, 0.0) + w
                key = (node, tok)
                child = node_of.get(key)
                if child is None:
                    child = node_of[key] = len(tokens)
                    tokens.append(tok)
                    parent.append(node)
                    weight.append(0.0)
                    # matches come longest first, so the creator's length is the node's longest
                    bucket.append(min(length + d, _BUCKETS) - 1)
                weight[child] += w
                node = child
        score = out.score
        for i, p in enumerate(parent):
            base = 1.0 if p < 0 else score[p]
            score.append(base * accept[bucket[i]] * weight[i] / child_weight[p])
        return out


@dataclass
class LookupCandidates:
    """`PromptLookup.candidates`: one entry per trie node, parents before children.

    Attributes:
        tokens: the node's token.
        parent: its parent node (-1 = the root).
        score: its estimated probability of being accepted (a path probability: below its parent's).
        bucket: the acceptance bucket of its tree level (effective match length - 1, capped).
    """

    tokens: list[int]
    parent: list[int]
    score: list[float]
    bucket: list[int]

    def best(self, min_score: float, max_nodes: int) -> list[int]:
        """The ``max_nodes`` best nodes scoring at least ``min_score``, best first (a tree: parents outscore their
        children, so every kept node's parent is kept and comes earlier; siblings come best first)."""
        score = self.score
        keep = sorted((i for i in range(len(score)) if score[i] >= min_score), key=lambda i: (-score[i], i))
        return keep[:max_nodes]


def prompt_lookup_predictions(
    tokens: Sequence[int] | torch.Tensor,
    *,
    max_ngram: int = 4,
    min_ngram: int = 1,
    max_matches: int = 8,
    min_score: float = _BUDGET_MIN_SCORE,
) -> list[int | None]:
    """For each position ``t``, the token a fresh `NgramAssistant` drafts first after seeing ``tokens[: t + 1]``
    (None where it drafts nothing): the same matcher (`PromptLookup`) with the prior acceptance estimates.

    Args:
        tokens: `[n]` token ids.
        max_ngram / min_ngram / max_matches: as in `NgramAssistant`.
        min_score: smallest score of a drafted node: 0.02 (the default) is the assistant's threshold when the loop's
            tree budget sizes the trees (the default in ``generate``), 0.1 its threshold without a budget.
    Returns:
        `[n]` the first drafted token after each prefix, or None.
    """
    _check_lookup_args("prompt_lookup_predictions", max_ngram, min_ngram, max_matches)
    check_number("prompt_lookup_predictions", "min_score", min_score, 0.0, 1.0)
    seq = tokens.tolist() if isinstance(tokens, torch.Tensor) else [int(t) for t in tokens]
    lookup = PromptLookup(max_ngram, min_ngram, max_matches)
    out: list[int | None] = []
    for tok in seq:
        lookup.extend((tok,))
        cands = lookup.candidates(_PRIOR, depth_cap=1)
        keep = cands.best(min_score, 1)
        out.append(cands.tokens[keep[0]] if keep else None)
    return out


def unseen_tokens(seq: Sequence[int], tokens: torch.Tensor) -> list[int] | None:
    """The tokens of a row's `[n]` ``tokens`` after the ``len(seq)`` an assistant has seen (``[]``: none), or None
    when ``tokens`` does not continue ``seq`` (an empty ``seq``, or another sequence under the row's index)."""
    n, known = tokens.numel(), len(seq)
    if known and n == known:
        return []
    if 0 < known < n:
        new = tokens[known - 1 :].tolist()  # one transfer: the last known token (a check) + the new ones
        if new[0] == seq[-1]:
            return new[1:]
    return None


def check_tree_args(owner: str, max_depth: int, max_nodes: int | None, min_score: float | None, decay, adaptive):
    """Refuse, by name, bad tree bounds and acceptance-learning options of a lookup assistant's constructor."""
    check_int(owner, "max_depth", max_depth, minimum=1)
    if max_nodes is not None:
        check_int(owner, "max_nodes", max_nodes, minimum=1)
    if min_score is not None:
        check_number(owner, "min_score", min_score, 0.0, 1.0)
    check_number(owner, "decay", decay, 0.0, 1.0)
    if not isinstance(adaptive, bool):
        raise TypeError(f"{owner} adaptive must be True or False, got {adaptive!r}")


def _check_lookup_args(owner: str, max_ngram: int, min_ngram: int, max_matches: int) -> None:
    for name, value in dict(max_ngram=max_ngram, min_ngram=min_ngram, max_matches=max_matches).items():
        check_int(owner, name, value, minimum=1)
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"{owner} needs 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")


class LevelAcceptance:
    """One row's running estimate of ``A[b]``: the probability that a drafted tree level whose best node has effective
    match length ``b + 1`` is accepted (the last bucket: that long or longer), learnt from the target's verdicts.

    `offer` records which bucket each level of a proposed tree tried; `observe` counts, down the accepted path, every
    verified level as a trial of its bucket and a hit when one of its nodes was accepted, after fading the old counts
    by ``decay``; `estimates` is hits over trials with two pseudo-trials of ``prior``.

    Args:
        prior: ``A[b]`` before any verdict, one entry per bucket.
        decay: per-step forgetting factor of the counts (memory of about ``1 / (1 - decay)`` steps).
    """

    __slots__ = ("prior", "decay", "hits", "trials", "level_bucket")

    def __init__(self, prior: Sequence[float] = _PRIOR, decay: float = 0.9) -> None:
        self.prior, self.decay = tuple(prior), decay
        self.hits = [0.0] * len(self.prior)
        self.trials = [0.0] * len(self.prior)
        # the last proposed tree: parent node (-1 = root) -> bucket of its best child (the level's trial)
        self.level_bucket: dict[int, int] = {}

    def estimates(self) -> list[float]:
        """``A[b]`` per bucket."""
        return [(h + 2.0 * p) / (t + 2.0) for h, t, p in zip(self.hits, self.trials, self.prior)]

    def offer(self, parents: Sequence[int], buckets: Sequence[int]) -> None:
        """The proposed tree: each node's parent (-1 = root) and bucket, siblings best first (so a level's first node
        is its best). Replaces the previous tree's levels."""
        self.level_bucket = {}
        for p, b in zip(parents, buckets):
            self.level_bucket.setdefault(p, b)

    def observe(self, fb: RowFeedback, learn: bool = True) -> None:
        """The verdict on the last offered tree (``learn=False``: only forget that tree)."""
        level_bucket = self.level_bucket if fb.tree is not None and fb.tree.num_nodes else {}
        self.level_bucket = {}
        if not learn:
            return
        hits, trials = self.hits, self.trials
        for k in range(len(hits)):
            hits[k] *= self.decay
            trials[k] *= self.decay
        if fb.verified is not None and level_bucket:  # a level the loop cut away was neither hit nor missed
            offered = set(fb.tree.parent[fb.verified.to(fb.tree.device)].tolist())
            level_bucket = {p: b for p, b in level_bucket.items() if p in offered}
        # Down the accepted path: every level that offered children is a trial for the bucket of its best child,
        # and a hit if one of them was accepted.
        path = fb.accepted.tolist()
        node = -1
        for depth in range(len(path) + 1):
            bucket = level_bucket.get(node)
            if bucket is None:
                break
            trials[bucket] += 1.0
            if depth == len(path):
                break
            hits[bucket] += 1.0
            node = path[depth]


class _RowLookup(PromptLookup):
    """One row's matcher and its acceptance statistics."""

    __slots__ = ("acceptance",)

    def __init__(self, max_ngram: int, min_ngram: int, max_matches: int, decay: float) -> None:
        super().__init__(max_ngram, min_ngram, max_matches)
        self.acceptance = LevelAcceptance(_PRIOR, decay)


class NgramAssistant(Proposer):
    """Prompt-lookup speculation with token trees built from several matches, sized by observed acceptance.

    Pass it as ``model.generate(ids, assistant=NgramAssistant())``. It drafts only where the context repeats
    (copying from the prompt, code, summaries, repetition loops) and drafts nothing, at no cost, elsewhere.

    Args:
        max_ngram: longest suffix looked up (n-grams up to this length are indexed). Matches are ranked by their full
            length, compared up to 16 tokens back, so this bounds the index, not the ranking.
        min_ngram: shortest suffix looked up. 1 also drafts after a single repeated token (the tree is then small,
            because short matches start with a low acceptance estimate).
        max_depth: most tokens drafted after one match (the tree's depth); the loop's remaining budget caps it too.
        max_matches: most earlier occurrences merged into one tree.
        max_nodes: most nodes in a tree (None: 48 candidates; the loop's tree budget keeps those that pay).
        min_score: smallest estimated acceptance probability of a node worth proposing (None: 0.02: every such node
            is a candidate with its score as ``DraftTree.scores``, and the loop's tree budget keeps those that pay on
            the machine at hand).
        adaptive: follow the acceptance observed per row (True) or keep the prior estimates (False).
        decay: per-step forgetting factor of the acceptance statistics (the memory is about ``1 / (1 - decay)``
            steps), so a row that stopped drafting after rejections tries again later.
    """

    sampling = DraftSampling.DETERMINISTIC
    hidden_state_layers = None
    proposes_for_free = True

    def __init__(
        self,
        max_ngram: int = 4,
        min_ngram: int = 1,
        max_depth: int = 10,
        max_matches: int = 8,
        max_nodes: int | None = None,
        min_score: float | None = None,
        adaptive: bool = True,
        decay: float = 0.9,
    ) -> None:
        _check_lookup_args("NgramAssistant", max_ngram, min_ngram, max_matches)
        check_tree_args("NgramAssistant", max_depth, max_nodes, min_score, decay, adaptive)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_depth = max_depth
        self.max_matches = max_matches
        self.max_nodes = max_nodes
        self.min_score = min_score
        self.adaptive = adaptive
        self.decay = decay
        self._rows: dict[int, _RowLookup] = {}

    def __repr__(self) -> str:
        return (
            f"NgramAssistant(max_ngram={self.max_ngram}, min_ngram={self.min_ngram}, max_depth={self.max_depth}, "
            f"max_matches={self.max_matches}, max_nodes={self.max_nodes}, min_score={self.min_score}, "
            f"adaptive={self.adaptive}, decay={self.decay})"
        )

    # ------------------------------------------------------------------ Proposer hooks
    def start(self, setup: ProposerSetup) -> None:
        super().start(setup)
        self._rows = {}

    def finish(self) -> None:
        self._rows = {}

    def observe(self, rows: Sequence[RowState], feedback: Sequence[RowFeedback]) -> None:
        for row, fb in zip(rows, feedback):
            self._synced(row).acceptance.observe(fb, learn=self.adaptive)

    def propose(self, rows: Sequence[RowState]) -> list[DraftTree]:
        min_score = self.min_score if self.min_score is not None else _BUDGET_MIN_SCORE
        max_nodes = self.max_nodes if self.max_nodes is not None else _BUDGET_MAX_NODES
        return [self._propose_row(row, min_score, max_nodes) for row in rows]

    # ------------------------------------------------------------------ internals
    def _synced(self, row: RowState) -> _RowLookup:
        """The row's lookup, extended with the tokens of ``row.tokens`` it has not indexed yet."""
        lookup = self._rows.get(row.row)
        new = None if lookup is None else unseen_tokens(lookup.seq, row.tokens)
        if new is not None:
            lookup.extend(new)
            return lookup
        # first sight of this row, or not the sequence this row index had: start over
        lookup = self._rows[row.row] = _RowLookup(self.max_ngram, self.min_ngram, self.max_matches, self.decay)
        lookup.extend(row.tokens.tolist())
        return lookup

    def acceptance_estimates(self, row: int) -> list[float]:
        """Current per-bucket acceptance estimates of ``row`` (bucket b = effective match length b + 1)."""
        lookup = self._rows.get(row)
        if lookup is None or not self.adaptive:
            return list(_PRIOR)
        return lookup.acceptance.estimates()

    def find_matches(self, lookup: PromptLookup) -> list[tuple[int, int]]:
        """Earlier occurrences of the suffix of a row's tokens (`PromptLookup.matches`)."""
        return lookup.matches()

    def _propose_row(self, row: RowState, min_score: float, max_nodes: int) -> DraftTree:
        depth_cap = min(self.max_depth, row.max_depth)
        if depth_cap <= 0:
            return DraftTree.empty()
        lookup = self._synced(row)
        cands = lookup.candidates(self.acceptance_estimates(row.row), depth_cap)
        keep = cands.best(min_score, max_nodes)
        out_parent = subset_parents(cands.parent, keep)
        lookup.acceptance.offer(out_parent, [cands.bucket[i] for i in keep])
        if not keep:
            return DraftTree.empty()
        return DraftTree.from_parents(
            torch.tensor([cands.tokens[i] for i in keep], dtype=torch.long),
            out_parent,
            sampling=DraftSampling.DETERMINISTIC,
            scores=torch.tensor([cands.score[i] for i in keep], dtype=torch.float32),
            source="ngram",
        )
