"""Short-convolution layers (LFM2's ``ShortConv``: gated depthwise causal convolution of kernel ``K``) on token trees.

Vanilla runs the convolution along the sequence: a token's output mixes the inputs of itself and the ``K - 1`` tokens
before it. In a planned forward the tokens before a tree node are its ancestors, then the row's committed text, so
each token's window is gathered along its own path: the staged inputs of this forward's and the pending tokens
(through the plan's visibility masks) and the row's committed state (``cache/conv_states.py``). Rows of a packed batch
never see each other. The accepted path's inputs become the state when the cache commits.

Like attention, the layer is switched per call and per thread: `install_for` wraps the ``forward`` of the model's
short-convolution classes once, and the wrapper serves the active plan inside planned forwards only; everywhere else
the original runs unchanged.

What every stateful layer served on trees shares lives here: the path windows (`window_index`, `path_windows`), each
token's predecessor along its path (`parents`), the recurrence driver that gives each token its predecessor's state
(`recurrent_outputs`: ``gated_delta.py``, ``mamba.py``, ``lightning.py``) and the class wrapper (`wrap_layer_classes`).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from .plan import AttentionPlan

_LOCK = threading.Lock()


def is_short_conv(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an LFM-style short convolution this module can run on trees (LFM2, LFM2-MoE, LFM3)."""
    conv = getattr(module, "conv", None)
    return (
        type(module).__name__.endswith("ShortConv")
        and isinstance(conv, torch.nn.Conv1d)
        and conv.groups == conv.in_channels == conv.out_channels
        and all(hasattr(module, a) for a in ("in_proj", "out_proj", "layer_idx", "conv_kernel_size"))
    )


def window_index(plan: AttentionPlan, width: int) -> torch.Tensor:
    """`[N, K]` where each packed token's window of ``K = width + 1`` inputs lies in the source
    ``[committed states of the rows (B x width) ; each row's staged then new inputs]``, oldest first (built once per
    forward and kernel size, kept on the plan).

    What a token sees is a chain (the row's prefix, then its path through the tail); the input ``d`` steps before it
    is the visible tail token at distance ``d`` along that chain, else the prefix position ``d - a`` before the tail
    (``a``: the tail tokens it sees, itself included), i.e. committed slot ``width - 1 - (d - a)``.
    """
    cached = plan.conv_windows.get(width)
    if cached is not None:
        return cached
    cu, prefix, pending = plan.cu_seqlens, plan.prefix_lens, plan.pending_lens
    tails = np.cumsum(np.concatenate([[0], pending + np.diff(cu)]))  # where each row's staged + new inputs start
    base = plan.num_rows * width
    out = []
    for b in range(plan.num_rows):
        n, pre = int(cu[b + 1] - cu[b]), int(prefix[b])
        mask = plan.row_mask(b, "cpu")  # [n, prefix + pending + n] or None (a causal chunk)
        tail = torch.ones(n, n, dtype=torch.bool).tril() if mask is None else mask[:, pre:]  # [n, pending + n]
        seen = tail.to(torch.int64).cumsum(-1)
        dist = seen[:, -1:] - seen  # [n, p + n] distance of each visible tail token
        a = seen[:, -1]  # [n]
        idx = torch.empty(n, width + 1, dtype=torch.int64)
        for d in range(width + 1):
            match = tail & (dist == d)
            in_tail = match.any(-1)
            col = match.to(torch.int64).argmax(-1)
            slot = (width - 1 - (d - a)).clamp(min=0)
            idx[:, width - d] = torch.where(in_tail, base + int(tails[b]) + col, b * width + slot)
        out.append(idx)
    plan.conv_windows[width] = index = torch.cat(out).to(plan.positions.device)
    return index


def path_windows(layer: int, plan: AttentionPlan, inputs: torch.Tensor, width: int) -> torch.Tensor:
    """`[N, width + 1, C]` each packed token's convolution window along its path (oldest first) over ``inputs``
    `[N, C]` (this forward's), the pending tokens' staged inputs and the rows' committed ones; stages ``inputs``."""
    states = plan.cache.conv_states
    committed = states.committed(layer, plan.rows, width, inputs)  # [B, width, C]
    pieces = [committed.reshape(-1, inputs.shape[-1])]
    for b, row in enumerate(plan.rows.tolist()):
        staged = states.pending(layer, row, int(plan.pending_lens[b]))  # [pending, C] or None
        if staged is not None:
            pieces.append(staged)
        pieces.append(inputs[int(plan.cu_seqlens[b]) : int(plan.cu_seqlens[b + 1])])
    states.stage(layer, plan.rows, inputs, plan.cu_seqlens)
    return torch.cat(pieces)[window_index(plan, width)]


