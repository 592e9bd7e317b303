"""Suffix decoding: draft what followed the context's suffix in this request *and* in earlier calls' answers.

`SuffixAssistant` needs no model. Each step, for every row, it matches the longest suffix of the row's text in two
suffix trees and drafts the continuations they hold as one token tree:

- the **request tree** (`RequestSuffixTree`): the row's prompt and everything generated so far, extended as tokens
  are accepted. An agent re-emitting a file from its prompt, a chat answer quoting an earlier turn, a repetition
  loop: the continuation is in the request itself.
- the **store** (`SuffixStore`, held by the user and shared by the calls that may see each other's text): the
  answers of earlier calls. The same JSON skeleton for the next input, the same table layout, the document written
  again with one line changed: the continuation is in an earlier *answer*, which prompt lookup cannot see.
  After each call the assistant adds every row's answer (after the last few tokens of its prompt) to the store.

From the node of the longest match, the tree grows best first. A node's score estimates the probability that the
target accepts it (a path probability):

    score(child) = score(parent) * A[source, l] * count(child) / count(children of parent)

``count`` is how often the continuation occurred after the matched text (observed frequency), and ``A[source, l]``
the row's running estimate (`LevelAcceptance`) that a tree level is accepted when the effective match length (the
matched suffix plus the tokens drafted above the node) is ``l``, per source (request or store). A long match gives
high ``A`` all the way down, so the tree gets deep; a short one gives a few shallow guesses: the tree's size follows
the match length. The two trees are merged by token path (a node keeps the higher of its two scores), and the loop's
tree budget keeps the nodes that pay on this machine's measured verify cost (`hf_specdec.generation.budget`).

Compared with SuffixDecoding (Oliaro et al., Snowflake's Arctic Inference, vLLM's ``suffix`` method): the same two
trees and frequency scores, but the request tree covers the generated text too, the two trees are merged instead of
picking one, and the size of the tree is chosen from acceptance learnt per row and the measured verify cost instead
of a fixed ``spec_factor * match_length``; the store is an explicit, bounded object the user scopes.

    store = hf_specdec.SuffixStore(max_tokens=1 << 20)           # one per user / session: the scope of sharing
    assistant = hf_specdec.SuffixAssistant(store=store)
    for instruction in session:
        out = model.generate(ids_of(instruction), assistant=assistant)   # later calls draft from earlier answers
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from ..inputs import check_int
from ..tree import DraftSampling, DraftTree, subset_parents
from .base import Proposer, ProposerSetup, RowFeedback, RowState
from .ngram import LevelAcceptance, LookupCandidates, check_tree_args, unseen_tokens
from .suffix_store import SORTED_DEPTH, SuffixIndex, SuffixStore

# Effective match lengths 1 .. _BUCKETS have their own acceptance estimate (the last: that long or longer). Request
# prior: NgramAssistant's measured per-level acceptance for lengths 1-8 (Spec-Bench, SmolLM2-135M, greedy), then
# rising towards the acceptance of a verbatim copy. Store prior: another call's answer is weaker evidence than this
# request's own text for short matches, as strong for long ones.
_BUCKETS = 16
_REQUEST_PRIOR = (0.4, 0.55, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.9, 0.91, 0.92, 0.93, 0.94, 0.94, 0.95, 0.95)
_STORE_PRIOR = (0.25, 0.35, 0.45, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.88, 0.9, 0.92, 0.93, 0.94, 0.95)
# A row's LevelAcceptance holds both: request bucket b is b, store bucket b is _BUCKETS + b.
# With the loop's tree budget: the candidates proposed (the budget keeps those that pay); without: the tree verified.
_BUDGET_MIN_SCORE, _BUDGET_MAX_NODES = 0.02, 64
_PLAIN_MIN_SCORE, _PLAIN_MAX_NODES = 0.1, 32
_MAX_CHILDREN = 16  # most continuations of one node considered (most frequent first)


# ---------------------------------------------------------------------------------------------- the request tree
class RequestSuffixTree:
    """A suffix tree of one growing sequence, with occurrence counts: every substring of at most ``max_match``
    tokens that occurs at least twice is a node (its count: how often it occurs); a substring that occurs once is a
    *leaf*, kept as the position where it ends, so its continuation is read from the sequence, at any depth. Below
    depth ``max_match`` only the newest occurrence of a continuation is kept (a leaf).

    Appending a token updates only the nodes of the sequence's repeated suffixes (`active`: ``active[k]`` is the node
    of the length-``k`` suffix, ``active[0]`` the root), so text that repeats nothing costs O(1) per token and a
    copy O(``max_match``) per token. ``children[node]`` maps a token to a node (>= 0) or a leaf (``~end``).
    """

    __slots__ = ("max_match", "seq", "count", "depth", "children", "active")

    def __init__(self, max_match: int) -> None:
        self.max_match = max_match
        self.seq: list[int] = []
        self.count: list[int] = [0]
        self.depth: list[int] = [0]
        self.children: list[dict[int, int]] = [{}]
        self.active: list[int] = [0]

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens``."""
        seq, count, depth, children, limit = self.seq, self.count, self.depth, self.children, self.max_match
        for tok in tokens:
            end = len(seq)
            seq.append(tok)
            active = [0]
            for node in self.active:  # the suffix that ended before ``tok`` (it occurred before), now + tok
                kids = children[node]
                code = kids.get(tok)
                if code is None:  # new: it occurs once, here
                    kids[tok] = ~end
                elif code >= 0:  # a node: one more occurrence
                    count[code] += 1
                    active.append(code)
                elif depth[node] < limit:  # a leaf seen once before, ending at ~code: now a node of two occurrences
                    before = ~code
                    kids[tok] = len(count)
                    count.append(2)
                    depth.append(depth[node] + 1)
                    children.append({seq[before + 1]: ~(before + 1)})  # where the earlier occurrence went on
                    active.append(kids[tok])
                else:  # deeper than max_match: keep the newest occurrence only
                    kids[tok] = ~end
            self.active = active

    @property
    def match(self) -> int:
        """The node of the longest suffix of the sequence, shorter than ``max_match``, that occurred before (0, the
        root: none). Shorter than ``max_match`` so that its continuations are nodes or leaves with exact counts."""
        active = self.active
        return active[-1] if self.depth[active[-1]] < self.max_match else active[-2]

    def continuations(self, state: tuple[int, int, int]) -> tuple[int, list[tuple[int, int, tuple[int, int, int]]]]:
        """Where the walk can go from ``state``: ``(total count, [(token, count, next state)])``, most frequent first.

        A state is ``(node, -1, 0)`` for a node, or ``(-1, end, period)`` for a leaf (the single occurrence ends at
        position ``end``; a leaf that runs into the end of the sequence goes on periodically, with ``period``: the
        text after the match *is* the text being generated).
        """
        node, end, period = state
        if node < 0:
            nxt = end + 1
            if nxt >= len(self.seq):
                nxt -= period
            return 1, [(self.seq[nxt], 1, (-1, nxt, period))]
        out = []
        total = 0
        count = self.count
        for tok, code in self.children[node].items():
            c = count[code] if code >= 0 else 1
            total += c
            out.append((tok, c, code))
        out.sort(key=lambda x: -x[1])
        return total, [(tok, c, (code, -1, 0) if code >= 0 else (-1, ~code, 0)) for tok, c, code in out[:_MAX_CHILDREN]]

    def walk_from_match(self) -> tuple[int, Callable]:
        """``(match length, children function)`` of the `match` node for `grow` (leaf periods set on the way)."""
        m = self.depth[self.match]
        last = len(self.seq) - 1

        def children(state, drafted: int):
            total, kids = self.continuations(state)
            if state[0] >= 0:  # a leaf child ends at s[1], drafted + 1 tokens below the match: that occurrence of the
                # match ended at s[1] - drafted - 1, and the text that runs into the present repeats with period last - it
                kids = [(t, c, s if s[0] >= 0 else (-1, s[1], last - (s[1] - drafted - 1))) for t, c, s in kids]
            return total, kids

        return m, children


