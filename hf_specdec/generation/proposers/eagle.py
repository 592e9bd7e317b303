"""EAGLE proposer: an `EagleHead` drafting EAGLE-2's dynamic token tree over the target's own features.

Features come from the verification forward itself: the loop hands `observe` the target's hidden states at every
token it commits (``hidden_state_layers`` = the head's feature layers), so no extra target pass is needed. The head
keeps its own KV cache (`DraftKVCache`, one slot per batch row) over the pairs ``(feature t, token t + 1)`` of the
committed text, prompt included: after prefill the prompt's pairs, after each step the pairs of the accepted path
with the target's *true* features. The tree's own keys and values live in a scratch buffer for one `propose` and are
dropped afterwards, so the cache is always exactly the accepted path (upstream EAGLE re-encodes accepted tokens the
same way).

EAGLE-2's dynamic expansion (Li et al. 2024, arXiv:2406.16858, section 4), vectorised over the frontier and over the
rows: the root's top-k children form the first frontier; each of ``depth - 1`` head passes expands every frontier node
(one batched forward of ``B x k`` queries), scores its top-k children by cumulative draft log-probability and keeps the
best k of the ``k x k`` as the next frontier; finally the ``num_nodes`` best-scored candidates form the tree. A parent
always scores at least as high as its child (log-probabilities are <= 0) and ties are broken by depth, so the kept set
is a tree; nodes are emitted in candidate order, so parents precede children. Children are a deterministic top-k of
the context, so the tree is `DraftSampling.DETERMINISTIC` and the verifier stays exact for sampling too.

Tree size: every kept candidate (the ``num_nodes`` best) goes out with its path probability (``scores``,
``source="eagle"``) and the loop's tree budget cuts each row to what pays on this machine, pausing rows whose drafts
stopped paying (a paused row costs no head pass: its pairs queue up until it drafts again); ``tree_budget=False``
verifies the candidates whole. The head's step-cost table (``head.tree["step_cost"]``) is the budget's prior.
"""

from __future__ import annotations

import torch

from ...heads.checks import check_tree_sizes
from ...heads.draft_cache import DraftKVCache
from ...heads.eagle import EagleHead
from ..tree import DraftSampling, DraftTree
from .base import Proposer, RowFeedback, RowState
from .hidden_states import HiddenStateProposer

DEFAULT_TOP_K = 6
DEFAULT_DEPTH = 5
DEFAULT_NUM_NODES = 24  # CPU-sized; EAGLE-2 uses 60 on a GPU


