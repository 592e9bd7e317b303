"""Starting a head's draft decoder layers as its target's decoder layers (EAGLE-1's layer, DFlash's layers).

A head trained on the little data a CPU builds may learn more starting from a layer that already computes what the
target's layers do than from random weights (docs/lab/heads_experiments.md measures it). The draft layer's parameters are
copied by name from the target layer's: attention projections, MLP, norms. A parameter the draft layer has and the
target's lacks is refused, except the ones named ``may_lack`` (a Qwen3-style draft layer's q / k norms over a Llama
target: they stay as initialised, ones); a parameter the target has and the draft layer lacks (EAGLE-1's layer has
no input norm) is left out.

    copy_target_layers(head.layers, model, -1, "DFlashHead", may_lack=("self_attn.q_norm.weight", ...))
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .derived import dense_weight


def copy_target_layers(
    draft_layers: Sequence[nn.Module], model: nn.Module, first: int, owner: str, may_lack: Sequence[str] = ()
) -> list[int]:
    """Copy the target's decoder layer ``first + i`` into ``draft_layers[i]`` (negative ``first``: counted from the
    end); returns the target layers copied.

    Raises:
        ValueError: naming ``owner`` and the parameter, when the target keeps no ``layers`` list, a layer does not
            exist in the target, or a draft parameter (but ``may_lack``'s) is missing from the target layer or
            shaped differently there.
    """
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{owner}: {type(model).__name__} keeps no list of decoder layers at get_decoder().layers, "
                         "so its layers cannot start the draft layers; train without init_layer")  # fmt: skip
    start = first + len(layers) if first < 0 else first
    ids = list(range(start, start + len(draft_layers)))
    if start < 0 or ids[-1] >= len(layers):
        raise ValueError(f"{owner}: cannot start its {len(draft_layers)} draft layer(s) from target layer {first}: "
                         f"the target has {len(layers)} decoder layers")  # fmt: skip
    for draft, index in zip(draft_layers, ids):
        source = layers[index].state_dict()
        for name, param in draft.state_dict().items():
            if name not in source and name in may_lack:
                continue
            if name not in source or source[name].shape != param.shape:
                got = tuple(source[name].shape) if name in source else "missing"
                raise ValueError(f"{owner}: target layer {index} has no {name} of shape {tuple(param.shape)} (got "
                                 f"{got}): its layers cannot start the draft layers")  # fmt: skip
            with torch.no_grad():
                param.copy_(dense_weight(source[name]).to(param.dtype))
    return ids


__all__ = ["copy_target_layers"]
