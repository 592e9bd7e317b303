"""Plain-torch paged tree attention: the CPU path of the ``hf_specdec`` backend and the oracle for the kernels.

For each row of the packed batch it reads the row's `[H_kv, L, D]` K/V through its block table (a zero-copy view when
the row's pages are contiguous; head-major pools make it one with unit stride between positions, as SDPA reads
fastest), builds ``[prefix | own-new-tokens mask]`` once per forward (kept on the plan) and calls
SDPA with GQA. A sliding window over one new token reads the window's last keys with SDPA; soft-capping, sliding
windows over chunks and trees, sinks and chunked attention fall back to an explicit softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache.paged import PagedLayer
from .plan import AttentionPlan, RowRead


def paged_attention_reference(
    query: torch.Tensor,
    layer: PagedLayer,
    plan: AttentionPlan,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Attention of the packed new tokens over their rows' pages.

    Args:
        query: `[1, H_q, N, D]` queries of the packed new tokens (transformers' layout), or `[N, H_q, D]`.
        layer: the layer's pools (the new tokens' K/V are already written).
        plan: the forward's `AttentionPlan`.
        scale: softmax scale.
        sliding_window: if set, a query at position p only sees keys at positions > p - sliding_window.
        softcap: if set, scores are ``softcap * tanh(scores / softcap)`` before the softmax.
        sinks: `[H_q]` attention-sink logits (gpt-oss's ``s_aux``): each query's softmax also spreads over a sink.
        chunk_size: if set, a query at position p only sees keys in its own chunk (``k // chunk_size == p //
            chunk_size``; Llama 4's chunked attention).
    Returns:
        `[1, N, H_q, D]` (`[N, H_q, D]` for a 3-D query).
    """
    if query.dim() == 3:
        return paged_attention_reference(
            query.transpose(0, 1)[None], layer, plan, scale, sliding_window, softcap, sinks, chunk_size
        )[0]
    outs = []
    for b, read in enumerate(_row_reads(plan, query.device)):
        s, e, total, mask = read.start, read.end, read.total, read.mask
        n = e - s
        k, v = layer.gather_heads(int(plan.rows[b]), total, read.where)  # [H_kv, L + P + n, D]
        q = query if len(plan.row_reads) == 1 else query[:, :, s:e]  # [1, H_q, n, D]
        k, v = k[None], v[None]  # [1, H_kv, L + P + n, D]
        if k.dtype != q.dtype:  # a cache kept in another dtype than the model's
            k, v = k.to(q.dtype), v.to(q.dtype)
        plain = softcap is None and sinks is None and chunk_size is None
        if sliding_window is not None and plain and mask is None and n == 1:
            # one new token after its committed prefix (a step that drafted nothing): it sees the last keys of the
            # window, as SDPA over them computes, no explicit mask needed
            keep = min(total, sliding_window)
            o = F.scaled_dot_product_attention(q, k[:, :, -keep:], v[:, :, -keep:], scale=scale, enable_gqa=True)
        elif sliding_window is None and plain:
            causal = mask is None and n > 1
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
        else:
            prefix = int(plan.prefix_lens[b]) + int(plan.pending_lens[b])
            if mask is None:
                mask = torch.ones(n, total, dtype=torch.bool, device=q.device)
                if n > 1:
                    mask[:, prefix:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            if sliding_window is not None:
                mask = mask & (_distances(mask) < sliding_window)
            if chunk_size is not None:
                q_pos = plan.positions[s:e].to(q.device)[:, None]  # [n, 1]
                mask = mask & ((q_pos - _distances(mask)) // chunk_size == q_pos // chunk_size)
            o = _explicit_attention(q, k, v, mask, scale, softcap, sinks)
        outs.append(o)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [1, H_q, N, D]
    return out.transpose(1, 2)


def _row_reads(plan: AttentionPlan, device: torch.device) -> list[RowRead]:
    """Per row where its tokens are, which keys it reads and how, and its mask: built once per forward (the torch
    path attends row by row anyway), kept on the plan for every layer."""
    if plan.row_reads is None:
        cu, prefix, pending = plan.cu_seqlens.tolist(), plan.prefix_lens.tolist(), plan.pending_lens.tolist()
        reads = []
        for b, row in enumerate(plan.rows.tolist()):
            s, e = cu[b], cu[b + 1]
            total = prefix[b] + pending[b] + (e - s)
            where = plan.cache.read_index(row, total, device)
            reads.append(RowRead(s, e, total, where, plan.row_mask(b, device)))
        plan.row_reads = reads
    return plan.row_reads


def _distances(mask: torch.Tensor) -> torch.Tensor:
    """`[n, total]` how many positions each visible key lies before its query.

    What a token sees is a chain: the row's prefix and its own path through the tree (pending ancestors, new
    ancestors, itself), whose positions count up by one, so a visible key's distance is the number of visible keys
    after it. This holds for causal chunks, trees and a draft model's pending levels alike."""
    seen = mask.to(torch.int32).cumsum(-1)  # [n, total]
    return seen[:, -1:] - seen


def _explicit_attention(q, k, v, mask, scale, softcap, sinks=None):
    """`[1, H_q, n, D]` attention with a boolean mask, optional soft-capping, GQA by head repetition, and optional
    attention sinks (`[H_q]` logits of a key with no value that every query also attends to, as gpt-oss has)."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1).float(), dim=-1)[..., :-1]  # the sink's share dropped
    return torch.matmul(probs.to(v.dtype), v)


def dense_tree_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Naive oracle: `[n, H_q, D]` queries over dense `[L, H_kv, D]` keys/values with a `[n, L]` bool mask (fp64)."""
    q = query.double().transpose(0, 1)  # [H_q, n, D]
    rep = q.shape[0] // keys.shape[1]
    k = keys.double().transpose(0, 1).repeat_interleave(rep, 0)  # [H_q, L, D]
    v = values.double().transpose(0, 1).repeat_interleave(rep, 0)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask.to(q.device), float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(0, 1).to(query.dtype)
