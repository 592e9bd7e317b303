"""Gated delta nets (the linear attention of Qwen3-Next, Qwen3.5 and OLMo-Hybrid) and Kimi delta attention (the
same with a decay per key channel: Kimi-Linear, Bailing-Hybrid) on token trees.

The layer convolves its q/k/v inputs causally (kernel K, then its activation) and runs a recurrence: each token's
state is its predecessor's, decayed (per head, or per head and key channel in Kimi's rule) and updated by the delta
rule, and its output reads that state, then is normalised, gated and projected. The layouts differ only in their
projections (`_inputs`); the rules are the two functions of the layer's own modeling file (`_LAYOUTS`). In a planned
forward a tree node's predecessor is its parent: the convolution window is gathered along the node's path
(`short_conv.path_windows`), and each node's state follows from its parent's state (a staged state of this forward
or of a pending token) or from the row's committed state (`short_conv.recurrent_outputs`,
``cache/recurrent_states.py``). The recurrence runs transformers' own code: the chunked rule over a prompt chunk (as
vanilla's prefill) and the one-token rule per tree node (as vanilla's decode steps). Committing keeps the state of
the last accepted token. Switched per call and per thread like the other layers (`install_for`).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from .plan import AttentionPlan
from .short_conv import depthwise, path_windows, recurrent_outputs, wrap_layer_classes

_COMMON = ("conv1d", "layer_idx", "conv_kernel_size", "activation", "conv_dim")
_GATED_DELTA = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")  # (prefill rule, decode rule)
_KIMI_DELTA = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")
_GDN = ("A_log", "dt_bias", "key_dim", "value_dim", "head_k_dim", "head_v_dim")
_QKV = ("q_proj", "k_proj", "v_proj")
# layout -> (the end of its class name, the attributes that identify it, its modeling file's rules)
_LAYOUTS = {
    "qkvz": ("GatedDeltaNet", (*_GDN, "in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering", "norm", "out_proj"),
             _GATED_DELTA),
    "split": ("GatedDeltaNet", (*_GDN, "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "norm", "out_proj"),
              _GATED_DELTA),
    "separate": ("GatedDeltaNet", (*_GDN, *_QKV, "a_proj", "b_proj", "g_proj", "o_norm", "o_proj"), _GATED_DELTA),
    "kda": ("DeltaAttention", (*_QKV, "forget_gate", "b_proj", "o_norm", "o_proj", "head_dim", "qkv_dim"), _KIMI_DELTA),
}  # fmt: skip


def _layout(module: torch.nn.Module) -> str | None:
    """``"qkvz"`` (Qwen3-Next: interleaved projections), ``"split"`` (Qwen3.5: one projection each), ``"separate"``
    (OLMo-Hybrid: q, k, v, a, b and the output gate apart), ``"kda"`` (Kimi-Linear, Bailing-Hybrid: a forget gate
    module and an output gate, ``g_proj`` or the low-rank ``g_a_proj`` -> ``g_b_proj``) or None; with both rules in
    its modeling file and a depthwise ``conv1d`` over its q/k/v channels."""
    if not all(hasattr(module, a) for a in _COMMON):
        return None
    conv, file = module.conv1d, sys.modules.get(type(module).__module__)
    if not isinstance(conv, torch.nn.Conv1d) or not conv.groups == conv.in_channels == module.conv_dim:
        return None
    for layout, (suffix, attributes, rules) in _LAYOUTS.items():
        if (
            type(module).__name__.endswith(suffix)
            and all(hasattr(module, a) for a in attributes)
            and all(callable(getattr(file, r, None)) for r in rules)
            and (layout != "kda" or hasattr(module, "g_proj") or hasattr(module, "g_b_proj"))
        ):
            return layout
    return None


def is_gated_delta(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a gated delta net or a Kimi delta attention this module runs on trees (Qwen3-Next,
    Qwen3.5, OLMo-Hybrid, Kimi-Linear, Bailing-Hybrid)."""
    return _layout(module) is not None


def _dims(module, layout: str) -> tuple[int, int, int, int]:
    """``(key_dim, value_dim, head_k_dim, head_v_dim)``: the widths of q/k and v, and of one head of each."""
    if layout == "kda":
        return module.qkv_dim, module.qkv_dim, module.head_dim, module.head_dim
    return module.key_dim, module.value_dim, module.head_k_dim, module.head_v_dim


