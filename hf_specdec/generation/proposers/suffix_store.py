"""`SuffixStore`: what a user's earlier generate() calls wrote, indexed for `SuffixAssistant` to draft from later.

An agent, a coding assistant or a multi-turn chat makes the model write again what it wrote a call ago: the same
JSON skeleton for the next input, the file again with one line changed. The store keeps the text of earlier calls
(each row's answer, after the last few tokens of its prompt) and answers one question fast: *what followed the
longest earlier occurrence of the context's suffix, and how often did each continuation occur?*

    store = SuffixStore(max_tokens=1 << 20)                    # one per user, session or tenant: the scope
    assistant = SuffixAssistant(store=store)                   # adds each call's answers after the call
    match_len, counts = store.continuations(context_tokens)    # what the assistant reads, for inspection

**Index.** Documents are concatenated with a separator (-1) and indexed by a suffix array: every position, sorted
by the 128 tokens that start there. The occurrences of a pattern are one contiguous range of the array (two binary
searches), and after the pattern the occurrences are sorted by their next token, so the continuations of a range and
their counts are its sub-ranges: a walk down the array is a walk down a suffix tree whose node counts are range
sizes. Memory is 12 bytes per token: 4 for the text, 4 for the array and 4 for the documents kept for rebuilds
(and 8 per document for its separator).

**Updates.** The arrays are immutable; readers take a snapshot (`snapshot`) and never lock. New documents go to a
small newest level (rebuilt on every `add`, a few thousand tokens); a level merges into the one before it once it
holds a quarter of its tokens, so a store of N tokens has O(log N) levels and every token is re-sorted O(log N)
times.

**Bound and eviction.** ``max_tokens`` bounds the stored tokens. When an `add` would pass it, the oldest documents
are evicted (first in, first out) until the store is at most three quarters full, and the levels are rebuilt as one;
a document longer than half the store keeps its last ``max_tokens // 2`` tokens. Eviction is by age, not use: in an
agent session or a conversation the recent text is what gets rewritten.

**Scope.** A store is the unit of sharing: text added to one store never drafts for an assistant holding another.
Give each user (tenant, session) their own store; share one only between calls that may see each other's text.
Every method is thread-safe: writers take the store's lock, readers a snapshot.
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_left, bisect_right
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..inputs import check_int

SEPARATOR = -1  # ends every document in an index; sorts before every token
SORTED_DEPTH = 128  # suffixes are sorted by this many tokens: walks deeper than that follow the newest occurrence
_NEWEST_LEVEL_TOKENS = 4096  # the newest level is rebuilt on every add while it holds fewer tokens than this
_MERGE_RATIO = 4  # a level merges into the one before it once it holds 1 / _MERGE_RATIO of its tokens
_SMALL_RANGE = 32  # ranges up to this size are split in Python, larger ones with numpy
_MAX_TOKEN = (1 << 31) - 1


def _suffix_array(text: np.ndarray, depth: int = SORTED_DEPTH) -> np.ndarray:
    """`[n]` int32 start positions of ``text``'s suffixes sorted by their first ``depth`` tokens (prefix doubling;
    ties in position order). A suffix that ends sooner sorts first among equal prefixes."""
    n = text.size
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    rank = np.unique(text, return_inverse=True)[1].astype(np.int64).reshape(-1)  # [n]
    order = np.argsort(rank, kind="stable")
    width = 1
    while width < depth and rank[order[-1]] < n - 1:
        second = np.full(n, -1, dtype=np.int64)  # [n] rank of the next `width` tokens, -1 past the end
        second[: n - width] = rank[width:]
        order = np.lexsort((second, rank))  # stable: ties stay in position order
        r, s = rank[order], second[order]
        new = np.empty(n, dtype=np.int64)
        new[order] = np.concatenate(([0], np.cumsum((r[1:] != r[:-1]) | (s[1:] != s[:-1]))))
        rank = new
        width *= 2
    return order.astype(np.int32)


class SuffixIndex:
    """An immutable suffix array over some documents (one level of a `SuffixStore`).

    Attributes:
        text: the documents, each followed by `SEPARATOR` (int32 ``array``).
        sa: the suffix array of ``text`` (int32 ``array``).
        num_tokens: the documents' tokens (separators not counted).
    """

    __slots__ = ("text", "sa", "num_tokens", "_np_text", "_np_sa")

    def __init__(self, documents: Sequence[array]) -> None:
        text = array("i")
        for doc in documents:
            text.extend(doc)
            text.append(SEPARATOR)
        np_text = np.frombuffer(text, dtype=np.int32) if text else np.zeros(0, dtype=np.int32)
        self.text = text
        self.sa = array("i", _suffix_array(np_text).tobytes())
        self.num_tokens = len(text) - len(documents)
        self._np_text = np_text
        self._np_sa = np.frombuffer(self.sa, dtype=np.int32) if self.sa else np.zeros(0, dtype=np.int32)

    @property
    def nbytes(self) -> int:
        return (len(self.text) + len(self.sa)) * 4

    def find(self, pattern: array, lo: int = 0, hi: int | None = None) -> tuple[int, int]:
        """``[lo, hi)``: the suffixes that start with ``pattern`` (an empty range where it does not occur)."""
        text, m = self.text, len(pattern)
        hi = len(self.sa) if hi is None else hi
        key = lambda i: text[i : i + m]  # noqa: E731 - the comparison key of one bisect
        lo = bisect_left(self.sa, pattern, lo, hi, key=key)
        return lo, bisect_right(self.sa, pattern, lo, hi, key=key)

    def longest_suffix(self, context: array) -> tuple[int, int, int]:
        """``(m, lo, hi)``: the longest suffix of ``context`` that occurs here (``m`` tokens, 0: none) and its
        range. Binary search over ``m``: if a suffix occurs, every shorter one does."""
        best = (0, 0, 0)
        low, high = 1, len(context)
        while low <= high:
            m = (low + high) // 2
            lo, hi = self.find(context[len(context) - m :])
            if hi > lo:
                best, low = (m, lo, hi), m + 1
            else:
                high = m - 1
        return best

    def next_tokens(self, lo: int, hi: int, depth: int, top: int) -> tuple[int, list[tuple[int, int, int]]]:
        """What follows the ``depth``-token prefix the suffixes ``[lo, hi)`` share.

        Returns:
            ``(total, groups)``: how many of them continue (do not end their document there), and the ``top``
            most frequent next tokens as ``(token, sub_lo, sub_hi)``, most frequent first (ties: smaller token).
        """
        if hi - lo <= _SMALL_RANGE:
            text, sa = self.text, self.sa
            groups: list[list[int]] = []
            for i in range(lo, hi):
                tok = text[sa[i] + depth]
                if groups and groups[-1][0] == tok:
                    groups[-1][2] = i + 1
                else:
                    groups.append([tok, i, i + 1])
            found = [(g[0], g[1], g[2]) for g in groups if g[0] != SEPARATOR]
        else:
            toks = self._np_text[self._np_sa[lo:hi] + depth]  # [hi - lo] sorted
            cut = np.flatnonzero(toks[1:] != toks[:-1]) + 1
            starts = np.concatenate(([0], cut))
            ends = np.concatenate((cut, [hi - lo]))
            keep = toks[starts] != SEPARATOR
            starts, ends = starts[keep], ends[keep]
            best = np.argsort(starts - ends, kind="stable")[:top]  # largest groups first
            found = [(int(toks[starts[j]]), lo + int(starts[j]), lo + int(ends[j])) for j in best]
        total = sum(b - a for _, a, b in found) if hi - lo <= _SMALL_RANGE else int((ends - starts).sum())
        found.sort(key=lambda g: (g[1] - g[2], g[0]))
        return total, found[:top]

    def newest(self, lo: int, hi: int) -> int:
        """The start of the most recently added of the suffixes ``[lo, hi)``."""
        return int(self._np_sa[lo:hi].max()) if hi - lo > _SMALL_RANGE else max(self.sa[lo:hi])


@dataclass(frozen=True)
class StoreSnapshot:
    """The store's levels at one moment (oldest first); immutable, so a call reads it without locking."""

    levels: tuple[SuffixIndex, ...] = ()

    def longest_match(self, context: Sequence[int], max_match: int) -> tuple[int, list[tuple[SuffixIndex, int, int]]]:
        """The longest suffix of ``context`` (at most ``max_match`` tokens) found in any level: its length and its
        range in every level that holds it (``(0, [])``: none)."""
        if not self.levels:
            return 0, []
        tail = array("i", context[-max_match:])
        best, parts = 0, []
        for index in self.levels:
            m, lo, hi = index.longest_suffix(tail)
            if m > best:
                best, parts = m, [(index, lo, hi)]
            elif m == best and m > 0:
                parts.append((index, lo, hi))
        return best, parts

    @property
    def num_tokens(self) -> int:
        return sum(index.num_tokens for index in self.levels)


