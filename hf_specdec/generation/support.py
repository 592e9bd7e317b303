"""Which models speculative decoding can verify exactly: a positive check, before the first verify forward.

A token tree is verified in one forward whose every layer must read the context and the tree through the
`PagedCache`: attention layers do (their K/V are paged, committed and rolled back per node), so do the stateful
layers served on trees (LFM2's short convolutions, the gated delta nets of Qwen3-Next, Qwen3.5 and OLMo-Hybrid,
the Kimi delta attention of Kimi-Linear and Bailing-Hybrid, Mamba-1 and Mamba-2 mixers, MiniMax's lightning
attention: their state is in the cache too), and nothing else may carry state from one forward to the next, since a
rejected branch would leave its mark there. So a model runs only when all of this holds, and is refused by name
(`UnsupportedModelError`) otherwise:

- `check_config`, before any forward: every entry of the config's ``layer_types`` is a kind we page (full, sliding
  or chunked attention, stateless ``mlp`` / ``moe``, ``conv`` of short convolutions, ``linear_attention`` and
  ``hybrid`` when every such layer holds a gated delta net (or a Kimi delta attention), a Mamba mixer or a lightning
  attention); another recurrent, linear-attention or indexed layer is named with its model type.
- `check_forward`, after the call's first planned forward (the prefill, which only writes hf_specdec's own cache):
  every layer of the cache ran attention (or a stateful layer served on trees) through the plan exactly once (a layer
  that ran none keeps its state elsewhere; a layer that ran twice, or one attention module serving several layers,
  would read one K/V set for two purposes), no module that takes a cache argument (``past_key_values``,
  ``cache_params``, ...) ran outside those calls and their parents (such a module keeps a state we do not page; a
  block of a layer the config declares ``mlp`` / ``moe`` passes when nothing below it takes one), and the windows of
  vanilla's masks reach the attention calls.
- `unclear_failure`, when the first forward itself fails: the error is re-raised naming the model type and saying
  that the architecture cannot run hf_specdec's planned forwards, the original error attached.
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter

import torch

from ..attention.gated_delta import is_gated_delta
from ..attention.lightning import is_lightning
from ..attention.mamba import is_mamba
from ..attention.short_conv import is_short_conv
from ..attention.unsupported import UnsupportedModelError
from ..text_config import text_config

# layer kinds (transformers' ``config.layer_types`` vocabulary) whose only state is attention K/V we page
PAGED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# layer kinds with no state between forwards at all (Nemotron-H's and Dory's feed-forward-only layers)
STATELESS_LAYER_TYPES = frozenset({"mlp", "moe"})
# what a kind of layer keeps, for the refusal
_STATE_OF = {
    "linear_attention": "a recurrent state (Mamba / gated delta net / linear attention) in modules other than the "
    "gated delta nets, Mamba mixers and lightning attentions served on trees",
    "conv": "a short-convolution state",
    "hybrid": "a recurrent state beside its attention, in modules other than the Mamba mixers served on trees",
    "hybrid_sliding": "a recurrent state beside its attention",
    "chunked_attention": "chunked attention without a chunk size in the config",
    "indexed_attention": "a sparse-attention indexer over its own key cache",
}
# forward arguments through which transformers modules receive the state they keep between forwards
CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "cache_params", "layer_past", "cache", "past_state")

_WORKS = (
    "Models whose every layer is full or sliding-window attention are supported (Llama, Qwen2/3, Mistral, Gemma, "
    "Phi, ...); docs/architectures.md lists every model type with its outcome"
)


def _name(model) -> str:
    return f"{type(model).__name__} (model type {getattr(text_config(model), 'model_type', '?')!r})"


def refusal(model, reason: str, why: str = "") -> UnsupportedModelError:
    """The error for ``model``: its class and type, what is unsupported, why that matters, and what works."""
    why = why or "hf_specdec neither pages nor rolls back that state, so a rejected draft would change later tokens"
    return UnsupportedModelError(
        f"{_name(model)} cannot be verified on token trees by hf_specdec: {reason}; {why}. {_WORKS}; use vanilla "
        "generate (or transformers' own assisted generation) for this model.",
        reason,
    )


def check_config(model) -> None:
    """Refuse ``model`` when its config declares layers that keep a state other than paged attention K/V."""
    config = text_config(model)
    kinds = getattr(config, "layer_types", None) or []
    paged = PAGED_LAYER_TYPES | STATELESS_LAYER_TYPES
    if getattr(config, "attention_chunk_size", None):  # chunk masks built from the config (attention_chunk)
        paged = paged | {"chunked_attention"}
    if "conv" in kinds and any(is_short_conv(m) for m in model.modules()):  # attention/short_conv.py
        paged = paged | {"conv"}
    paged = paged | _recurrent_kinds_served(model, kinds)
    other = [k for k in dict.fromkeys(kinds) if k not in paged]
    if other:
        layers = {k: [i for i, x in enumerate(kinds) if x == k] for k in other}
        raise refusal(
            model,
            "; ".join(
                f"its {k!r} layers {layers[k][:6]} keep {_STATE_OF.get(k, 'a state of their own')}" for k in other
            ),
        )


def _recurrent_kinds_served(model, kinds: list[str]) -> set[str]:
    """The kinds among ``linear_attention`` (a recurrent layer) and ``hybrid`` (a recurrent layer beside attention)
    whose every layer has a recurrent module served on trees with its index: a gated delta net or a
    Kimi delta attention (``attention/gated_delta.py``), a Mamba-1 / Mamba-2 mixer (``attention/mamba.py``) or a
    lightning attention (``attention/lightning.py``)."""
    served = {m.layer_idx for m in model.modules() if is_gated_delta(m) or is_mamba(m) or is_lightning(m)}
    return {
        kind
        for kind in ("linear_attention", "hybrid")
        if kind in kinds and {i for i, k in enumerate(kinds) if k == kind} <= served
    }


@functools.cache
def _takes_cache(cls: type) -> bool:
    """Whether modules of ``cls`` take a cache argument in ``forward`` (they keep state between forwards)."""
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False
    return any(name in params for name in CACHE_ARGUMENTS)


def check_forward(
    model,
    attention_modules: list[torch.nn.Module],
    num_layers: int,
    attention_windows: list[int | None] = (),
    mask_windows: list[int | None] = (),
    state_modules: list[torch.nn.Module] = (),
) -> None:
    """Refuse ``model`` unless its first planned forward ran paged attention (or a layer whose state the cache pages
    too: a short convolution, a gated delta net, a Mamba mixer, a lightning attention) once per layer, and nothing
    stateful beside it.

    Args:
        model: the model that ran the forward.
        attention_modules: the modules that called hf_specdec's attention during the forward, in call order.
        num_layers: the layers of the forward's `PagedCache` (the config's ``num_hidden_layers``).
        attention_windows: each attention call's ``sliding_window`` argument (what hf_specdec's attention applies).
        mask_windows: the window of each mask the model asked transformers for (its ``local_size``: a sliding
            window or a chunk; None: causal): what vanilla applies.
        state_modules: the stateful layers that served the forward on its tree (``attention/short_conv.py``,
            ``attention/gated_delta.py``, ``attention/mamba.py``, ``attention/lightning.py``).
    """
    if not attention_modules and not state_modules:
        impl = getattr(model.config, "_attn_implementation", None)
        fix = (
            "; loading it with attn_implementation='sdpa' may help"
            if impl != "sdpa" and getattr(model, "_supports_sdpa", False)
            else ""
        )
        raise refusal(
            model,
            f"it ran no attention through transformers' AttentionInterface (implementation {impl!r}){fix}",
            "its layers keep their state in their own code, where hf_specdec cannot page or roll it back",
        )
    per_layer = Counter(getattr(m, "layer_idx", None) for m in attention_modules)
    per_module = Counter(id(m) for m in attention_modules)
    twice = sorted((i, n) for i, n in per_layer.items() if n > 1)
    if twice or max(per_module.values(), default=1) > 1:
        cls = type(attention_modules[0]).__name__
        raise refusal(
            model,
            f"it runs attention more than once per layer in one forward ({cls}; layer and calls: "
            f"{twice or 'one module for several layers'})",
            "hf_specdec pages one K/V set per layer and call",
        )
    _check_windows(model, attention_modules, attention_windows, mask_windows)
    stateful = _unknown_stateful_modules(model, [*attention_modules, *state_modules])
    if stateful:
        more = ", ..." if len(stateful) > 3 else ""
        raise refusal(model, f"its modules {', '.join(stateful[:3])}{more} keep a state of their own")
    silent = set(range(num_layers)) - set(per_layer) - {m.layer_idx for m in state_modules}
    silent = sorted(silent - _stateless_layers(model))
    if silent:
        raise refusal(model, f"its layers {silent[:8]} ran no attention through hf_specdec in a forward")


def _check_windows(model, attention_modules, attention_windows, mask_windows) -> None:
    """The window vanilla's mask gives a layer must reach that layer's attention call, where hf_specdec applies it: a
    window given to the mask alone (PhiMoE's) would silently widen what a token sees.

    With ``layer_types`` the config says which layers get the sliding-window mask (of ``config.sliding_window``); a
    model may build masks it uses on no layer (Qwen2-MoE builds both kinds always). Without it, every window of a mask
    the model built must be one some attention call is given."""
    config = text_config(model)
    kinds = getattr(config, "layer_types", None)
    if kinds and attention_windows:
        wrong = [
            (m.layer_idx, w)
            for m, w in zip(attention_modules, attention_windows)
            if m.layer_idx < len(kinds) and (kinds[m.layer_idx] == "sliding_attention") != (w is not None)
        ]
        if wrong:
            raise refusal(
                model,
                f"its layers {[i for i, _ in wrong][:6]} are {kinds[wrong[0][0]]!r} layers whose attention calls are "
                f"given the sliding window {wrong[0][1]}",
                "hf_specdec applies the window an attention call is given, vanilla the mask of the layer's type",
            )
        return
    masks = {w for w in mask_windows if w is not None}
    calls = {w for w in attention_windows if w is not None}
    if not masks <= calls:
        raise refusal(
            model,
            f"its masks limit attention to windows (or chunks) of {sorted(masks)} tokens that its attention calls "
            f"are not given (their sliding_window arguments: {sorted(calls) or 'none'})",
            "hf_specdec applies the window an attention call is given, so it would let tokens see too far",
        )


def _unknown_stateful_modules(model, attention_modules: list[torch.nn.Module]) -> list[str]:
    """Innermost modules (``name (Class)``) that take a cache argument and are neither an attention module that
    served the plan nor a parent of one."""
    callers = {id(m) for m in attention_modules}
    names = [name for name, m in model.named_modules() if id(m) in callers]
    parents = {name.rsplit(".", i)[0] for name in names for i in range(1, name.count(".") + 1)} | {""}
    stateless = _stateless_layers(model)
    flagged = [
        (name, m)
        for name, m in model.named_modules()
        if id(m) not in callers and name not in parents and _takes_cache(type(m))
    ]
    flagged = [  # a block of a layer the config declares stateless (Nemotron-H's mlp / moe blocks) passes
        (n, m) for n, m in flagged if getattr(m, "layer_idx", None) not in stateless or _has_cache_taker(m)
    ]
    inner = [(n, m) for n, m in flagged if not any(o.startswith(n + ".") for o, _ in flagged)]
    return [f"{n} ({type(m).__name__})" for n, m in inner]


def _stateless_layers(model) -> set[int]:
    """Indices of the layers whose config type (``mlp`` / ``moe``) keeps no state between forwards."""
    kinds = getattr(text_config(model), "layer_types", None) or []
    return {i for i, k in enumerate(kinds) if k in STATELESS_LAYER_TYPES}


def _has_cache_taker(module: torch.nn.Module) -> bool:
    """Whether a module below ``module`` takes a cache argument."""
    return any(_takes_cache(type(m)) for m in module.modules() if m is not module)


def unclear_failure(model, exc: Exception) -> UnsupportedModelError:
    """The error for a first planned forward that failed inside the model's own code: what is unsupported, named."""
    return refusal(
        model,
        f"its forward failed when run through hf_specdec's paged attention ({type(exc).__name__}: {exc})",
        "it computes something (an attention mask, a cache of its own, ...) that hf_specdec's planned forwards do not "
        "provide",
    )


def naming_the_model(model, exc: UnsupportedModelError) -> UnsupportedModelError:
    """A refusal raised inside the forward (by an attention call, which knows its module only), with the model and
    its type in front."""
    if repr(text_config(model).model_type) in str(exc):
        return exc
    return refusal(model, exc.reason, str(exc))
