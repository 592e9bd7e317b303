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
"""

from __future__ import annotations

from collections.abc import Sequence

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


class _RowLookup:
    """One row's token history, its n-gram index and its acceptance statistics.

    The index is a linked list of occurrences per n-gram length: ``previous[n - 1][p]`` is the last position before
    ``p`` where the n-gram ending at ``p`` also ends (-1: none), so the occurrences of the context's suffix, most
    recent first, are ``previous[n - 1][last]``, ``previous[n - 1][that]``, ... without computing any key.
    """

    __slots__ = ("seq", "previous", "_last_end", "hits", "trials", "level_bucket")

    def __init__(self, max_ngram: int) -> None:
        self.seq: list[int] = []
        self.previous: list[list[int]] = [[] for _ in range(max_ngram)]
        # per n: n-gram (packed in one int, 32 bits per token) -> last position where it ends
        self._last_end: list[dict[int, int]] = [{} for _ in range(max_ngram)]
        self.hits = [0.0] * _BUCKETS
        self.trials = [0.0] * _BUCKETS
        # the last proposed tree: parent node (-1 = root) -> bucket of its best child (the level's trial), for `observe`
        self.level_bucket: dict[int, int] = {}

    def extend(self, tokens: list[int]) -> None:
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
        counts = dict(max_ngram=max_ngram, min_ngram=min_ngram, max_depth=max_depth, max_matches=max_matches)
        if max_nodes is not None:
            counts["max_nodes"] = max_nodes
        for name, value in counts.items():
            check_int("NgramAssistant", name, value, minimum=1)
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"NgramAssistant needs 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        if min_score is not None:
            check_number("NgramAssistant", "min_score", min_score, 0.0, 1.0)
        check_number("NgramAssistant", "decay", decay, 0.0, 1.0)
        if not isinstance(adaptive, bool):
            raise TypeError(f"NgramAssistant adaptive must be True or False, got {adaptive!r}")
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
            lookup = self._synced(row)
            level_bucket = lookup.level_bucket if fb.tree is not None and fb.tree.num_nodes else {}
            lookup.level_bucket = {}
            if not self.adaptive:
                continue
            hits, trials = lookup.hits, lookup.trials
            for k in range(_BUCKETS):
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

    def propose(self, rows: Sequence[RowState]) -> list[DraftTree]:
        min_score = self.min_score if self.min_score is not None else _BUDGET_MIN_SCORE
        max_nodes = self.max_nodes if self.max_nodes is not None else _BUDGET_MAX_NODES
        return [self._propose_row(row, min_score, max_nodes) for row in rows]

    # ------------------------------------------------------------------ internals
    def _synced(self, row: RowState) -> _RowLookup:
        """The row's lookup, extended with the tokens of ``row.tokens`` it has not indexed yet."""
        lookup = self._rows.get(row.row)
        n = row.tokens.numel()
        known = 0 if lookup is None else len(lookup.seq)
        if lookup is not None and n == known:
            return lookup
        if lookup is not None and 0 < known < n:
            new = row.tokens[known - 1 :].tolist()  # one transfer: the last known token (a check) + the new ones
            if new[0] == lookup.seq[-1]:
                lookup.extend(new[1:])
                return lookup
        # first sight of this row, or not the sequence this row index had: start over
        lookup = self._rows[row.row] = _RowLookup(self.max_ngram)
        lookup.extend(row.tokens.tolist())
        return lookup

    def acceptance_estimates(self, row: int) -> list[float]:
        """Current per-bucket acceptance estimates of ``row`` (bucket b = effective match length b + 1)."""
        lookup = self._rows.get(row)
        if lookup is None or not self.adaptive:
            return list(_PRIOR)
        # two pseudo-trials of prior
        return [(h + 2.0 * p) / (t + 2.0) for h, t, p in zip(lookup.hits, lookup.trials, _PRIOR)]

    def find_matches(self, lookup: _RowLookup) -> list[tuple[int, int]]:
        """Earlier occurrences of the suffix of the row's tokens: ``(match_len, end position)``, best first.

        Longest suffix first; among equally long matches the most recent first. The last position (the suffix
        itself) is never a match. ``match_len`` is compared up to 16 tokens back, past ``max_ngram``.
        """
        seq = lookup.seq
        last = len(seq) - 1
        seen: set[int] = set()
        found: list[tuple[int, int]] = []
        scan = 2 * self.max_matches
        for n in range(min(self.max_ngram, last), self.min_ngram - 1, -1):
            previous = lookup.previous[n - 1]
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

    def _propose_row(self, row: RowState, min_score: float, max_nodes: int) -> DraftTree:
        depth_cap = min(self.max_depth, row.max_depth)
        if depth_cap <= 0:
            return DraftTree.empty()
        lookup = self._synced(row)
        lookup.level_bucket = {}
        seq = lookup.seq
        matches = self.find_matches(lookup)
        if not matches:
            return DraftTree.empty()
        accept = self.acceptance_estimates(row.row)
        end = len(seq)

        # ---- trie of the continuations; node lists in creation order (parents before children)
        node_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        tokens: list[int] = []
        parent: list[int] = []
        weight: list[float] = []
        bucket: list[int] = []
        child_weight: dict[int, float] = {}  # parent (-1 = root) -> summed weight of its children
        for length, pos in matches:
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

        # ---- scores, then the best max_nodes nodes above min_score (parents outscore children: a tree)
        score = [0.0] * len(tokens)
        for i, p in enumerate(parent):
            base = 1.0 if p < 0 else score[p]
            score[i] = base * accept[bucket[i]] * weight[i] / child_weight[p]
        keep = sorted((i for i in range(len(tokens)) if score[i] >= min_score), key=lambda i: (-score[i], i))
        keep = keep[:max_nodes]
        if not keep:
            return DraftTree.empty()

        out_parent = subset_parents(parent, keep)
        for new, old in enumerate(keep):
            lookup.level_bucket.setdefault(out_parent[new], bucket[old])  # siblings come best first
        return DraftTree.from_parents(
            torch.tensor([tokens[i] for i in keep], dtype=torch.long),
            out_parent,
            sampling=DraftSampling.DETERMINISTIC,
            scores=torch.tensor([score[i] for i in keep], dtype=torch.float32),
            source="ngram",
        )
