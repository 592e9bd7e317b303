"""DraftModelAssistant: a smaller causal LM sharing the target's vocabulary drafts a chain or a tree.

The draft keeps its own `PagedCache`. Each step it feeds, in one packed forward over the batch, the tokens the
target committed since the last step (ending with the root), then expands the tree one level per forward:

- ``top_k == 1``: a chain of ``depth`` tokens (the classic draft-model speculative decoding).
- ``top_k > 1``: an EAGLE-2-style confidence-ranked tree: every level expands the ``top_k`` best frontier nodes by
  cumulative draft log-probability, and the ``num_nodes`` best nodes overall form the tree (a parent always scores
  at least as well as its child, so they form a tree).

Frontier nodes are written into the draft's cache as *pending* tokens: later levels see their ancestors through the
attention plan's mask, siblings never see each other. After verification the draft rolls back to its committed
prefix; the accepted tokens are fed again at the next step together with the new root (the same forward that the
next step needs anyway), so no extra draft pass is spent on bookkeeping.

A draft made of the target's own first layers (`hf_specdec.draft_model_from_layers`, weights unchanged since:
`models.is_first_layers_of`) keeps no cache: the keys and values of its layers for every committed token are the
ones the target's verify forward wrote for its first layers (LayerSkip's self-speculation), so level 0 feeds the
root alone and the tree's tokens stay pending in the target's cache, which its next verify forward writes over. A
row that drafted nothing for a while resumes at the cost of one level, not of a catch-up over what it skipped.

With ``do_sample=True`` children are drawn without replacement from the processed draft distribution q
(Gumbel-top-k) and the tree carries q for exact verification (`DraftSampling.WITHOUT_REPLACEMENT`).

A draft vocabulary (``draft_vocab=``, the ids of the target's vocabulary the draft may propose; each call adds its
prompts' tokens) scores the draft's last hidden state against those rows of its lm_head only: over a 262k-token
vocabulary the full lm_head costs more than a few layers. Verification is unchanged (greedy stays exact; when
sampling q is zero outside the draft vocabulary, which rejection sampling handles exactly). The first forward checks
that the draft's logits are its last hidden state through its lm_head (and Gemma's soft-cap); a model where they are
not drafts over its whole vocabulary, with a warning.

What drafting costs is planned for (`TreeBudgeter.plan_proposing`): every step the draft times its own forwards
(its layers, its lm_head over the whole vocabulary, the feeding of the committed tokens) and reports the seconds per
level drafted; the budget weighs them, in plain steps of the target, against the acceptance its drafts showed and
caps the rows' depth at the levels that pay, none where no level pays. A step whose rows all have depth 0 runs no
draft forward: the committed tokens wait and are fed in one chunk the next time the rows draft (their keys and
values as a forward per step would have written them, up to rounding); a row paused while others
draft feeds its tokens in their forward, where they cost little. The cost is kept per (draft, target) across calls
and processes (`cost_model.proposing_cost_for`). ``HF_SPECDEC_PROPOSING_COST=0`` turns this off: the draft then
feeds every step, as before.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ...kernels.mask_bits import pack_bits
from ...models import is_first_layers_of
from ...text_config import text_config
from ..budget import proposing_cost_enabled
from ..cost_model import proposing_cost_for, save_proposing_cost
from ..logits import NodeScorer
from ..packed_linears import tuning_calls
from ..target import PlannedModel, TailMask, TargetCache
from ..tree import DraftSampling, DraftTree
from .base import Proposer, ProposerSetup, RowState

_SOURCE = "draft"  # the trees' source: the budget calibrates and plans per source


def _vocab_size(model) -> int:
    return int(text_config(model).vocab_size)


class _VocabularyHead:
    """The draft's lm_head over part of its vocabulary: `[K, H]` last hidden states -> `[K, V']` fp32 logits.

    Args:
        model: the draft model (its output embeddings and, where its config has one, the final logit soft-cap).
        ids: `[V']` sorted distinct token ids it scores.
    """

    def __init__(self, model, ids: torch.Tensor):
        lm_head = model.get_output_embeddings()
        self.ids = ids.to(lm_head.weight.device)  # [V']
        self.vocab = int(lm_head.weight.shape[0])
        self.weight = lm_head.weight[self.ids].contiguous()  # [V', H]
        bias = getattr(lm_head, "bias", None)
        self.bias = None if bias is None else bias[self.ids]
        self.softcap = getattr(text_config(model), "final_logit_softcapping", None)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight, self.bias).float()  # [K, V']
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def expand(self, logits: torch.Tensor) -> torch.Tensor:
        """`[n, V']` -> `[n, V]` with -inf outside the draft vocabulary (for logits processors and sampling)."""
        full = logits.new_full((logits.shape[0], self.vocab), float("-inf"))
        return full.index_copy_(1, self.ids, logits)


class DraftModelAssistant(Proposer):
    """Drafts with a small causal LM.

    Args:
        model: the draft model (any transformers causal LM with the target's vocabulary).
        depth: tokens per chain / levels of the tree.
        top_k: children expanded per frontier node; 1 drafts a chain.
        num_nodes: tree size budget (ignored for chains).
        draft_vocab: `[V']` ids of the vocabulary the draft may propose (None: all), or the path of a JSON list of
            them (``hf-specdec tune`` writes ``DIR/draft_vocab.json``); each call adds its prompts' tokens.
            `hf_specdec.training.labels.frequent_token_ids` picks the most frequent ids of some text.
    """

    def __init__(self, model, depth: int = 4, top_k: int = 1, num_nodes: int = 12, draft_vocab=None):
        if depth < 1 or top_k < 1 or num_nodes < 1:
            raise ValueError(f"depth, top_k and num_nodes must be >= 1, got {depth}, {top_k}, {num_nodes}")
        self.model = model
        self.depth = depth
        self.top_k = top_k
        self.num_nodes = num_nodes if top_k > 1 else depth
        if isinstance(draft_vocab, (str, os.PathLike)):
            draft_vocab = json.loads(Path(draft_vocab).read_text(encoding="utf-8"))
        self.draft_vocab = None if draft_vocab is None else torch.as_tensor(draft_vocab, dtype=torch.long).unique()
        if self.draft_vocab is not None and self.draft_vocab.numel() == 0:
            raise ValueError("draft_vocab is empty: pass the token ids the draft may propose, or None for all")
        self.head_checked = False  # whether the first forward confirmed the draft vocabulary's logits
        self.head: _VocabularyHead | None = None  # this call's draft-vocabulary lm_head (`_feed_new_tokens`)
        self.draft: PlannedModel | None = None  # the draft's planned forwards and cache, for one generate call
        self.shared: TargetCache | None = None  # the target's cache, when the draft is its first layers (`start`)
        self.cost = None  # what a drafted level costs (`start`)

    def validate(self, target) -> None:
        if getattr(self.model.config, "is_encoder_decoder", False):
            raise ValueError("the draft model must be a decoder-only causal LM")
        tv, dv = _vocab_size(target), _vocab_size(self.model)
        if tv != dv:
            raise ValueError(
                f"draft model vocabulary ({dv} tokens, {type(self.model).__name__}) does not match the target's "
                f"({tv} tokens): a draft model must share the target's tokenizer"
            )
        if self.model.device != target.device:
            raise ValueError(f"draft model is on {self.model.device} but the target is on {target.device}")
        if self.draft_vocab is not None:
            ids = self.draft_vocab
            if int(ids[0]) < 0 or int(ids[-1]) >= dv:
                raise ValueError(
                    f"draft_vocab holds ids outside the vocabulary [0, {dv}): {int(ids[0])}..{int(ids[-1])}"
                )
            if self.model.get_output_embeddings() is None:
                raise ValueError(f"draft_vocab needs the draft's lm_head; {type(self.model).__name__} has none")

    def start(self, setup: ProposerSetup) -> None:
        super().start(setup)
        self.finish()
        self.draft = None  # entered at the call's first draft forward (`_planned`): none for a call drafting nothing
        self.cache_rows: dict[int, int] = {}
        self.cached: dict[int, int] = {}  # committed tokens of each row in the draft cache
        self.sample = setup.do_sample
        # the call's processors as each row sees them (batch-indexed state, e.g. a repetition penalty's per-row
        # prompt_ignore_length, sliced to the row): applied to the draft's logits when sampling
        self.processors = NodeScorer(setup.logits_processor) if setup.do_sample and setup.logits_processor else None
        self.head = None  # built from the call's prompts at its first draft forward
        lent = setup.target_cache
        self.shared = lent if lent is not None and is_first_layers_of(self.model, setup.target) else None
        self._plan_cost()

    def _plan_cost(self) -> None:
        """What a drafted level costs, planned for by the budget (None: every row feeds every step, as before); kept
        per way of drafting (a draft vocabulary's size, over the target's cache or its own)."""
        ways = [] if self.draft_vocab is None else [f"draft_vocab={self.draft_vocab.numel()}"]
        variant = ",".join([*ways, "target_cache"] if self.shared is not None else ways) or None
        self.cost = proposing_cost_for(self.setup.target, self.model, variant) if proposing_cost_enabled() else None
        if self.cost is not None:
            self.setup.budget.plan_proposing(self.cost, _SOURCE)

    def finish(self) -> None:
        self.shared = None
        draft, self.draft = self.draft, None
        if draft is not None:
            draft.close()
        cost, self.cost = getattr(self, "cost", None), None
        if cost is not None:
            save_proposing_cost(cost)  # for the next process on this machine (throttled; never raises)

    # ------------------------------------------------------------------ drafting
    def _planned(self) -> PlannedModel:
        """The draft's planned forwards and cache for this call, entered once per call, not per draft forward
        (packing the linears scans the modules)."""
        if self.draft is None:
            cache = None if self.shared is None else self.shared.planned.cache
            if cache is not None and (cache.conv_states or cache.recurrent_states):  # states are not per layer
                self.shared = None  # (a hybrid target: its convolution or recurrent states would be the draft's too)
                self._plan_cost()
            lent = None if self.shared is None else self.shared.planned
            self.draft = PlannedModel(self.model, lent_cache=lent).__enter__()
        return self.draft

    def _forward(self, tokens, positions, rows, q_lens, masks, pending, keep) -> torch.Tensor:
        """`[K, V]` fp32 draft logits at the kept positions of one packed forward (see `PlannedModel.forward`); `[K,
        V']` over the draft vocabulary when the call has one (`_VocabularyHead`)."""
        if self.head is None:
            out = self.draft.forward(rows, tokens, positions, q_lens, masks, pending_lens=pending, logits_to_keep=keep)
            return out.logits.float()
        checking = not self.head_checked
        skip = keep if checking else torch.zeros(0, dtype=torch.long, device=tokens.device)  # no full lm_head
        out = self.draft.forward(
            rows, tokens, positions, q_lens, masks, pending_lens=pending, logits_to_keep=skip, hidden_layers=[-1]
        )
        hidden = out.hidden_states[-1]  # [N, H]
        logits = self.head(hidden if isinstance(keep, int) else hidden[keep])  # [K, V']
        if checking:
            self.head_checked = True
            full = out.logits.float()[:, self.head.ids]  # [K, V']
            if not torch.allclose(logits, full, rtol=1e-3, atol=1e-3 * float(full.abs().max().clamp(min=1.0))):
                warnings.warn(
                    f"{type(self.model).__name__}: its logits are not its last hidden state through its lm_head, so "
                    "the draft vocabulary is not used; the draft scores its whole vocabulary",
                    stacklevel=2,
                )
                self.draft_vocab = self.head = None
                return out.logits.float()
        return logits

    def _children(self, logits: torch.Tensor, contexts: list[tuple[int, torch.Tensor]] | None):
        """Top-k (greedy) or Gumbel-top-k (sampling) children of each expanded node of `[n, V]` ``logits``:
        ``(tokens [n, k], log q [n, k], q [n, V] or None)``; ``contexts``: per expanding row its batch row and the
        `[F, L]` token contexts of its F nodes, for the call's logits processors (sampling only)."""
        mapped = self.head is not None and logits.shape[-1] != self.head.vocab  # scored over the draft vocabulary
        if mapped and (self.sample or self.processors):
            logits, mapped = self.head.expand(logits), False  # [n, V]: q and the processors see the whole vocabulary
        if self.processors:
            rows, start = [], 0
            for row, ctx in contexts:
                rows.append(self.processors.for_row(row)(ctx, logits[start : start + ctx.shape[0]].clone()))
                start += ctx.shape[0]
            logits = torch.cat(rows)
        toks, logq, q = self._top_children(logits)
        return (self.head.ids[toks] if mapped else toks), logq, q

    def _top_children(self, logits: torch.Tensor):
        """``(tokens [n, k], log q [n, k], q [n, V] or None)``: the top-k (greedy) or Gumbel-top-k (sampling)
        children of each row of processed `[n, V]` ``logits``."""
        logq = torch.log_softmax(logits, dim=-1)  # [n, V]
        k = min(self.top_k, logq.shape[-1])
        if self.sample:
            u = torch.rand(logq.shape, generator=self.setup.generator, device=logq.device).clamp_(1e-20, 1.0)
            gumbel = logq - torch.log(-torch.log(u))
            top = gumbel.topk(k, dim=-1).indices
            return top, logq.gather(-1, top), logq.exp()
        top = logq.topk(k, dim=-1)
        return top.indices, top.values, None

    def _feed_new_tokens(self, rows: Sequence[RowState]) -> tuple[list[int], torch.Tensor, bool]:
        """Level 0: feed each row's tokens the draft has not seen (ending with the root) and commit them.

        Returns:
            the rows' draft cache rows, `[B, V]` fp32 draft logits at each root (the depth-1 distribution), and
            whether a row fed more than a step's root and accepted tokens (its prompt, or the tokens committed while
            it drafted nothing: a backlog, whose time is no sample of a level's cost).
        """
        device = rows[0].tokens.device
        self._planned()
        if self.draft_vocab is not None and self.head is None:  # the call's first forward: its prompts' tokens too
            ids = torch.cat([self.draft_vocab.to(device), *(r.tokens for r in rows)]).unique()  # [V']
            self.head = _VocabularyHead(self.model, ids)
        if self.shared is not None:
            return self._feed_roots(rows)
        for r in rows:
            if r.row not in self.cache_rows:
                self.cache_rows[r.row] = self.draft.add_rows(1)[0]
                self.cached[r.row] = 0
        feed = [r.tokens[self.cached[r.row] :] for r in rows]  # per row [n]
        q_lens = [f.numel() for f in feed]
        positions = torch.cat([torch.arange(self.cached[r.row], r.tokens.numel(), device=device) for r in rows])
        cache_rows = [self.cache_rows[r.row] for r in rows]
        last = torch.tensor(q_lens, device=device).cumsum(0) - 1  # [B] each row's root in the packed batch
        logits = self._forward(torch.cat(feed), positions, cache_rows, q_lens, None, None, last)
        self.draft.commit_chunks(cache_rows, q_lens)  # the fed tokens stay; last step's tree is forgotten
        for r in rows:
            self.cached[r.row] = r.tokens.numel()
        return cache_rows, logits, max(q_lens) > self.depth + 1

    def _feed_roots(self, rows: Sequence[RowState]) -> tuple[list[int], torch.Tensor, bool]:
        """Level 0 over the target's cache: each row's root alone, left pending (the target committed every earlier
        token's keys and values in the layers the draft is made of). Returns what `_feed_new_tokens` returns."""
        cache_rows = [self.shared.rows[r.row] for r in rows]
        lengths = self.draft.lengths(cache_rows)  # [B]
        expected = np.array([r.tokens.numel() - 1 for r in rows])
        if (lengths != expected).any():
            raise RuntimeError(f"the target's cache holds {lengths.tolist()} tokens of rows whose tokens before their "
                               f"roots number {expected.tolist()}: the draft cannot read its layers' keys there")  # fmt: skip
        device = rows[0].tokens.device
        roots = torch.stack([r.tokens[-1] for r in rows])  # [B]
        every = torch.arange(len(rows), device=device)  # [B] each row's one token is its root
        logits = self._forward(
            roots, torch.from_numpy(lengths).to(device), cache_rows, [1] * len(rows), None, None, every
        )
        return cache_rows, logits, False

    def propose(self, rows: Sequence[RowState]) -> list[DraftTree]:
        device = rows[0].tokens.device
        if self.cost is None:
            return self._draft(rows)[0]
        if all(r.max_depth <= 0 for r in rows):  # drafting is off: no forward; the rows catch up when it is on
            return [DraftTree.empty(device) for _ in rows]
        start, tuning = time.perf_counter(), tuning_calls()
        trees, levels, catching_up = self._draft(rows)  # a paused row among drafting rows feeds in their forward
        fair = tuning_calls() == tuning  # a GEMM form timed inside is no fair sample
        self.budget.record_proposing(time.perf_counter() - start if fair else None, levels, catching_up)
        return trees

    def _draft(self, rows: Sequence[RowState]) -> tuple[list[DraftTree], int, bool]:
        """One tree per row, the levels drafted (draft forwards run) and whether a row fed a backlog."""
        device = rows[0].tokens.device
        cache_rows, logits, fed_backlog = self._feed_new_tokens(rows)
        levels = 1
        table = _NodeTable(len(rows), [min(self.depth, r.max_depth) for r in rows], device)
        frontier = _Frontier.at_roots(len(rows), device, pending_root=self.shared is not None)
        for level in range(1, table.levels + 1):
            expanding = table.expanding(level)  # [E] rows whose frontier was fed (all rows at level 1)
            contexts = frontier.contexts(rows, expanding) if self.processors else None
            toks, logq, q = self._children(logits, contexts)  # [E * F, k] each, q [E * F, V]
            table.add_level(level, expanding, frontier, toks, logq, q)
            going = table.expanding(level + 1)  # rows that expand this level's best children
            if not going.size:
                break
            levels += 1
            frontier = frontier.next(table, level, min(self.top_k, table.widths[-1]))
            mask = frontier.feed_mask(going)  # [E' * F', pending + F'] bool
            feed = frontier.tokens[going].flatten()  # [E' * F']
            width = frontier.tokens.shape[1]
            positions = np.repeat([rows[b].tokens.numel() - 1 + level for b in going], width)
            pending = mask.shape[1] - width
            logits = self._forward(
                feed,
                torch.from_numpy(positions).to(device),
                [cache_rows[b] for b in going],
                [width] * going.size,
                TailMask(pack_bits(mask), np.zeros(going.size, dtype=bool)),
                [pending] * going.size,
                0,
            )
        return table.trees(self.num_nodes, self.sample, device), levels, fed_backlog


class _Frontier:
    """The nodes each row expands next, as `[B, F]` tensors (every expanding row has the same F).

    Attributes:
        nodes: `[B, F]` their indices in the row's node table (-1: the root).
        scores: `[B, F]` their cumulative draft log-probabilities.
        tokens: `[B, F]` their tokens.
        paths: `[B, F, l]` the tokens from the root's child down to each node (for logits processors).
        fed: `[B, F, P]` bool: which of the row's P pending (fed, uncommitted) tree tokens each node sees: its fed
            ancestors, and itself once fed.
    """

    def __init__(self, nodes, scores, tokens, paths, fed):
        self.nodes, self.scores, self.tokens, self.paths, self.fed = nodes, scores, tokens, paths, fed

    @classmethod
    def at_roots(cls, batch: int, device, pending_root: bool = False) -> _Frontier:
        """Every row's root; ``pending_root``: the root is the row's one pending token (over the target's cache)
        rather than committed."""
        nodes = torch.full((batch, 1), -1, dtype=torch.long, device=device)
        empty = torch.zeros(batch, 1, 0, dtype=torch.long, device=device)
        fed = torch.ones(batch, 1, int(pending_root), dtype=torch.bool, device=device)  # [B, 1, P]
        return cls(nodes, torch.zeros(batch, 1, device=device), nodes.clone(), empty, fed)

    def next(self, table: _NodeTable, level: int, width: int) -> _Frontier:
        """The ``width`` best children (by score; ties in creation order) of this frontier's nodes, per row."""
        scores = table.scores[-1]  # [B, F * k] this level's children
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :width]  # [B, F']
        parent = torch.div(order, table.children_per_node[-1], rounding_mode="floor")  # [B, F'] slot in this frontier
        tokens = table.tokens[-1].gather(1, order)
        paths = torch.cat([_gather_rows(self.paths, parent), tokens[..., None]], dim=-1)  # [B, F', l + 1]
        seen = _gather_rows(self.fed, parent)  # [B, F', P] the parents' fed ancestors and themselves
        own = torch.eye(width, dtype=torch.bool, device=seen.device).expand(seen.shape[0], width, width)
        return _Frontier(order + table.offsets[-1], scores.gather(1, order), tokens, paths, torch.cat([seen, own], -1))

    def feed_mask(self, going: np.ndarray) -> torch.Tensor:
        """`[E * F, P + F]` bool: what each fed node of the rows ``going`` sees among the row's pending tokens."""
        return self.fed[torch.from_numpy(going).to(self.fed.device)].flatten(0, 1)

    def contexts(self, rows: Sequence[RowState], expanding: np.ndarray) -> list[tuple[int, torch.Tensor]]:
        """Per expanding row its batch row and the `[F, L + l]` contexts (committed tokens, then each node's path)."""
        out = []
        for b in expanding.tolist():
            paths = self.paths[b]  # [F, l]
            ctx = torch.cat([rows[b].tokens.expand(paths.shape[0], -1), paths.to(rows[b].tokens)], dim=1)
            out.append((rows[b].row, ctx))
        return out


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[b, index[b, j]]`` for `[B, F, ...]` ``x`` and `[B, F']` ``index``: `[B, F', ...]`."""
    return x.gather(1, index.view(*index.shape, *([1] * (x.dim() - 2))).expand(*index.shape, *x.shape[2:]))


class _NodeTable:
    """Every row's drafted nodes, level by level, as `[B, n_l]` tensors per level (the same n_l for every row; a
    row that stopped expanding has invalid entries).

    Args:
        batch: rows.
        caps: per row the deepest level it drafts (host ints).
    """

    def __init__(self, batch: int, caps: Sequence[int], device):
        self.batch, self.device = batch, device
        self.caps = np.asarray(caps, dtype=np.int64)
        self.levels = int(self.caps.max(initial=0))
        self.tokens: list[torch.Tensor] = []  # per level [B, n_l]
        self.scores: list[torch.Tensor] = []  # per level [B, n_l] cumulative log q (-inf where invalid)
        self.parents: list[torch.Tensor] = []  # per level [B, n_l] node index of the parent (-1: root)
        self.widths: list[int] = []  # n_l
        self.offsets: list[int] = []  # node index of each level's first node
        self.children_per_node: list[int] = []
        self.q_parts: list[tuple[np.ndarray, torch.Tensor, torch.Tensor]] = []  # (rows, expanded nodes, q [E, F, V])

    def expanding(self, level: int) -> np.ndarray:
        """`[E]` rows that draft at ``level`` (level 1: every row has its root's distribution)."""
        return np.arange(self.batch) if level == 1 else np.flatnonzero(self.caps >= level)

    def add_level(self, level: int, expanding: np.ndarray, frontier: _Frontier, toks, logq, q) -> None:
        """Record the children ``toks`` / ``logq`` (`[E * F, k]`) of the frontier nodes of the rows ``expanding``."""
        frontier_width, k = frontier.nodes.shape[1], toks.shape[1]
        rows = torch.from_numpy(expanding).to(self.device)
        parent_score = frontier.scores[rows][..., None]  # [E, F, 1]
        if expanding.size != self.batch:
            full = torch.zeros(self.batch, frontier_width, k, dtype=toks.dtype, device=self.device)
            toks = full.index_copy(0, rows, toks.view(-1, frontier_width, k))
            logq = torch.full_like(full, float("-inf"), dtype=logq.dtype).index_copy(
                0, rows, logq.view(-1, frontier_width, k) + parent_score
            )
        else:
            toks, logq = toks.view(-1, frontier_width, k), logq.view(-1, frontier_width, k) + parent_score
        valid = torch.from_numpy(self.caps >= level).to(self.device)[:, None]  # [B, 1]
        self.offsets.append(sum(self.widths))
        self.widths.append(frontier_width * k)
        self.children_per_node.append(k)
        self.tokens.append(toks.flatten(1))
        self.scores.append(torch.where(valid, logq.flatten(1), float("-inf")))
        self.parents.append(frontier.nodes[..., None].expand(-1, -1, k).flatten(1))
        if q is not None:
            self.q_parts.append((expanding, frontier.nodes[rows], q.view(-1, frontier_width, q.shape[-1])))

    def counts(self) -> np.ndarray:
        """`[B]` valid nodes per row."""
        return sum((self.caps >= level + 1) * width for level, width in enumerate(self.widths)) + 0 * self.caps

    def trees(self, num_nodes: int, sample: bool, device) -> list[DraftTree]:
        """Each row's ``num_nodes`` best nodes (by score; ties: shallower, then earlier) as a `DraftTree`; when
        sampling, its first ``num_nodes`` nodes level by level (never chosen by their own drawn probability), children
        drawn without replacement a prefix of their draws."""
        if not self.widths:
            return [DraftTree.empty(device) for _ in range(self.batch)]
        tokens, scores, parents = (torch.cat(x, dim=1) for x in (self.tokens, self.scores, self.parents))  # [B, C]
        total = tokens.shape[1]
        valid_count = self.counts()
        valid = torch.arange(total, device=device)[None, :] < torch.from_numpy(valid_count).to(device)[:, None]
        # nodes are in level order, so index order is (depth, index) order: stable sorts give (-score, depth, index).
        # Sampled children are kept by structure only, (depth, parent's rank, draw rank): a draw kept for its own
        # probability would no longer be a draw from q, and the verifier's rejection sampling would be biased.
        if sample:
            order = torch.arange(total, device=device).expand(self.batch, total)
        else:
            order = torch.sort(scores, dim=1, descending=True, stable=True).indices
        order = order.gather(1, torch.sort((~valid).gather(1, order).to(torch.uint8), dim=1, stable=True).indices)
        counts = np.minimum(valid_count, num_nodes)
        keep = torch.arange(total, device=device)[None, :] < torch.from_numpy(counts).to(device)[:, None]  # [B, C]
        keep = torch.zeros_like(keep).scatter_(1, order, keep)  # [B, C] the kept nodes, by node index
        if sample:
            keep = self._prefix_closed(keep)
            counts = keep.sum(1).cpu().numpy()  # a read, in the sampling path only
        width = int(counts.max(initial=0))
        kept = torch.where(keep, torch.arange(total, device=device), total).sort(dim=1).values[:, :width]  # [B, K]
        new_index = torch.full((self.batch, total + 1), -1, dtype=torch.long, device=device)
        new_index.scatter_(1, kept, torch.arange(width, device=device).expand(self.batch, width))
        index = kept.clamp(max=total - 1)
        parent = parents.gather(1, index)
        parent = torch.where(parent >= 0, new_index.gather(1, parent.clamp(min=0)), -1)
        depth = torch.from_numpy(np.repeat(np.arange(1, len(self.widths) + 1), self.widths)).to(device)[index]
        tokens, probs = tokens.gather(1, index), scores.gather(1, index).exp()
        q = self._draft_probs(kept, total) if sample else None
        out = []
        for b, n in enumerate(counts.tolist()):
            if n == 0:
                out.append(DraftTree.empty(device))
                continue
            out.append(
                DraftTree(
                    tokens[b, :n],
                    parent[b, :n],
                    depth[b, :n],
                    DraftSampling.WITHOUT_REPLACEMENT if sample else DraftSampling.DETERMINISTIC,
                    None if q is None else q[b, : n + 1],
                    probs[b, :n],
                    _SOURCE,
                    depth_bound=int(self.caps[b]),
                )  # fmt: skip
            )
        return out

    def _prefix_closed(self, keep: torch.Tensor) -> torch.Tensor:
        """Keep a child only if its parent and every earlier sibling (its earlier draws) are kept."""
        for level, (offset, width, k) in enumerate(zip(self.offsets, self.widths, self.children_per_node)):
            block = keep[:, offset : offset + width].view(self.batch, -1, k)  # [B, F, k] children by parent
            if level:
                parent = self.parents[level].view(self.batch, -1, k)[..., 0].clamp(min=0)  # [B, F]
                block = block & keep.gather(1, parent)[..., None]
            keep[:, offset : offset + width] = block.to(torch.uint8).cumprod(-1).bool().flatten(1)
        return keep

    def _draft_probs(self, kept: torch.Tensor, total: int) -> torch.Tensor:
        """`[B, K + 1, V]` q over the children of the root and of each kept node (zeros where none were drawn)."""
        vocab = self.q_parts[0][2].shape[-1]
        bank = torch.cat([q.reshape(-1, vocab) for _, _, q in self.q_parts] + [self.q_parts[0][2].new_zeros(1, vocab)])
        where = torch.full((self.batch, total + 2), bank.shape[0] - 1, dtype=torch.long, device=bank.device)  # +1
        start = 0
        for rows, nodes, q in self.q_parts:  # one entry per level
            count = q.shape[0] * q.shape[1]
            ids = torch.arange(start, start + count, device=bank.device).view(q.shape[0], q.shape[1])
            where[torch.from_numpy(rows).to(bank.device)[:, None], nodes + 1] = ids  # the root is position 0
            start += count
        positions = torch.cat([torch.zeros_like(kept[:, :1]), kept + 1], dim=1)  # [B, K + 1]
        return bank[where.gather(1, positions)]


def draft_model_assistant_for(obj, target) -> Proposer | None:
    """``assistant=<PreTrainedModel>`` -> a chain-drafting `DraftModelAssistant`."""
    from transformers import PreTrainedModel

    if isinstance(obj, PreTrainedModel):
        return DraftModelAssistant(obj)
    return None