def _projections(module, layout: str, hidden_states: torch.Tensor):
    """``(mixed_qkv [N, conv_dim], z [N, H_v, d_v], b [N, H_v], a [N, H_v])`` of `[1, N, H]` hidden states (the
    gated delta net layouts)."""
    h = hidden_states
    if layout == "qkvz":
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(h), module.in_proj_ba(h))
        mixed = torch.cat([x.reshape(x.shape[0], x.shape[1], -1) for x in (q, k, v)], dim=-1)
        return mixed[0], z[0], b[0], a[0]
    if layout == "split":
        mixed, z, b, a = module.in_proj_qkv(h), module.in_proj_z(h), module.in_proj_b(h), module.in_proj_a(h)
    else:  # "separate"
        mixed = torch.cat([module.q_proj(h), module.k_proj(h), module.v_proj(h)], dim=-1)
        z, b, a = module.g_proj(h), module.b_proj(h), module.a_proj(h)
    return mixed[0], z[0].reshape(z.shape[1], -1, module.head_v_dim), b[0], a[0]


def _inputs(module, layout: str, hidden_states: torch.Tensor):
    """``(mixed_qkv [N, conv_dim], gate [N, H_v, d_v], beta [N, H_v], g [N, H_v] or, Kimi's, [N, H_v, d_k])`` of
    `[1, N, H]` hidden states, as the layer's forward computes them."""
    if layout == "kda":
        h = hidden_states
        mixed = torch.cat([module.q_proj(h), module.k_proj(h), module.v_proj(h)], dim=-1)[0]
        gate = (module.g_proj(h) if hasattr(module, "g_proj") else module.g_b_proj(module.g_a_proj(h)))[0]
        beta = torch.sigmoid(module.b_proj(h))[0]
        return mixed, gate.view(gate.shape[0], -1, module.head_dim), beta, module.forget_gate(h)[0]
    mixed, z, b, a = _projections(module, layout, hidden_states)
    beta = b.sigmoid()
    if getattr(module, "allow_neg_eigval", False):  # OLMo-Hybrid: beta in [0, 2]
        beta = beta * 2.0
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    return mixed, z, beta, g


def _convolved(module, plan: AttentionPlan, mixed: torch.Tensor) -> torch.Tensor:
    """`[N, conv_dim]` the causal convolution of ``mixed`` `[N, conv_dim]` along each token's path, activated, computed
    in the convolution weight's dtype as vanilla's ``causal_conv1d_fn``; stages ``mixed``."""
    windows = path_windows(module.layer_idx, plan, mixed, module.conv_kernel_size - 1)  # [N, K, conv_dim]
    out = depthwise(module.conv1d, windows.to(module.conv1d.weight.dtype))
    return ACT2FN[module.activation](out).to(mixed.dtype)


def tree_gated_delta(module: torch.nn.Module, hidden_states: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """The layer's output for the plan's packed tokens: `[1, N, H]` -> `[1, N, H]`."""
    plan.state_modules.append(module)
    layout = _layout(module)
    chunk_rule, token_rule = (getattr(sys.modules[type(module).__module__], r) for r in _LAYOUTS[layout][2])
    mixed, gate, beta, g = _inputs(module, layout, hidden_states)
    key_dim, value_dim, d_k, d_v = _dims(module, layout)
    q, k, v = torch.split(_convolved(module, plan, mixed), [key_dim, key_dim, value_dim], dim=-1)
    q, k, v = q.reshape(q.shape[0], -1, d_k), k.reshape(k.shape[0], -1, d_k), v.reshape(v.shape[0], -1, d_v)
    rule = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)

    def chunk(index: torch.Tensor, initial: torch.Tensor):  # vanilla's prefill rule over rows of tokens [R, n]
        return chunk_rule(q[index], k[index], v[index], g=g[index], beta=beta[index], initial_state=initial, **rule)

    def token(index: torch.Tensor, start: torch.Tensor):  # vanilla's decode rule for tokens [m]
        out, state = token_rule(
            q[index, None], k[index, None], v[index, None], g=g[index, None], beta=beta[index, None],
            initial_state=start, **rule,
        )  # fmt: skip
        return out[:, 0], state

    zero = torch.zeros(v.shape[1], d_k, d_v, dtype=torch.float32, device=v.device)
    core = recurrent_outputs(plan, module.layer_idx, zero, chunk, token)  # [N, H_v, d_v]
    norm, out_proj = (module.norm, module.out_proj) if layout in ("qkvz", "split") else (module.o_norm, module.o_proj)
    core = norm(core.reshape(-1, d_v), gate.reshape(-1, d_v))  # gated RMS norm per head
    return out_proj(core.reshape(1, core.shape[0] // v.shape[1], -1))  # [1, N, H]


def install_for(model: torch.nn.Module, active_plan) -> None:
    """Serve ``model``'s gated delta nets and Kimi delta attentions on trees inside planned forwards
    (`short_conv.wrap_layer_classes`)."""
    wrap_layer_classes(model, active_plan, is_gated_delta, tree_gated_delta)
