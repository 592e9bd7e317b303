"""Lightning attention layers (MiniMax's linear attention with a decay per head) on token trees.

The layer projects each token to SiLU-activated queries, keys and values and runs a recurrence per head: each
token's state `[d, d]` is its predecessor's, decayed by ``exp(-slope)`` and updated by ``k^T v``; its output reads
the state through ``q``, then is normalised, gated by the hidden states and projected. Vanilla runs a prompt (its
first forward, from a zero state) block by block (``block_size`` tokens, the intra-block part as masked attention)
and every later token one at a time. In a planned forward a tree node's predecessor is its parent, so each node's
state follows from its parent's (a staged state of this forward or of a pending token) or from the row's committed
state (`short_conv.recurrent_outputs`, ``cache/recurrent_states.py``).

The recurrence is the layer's own ``forward`` of its modeling file, run on the packed tokens: over a row's prompt
without a cache (vanilla's blocked prefill, from zeros), and one tree level at a time as a batch of one-token
sequences whose cache holds each node's starting state (vanilla's decode step). Like Mamba-1's scan, the prefill
starts from zeros only: a chunk after committed tokens runs the one-token step, token after token, as vanilla does.
Switched per call and per thread like the other layers (`install_for`).
"""

from __future__ import annotations

import torch

from ..cache.model_arg import cache_kwarg
from .plan import AttentionPlan
from .short_conv import recurrent_outputs, wrap_layer_classes

_ATTRIBUTES = (
    "qkv_proj", "output_gate", "out_proj", "norm", "act_fn", "slope_rate", "query_decay", "key_decay",
    "diagonal_decay", "block_size", "num_attention_heads", "head_dim", "layer_idx",
)  # fmt: skip


def is_lightning(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a lightning attention this module runs on trees (MiniMax's linear attention layers)."""
    return type(module).__name__.endswith("LightningAttention") and all(hasattr(module, a) for a in _ATTRIBUTES)


class _LinearState:
    """The one-layer cache the layer's ``forward`` reads its starting state from and writes its new state to (the
    ``get_linear_cache`` / ``set_linear_cache`` half of transformers' ``MiniMaxCache``)."""

    def __init__(self, layer: int, state: torch.Tensor):
        self.layer, self.state = layer, state  # [m, heads, d, d]

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor:
        assert layer_idx == self.layer, f"layer {layer_idx} read the cache of layer {self.layer}"
        return self.state

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        assert layer_idx == self.layer, f"layer {layer_idx} wrote the cache of layer {self.layer}"
        self.state = linear_cache


def tree_lightning(module: torch.nn.Module, hidden_states: torch.Tensor, plan: AttentionPlan):
    """The layer's ``(output [1, N, H], None)`` for the plan's packed tokens' `[1, N, H]` hidden states."""
    plan.state_modules.append(module)
    forward = type(module).forward.hf_specdec_fallback  # the modeling file's own forward
    hidden = hidden_states[0]  # [N, H]

    def chunk(index: torch.Tensor, initial: torch.Tensor):  # vanilla's prefill over rows of tokens [R, n], from zeros
        out, last = forward(module, hidden[index], None, None, **cache_kwarg(forward, None))
        return out, last  # [R, n, H], [R, heads, d, d]

    def token(index: torch.Tensor, start: torch.Tensor):  # vanilla's decode step for tokens [m]
        cache = _LinearState(module.layer_idx, start)
        out, _ = forward(module, hidden[index, None], None, None, **cache_kwarg(forward, cache))
        return out[:, 0], cache.state  # [m, H], [m, heads, d, d]

    d = module.head_dim
    zero = hidden.new_zeros(module.num_attention_heads, d, d)  # vanilla's state: the hidden states' dtype
    out = recurrent_outputs(plan, module.layer_idx, zero, chunk, token, chunk_from_state=False)  # [N, H]
    return out[None], None


def install_for(model: torch.nn.Module, active_plan) -> None:
    """Serve ``model``'s lightning attentions on trees inside planned forwards (`short_conv.wrap_layer_classes`)."""
    wrap_layer_classes(model, active_plan, is_lightning, tree_lightning)