# ---------------------------------------------------------------------------------------------- the store walk
def _store_children(state, drafted: int) -> tuple[int, list]:
    """The children function of `grow` over the store's levels (``drafted`` is not needed: counts are exact).

    A state is ``(((index, lo, hi), ...), depth)`` (the occurrences of the matched text plus the drafted path, ``depth``
    tokens, in every level that holds it), or ``(index, position)`` once a single occurrence is left (read on from its
    document; also the newest occurrence once the walk passes the depth the suffixes are sorted by).
    """
    first, depth = state
    if isinstance(first, SuffixIndex):  # one occurrence: its document goes on (or ends)
        tok = first.text[depth]
        return (1, [(tok, 1, (first, depth + 1))]) if tok >= 0 else (0, [])
    if depth >= SORTED_DEPTH:  # past the sorted prefix: the newest occurrence
        index, lo, hi = first[-1]
        return _store_children((index, index.newest(lo, hi) + depth), drafted)
    merged: dict[int, list] = {}
    total = 0
    for index, lo, hi in first:
        n, groups = index.next_tokens(lo, hi, depth, _MAX_CHILDREN)
        total += n
        for tok, a, b in groups:
            entry = merged.setdefault(tok, [0, []])
            entry[0] += b - a
            entry[1].append((index, a, b))
    out = []
    for tok, (c, ranges) in sorted(merged.items(), key=lambda kv: -kv[1][0])[:_MAX_CHILDREN]:
        if c == 1:  # a single occurrence: read on from its document
            index, a, _ = ranges[0]
            out.append((tok, 1, (index, index.sa[a] + depth + 1)))
        else:
            out.append((tok, c, (tuple(ranges), depth + 1)))
    return total, out


