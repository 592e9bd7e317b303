"""Gated delta net layers (Qwen3-Next's and Qwen3.5's linear attention) on token trees.

The layer convolves its q/k/v inputs causally (kernel K, then SiLU) and runs a recurrence: each token's state is its
predecessor's, decayed and updated by the delta rule, and its output reads that state. In a planned forward a tree
node's predecessor is its parent: the convolution window is gathered along the node's path
(`short_conv.path_windows`), and each node's state follows from its parent's state (a staged state of this forward
or of a pending token) or from the row's committed state (`short_conv.recurrent_outputs`, ``cache/recurrent_states.py``). The recurrence runs
transformers' own functions of the layer's modeling file: its chunked rule over a prompt chunk (as vanilla's
prefill) and its one-token rule per tree node (as vanilla's decode steps). Committing keeps the state of the last
accepted token. Switched per call and per thread like the other layers (`install_for`).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from .plan import AttentionPlan
from .short_conv import depthwise, path_windows, recurrent_outputs, wrap_layer_classes

_COMMON = (
    "conv1d",
    "A_log",
    "dt_bias",
    "norm",
    "out_proj",
    "layer_idx",
    "conv_kernel_size",
    "head_k_dim",
    "head_v_dim",
)


def _layout(module: torch.nn.Module) -> str | None:
    """``"qkvz"`` (Qwen3-Next: interleaved projections), ``"split"`` (Qwen3.5: one projection each) or None."""
    if not type(module).__name__.endswith("GatedDeltaNet") or not all(hasattr(module, a) for a in _COMMON):
        return None
    if all(hasattr(module, a) for a in ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering")):
        return "qkvz"
    if all(hasattr(module, a) for a in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")):
        return "split"
    return None


def is_gated_delta(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a gated delta net this module runs on trees (Qwen3-Next, Qwen3.5)."""
    return _layout(module) is not None


def _projections(module, hidden_states: torch.Tensor):
    """``(mixed_qkv [N, conv_dim], z [N, H_v, d_v], b [N, H_v], a [N, H_v])`` of `[1, N, H]` hidden states."""
    if _layout(module) == "qkvz":
        q, k, v, z, b, a = module.fix_query_key_value_ordering(
            module.in_proj_qkvz(hidden_states), module.in_proj_ba(hidden_states)
        )
        mixed = torch.cat([x.reshape(x.shape[0], x.shape[1], -1) for x in (q, k, v)], dim=-1)
        return mixed[0], z[0], b[0], a[0]
    z = module.in_proj_z(hidden_states)[0]
    z = z.reshape(z.shape[0], -1, module.head_v_dim)
    return (
        module.in_proj_qkv(hidden_states)[0],
        z,
        module.in_proj_b(hidden_states)[0],
        module.in_proj_a(hidden_states)[0],
    )


def tree_gated_delta(module: torch.nn.Module, hidden_states: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """The layer's output for the plan's packed tokens: `[1, N, H]` -> `[1, N, H]`."""
    plan.state_modules.append(module)
    rules = sys.modules[type(module).__module__]
    mixed, z, b, a = _projections(module, hidden_states)
    conv = depthwise(module.conv1d, path_windows(module.layer_idx, plan, mixed, module.conv_kernel_size - 1))
    mixed = F.silu(conv)  # the layer's activation (SiLU)
    q, k, v = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q = q.reshape(q.shape[0], -1, module.head_k_dim)  # [N, H_k, d_k]
    k = k.reshape(k.shape[0], -1, module.head_k_dim)
    v = v.reshape(v.shape[0], -1, module.head_v_dim)  # [N, H_v, d_v]
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    rule = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)

    def chunk(index: torch.Tensor, initial: torch.Tensor):  # vanilla's prefill rule over rows of tokens [R, n]
        out, last = rules.torch_chunk_gated_delta_rule(
            q[index], k[index], v[index], g=g[index], beta=beta[index], initial_state=initial, **rule
        )
        return out, last

    def token(index: torch.Tensor, start: torch.Tensor):  # vanilla's decode rule for tokens [m]
        out, state = rules.torch_recurrent_gated_delta_rule(
            q[index, None], k[index, None], v[index, None], g=g[index, None], beta=beta[index, None],
            initial_state=start, **rule,
        )  # fmt: skip
        return out[:, 0], state

    zero = torch.zeros(v.shape[1], module.head_k_dim, module.head_v_dim, dtype=torch.float32, device=v.device)
    core = recurrent_outputs(plan, module.layer_idx, zero, chunk, token)  # [N, H_v, d_v]
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(1, core.shape[0] // v.shape[1], -1))  # [1, N, H]


def install_for(model: torch.nn.Module, active_plan) -> None:
    """Serve ``model``'s gated delta nets on trees inside planned forwards (`short_conv.wrap_layer_classes`)."""
    wrap_layer_classes(model, active_plan, is_gated_delta, tree_gated_delta)
