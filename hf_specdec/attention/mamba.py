"""Mamba-2 mixers (Bamba, GraniteMoE-Hybrid, Falcon-H1, Nemotron-H, Zamba2) on token trees.

The mixer projects each token to a gate, the ``x | B | C`` inputs of a depthwise causal convolution (kernel K, then
its activation) and a step size ``dt``, then runs a selective state-space recurrence: each token's `[H, P, N]` state
is its predecessor's, decayed by ``exp(A dt)`` and updated by ``dt B x``; its output reads the state through ``C``,
plus the skip ``D x``, gated and normalised. In a planned forward a tree node's predecessor is its parent: the
convolution window is gathered along the node's path (`short_conv.path_windows`) and the state follows from the
parent's (a staged state of this forward or of a pending token) or from the row's committed state
(`short_conv.recurrent_outputs`, ``cache/recurrent_states.py``). The recurrence runs the functions of the layer's
own modeling file: ``mamba2_chunk_scan`` over a prompt chunk (vanilla's prefill) and ``mamba2_selective_state_update``
per tree node (vanilla's decode step). Switched per call and per thread like the other layers (`install_for`).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from .plan import AttentionPlan
from .short_conv import depthwise, path_windows, recurrent_outputs, wrap_layer_classes

_ATTRIBUTES = (
    "in_proj", "conv1d", "out_proj", "norm", "A_log", "D", "dt_bias", "layer_idx", "conv_kernel_size", "act",
    "intermediate_size", "conv_dim", "num_heads", "head_dim", "n_groups", "ssm_state_size", "chunk_size",
    "time_step_limit",
)  # fmt: skip
_RULES = ("mamba2_chunk_scan", "mamba2_selective_state_update")


def is_mamba2(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Mamba-2 mixer this module runs on trees: the layout Bamba, GraniteMoE-Hybrid,
    Falcon-H1, Nemotron-H and Zamba2 share, with both rules in its modeling file."""
    rules = sys.modules.get(type(module).__module__)
    conv = getattr(module, "conv1d", None)
    return (
        all(hasattr(module, a) for a in _ATTRIBUTES)
        and all(callable(getattr(rules, r, None)) for r in _RULES)
        and isinstance(conv, torch.nn.Conv1d)
        and conv.groups == conv.in_channels == conv.out_channels == module.conv_dim
    )


def _inputs(module, hidden_states: torch.Tensor):
    """``(gate [N, I], xbc [N, conv_dim], dt [N, H])`` of `[1, N, H]` hidden states (Falcon-H1's multipliers too)."""
    if hasattr(module, "ssm_in_multiplier"):
        hidden_states = hidden_states * module.ssm_in_multiplier
    projected = module.in_proj(hidden_states)
    if hasattr(module, "mup_vector"):
        projected = projected * module.mup_vector
    gate, xbc, dt = projected[0].split([module.intermediate_size, module.conv_dim, module.num_heads], dim=-1)
    return gate, xbc, dt


def _gated(module, scan: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`[N, I]` the scan's output `[N, I]` gated by ``gate`` `[N, I]` as vanilla does: the gated RMS norm, or (Falcon-H1
    without it) ``scan * silu(gate)``."""
    if getattr(module, "mamba_rms_norm", True):
        return module.norm(scan, gate)
    return scan * F.silu(gate)


def tree_mamba2(module: torch.nn.Module, hidden_states: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """The mixer's output for the plan's packed tokens: `[1, N, H]` -> `[1, N, H]`."""
    plan.state_modules.append(module)
    rules = sys.modules[type(module).__module__]
    gate, xbc, dt = _inputs(module, hidden_states)
    xbc = module.act(depthwise(module.conv1d, path_windows(module.layer_idx, plan, xbc, module.conv_kernel_size - 1)))
    g, n, p, h = module.n_groups, module.ssm_state_size, module.head_dim, module.num_heads
    x, b, c = torch.split(xbc, [module.intermediate_size, g * n, g * n], dim=-1)
    a = -torch.exp(module.A_log.float())  # [H]

    def chunk(s: int, e: int, initial: torch.Tensor):  # vanilla's prefill rule over tokens s:e
        out, last = rules.mamba2_chunk_scan(
            x[None, s:e].view(1, e - s, h, p), dt[None, s:e], a, b[None, s:e].view(1, e - s, g, n),
            c[None, s:e].view(1, e - s, g, n), chunk_size=module.chunk_size, D=module.D, z=None,
            return_final_states=True, dt_bias=module.dt_bias, dt_softplus=True, initial_states=initial[None],
            dt_limit=module.time_step_limit,
        )  # fmt: skip
        return out[0].reshape(e - s, -1), last[0]

    def token(i: int, start: torch.Tensor):  # vanilla's decode rule for token i (it writes the state it is given)
        state = start.clone()[None]  # [1, H, P, N]
        out = rules.mamba2_selective_state_update(
            state, x[i].view(1, h, p), dt[i, :, None].expand(-1, p)[None], a[:, None, None].expand(-1, p, n),
            b[i].view(1, g, n), c[i].view(1, g, n), module.D[:, None].expand(-1, p), z=None,
            dt_bias=module.dt_bias[:, None].expand(-1, p), dt_softplus=True,
        )  # fmt: skip
        return out.reshape(-1), state[0]

    zero = torch.zeros(h, p, n, dtype=torch.float32, device=x.device)
    scan = recurrent_outputs(plan, module.layer_idx, zero, chunk, token)  # [N, I]
    return module.out_proj(_gated(module, scan, gate).to(hidden_states.dtype)[None])  # [1, N, H]


def install_for(model: torch.nn.Module, active_plan) -> None:
    """Serve ``model``'s Mamba-2 mixers on trees inside planned forwards (`short_conv.wrap_layer_classes`)."""
    wrap_layer_classes(model, active_plan, is_mamba2, tree_mamba2)