class SuffixStore:
    """Earlier calls' text, for `SuffixAssistant` to draft from (see the module docstring).

    Args:
        max_tokens: most tokens kept (default 2**20, about a million: 12 MB of arrays). 0 keeps nothing.
    """

    def __init__(self, max_tokens: int = 1 << 20) -> None:
        check_int("SuffixStore", "max_tokens", max_tokens, minimum=0)
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._docs: deque[array] = deque()
        self._level_docs: list[int] = []  # documents per level, oldest level first (they cover self._docs in order)
        self._snapshot = StoreSnapshot()
        self._tokens = 0
        self.evicted_tokens = 0  # over the store's life

    def __repr__(self) -> str:
        return (
            f"SuffixStore(max_tokens={self.max_tokens}; {self.num_documents} documents, {self.num_tokens} tokens, "
            f"{self.nbytes / 1e6:.2f} MB)"
        )

    # ------------------------------------------------------------------ reading
    def snapshot(self) -> StoreSnapshot:
        """The index as it is now (later `add` calls do not change it)."""
        return self._snapshot

    @property
    def num_tokens(self) -> int:
        """Tokens stored (at most ``max_tokens``)."""
        return self._tokens

    @property
    def num_documents(self) -> int:
        return len(self._docs)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored arrays: text and suffix array of every level, and the documents kept for rebuilds."""
        with self._lock:
            return sum(index.nbytes for index in self._snapshot.levels) + 4 * self._tokens

    def continuations(self, context: Sequence[int] | torch.Tensor, max_match: int = 32) -> tuple[int, Counter]:
        """What followed the longest earlier occurrence of ``context``'s suffix (at most ``max_match`` tokens):
        ``(match length, Counter{next token: occurrences})`` (``(0, Counter())`` when nothing matches)."""
        tokens = _as_tokens(context, "context")
        m, parts = self._snapshot.longest_match(tokens, max_match)
        counts: Counter = Counter()
        for index, lo, hi in parts:
            for tok, a, b in index.next_tokens(lo, hi, m, top=hi - lo)[1]:
                counts[tok] += b - a
        return (m, counts) if counts else (0, Counter())

    # ------------------------------------------------------------------ writing
    def add(self, tokens: Sequence[int] | torch.Tensor) -> None:
        """Store one document (a row's text); evicts the oldest documents when the store would pass ``max_tokens``."""
        doc = array("i", _as_tokens(tokens, "tokens"))
        if not doc or not self.max_tokens:
            return
        if len(doc) > self.max_tokens // 2:
            doc = doc[len(doc) - max(1, self.max_tokens // 2) :]
        with self._lock:
            self._docs.append(doc)
            self._tokens += len(doc)
            if self._tokens > self.max_tokens:
                self._evict(keep=self.max_tokens * 3 // 4)
                self._level_docs = [len(self._docs)]
                self._publish([SuffixIndex(list(self._docs))])
                return
            levels = list(self._snapshot.levels)
            if levels and levels[-1].num_tokens < _NEWEST_LEVEL_TOKENS:  # rebuild the newest level with the document
                self._level_docs[-1] += 1
                levels[-1] = SuffixIndex(self._docs_of(len(levels) - 1))
            else:
                self._level_docs.append(1)
                levels.append(SuffixIndex([doc]))
            while len(levels) >= 2 and levels[-1].num_tokens * _MERGE_RATIO >= levels[-2].num_tokens:
                self._level_docs[-2:] = [sum(self._level_docs[-2:])]
                levels[-2:] = [SuffixIndex(self._docs_of(len(levels) - 2))]
            self._publish(levels)

    def clear(self) -> None:
        """Forget every document."""
        with self._lock:
            self._docs.clear()
            self._level_docs = []
            self._tokens = 0
            self._publish([])

    def _evict(self, keep: int) -> None:
        """Drop the oldest documents until at most ``keep`` tokens remain (the newest document always stays)."""
        while self._tokens > keep and len(self._docs) > 1:
            old = self._docs.popleft()
            self._tokens -= len(old)
            self.evicted_tokens += len(old)

    def _docs_of(self, level: int) -> list[array]:
        start = sum(self._level_docs[:level])
        return [self._docs[i] for i in range(start, start + self._level_docs[level])]

    def _publish(self, levels: list[SuffixIndex]) -> None:
        self._snapshot = StoreSnapshot(tuple(levels))


def _as_tokens(tokens, what: str) -> list[int]:
    """``tokens`` as a list of ints, checked to be token ids."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.is_floating_point():
            raise ValueError(
                f"{what} must be a 1-D tensor of token ids, got shape {tuple(tokens.shape)} {tokens.dtype}"
            )
        out = tokens.tolist()
    else:
        out = list(tokens)
    for t in out:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _MAX_TOKEN:
            raise ValueError(f"{what} must be token ids (ints in [0, 2**31)), got {t!r}")
    return out
