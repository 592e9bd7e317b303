"""Mamba mixers on token trees: Mamba-2 (Bamba, GraniteMoE-Hybrid, Falcon-H1, Nemotron-H, Zamba2, Mamba-2) and
Mamba-1 (Jamba, Mamba, FalconMamba).

The mixer projects each token to a gate, the inputs of a depthwise causal convolution (kernel K, then its
activation) and a step size ``dt``, then runs a selective state-space recurrence: each token's state (Mamba-2:
`[H, P, N]` per head; Mamba-1: `[I, N]` per channel) is its predecessor's, decayed by ``exp(A dt)`` and updated by
``dt B x``; its output reads the state through ``C``, plus the skip ``D x``, gated (and, in Mamba-2, normalised). In a
planned forward a tree node's predecessor is its parent: the convolution window is gathered along the node's path
(`short_conv.path_windows`) and the state follows from the parent's (a staged state of this forward or of a pending
token) or from the row's committed state (`short_conv.recurrent_outputs`, ``cache/recurrent_states.py``). The
recurrence runs the functions of the layer's own modeling file: the chunked scan over a prompt (vanilla's prefill:
``mamba2_chunk_scan``, ``mamba_selective_scan``) and the one-token update per tree node (vanilla's decode step:
``mamba2_selective_state_update``, ``mamba_selective_state_update``). Switched per call and per thread like the other
layers (`install_for`).
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
_ATTRIBUTES_1 = (
    "in_proj", "conv1d", "x_proj", "dt_proj", "out_proj", "A_log", "D", "layer_idx", "conv_kernel_size", "act",
    "intermediate_size", "time_step_rank", "ssm_state_size",
)  # fmt: skip
_RULES_1 = ("mamba_selective_scan", "mamba_selective_state_update")


def _is_mixer(module: torch.nn.Module, attributes: tuple[str, ...], rules: tuple[str, ...], channels: str) -> bool:
    """Whether ``module`` has ``attributes``, its modeling file both ``rules`` and its ``conv1d`` is depthwise over
    the ``channels`` attribute's count."""
    file = sys.modules.get(type(module).__module__)
    conv = getattr(module, "conv1d", None)
    return (
        all(hasattr(module, a) for a in attributes)
        and all(callable(getattr(file, r, None)) for r in rules)
        and isinstance(conv, torch.nn.Conv1d)
        and conv.groups == conv.in_channels == conv.out_channels == getattr(module, channels)
    )


