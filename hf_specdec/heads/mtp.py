"""The multi-token-prediction (MTP) layers some models ship beside their decoder (DeepSeek-V3, GLM-4.5, ERNIE-4.5-MoE,
Mellum, Step-3.7, ...), as a draft head: `MTPHead`.

Loading is transformers' own: `MtpModel.from_pretrained(model)` reads the MTP weights from the checkpoint ``model``
was loaded from (``config.num_mtp_layers`` layers, each an `MtpLayer`: ``eh_proj([enorm(embed(token t + 1));
hnorm(h_t)])`` through one of the model's own decoder layers, then its post-norm), sharing the model's embeddings,
lm_head and rotary embedding. This module only runs an `MtpLayer` over this project's per-row draft cache instead
of transformers' `MtpCache`, with the masks a tree needs: `MTPHead.layer_forward` has `EagleHead.layer_forward`'s
contract, so the EAGLE tree expansion drafts with it unchanged.

Which layer drafts: MTP layer 0 at every level, fed back its own output as the next position's feature (as vLLM
runs one MTP layer for several tokens). Layer k > 0 was trained on the outputs of layer k - 1 at the *same*
position with token t + 1 + k, so its cache at the last k - 1 positions depends on the drafted path; a tree would
recompute those per path (transformers' chain crops and recomputes them). Deeper layers are loaded but not used.
A layer reads its whole cache and the drafted path (a sliding window, as Mellum's MTP layer has, is not applied to
drafts: the target's verification keeps the output exact either way). MTP layers that keep state besides keys and
values (Inkling's short convolution) are refused by name (`UnsupportedModelError`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention.unsupported import UnsupportedModelError
from ..text_config import text_config
from .draft_cache import DraftKVCache


class NoMTPLayersError(ValueError):
    """The model ships no MTP layers (no ``num_mtp_layers`` in its config, or 0), or their weights cannot be read."""


def num_mtp_layers(model: nn.Module) -> int:
    """``config.num_mtp_layers`` of ``model``'s text config (0 when the config has no such field)."""
    config = text_config(model)
    return int(getattr(config, "num_mtp_layers", None) or 0)


def _model_type(model: nn.Module) -> str:
    return f"{type(model).__name__} (model_type {getattr(model.config, 'model_type', '?')!r})"


class _PrefixKV:
    """Stands in for transformers' ``Cache`` in one decoder-layer call: the layer's new keys/values are appended to
    a fixed prefix (None: no prefix) and kept for the caller. Keys and values may differ in their last dimension
    (multi-head latent attention)."""

    def __init__(self, key: torch.Tensor | None, value: torch.Tensor | None):
        self.prefix_key, self.prefix_value = key, value  # [B, kv_heads, S, Dk], [B, kv_heads, S, Dv]
        self.new_key = self.new_value = None

    def __getattr__(self, name: str):
        raise _StatefulLayer(name)  # the layer asked its cache for more than keys and values

    def update(self, key_states, value_states, *args, **kwargs):
        self.new_key, self.new_value = key_states, value_states  # [B, kv_heads, q, D]
        if self.prefix_key is None:
            return key_states, value_states
        key = torch.cat([self.prefix_key.to(key_states.dtype), key_states], dim=2)
        return key, torch.cat([self.prefix_value.to(value_states.dtype), value_states], dim=2)


class _StatefulLayer(AttributeError):
    """An MTP layer called a cache method other than ``update``: it keeps state besides keys and values."""


class MTPKVCache(DraftKVCache):
    """`DraftKVCache` whose values may be narrower or wider than its keys (``value_dim``)."""

    def __init__(self, rows: int, kv_heads: int, key_dim: int, value_dim: int, dtype, device, capacity: int = 256):
        super().__init__(rows, kv_heads, key_dim, dtype, device, capacity)
        self.value = torch.zeros(rows, kv_heads, capacity, value_dim, dtype=dtype, device=device)

    def reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        grow = max(needed, 2 * self.capacity) - self.capacity
        self.key = torch.cat([self.key, self.key.new_zeros(*self.key.shape[:2], grow, self.key.shape[3])], dim=2)
        self.value = torch.cat([self.value, self.value.new_zeros(*self.value.shape[:2], grow, self.value.shape[3])], 2)