def depthwise(conv: torch.nn.Conv1d, windows: torch.Tensor) -> torch.Tensor:
    """`[N, C]` the depthwise convolution ``conv`` (weight `[C, 1, K]`) of `[N, K, C]` windows, as vanilla's."""
    out = torch.einsum("nkc,ck->nc", windows, conv.weight[:, 0, :].to(windows.dtype))
    return out if conv.bias is None else out + conv.bias


def tree_short_conv(module: torch.nn.Module, hidden_states: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """The layer's output for the plan's packed tokens: `[1, N, H]` -> `[1, N, H]`."""
    plan.state_modules.append(module)
    bcx = module.in_proj(hidden_states)[0]  # [N, 3C]
    gate_b, gate_c, x = bcx.chunk(3, dim=-1)
    inputs = gate_b * x  # [N, C] what vanilla convolves
    out = depthwise(module.conv, path_windows(module.layer_idx, plan, inputs, module.conv_kernel_size - 1))
    return module.out_proj((gate_c * out)[None])  # [1, N, H]


def parents(plan: AttentionPlan) -> list[np.ndarray]:
    """Per row, each new token's predecessor as an index into the row's ``[pending ; new]`` tokens, -1 for the
    row's committed text (built from the same masks as the convolution windows)."""
    prev = window_index(plan, 1)[:, 0].cpu().numpy()  # [N] source index of the input one step back
    base = plan.num_rows
    tails = np.cumsum(np.concatenate([[0], plan.pending_lens + np.diff(plan.cu_seqlens)]))
    out = []
    for b in range(plan.num_rows):
        mine = prev[plan.cu_seqlens[b] : plan.cu_seqlens[b + 1]]
        out.append(np.where(mine >= base, mine - base - tails[b], -1))
    return out


def recurrent_outputs(
    plan: AttentionPlan, layer: int, zero: torch.Tensor, chunk_rule, token_rule, chunk_from_state: bool = True
) -> torch.Tensor:
    """`[N, ...]` a recurrent layer's outputs for the plan's packed tokens, its states staged in
    ``plan.cache.recurrent_states`` (shared by the recurrent layers served on trees: ``gated_delta.py``, ``mamba.py``,
    ``lightning.py``).

    A row that is a causal chunk with nothing pending (a prompt, or accepted tokens a draft model catches up on) runs
    the layer's prefill rule, batched over the rows of equal length; every other token runs the one-token rule (the
    decode step), batched over all tokens of one depth, each from its predecessor's state.

    Args:
        plan: the forward's plan.
        layer: the layer's index (its states' key in the cache).
        zero: `[*state]` a row's state before its first token (shape, dtype and device of every state).
        chunk_rule: ``(index [R, n], initial [R, *state]) -> (out [R, n, ...], last [R, *state])``, the prefill rule
            over the causal chunks of packed tokens ``index`` from ``initial``.
        token_rule: ``(index [m], start [m, *state]) -> (out [m, ...], state [m, *state])``, the one-token rule for
            packed tokens ``index`` from their predecessors' states ``start`` (a copy, which it may write).
        chunk_from_state: whether ``chunk_rule`` starts from a state (Mamba-1's scan and MiniMax's blocked prefill
            start from zeros only: a chunk after committed tokens then runs the one-token rule, token after token).
    """
    states = plan.cache.recurrent_states
    committed = states.committed(layer, plan.rows, zero)  # [B, *state]
    rows = plan.rows.tolist()
    pending = [states.pending(layer, row, int(plan.pending_lens[r])) for r, row in enumerate(rows)]  # [P, *state]
    chunks = _chunk_rows(plan, chunk_from_state)
    index, outs, lasts = _run_chunks(plan, chunks, committed, chunk_rule)
    trees = [r for r in range(plan.num_rows) if not chunks[r]]
    new = None
    if trees:
        base = torch.cat([committed, *[p for p in pending if p is not None]])  # [B + pending, *state]
        tree_index, tree_outs, new = _run_levels(plan, trees, base, token_rule)
        index, outs = index + tree_index, outs + tree_outs
    for r, row in enumerate(rows):
        s, e = int(plan.cu_seqlens[r]), int(plan.cu_seqlens[r + 1])
        states.stage(layer, row, e - s, lasts[r][None] if chunks[r] else new[s:e])
    order = torch.cat(index).to(outs[0].device)
    result = outs[0].new_empty(int(plan.cu_seqlens[-1]), *outs[0].shape[1:])  # [N, ...]
    result[order] = torch.cat(outs)
    return result


def _chunk_rows(plan: AttentionPlan, from_state: bool) -> list[bool]:
    """Per row, whether it runs the prefill rule: a causal chunk with nothing pending, and not a single token after
    committed ones (vanilla decodes that one with the one-token rule); without ``from_state``, a row's first chunk
    only."""
    n, prefix = np.diff(plan.cu_seqlens), plan.prefix_lens
    return [
        bool(plan.mask.causal[b])
        and not plan.pending_lens[b]
        and (n[b] > 1 or not prefix[b])
        and (from_state or not prefix[b])
        for b in range(plan.num_rows)
    ]


def _run_chunks(plan: AttentionPlan, chunks: list[bool], committed: torch.Tensor, chunk_rule):
    """The prefill rule over the chunk rows, one call per chunk length: ``(index [per call: [R n]], out [per call:
    [R n, ...]], last {row b: [*state]})``."""
    index, outs, lasts = [], [], {}
    n = np.diff(plan.cu_seqlens)
    for length in sorted({int(n[b]) for b in range(plan.num_rows) if chunks[b]}):
        group = [b for b in range(plan.num_rows) if chunks[b] and n[b] == length]
        idx = torch.as_tensor(plan.cu_seqlens[group])[:, None] + torch.arange(length)  # [R, n]
        out, last = chunk_rule(idx.to(committed.device), committed[torch.as_tensor(group, device=committed.device)])
        index.append(idx.reshape(-1))
        outs.append(out.reshape(-1, *out.shape[2:]))
        lasts.update(zip(group, last))
    return index, outs, lasts


def _run_levels(plan: AttentionPlan, trees: list[int], base: torch.Tensor, token_rule):
    """The one-token rule over the tokens of rows ``trees``, one call per depth, each token from its predecessor's
    state in ``base`` `[B + pending, *state]` (committed, then the rows' pending states) or a new token's:
    ``(index [per call: [m]], out [per call: [m, ...]], states [N, *state])``."""
    source, depth = _sources(plan, trees)  # [N] each (-1 for chunk rows' tokens)
    new = base.new_zeros(int(plan.cu_seqlens[-1]), *base.shape[1:])  # [N, *state]
    index, outs = [], []
    nb = base.shape[0]  # a token at depth d > 0 follows one of this forward's tokens, at depth 0 a base state
    for level in range(int(depth.max()) + 1):
        idx = np.nonzero(depth == level)[0]
        src = torch.as_tensor(source[idx], device=base.device)
        start = new.index_select(0, src - nb) if level else base.index_select(0, src)  # [m, *state], a copy
        out, state = token_rule(torch.as_tensor(idx, device=base.device), start)
        new[torch.as_tensor(idx, device=base.device)] = state
        index.append(torch.as_tensor(idx))
        outs.append(out)
    return index, outs, new


def _sources(plan: AttentionPlan, trees: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """For the tokens of rows ``trees``: ``(source [N], depth [N])``: where each token's predecessor's state lies in
    ``[committed (B) ; pending of every row ; this forward's tokens (N)]``, and how many of this forward's tokens
    precede it on its path (-1 for other rows' tokens)."""
    prev = parents(plan)
    pending = plan.pending_lens
    offset = plan.num_rows + np.concatenate([[0], np.cumsum(pending)[:-1]])  # where each row's pending states start
    nb = plan.num_rows + int(pending.sum())
    source = np.full(int(plan.cu_seqlens[-1]), -1, dtype=np.int64)
    depth = np.full(int(plan.cu_seqlens[-1]), -1, dtype=np.int64)
    for b in trees:
        s, e, p = int(plan.cu_seqlens[b]), int(plan.cu_seqlens[b + 1]), prev[b]
        source[s:e] = np.where(p < 0, b, np.where(p < pending[b], offset[b] + p, nb + s + p - pending[b]))
        mask = plan.row_mask(b, "cpu")  # [n, prefix + pending + n] or None (causal)
        own = np.arange(e - s) if mask is None else mask[:, int(plan.prefix_lens[b] + pending[b]) :].sum(-1).numpy() - 1
        depth[s:e] = own
    return source, depth


def wrap_layer_classes(model: torch.nn.Module, active_plan, is_layer, tree_forward) -> None:
    """Wrap, once per class, the ``forward`` of ``model``'s modules that ``is_layer``: inside a planned forward
    (``active_plan()`` returns this thread's plan) the wrapper runs ``tree_forward(module, hidden_states, plan)``,
    everywhere else the original. Shared by every stateful layer served on trees (this module, ``gated_delta.py``,
    ``mamba.py``, ``lightning.py``)."""
    classes = {type(m) for m in model.modules() if is_layer(m)}
    with _LOCK:
        for cls in classes:
            if hasattr(cls.forward, "hf_specdec_fallback"):
                continue
            forward = cls.forward

            def wrapped(self, hidden_states, *args, _forward=forward, **kwargs):
                plan = active_plan()
                if plan is None:
                    return _forward(self, hidden_states, *args, **kwargs)
                return tree_forward(self, hidden_states, plan)

            wrapped.hf_specdec_fallback = forward
            cls.forward = wrapped


def install_for(model: torch.nn.Module, active_plan) -> None:
    """Serve ``model``'s short convolutions on trees inside planned forwards (`wrap_layer_classes`)."""
    wrap_layer_classes(model, active_plan, is_short_conv, tree_short_conv)