def is_mamba2(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Mamba-2 mixer this module runs on trees: the layout Bamba, GraniteMoE-Hybrid,
    Falcon-H1, Nemotron-H, Zamba2 and Mamba-2 share, with both rules in its modeling file."""
    return _is_mixer(module, _ATTRIBUTES, _RULES, "conv_dim")


def is_mamba1(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Mamba-1 mixer this module runs on trees (Jamba, Mamba, FalconMamba; not quantized:
    Jamba's quantized models compute ``dt`` through another path)."""
    quantized = hasattr(getattr(module, "config", None), "_is_quantized")
    return _is_mixer(module, _ATTRIBUTES_1, _RULES_1, "intermediate_size") and not quantized


def is_mamba(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Mamba mixer (1 or 2) this module runs on trees."""
    return is_mamba2(module) or is_mamba1(module)


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

    def chunk(index: torch.Tensor, initial: torch.Tensor):  # vanilla's prefill rule over rows of tokens [R, n]
        r, t = index.shape
        out, last = rules.mamba2_chunk_scan(
            x[index].view(r, t, h, p), dt[index], a, b[index].view(r, t, g, n), c[index].view(r, t, g, n),
            chunk_size=module.chunk_size, D=module.D, z=None, return_final_states=True, dt_bias=module.dt_bias,
            dt_softplus=True, initial_states=initial, dt_limit=module.time_step_limit,
        )  # fmt: skip
        return out.reshape(r, t, -1), last

    def token(index: torch.Tensor, start: torch.Tensor):  # vanilla's decode rule for tokens [m] (it writes `start`)
        m = index.shape[0]
        out = rules.mamba2_selective_state_update(
            start, x[index].view(m, h, p), dt[index, :, None].expand(-1, -1, p), a[:, None, None].expand(-1, p, n),
            b[index].view(m, g, n), c[index].view(m, g, n), module.D[:, None].expand(-1, p), z=None,
            dt_bias=module.dt_bias[:, None].expand(-1, p), dt_softplus=True,
        )  # fmt: skip
        return out.reshape(m, -1), start  # the state after each token [m, H, P, N]

    zero = torch.zeros(h, p, n, dtype=torch.float32, device=x.device)
    scan = recurrent_outputs(plan, module.layer_idx, zero, chunk, token)  # [N, I]
    return module.out_proj(_gated(module, scan, gate).to(hidden_states.dtype)[None])  # [1, N, H]


def _mamba1_inputs(module, hidden_states: torch.Tensor, plan: AttentionPlan):
    """``(x [N, I] convolved, gate [N, I], dt [N, I] before its bias, b [N, S], c [N, S])`` of `[1, N, H]` hidden
    states as vanilla computes them (Jamba's and FalconMamba's norms of ``dt``, B and C too); stages the convolution's
    inputs."""
    x, gate = module.in_proj(hidden_states)[0].chunk(2, dim=-1)  # [N, I] each
    x = module.act(depthwise(module.conv1d, path_windows(module.layer_idx, plan, x, module.conv_kernel_size - 1)))
    s = module.ssm_state_size
    step, b, c = torch.split(module.x_proj(x), [module.time_step_rank, s, s], dim=-1)
    if hasattr(module, "dt_layernorm"):
        step, b, c = module.dt_layernorm(step), module.b_layernorm(b), module.c_layernorm(c)
    return x, gate, (module.dt_proj.weight @ step.T).T, b, c


def tree_mamba1(module: torch.nn.Module, hidden_states: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """The Mamba-1 mixer's output for the plan's packed tokens: `[1, N, H]` -> `[1, N, H]`."""
    plan.state_modules.append(module)
    rules = sys.modules[type(module).__module__]
    x, gate, dt, b, c = _mamba1_inputs(module, hidden_states, plan)
    a = -torch.exp(module.A_log.float())  # [I, S]
    bias = module.dt_proj.bias.float() if module.dt_proj.bias is not None else None
    scan = dict(use_mambapy=getattr(module, "use_mambapy", False))
    scan["use_associative_scan"] = getattr(module, "use_associative_scan", False)

    def chunk(index: torch.Tensor, initial: torch.Tensor):  # vanilla's prefill scan (from zeros) over [R, n]
        out, last = rules.mamba_selective_scan(
            x[index].transpose(1, 2), dt[index].transpose(1, 2), a, b[index].transpose(1, 2),
            c[index].transpose(1, 2), D=module.D.float(), z=gate[index].transpose(1, 2), delta_bias=bias,
            delta_softplus=True, return_last_state=True, **scan,
        )  # fmt: skip
        return out.transpose(1, 2), last  # [R, n, I], [R, I, S]

    def token(index: torch.Tensor, start: torch.Tensor):  # vanilla's decode rule for tokens [m] (it writes `start`)
        out = rules.mamba_selective_state_update(
            start, x[index], dt[index], a, b[index], c[index], module.D, z=gate[index], dt_bias=bias, dt_softplus=True
        )
        return out, start  # the state after each token [m, I, S]

    zero = torch.zeros(module.intermediate_size, module.ssm_state_size, dtype=torch.float32, device=x.device)
    out = recurrent_outputs(plan, module.layer_idx, zero, chunk, token, chunk_from_state=False)  # [N, I]
    return module.out_proj(out.to(hidden_states.dtype)[None])  # [1, N, H]


def install_for(model: torch.nn.Module, active_plan) -> None:
    """Serve ``model``'s Mamba mixers on trees inside planned forwards (`short_conv.wrap_layer_classes`)."""
    wrap_layer_classes(model, active_plan, is_mamba2, tree_mamba2)
    wrap_layer_classes(model, active_plan, is_mamba1, tree_mamba1)