class MTPHead(nn.Module):
    """A model's own MTP layers (transformers' `MtpModel`) as the draft head of `MTPAssistant`; drafts with layer 0.

    Args:
        mtp: the `MtpModel` (its embeddings, lm_head and rotary embedding are the model's).
        model_type: the model's type, for messages.
        tree: defaults for the drafted trees (``top_k``, ``depth``, ``num_nodes``, ``step_cost``).

    Attributes:
        feature_layers: ``(-1,)``: the target's final normed hidden state, what transformers' MTP drafting reads.
    """

    head_type = "mtp"
    feature_layers = (-1,)
    aux_layers = None

    def __init__(self, mtp: nn.Module, model_type: str, tree: dict | None = None):
        super().__init__()
        self.mtp = mtp
        self.model_type = model_type
        self.tree = dict(tree or {})
        self._kv_dims: tuple[int, int, int] | None = None  # kv heads, key dim, value dim (measured by `bind`)

    @classmethod
    def from_model(cls, model: nn.Module, tree: dict | None = None) -> MTPHead:
        """The MTP layers of ``model``, read by transformers from the checkpoint ``model`` was loaded from; a
        `NoMTPLayersError` names the model type where it ships none or they cannot be read."""
        from transformers.modeling_layers import MtpModel

        n, name = num_mtp_layers(model), getattr(model.config, "name_or_path", "") or ""
        if n == 0:
            raise NoMTPLayersError(
                f"{_model_type(model)} ships no multi-token-prediction layers (its config has no num_mtp_layers, or "
                "0): assistant='mtp' drafts with a model's own MTP layers (DeepSeek-V3, GLM-4.5, ERNIE-4.5-MoE, ...); "
                "pass another assistant for this model"
            )
        if not name:
            raise NoMTPLayersError(f"{_model_type(model)} declares {n} MTP layer(s), but was not loaded from a "
                                   "checkpoint: their weights are read from the folder or Hub repo the model was "
                                   "loaded from (model.config.name_or_path)")  # fmt: skip
        device = next(model.get_decoder().layers[-1].parameters()).device  # transformers' choice for MtpModel
        try:
            mtp = MtpModel.from_pretrained(model, device_map={"": device})
        except (OSError, RuntimeError, ValueError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise NoMTPLayersError(f"the {n} MTP layer(s) of {_model_type(model)} could not be read from {name}: "
                                   f"{first}") from err  # fmt: skip
        return cls(mtp.eval(), str(model.config.model_type), tree).bind(model)

    # ------------------------------------------------------------------------------------------ target
    def bind(self, model: nn.Module) -> MTPHead:
        """Check that ``model`` is the model these layers were loaded for (they share its embeddings and lm_head
        objects); returns self."""
        if self.mtp.shared_head is not getattr(model, "lm_head", None):
            raise ValueError(f"this MTPHead holds the MTP layers of another {self.model_type} model object; load the "
                             f"layers of {_model_type(model)} with MTPHead.from_model(model) or assistant='mtp'")  # fmt: skip
        if self._kv_dims is None:
            self._kv_dims = self._probe_kv(model)
        return self

    def _probe_kv(self, model: nn.Module) -> tuple[int, int, int]:
        """``(kv heads, key dim, value dim)`` of layer 0, from one token; an `UnsupportedModelError` names the
        model where the layer keeps state besides keys and values (a short convolution's, a recurrent one)."""
        dev, dtype = self._param.device, self._param.dtype
        one = torch.zeros(1, 1, dtype=torch.long, device=dev)
        feat = torch.zeros(1, 1, self.mtp.config.hidden_size, dtype=dtype, device=dev)
        try:
            with torch.no_grad():
                _, key, value = self.layer_forward(one, feat, one, torch.ones(1, 1, 1, dtype=torch.bool), None, None)
        except _StatefulLayer as err:
            raise UnsupportedModelError(
                f"the MTP layers of {_model_type(model)} keep state besides keys and values (the layer asked its cache "
                f"for {err.args[0]!r}): hf_specdec drafts with MTP layers of attention only; use generate(use_mtp=True) "
                "(transformers' chain) or another assistant", reason="MTP layer with a recurrent or convolution state"
            ) from err
        return int(key.shape[1]), int(key.shape[3]), int(value.shape[3])

    def drafting_copy(self, dtype: torch.dtype) -> MTPHead:
        """The head itself: MTP layers draft in the model's own dtype (a copy would copy the shared lm_head too)."""
        return self

    def drafting_linears(self) -> tuple[nn.Module, ...]:
        return ()

    @property
    def _param(self) -> torch.Tensor:
        return self.mtp.layers[0].eh_proj.weight

    def draft_to_token(self, index: torch.Tensor) -> torch.Tensor:
        """Token ids of draft-vocabulary indices: the vocabulary is the model's own."""
        return index

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """`[..., V]` fp32 logits of the layer's outputs `[..., H]`, through the model's lm_head as transformers
        projects them (`MtpModel._project_to_logits`: muP scaling, unpadded vocabulary)."""
        return self.mtp._project_to_logits(out).float()

    # ------------------------------------------------------------------------------------------ math
    def layer_forward(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        past_key: torch.Tensor | None,
        past_value: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """MTP layer 0 over ``q`` new (feature t, token t + 1) pairs per row (`EagleHead.layer_forward`'s contract).

        Args:
            tokens: `[B, q]` token t + 1 of each pair.
            features: `[B, q, H]` feature t: the target's final normed state, or the layer's own output (fed back).
            positions: `[B, q]` position t of each feature (the layer runs at t + 1, its token's position, as
                transformers runs it).
            mask: `[B, q, S + q]` bool, which of the ``S`` past entries and the new ones each query sees.
            past_key / past_value: `[B, kv_heads, S, Dk]` / `[B, kv_heads, S, Dv]`, or None (no past).
        Returns:
            ``(out, key, value)``: `[B, q, H]` the layer's output (post-normed: fed back, and what `logits` reads),
            and the new entries' `[B, kv_heads, q, Dk]` keys and `[B, kv_heads, q, Dv]` values.
        """
        mtp, dtype = self.mtp, self._param.dtype
        dev = self._param.device
        emb = mtp.embed_tokens(tokens.to(dev)).to(dtype)  # [B, q, H]
        feats = features.to(device=dev, dtype=dtype)
        pos = positions.to(dev) + 1
        rope = {"layer_type": mtp.config.layer_types[0]} if mtp.has_per_layer_rope else {}
        cos_sin = mtp.rotary_emb(emb, position_ids=pos, **rope) if mtp.rotary_emb is not None else None
        additive = torch.zeros(mask.shape, dtype=dtype, device=dev).masked_fill(~mask.to(dev), torch.finfo(dtype).min)
        kv = _PrefixKV(past_key, past_value)
        out = mtp.layers[0](emb, feats, position_embeddings=cos_sin, attention_mask=additive[:, None],
                            position_ids=pos, cache=kv)  # fmt: skip
        if mtp.use_shared_post_norm:
            out = mtp.shared_post_norm(out)
        return out, kv.new_key, kv.new_value

    def new_cache(self, rows: int, capacity: int = 256) -> MTPKVCache:
        """An empty cache for ``rows`` rows, shaped like layer 0's keys and values (measured by `bind`, which runs the layer once)."""
        heads, dk, dv = self._kv_dims
        return MTPKVCache(rows, heads, dk, dv, self._param.dtype, self._param.device, capacity)

    def extra_repr(self) -> str:
        return f"model_type={self.model_type!r}, num_mtp_layers={len(self.mtp.layers)}, drafts_with=layer 0"


__all__ = ["MTPHead", "MTPKVCache", "NoMTPLayersError", "num_mtp_layers"]
