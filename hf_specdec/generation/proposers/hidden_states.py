"""The base of the proposers whose head reads the target's hidden states and keeps a draft KV cache of its own
(EAGLE, DFlash; later MTP): `HiddenStateProposer`, which holds their life cycle once.

    validate(target)     bind the head to the target: it learns the layers it reads (``head.feature_layers``), which
                         become ``hidden_state_layers``, the layers the loop hands `observe`
    start(setup)         the drafting head (`drafting_head`: the head, or its copy in the dtype this machine
                         multiplies fastest, bound to the same target), a fresh `DraftKVCache` (one slot per row)
    observe(rows, fb)    each row's committed states (the target's hidden states at the feature layers, at
                         ``new_tokens``) join the row's queue; no head pass yet
    propose(rows)        rows with a depth to draft and a queue: `_commit` runs their queues through the head into
                         their cache slots in one pass, then `_draft` builds their trees. A row the tree budget pauses
                         (``max_depth`` 0) costs no head pass: its queue grows until it drafts again
    finish()             drop the cache, the queues and the drafting copy (also after an error)

Nothing is ever rolled back: the cache only receives committed states, and a tree's own keys and values live inside
one `propose`. Per-call state lives on the assistant, never on the head (only `bind` and the cached drafting copy
touch the head); one assistant serves one call at a time (`Proposer.claimed`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...heads.draft_cache import DraftKVCache
from ..cost_model import PriorCurve
from ..tree import DraftTree
from .base import Proposer, ProposerSetup, RowFeedback, RowState, drafting_head


class HiddenStateProposer(Proposer):
    """Base of the proposers drafting with a head over the target's hidden states (`EagleAssistant`,
    `DFlashAssistant`). An ``XAssistant`` is the `Proposer` of method X: "assistant" is what a user passes as
    ``assistant=``, "proposer" what the loop drives; one concept under two names.

    A subclass checks its head's type, calls ``super().__init__``, and implements `_context_kv` (how a batch of
    queued states becomes cache entries) and `_draft` (the ready rows' trees); it may extend `_row_states` (what a
    row queues besides its states) and `_layers_before_bind`.

    Args:
        head: the draft head (``tree``, ``feature_layers``, ``aux_layers``, ``bind``, ``new_cache``,
            ``drafting_copy``).
        top_k: candidates per expansion (default: the head's ``tree["top_k"]``, else ``default_top_k``).
        num_nodes: nodes per row at most (default: ``tree["num_nodes"]``, else ``default_num_nodes``); 0 drafts none.
        step_cost: ``{nodes: cost of a step / a plain decoding step}`` (default: the head's ``tree["step_cost"]``):
            the tree budget's prior cost curve (``prior_cost``).

    Attributes:
        draft_head: what drafts during a call (the head or its `drafting_head` copy); the head outside a call.
        cache: the head's `DraftKVCache` during a call (slot = row index), exactly the committed states it has run.
    """

    default_top_k: int
    default_num_nodes: int

    def __init__(self, head, top_k: int | None, num_nodes: int | None, step_cost: dict[int, float] | None):
        tree = head.tree or {}
        self.head = head
        self.top_k = int(top_k or tree.get("top_k") or self.default_top_k)
        self.num_nodes = int(num_nodes if num_nodes is not None else tree.get("num_nodes") or self.default_num_nodes)
        cost = step_cost if step_cost is not None else tree.get("step_cost")
        self.step_cost = {int(n): float(c) for n, c in cost.items()} if cost else None
        self.prior_cost = PriorCurve.from_node_costs(self.step_cost) if self.step_cost else None
        self.hidden_state_layers = self._layers_before_bind(head)
        self.draft_head = head
        self.cache: DraftKVCache | None = None
        self._pending: dict[int, tuple[torch.Tensor, ...]] = {}  # row -> its queue, `[m, ...]` each, states first

    def _layers_before_bind(self, head) -> tuple[int, ...] | None:
        """The head's feature layers when it knows them before `validate` binds it (else None)."""
        return head.feature_layers if head.aux_layers else None

    # ------------------------------------------------------------------ lifecycle
    def validate(self, target: torch.nn.Module) -> None:
        self.head.bind(target)
        self.hidden_state_layers = self.head.feature_layers

    def start(self, setup: ProposerSetup) -> None:
        super().start(setup)
        self.draft_head = drafting_head(self.head)  # the head, or its copy in this machine's fastest dtype
        if self.draft_head is not self.head:
            self.draft_head.bind(setup.target)
        self.cache = self.draft_head.new_cache(max(1, setup.batch_size))
        self._pending = {}

    def finish(self) -> None:
        self.cache, self.draft_head, self._pending = None, self.head, {}

    def drafting_modules(self) -> tuple[torch.nn.Module, ...]:
        return (self.draft_head,)

    def observe(self, rows: Sequence[RowState], feedback: Sequence[RowFeedback]) -> None:
        layers = self.head.feature_layers
        for row, fb in zip(rows, feedback):
            if fb.hidden_states is None or any(layer not in fb.hidden_states for layer in layers):
                raise RuntimeError(f"{type(self).__name__} needs the target's hidden states of layers {list(layers)}")
            feats = torch.cat([fb.hidden_states[layer] for layer in layers], dim=-1).detach()  # [m, n H]
            new, old = self._row_states(fb, feats), self._pending.get(row.row)
            self._pending[row.row] = new if old is None else tuple(torch.cat(pair) for pair in zip(old, new))

    def _row_states(self, fb: RowFeedback, feats: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What a row queues from one feedback: `[m, n H]` its states at ``fb.new_tokens``; a subclass may add
        more `[m, ...]` tensors after them."""
        return (feats,)

    # ------------------------------------------------------------------ drafting
    @torch.no_grad()
    def propose(self, rows: Sequence[RowState]) -> list[DraftTree]:
        trees = [DraftTree.empty(r.tokens.device) for r in rows]
        # every observed row has states queued (each step commits the old root at least); a paused row's queue up
        ready = [i for i, r in enumerate(rows) if r.max_depth > 0 and r.row in self._pending]
        if not ready or self.num_nodes == 0:
            return trees
        for i, tree in zip(ready, self._draft([rows[i] for i in ready])):
            trees[i] = tree
        return trees

    def _draft(self, rows: list[RowState]) -> list[DraftTree]:
        """One tree per row; each row has a depth to draft and a queue, which `_commit` enters into the cache."""
        raise NotImplementedError

    def _commit(self, slots: list[int]):
        """Run the rows' queues through the head into their cache slots (one head pass for all rows).

        Args:
            slots: the rows' cache slots (their row indices), each with a queue.
        Returns:
            what `_context_kv` returns besides the keys and values.
        """
        pending = [self._pending.pop(s) for s in slots]
        cache, dev = self.cache, self.cache.key.device
        m = torch.tensor([p[0].shape[0] for p in pending], device=dev)  # [B] queued entries per row
        pad = torch.nn.utils.rnn.pad_sequence
        queued = [pad([p[j].to(dev) for p in pending], batch_first=True) for j in range(len(pending[0]))]  # [B, q, ...]
        lengths = cache.lengths[slots]  # [B] committed entries before these
        cache.reserve(int((lengths + m).max()))
        out, key, value = self._context_kv(slots, lengths, m, *queued)  # key, value [B, kvh, q, D]
        for i, slot in enumerate(slots):
            n0, n = int(lengths[i]), int(m[i])
            cache.key[slot, :, n0 : n0 + n], cache.value[slot, :, n0 : n0 + n] = key[i, :, :n], value[i, :, :n]
        cache.lengths[slots] = lengths + m
        return out

    def _context_kv(self, slots: list[int], lengths: torch.Tensor, m: torch.Tensor, *queued: torch.Tensor):
        """The cache entries of the rows' queues (the method's head pass over them).

        Args:
            slots: the rows' cache slots, already reserved for their queues.
            lengths: `[B]` entries each slot holds before these (the queue's first position).
            m: `[B]` queued entries per row.
            queued: the `_row_states` tensors, padded with zeros: `[B, q, n H]` states, then the subclass's own.
        Returns:
            ``(out, key, value)``: anything the drafting needs (returned by `_commit`), and `[B, kvh, q, D]` the new
            keys and values (entries past ``m`` are ignored).
        """
        raise NotImplementedError


__all__ = ["HiddenStateProposer"]