def expand_dynamic_tree(
    head: EagleHead,
    cache: DraftKVCache,
    slots: torch.Tensor,
    root_out: torch.Tensor,
    root_logp: torch.Tensor,
    top_k: int,
    depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-2's expansion for ``B`` rows at once: every candidate node with its score, token, parent and depth.

    Args:
        head: the draft head.
        cache: the head's cache; ``slots`` `[B]` are the rows' slots (their committed pairs end with the root's).
        root_out: `[B, H]` the head's output at the root's pair (the feature that predicts depth 1).
        root_logp: `[B, V']` log-probabilities of depth 1 over the draft vocabulary.
        top_k: children per expanded node, and frontier width.
        depth: tree depth (``depth - 1`` head passes).
    Returns:
        ``(score, token, parent, node_depth)``, each `[B, C]` with ``C = k + (depth - 1) k^2`` candidates in creation
        order: cumulative log-probability, token id, parent candidate index (-1 = root), depth.
    """
    b, k = root_logp.shape[0], min(top_k, root_logp.shape[-1])
    dev = root_logp.device
    score, idx = root_logp.topk(k, dim=-1)  # [B, k]
    scores, tokens = [score], [head.draft_to_token(idx)]
    parents, depths = [torch.full((b, k), -1, device=dev)], [torch.ones(b, k, dtype=torch.long, device=dev)]
    front_cand = torch.arange(k, device=dev).expand(b, k)  # [B, k] candidate index of each frontier node
    front_feat = root_out.unsqueeze(1).expand(b, k, root_out.shape[-1])  # [B, k, H] the parents' outputs
    front_score, front_tok = score, tokens[0]
    lengths = cache.lengths[slots]  # [B]
    past = int(lengths.max())
    pk, pv = cache.key[slots, :, :past], cache.value[slots, :, :past]  # [B, kvh, L, D]
    seen = torch.arange(past, device=dev)[None, :] < lengths[:, None]  # [B, L]
    anc = torch.zeros(b, 0, 0, dtype=torch.bool, device=dev)  # [B, P, P] ancestry among processed nodes
    front_proc = torch.full((b, k), -1, device=dev)  # [B, k] processed index of each frontier node's parent
    n_cand = k
    for d in range(1, depth):
        p = anc.shape[1]
        parent_rows = torch.zeros(b, k, p, dtype=torch.bool, device=dev)
        if p:
            has = front_proc >= 0
            gathered = anc.gather(1, front_proc.clamp(min=0)[..., None].expand(b, k, p))  # [B, k, P]
            parent_rows = (gathered | torch.nn.functional.one_hot(front_proc.clamp(min=0), p).bool()) & has[..., None]
        mask = torch.cat(
            [
                seen[:, None, :].expand(b, k, past),
                parent_rows,
                torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k),
            ],
            dim=-1,
        )  # [B, k, L + P + k]
        positions = (lengths - 1 + d)[:, None].expand(b, k)
        out, nk, nv = head.layer_forward(front_tok, front_feat, positions, mask, pk, pv)  # out [B, k, H]
        pk, pv = torch.cat([pk, nk], dim=2), torch.cat([pv, nv], dim=2)
        new_anc = torch.cat([parent_rows, torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k)], dim=-1)
        anc = torch.cat([torch.nn.functional.pad(anc, (0, k)), new_anc], dim=1)  # [B, P + k, P + k]
        logp = torch.log_softmax(head.logits(out), dim=-1)  # [B, k, V']
        child_lp, child_idx = logp.topk(k, dim=-1)  # [B, k, k]
        cum = (front_score[..., None] + child_lp).reshape(b, k * k)  # [B, k * k]
        child_tok = head.draft_to_token(child_idx).reshape(b, k * k)
        child_parent = front_cand[..., None].expand(b, k, k).reshape(b, k * k)
        scores.append(cum)
        tokens.append(child_tok)
        parents.append(child_parent)
        depths.append(torch.full((b, k * k), d + 1, dtype=torch.long, device=dev))
        if d + 1 < depth:  # the next frontier: the best k children
            front_score, best = cum.topk(k, dim=-1)  # [B, k]
            front_tok = child_tok.gather(1, best)
            front_cand = n_cand + best
            front_proc = p + best // k  # the chosen children's parents are this pass's processed nodes
            front_feat = out.gather(1, (best // k)[..., None].expand(b, k, out.shape[-1]))
        n_cand += k * k
    return torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(depths, 1)


def select_tree_nodes(
    score: torch.Tensor, node_depth: torch.Tensor, max_depth: torch.Tensor, num_nodes: int
) -> torch.Tensor:
    """The candidates each row keeps: the ``num_nodes`` best by score (ties: shallower first), none deeper than the
    row's ``max_depth``.

    Args:
        score: `[B, C]` cumulative log-probabilities (a child never above its parent).
        node_depth: `[B, C]` depth of each candidate.
        max_depth: `[B]` deepest node allowed per row.
        num_nodes: nodes per row at most.
    Returns:
        `[B, C]` bool, the kept candidates (closed under parents: a kept node's parent is kept).
    """
    allowed = (node_depth <= max_depth[:, None]) & (score > float("-inf"))  # a zero-probability draft never pays
    key = torch.where(allowed, score, torch.full_like(score, float("-inf")))
    order = torch.sort(node_depth, dim=1, stable=True).indices  # shallower first among equal scores
    order = order.gather(1, torch.sort(key.gather(1, order), dim=1, descending=True, stable=True).indices)
    n = min(num_nodes, score.shape[1])
    keep = torch.zeros_like(allowed)
    keep.scatter_(1, order[:, :n], True)
    return keep & allowed


class EagleAssistant(HiddenStateProposer):
    """Drafts EAGLE-2 dynamic trees with an `EagleHead` (EAGLE-1/2 or EAGLE-3 weights); the life cycle (binding,
    the head's cache, the queued pairs) is `HiddenStateProposer`'s.

    Args:
        head: the draft head.
        top_k: children per expanded node and frontier width (default: the head's ``tree["top_k"]``, else 6).
        depth: tree depth (default: ``tree["depth"]``, else 5).
        num_nodes: nodes per tree at most (default: ``tree["num_nodes"]``, else 24).
        step_cost: ``{nodes: cost of a step / a plain decoding step}`` (default: the head's ``tree["step_cost"]``):
            the tree budget's prior cost curve.
    """

    sampling = DraftSampling.DETERMINISTIC
    default_top_k, default_num_nodes = DEFAULT_TOP_K, DEFAULT_NUM_NODES

    def __init__(
        self,
        head: EagleHead,
        top_k: int | None = None,
        depth: int | None = None,
        num_nodes: int | None = None,
        step_cost: dict[int, float] | None = None,
    ):
        if not isinstance(head, EagleHead):
            raise TypeError(f"EagleAssistant needs an EagleHead, got {type(head).__name__}")
        super().__init__(head, top_k, num_nodes, step_cost)
        self.depth = int(depth or (head.tree or {}).get("depth") or DEFAULT_DEPTH)
        check_tree_sizes("EagleAssistant", "the tree", top_k=self.top_k, depth=self.depth, num_nodes=self.num_nodes)

    def __repr__(self) -> str:
        return f"EagleAssistant(top_k={self.top_k}, depth={self.depth}, num_nodes={self.num_nodes})"

    def _layers_before_bind(self, head: EagleHead) -> tuple[int, ...] | None:
        return head.feature_layers if head.version == 1 or head.aux_layers else None  # EAGLE-1 reads the final state

    def drafting_modules(self) -> tuple[torch.nn.Module, ...]:
        return (self.draft_head, *self.draft_head.drafting_linears())  # EAGLE-1: its gathered lm_head rows too

    def _row_states(self, fb: RowFeedback, feats: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A row's pairs (feature t, token t + 1): `[m, F]` the features at ``new_tokens``, `[m]` the tokens after
        them (the last one the new root)."""
        nxt = torch.cat([fb.new_tokens[1:].long(), fb.new_tokens.new_tensor([fb.next_token]).long()])  # [m]
        return feats, nxt

    # ------------------------------------------------------------------ drafting
    def _context_kv(self, slots: list[int], lengths: torch.Tensor, m: torch.Tensor, feats: torch.Tensor, toks):
        """The head's pass over the rows' queued pairs (`[B, q, F]` features, `[B, q]` tokens) after their cached
        ones: ``(out, key, value)``, ``out`` `[B, H]` the head's output at each row's last pair (the root's)."""
        cache, dev = self.cache, self.cache.key.device
        b, q = feats.shape[:2]
        past = int(lengths.max())
        seen = (torch.arange(past, device=dev)[None, :] < lengths[:, None])[:, None, :].expand(b, q, past)
        valid = torch.arange(q, device=dev)[None, :] < m[:, None]  # [B, q]
        causal = torch.ones(q, q, dtype=torch.bool, device=dev).tril() & valid[:, None, :]
        causal = causal | torch.eye(q, dtype=torch.bool, device=dev)  # padding queries see themselves only
        mask = torch.cat([seen & valid[..., None], causal], dim=-1)  # [B, q, L + q]
        positions = lengths[:, None] + torch.arange(q, device=dev)[None, :]
        pk, pv = cache.key[slots, :, :past], cache.value[slots, :, :past]
        out, nk, nv = self.draft_head.layer_forward(toks, feats, positions, mask, pk, pv)  # [B, q, H]
        return out[torch.arange(b, device=dev), m - 1], nk, nv

    def _draft(self, rows: list[RowState]) -> list[DraftTree]:
        slots = [r.row for r in rows]
        root_out = self._commit(slots)  # [B, H]
        root_logp = torch.log_softmax(self.draft_head.logits(root_out), dim=-1)  # [B, V']
        max_depth = torch.tensor([min(r.max_depth, self.depth) for r in rows], device=root_logp.device)
        score, token, parent, node_depth = expand_dynamic_tree(
            self.draft_head, self.cache, torch.tensor(slots, device=self.cache.key.device), root_out, root_logp,
            self.top_k, int(max_depth.max()),
        )  # fmt: skip
        keep = select_tree_nodes(score, node_depth, max_depth, self.num_nodes)  # [B, C]
        return [self._row_tree(r, score[j], token[j], parent[j], node_depth[j], keep[j]) for j, r in enumerate(rows)]

    def _row_tree(self, row: RowState, score, token, parent, node_depth, keep) -> DraftTree:
        """One row's kept candidates as a `DraftTree` (candidate order: parents first)."""
        idx = keep.nonzero().flatten()  # [n] ascending candidate index
        device = row.tokens.device
        if idx.numel() == 0:
            return DraftTree.empty(device)
        remap = torch.full((keep.numel(),), -1, dtype=torch.long, device=keep.device)
        remap[idx] = torch.arange(idx.numel(), device=keep.device)
        par = parent[idx]
        new_parent = torch.where(par >= 0, remap[par.clamp(min=0)], par)
        tree = DraftTree(
            token[idx].to(device), new_parent.to(device), node_depth[idx].to(device), self.sampling,
            depth_bound=min(row.max_depth, self.depth),
        )  # fmt: skip
        tree.scores, tree.source = score[idx].exp().float(), "eagle"  # path probabilities, for the tree budget
        return tree


def eagle_assistant_for(obj, target) -> Proposer | None:
    """``assistant=`` resolver: an `EagleAssistant` when ``obj`` is an `EagleHead`, else None."""
    if isinstance(obj, EagleHead):
        return EagleAssistant(obj)
    return None


__all__ = ["EagleAssistant", "eagle_assistant_for", "expand_dynamic_tree", "select_tree_nodes"]