# ---------------------------------------------------------------------------------------------- growing a tree
def grow(
    children: Callable, root, match_len: int, accept: Sequence[float], depth_cap: int, max_nodes: int, min_score: float
) -> LookupCandidates:
    """The best-first tree of continuations below ``root`` (a match of ``match_len`` tokens).

    Args:
        children: ``children(state, drafted) -> (total, [(token, count, state)])`` (``drafted``: the state's depth
            below the match).
        accept: ``accept[b]``: estimated acceptance of a level at effective match length ``b + 1`` (last: longer).
        depth_cap / max_nodes / min_score: the tree's bounds.
    Returns:
        the nodes, parents before children, each with its score and bucket (`LookupCandidates`).
    """
    out = LookupCandidates([], [], [], [])
    last = len(accept)
    heap: list = []
    order = 0

    def push(state, drafted: int, parent: int, base: float) -> None:
        nonlocal order
        if drafted >= depth_cap:
            return
        bucket = min(match_len + drafted, last) - 1
        total, kids = children(state, drafted)
        scale = base * accept[bucket] / total if total else 0.0
        for tok, count, child in kids:
            score = scale * count
            if score < min_score:
                break  # kids come most frequent first
            heapq.heappush(heap, (-score, order, tok, child, drafted + 1, parent, bucket))
            order += 1

    push(root, 0, -1, 1.0)
    while heap and len(out.tokens) < max_nodes:
        neg, _, tok, state, drafted, parent, bucket = heapq.heappop(heap)
        node = len(out.tokens)
        out.tokens.append(tok)
        out.parent.append(parent)
        out.score.append(-neg)
        out.bucket.append(bucket)
        push(state, drafted, node, -neg)
    return out


def merge(trees: Sequence[tuple[LookupCandidates, int]]) -> LookupCandidates:
    """One tree of several candidate trees merged by token path; a node keeps the higher score (and that tree's
    bucket, offset by ``offset`` of that tree). Each input lists parents before children, and so does the output."""
    out = LookupCandidates([], [], [], [])
    node_of: dict[tuple[int, int], int] = {}
    for cands, offset in trees:
        remap: list[int] = []
        for tok, p, score, bucket in zip(cands.tokens, cands.parent, cands.score, cands.bucket):
            key = (remap[p] if p >= 0 else -1, tok)
            j = node_of.get(key)
            if j is None:
                j = node_of[key] = len(out.tokens)
                out.tokens.append(tok)
                out.parent.append(key[0])
                out.score.append(score)
                out.bucket.append(bucket + offset)
            elif score > out.score[j]:
                out.score[j], out.bucket[j] = score, bucket + offset
            remap.append(j)
    return out


# ---------------------------------------------------------------------------------------------- the assistant
@dataclass
class _Row:
    tree: RequestSuffixTree
    acceptance: LevelAcceptance
    prompt_len: int


class SuffixAssistant(Proposer):
    """Suffix decoding over this request and a store of earlier calls' answers (see the module docstring).

    Pass it as ``model.generate(ids, assistant=SuffixAssistant(store=store))`` and keep passing the same assistant
    (or another one holding the same store) in later calls: each call adds its answers to the store when it ends.
    It drafts only where the text repeats something (this request, or an earlier answer) and nothing elsewhere.

    Args:
        store: the `SuffixStore` earlier answers are read from and this call's answers added to: the scope of
            sharing (text in one store never drafts for another). None: a private store of this assistant.
        max_depth: most tokens drafted after one match (the loop's remaining budget caps it too).
        max_match: the request tree's depth: suffixes of up to ``max_match - 1`` tokens are matched (longer repeats
            count as that long), and their continuations counted.
        max_nodes: most nodes in a tree (None: 32, or 64 candidates when the loop's tree budget sizes the trees).
        min_score: smallest estimated acceptance probability of a node worth proposing (None: 0.1, or 0.02 with the
            loop's tree budget, which keeps the candidates that pay).
        lead_in: prompt tokens stored before each answer, so that the start of a later answer matches its prompt's
            end (the chat template's assistant header).
        adaptive: follow the acceptance observed per row (True) or keep the prior estimates (False).
        decay: per-step forgetting factor of the acceptance statistics.
    """

    sampling = DraftSampling.DETERMINISTIC
    hidden_state_layers = None
    proposes_for_free = True

    def __init__(
        self,
        store: SuffixStore | None = None,
        *,
        max_depth: int = 48,
        max_match: int = 32,
        max_nodes: int | None = None,
        min_score: float | None = None,
        lead_in: int = 8,
        adaptive: bool = True,
        decay: float = 0.9,
    ) -> None:
        if store is not None and not isinstance(store, SuffixStore):
            raise TypeError(f"SuffixAssistant store must be a SuffixStore or None, got {type(store).__name__}")
        check_tree_args("SuffixAssistant", max_depth, max_nodes, min_score, decay, adaptive)
        check_int("SuffixAssistant", "max_match", max_match, minimum=2)
        check_int("SuffixAssistant", "lead_in", lead_in, minimum=0)
        self.store = store if store is not None else SuffixStore()
        self.max_depth, self.max_match, self.max_nodes, self.min_score = max_depth, max_match, max_nodes, min_score
        self.lead_in, self.adaptive, self.decay = lead_in, adaptive, decay
        self._rows: dict[int, _Row] = {}
        self._snapshot = self.store.snapshot()

    def __repr__(self) -> str:
        return (
            f"SuffixAssistant(store={self.store!r}, max_depth={self.max_depth}, max_match={self.max_match}, "
            f"max_nodes={self.max_nodes}, min_score={self.min_score}, lead_in={self.lead_in}, "
            f"adaptive={self.adaptive}, decay={self.decay})"
        )

    # ------------------------------------------------------------------ Proposer hooks
    def start(self, setup: ProposerSetup) -> None:
        super().start(setup)
        self._rows = {}
        self._snapshot = self.store.snapshot()  # this call drafts from the store as it is now

    def finish(self) -> None:
        """Add every row's answer (after ``lead_in`` prompt tokens) to the store."""
        rows, self._rows = self._rows, {}
        for row in rows.values():
            seq = row.tree.seq
            if len(seq) > row.prompt_len:
                self.store.add(seq[max(0, row.prompt_len - self.lead_in) :])

    def observe(self, rows: Sequence[RowState], feedback: Sequence[RowFeedback]) -> None:
        for row, fb in zip(rows, feedback):
            self._synced(row).acceptance.observe(fb, learn=self.adaptive)

    def propose(self, rows: Sequence[RowState]) -> list[DraftTree]:
        budgeted = self.budget is not None
        min_score, max_nodes = (
            (_BUDGET_MIN_SCORE, _BUDGET_MAX_NODES) if budgeted else (_PLAIN_MIN_SCORE, _PLAIN_MAX_NODES)
        )
        min_score = self.min_score if self.min_score is not None else min_score
        max_nodes = self.max_nodes if self.max_nodes is not None else max_nodes
        return [self._propose_row(row, min_score, max_nodes) for row in rows]

    # ------------------------------------------------------------------ internals
    def _synced(self, row: RowState) -> _Row:
        """The row's state, its request tree extended with the tokens of ``row.tokens`` it has not seen yet."""
        state = self._rows.get(row.row)
        new = None if state is None else unseen_tokens(state.tree.seq, row.tokens)
        if new is not None:
            state.tree.extend(new)
            return state
        # first sight of this row, or not the sequence this row index had: start over
        tree = RequestSuffixTree(self.max_match)
        tree.extend(row.tokens.tolist())
        acceptance = LevelAcceptance(_REQUEST_PRIOR + _STORE_PRIOR, self.decay)
        state = self._rows[row.row] = _Row(tree, acceptance, min(row.prompt_len, len(tree.seq)))
        return state

    def acceptance_estimates(self, row: int) -> list[float]:
        """Current estimates of ``row``: request buckets (effective match length 1 .. 16), then store buckets."""
        state = self._rows.get(row)
        if state is None or not self.adaptive:
            return list(_REQUEST_PRIOR + _STORE_PRIOR)
        return state.acceptance.estimates()

    def _propose_row(self, row: RowState, min_score: float, max_nodes: int) -> DraftTree:
        depth_cap = min(self.max_depth, row.max_depth)
        state = self._synced(row)
        if depth_cap <= 0:
            state.acceptance.offer([], [])
            return DraftTree.empty()
        accept = self.acceptance_estimates(row.row)
        trees = []
        m, children = state.tree.walk_from_match()
        if m:
            root = (state.tree.match, -1, 0)
            trees.append((grow(children, root, m, accept[:_BUCKETS], depth_cap, max_nodes, min_score), 0))
        m, parts = self._snapshot.longest_match(state.tree.seq, self.max_match)
        if m:
            store = grow(_store_children, (tuple(parts), m), m, accept[_BUCKETS:], depth_cap, max_nodes, min_score)
            trees.append((store, _BUCKETS))
        cands = merge(trees)
        keep = cands.best(min_score, max_nodes)
        parents = subset_parents(cands.parent, keep)
        state.acceptance.offer(parents, [cands.bucket[i] for i in keep])
        if not keep:
            return DraftTree.empty()
        return DraftTree.from_parents(
            torch.tensor([cands.tokens[i] for i in keep], dtype=torch.long),
            parents,
            sampling=DraftSampling.DETERMINISTIC,
            scores=torch.tensor([cands.score[i] for i in keep], dtype=torch.float32),
            source="suffix",
        )
