"""EAGLE draft heads (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty",
arXiv:2401.15077; EAGLE-2, arXiv:2406.16858; EAGLE-3, arXiv:2503.01840): one Llama decoder layer that drafts over the
target's features, one token at a time, feeding its own output back.

Two layouts, both as published on the Hub (read and written by `hf_specdec.heads.formats.eagle`):

- **EAGLE-1/2** (``version=1``): ``x = fc([embed(token_{t+1}); f_t])`` with ``f_t`` the target's final normed hidden
  state (what its lm_head sees), then the decoder layer without ``input_layernorm``; its output is the next feature and
  the *target's* lm_head turns it into logits. Keys ``fc.*``, ``layers.0.*``, optional ``embed_tokens.weight``.
- **EAGLE-3** (``version=3``): the first step fuses three target layers' features, ``h = fc([f_low; f_mid; f_high])``;
  the layer's attention reads ``[input_layernorm(embed(token)); hidden_norm(h)]`` (2H wide) with ``h`` as residual;
  logits are ``lm_head(norm(out))`` over a draft vocabulary mapped to token ids by ``d2t`` (``id = i + d2t[i]``).
  Keys ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``.

The decoder layer is built from transformers' own `LlamaAttention`, `LlamaMLP`, `LlamaRMSNorm` and
`LlamaRotaryEmbedding`; keys and values live in the head's own small cache (`DraftKVCache`), one slot per batch row,
so that rows of different lengths draft together. `save_pretrained` writes the upstream tensor names plus our
``config.json`` (``head_type: "eagle"``), or with ``format="speculators"`` / ``"eagle"`` vLLM's speculators format /
the upstream layout SGLang loads; `from_pretrained` reads all of them, from a folder or a Hub repo id.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from ..cache.model_arg import cache_kwarg
from ..text_config import text_config
from .checks import check_verifier
from .derived import cached_derived, dense_weight, drafting_copy, lm_head_linear, lm_head_logits
from .draft_cache import DraftKVCache, ExtendKV
from .formats.eagle import eagle_upstream_config, read_eagle_checkpoint
from .formats.speculators import (
    EAGLE3_OPTIONS,
    is_speculators_config,
    read_speculators_checkpoint,
    speculators_eagle3_config,
    speculators_eagle3_tensors,
)
from .hub import CONFIG_NAME, HeadSource, PretrainedHead, base_model_dims, base_model_name
from .target_layers import copy_target_layers

# Llama config fields the head's decoder layer needs (upstream EAGLE configs are full Llama configs).
_LLAMA_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "vocab_size",
)


class EagleHead(
    nn.Module,
    PretrainedHead,
    library_name="hf-specdec",
    tags=["speculative-decoding", "eagle"],
    paper_url="https://arxiv.org/abs/2401.15077",
):
    """An EAGLE-1/2 or EAGLE-3 draft head.

    Args:
        config: a Llama config of the head's decoder layer (``hidden_size`` = the target's hidden size for EAGLE-1;
            ``num_hidden_layers`` must be 1). Extra keys used: ``bias`` (EAGLE-1's fc bias, default True),
            ``draft_vocab_size`` and ``target_hidden_size`` (EAGLE-3).
        version: 1 (EAGLE-1/2 layout) or 3 (EAGLE-3 layout).
        has_embed_tokens: the head stores its own ``embed_tokens`` (else it uses the bound target's).
        draft_vocab_size: size of the draft vocabulary (``d2t`` buffer); None = the full vocabulary. For EAGLE-1 the
            logits are then taken from the target lm_head's rows at those tokens.
        aux_layers: EAGLE-3 only: indices into the target's ``hidden_states`` tuple whose features are fused
            (default: 2, L // 2, L - 3, filled in by `bind`).
        base_model_name_or_path: the target this head was trained for (informational; sizes are checked).
        tree: defaults for the dynamic tree (``top_k``, ``depth``, ``num_nodes``, ``step_cost``...).
        model_card: facts for the generated model card.
        eagle3_options: EAGLE-3 variants that vLLM's ``speculators`` library trains (all False = upstream EAGLE-3):
            ``norm_before_residual`` (the residual is ``hidden_norm(h)``, not ``h``), ``norm_before_fc`` (an RMSNorm
            ``input_norm`` over the fused features before ``fc``), ``fc_norm`` (one RMSNorm per feature layer,
            ``fc_norm.{i}``), ``norm_output`` (the fed-back feature is ``norm(out)``). See `EAGLE3_OPTIONS`.
        verifier_architectures: the ``architectures`` of the target the head was built for (checked by `bind`
            when known; written into exported configs).
    """

    head_type = "eagle"
    export_formats = ("hf-specdec", "speculators", "eagle")

    def __init__(
        self,
        config: LlamaConfig | Mapping,
        version: int = 1,
        has_embed_tokens: bool = False,
        draft_vocab_size: int | None = None,
        aux_layers: list[int] | None = None,
        base_model_name_or_path: str | None = None,
        tree: dict | None = None,
        model_card: dict | None = None,
        eagle3_options: Mapping | None = None,
        verifier_architectures: list[str] | None = None,
    ):
        super().__init__()
        config = _llama_config(config)
        if version not in (1, 3):
            raise ValueError(f"EagleHead version must be 1 (EAGLE-1/2) or 3 (EAGLE-3), got {version}")
        self.config = config
        self.version = int(version)
        h = config.hidden_size
        self.hidden_size = h
        self.vocab_size = int(config.vocab_size)
        self.target_hidden_size = int(getattr(config, "target_hidden_size", None) or h)
        self.draft_vocab_size = None if draft_vocab_size is None else int(draft_vocab_size)
        self.aux_layers = None if aux_layers is None else [int(i) for i in aux_layers]
        self.base_model_name_or_path = base_model_name_or_path
        self.tree = dict(tree or {})
        self.model_card = dict(model_card or {})
        self.eagle3_options = _eagle3_options(eagle3_options, self.version)
        self.verifier_architectures = None if verifier_architectures is None else list(verifier_architectures)
        self.source, self.source_format = None, "hf-specdec"
        self._target_embed = self._target_lm_head = None  # plain attributes: never saved with the head
        bias = bool(getattr(config, "bias", True)) if version == 1 else False
        num_features = len(self.aux_layers) if self.aux_layers else 3
        if version == 3 and num_features < 2:
            raise ValueError(f"an EAGLE-3 head fuses at least 2 feature layers, got aux_layers={self.aux_layers}")
        fc_in = 2 * h if version == 1 else num_features * self.target_hidden_size
        self.fc = nn.Linear(fc_in, h, bias=bias)
        layer = _decoder_layer(config, version)
        if version == 1:
            self.layers = nn.ModuleList([layer])
        else:
            self.midlayer = layer
            self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
            self.lm_head = nn.Linear(h, self.draft_vocab_size or self.vocab_size, bias=False)
            eps, t = config.rms_norm_eps, self.target_hidden_size
            if self.eagle3_options["norm_before_fc"]:
                self.input_norm = LlamaRMSNorm(num_features * t, eps=eps)
            if self.eagle3_options["fc_norm"]:
                self.fc_norm = nn.ModuleList([LlamaRMSNorm(t, eps=eps) for _ in range(num_features)])
        self.embed_tokens = nn.Embedding(self.vocab_size, h) if has_embed_tokens else None
        if self.draft_vocab_size is not None:
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(self.vocab_size, dtype=torch.bool))
        else:
            self.d2t = self.t2d = None
        self.rotary_emb = LlamaRotaryEmbedding(config)

    # ------------------------------------------------------------------------------------------ construction
    @property
    def layer(self) -> nn.Module:
        return self.layers[0] if self.version == 1 else self.midlayer

    def copy_target_layers(self, model: nn.Module, first: int) -> list[int]:
        """Start the EAGLE-1 layer as the target's decoder layer ``first`` (negative: from the end): its attention
        projections, MLP and post-attention norm (`target_layers.copy_target_layers`, which raises ValueError where
        the shapes differ); EAGLE-3's layer, twice as wide at its input, is refused. Returns ``[layer]``."""
        if self.version != 1:
            raise ValueError("EagleHead: only an EAGLE-1 layer can start as a target layer; EAGLE-3's reads the "
                             "embeddings and features side by side")  # fmt: skip
        return copy_target_layers(self.layers, model, first, "EagleHead")

    @property
    def head_dim(self) -> int:
        """The attention head dimension (the last dimension of the cached keys and values)."""
        return _head_dim(self.config)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Indices into the target's ``hidden_states`` tuple this head reads (``-1`` = the final normed state)."""
        if self.version == 1:
            return (-1,)
        if self.aux_layers is None:
            raise ValueError("this EAGLE-3 head does not know its target's feature layers yet; call head.bind(model)")
        return tuple(self.aux_layers)

    @classmethod
    def for_model(cls, model: nn.Module, version: int = 1, draft_vocab: torch.Tensor | None = None, **kwargs):
        """A fresh EAGLE-1 (or EAGLE-3) head shaped like one of ``model``'s decoder layers, bound to it.

        Args:
            model: the target (a transformers causal LM).
            version: 1 or 3.
            draft_vocab: optional `[V']` token ids the head drafts over (sorted, distinct).
            **kwargs: `EagleHead` arguments (``tree``, ``model_card``...).
        """
        text = text_config(model)
        hidden, vocab = base_model_dims(model)
        fields = {k: getattr(text, k) for k in _LLAMA_FIELDS if getattr(text, k, None) is not None}
        fields.update(hidden_size=hidden, vocab_size=vocab, num_hidden_layers=1, bias=version == 1)
        fields.pop("rope_scaling", None)
        if version == 3:
            fields["target_hidden_size"] = hidden
        head = cls(
            fields,
            version=version,
            draft_vocab_size=None if draft_vocab is None else int(draft_vocab.numel()),
            base_model_name_or_path=kwargs.pop("base_model_name_or_path", base_model_name(model)),
            **kwargs,
        )
        if draft_vocab is not None:
            head.set_draft_vocab(draft_vocab)
        if version == 3:
            with torch.no_grad():
                rows = draft_vocab if draft_vocab is not None else torch.arange(vocab)
                head.lm_head.weight.copy_(dense_weight(model.get_output_embeddings().weight)[rows])
                norm = getattr(model.get_decoder(), "norm", None)  # the target's final norm: what its lm_head expects
                if getattr(norm, "weight", None) is not None and norm.weight.shape == head.norm.weight.shape:
                    head.norm.weight.copy_(norm.weight.detach())
        return head.bind(model)

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Draft over ``token_ids`` `[V']` only (distinct ids of the full vocabulary): fills ``d2t`` and ``t2d``."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        if self.d2t is None or ids.numel() != self.d2t.numel():
            raise ValueError(f"draft vocabulary of {ids.numel()} ids for a head built with {self.draft_vocab_size}")
        if ids.unique().numel() != ids.numel() or int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"draft vocabulary ids must be distinct and in [0, {self.vocab_size})")
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(ids.numel()))
            self.t2d.zero_()
            self.t2d[ids] = True

    @classmethod
    def _read_checkpoint(cls, source: HeadSource) -> tuple[dict, dict, str]:
        """``(init kwargs, tensors in our layout, source format)`` of the EAGLE head in ``source`` (any layout)."""
        try:
            config = source.json(CONFIG_NAME)
        except ValueError as err:
            raise ValueError(f"EagleHead: {err}") from err
        if is_speculators_config(config):
            return read_speculators_checkpoint(source, config, expected_shapes)
        return read_eagle_checkpoint(source, expected_shapes)

    def _place(self, dtype: torch.dtype | None, device: torch.device | str | None) -> None:
        """Cast / move the loaded head; the rotary frequencies (never stored) are built afresh in float32 where the
        head lies, whatever its dtype (as transformers builds them)."""
        del self.rotary_emb  # built on the meta device, it cannot move
        super()._place(dtype, device)
        with torch.device(self._param.device):
            self.rotary_emb = LlamaRotaryEmbedding(self.config)

    # ------------------------------------------------------------------------------------------ target
    def check_compatible(self, model: nn.Module) -> None:
        """Refuse a target whose hidden size, vocabulary or layer count do not fit (the message names both sides)."""
        hidden, vocab = base_model_dims(model)
        trained = f" (it was built for {self.base_model_name_or_path})" if self.base_model_name_or_path else ""
        if self.target_hidden_size != hidden:
            raise ValueError(
                f"EagleHead for a target of hidden size {self.target_hidden_size} cannot serve "
                f"{type(model).__name__} with hidden size {hidden}{trained}; load or train a head for this model"
            )
        if self.vocab_size != vocab:
            raise ValueError(
                f"EagleHead for a vocabulary of {self.vocab_size} tokens cannot serve {type(model).__name__} with "
                f"{vocab} tokens{trained}; load or train a head for this model"
            )
        if self.version == 3 and self.aux_layers is not None:
            layers = _num_layers(model)
            bad = [i for i in self.aux_layers if not 0 <= i <= layers]
            if bad:
                raise ValueError(
                    f"EagleHead reads the target's hidden states {self.aux_layers}, but {type(model).__name__} has "
                    f"{layers} layers (valid indices 0..{layers}); load or train a head for this model"
                )
        self._check_verifier(model)
        needs = [] if self.embed_tokens is not None else ["input embeddings"]
        if self.version == 1:
            needs.append("output embeddings")
        for what in needs:
            getter = "get_input_embeddings" if what.startswith("input") else "get_output_embeddings"
            if getattr(model, getter, lambda: None)() is None:
                raise ValueError(f"EagleHead uses the target's {what}, but {type(model).__name__}.{getter}() is None")

    def _check_verifier(self, model: nn.Module) -> None:
        """Refuse a target whose architecture differs from the one the checkpoint names (its ``verifier``)."""
        theirs = _architectures(model)
        if self.verifier_architectures and not set(theirs) & set(self.verifier_architectures):
            name = getattr(model.config, "_name_or_path", "") or type(model).__name__
            raise ValueError(
                f"EagleHead was trained for a verifier {self.base_model_name_or_path or '(unnamed)'} of architecture "
                f"{self.verifier_architectures}, but the target {name} is {theirs}; load or train a head for this "
                "model"
            )

    def bind(self, model: nn.Module) -> EagleHead:
        """Check ``model``, remember its embeddings / lm_head where the head uses them, and (EAGLE-3) fill in the
        default feature layers 2, L // 2, L - 3; returns self."""
        if self.version == 3 and self.aux_layers is None:
            self.aux_layers = list(eagle3_feature_layers(model))
        self.check_compatible(model)
        if self.verifier_architectures is None:
            self.verifier_architectures = _architectures(model)
        if self.embed_tokens is None:
            object.__setattr__(self, "_target_embed", model.get_input_embeddings())
        if self.version == 1:
            object.__setattr__(self, "_target_lm_head", model.get_output_embeddings())
        return self

    # ------------------------------------------------------------------------------------------ math
    @property
    def _param(self) -> torch.Tensor:
        return self.fc.weight

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """`[..., H]` token embeddings (the head's own, else the bound target's)."""
        table = self.embed_tokens if self.embed_tokens is not None else self._target_embed
        if table is None:
            raise ValueError("this EagleHead stores no embed_tokens: call head.bind(target) first")
        w = table.weight
        return F.embedding(tokens.to(w.device), w).to(self._param.dtype)

    def layer_forward(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        past_key: torch.Tensor,
        past_value: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One pass of the decoder layer over ``q`` new (token, feature) pairs per row.

        Args:
            tokens: `[B, q]` the tokens (token t + 1 beside feature t).
            features: `[B, q, F]`: EAGLE-1: the target's final state (or the head's own output); EAGLE-3: the fused
                `[3 H_t]` target features, or the head's own `[H]` output (fed back).
            positions: `[B, q]` position ids.
            mask: `[B, q, S + q]` bool, which of the ``S`` past entries and the new ones each query sees.
            past_key / past_value: `[B, kv_heads, S, D]` the keys/values the queries may attend to.
        Returns:
            ``(out, key, value)``: `[B, q, H]` the layer's output (the predicted next feature), and the new entries'
            `[B, kv_heads, q, D]` keys and values.
        """
        dtype = self._param.dtype
        emb = self.embed(tokens)  # [B, q, H]
        feats = features.to(device=emb.device, dtype=dtype)
        layer = self.layer
        if self.version == 1:
            x = self.fc(torch.cat([emb, feats], dim=-1))
            residual = x
        else:
            h = self.fc(self._normed_features(feats)) if feats.shape[-1] != self.hidden_size else feats
            hidden = layer.hidden_norm(h)
            x = torch.cat([layer.input_layernorm(emb), hidden], dim=-1)  # [B, q, 2H]
            residual = hidden if self.eagle3_options["norm_before_residual"] else h
        cos_sin = self.rotary_emb(x, positions.to(x.device))
        kv = ExtendKV(past_key.to(dtype), past_value.to(dtype))
        attn, _ = layer.self_attn(
            hidden_states=x,
            position_embeddings=cos_sin,
            attention_mask=mask[:, None],
            **cache_kwarg(layer.self_attn.forward, kv),
        )
        h = residual + attn
        out = h + layer.mlp(layer.post_attention_layernorm(h))
        if self.version == 3 and self.eagle3_options["norm_output"]:
            out = self.norm(out)  # the normed state is both fed back and what the lm_head reads
        return out, kv.new_key, kv.new_value

    def _normed_features(self, feats: torch.Tensor) -> torch.Tensor:
        """`[B, q, n T]` fused target features after ``input_norm`` / the per-layer ``fc_norm`` (when the head has
        them)."""
        if self.eagle3_options["norm_before_fc"]:
            return self.input_norm(feats)
        if self.eagle3_options["fc_norm"]:
            chunks = feats.chunk(len(self.fc_norm), dim=-1)
            return torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return feats

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """`[..., V']` fp32 logits over the draft vocabulary (the full vocabulary when there is none)."""
        if self.version == 3:
            normed = out if self.eagle3_options["norm_output"] else self.norm(out)
            return self.lm_head(normed).float()
        head = self._target_lm_head
        if head is None:
            raise ValueError("EAGLE-1 heads take logits from the target's lm_head: call head.bind(target) first")
        index = None if self.d2t is None else self._draft_ids()
        return lm_head_logits(self, head, out, index, self._param.dtype).float()  # the head's dtype: `drafting_copy`

    def drafting_linears(self) -> tuple[nn.Module, ...]:
        """The modules outside the head that `logits` multiplies by and that the target does not run itself:
        EAGLE-1's target lm_head rows at the draft vocabulary, or in the head's narrower dtype (`lm_head_linear`,
        gathered now if not yet); none for EAGLE-3 (its lm_head is its own module) or a full fp32 vocabulary."""
        head = self._target_lm_head
        if self.version == 3 or not isinstance(head, nn.Linear):
            return ()
        index = None if self.d2t is None else self._draft_ids()
        linear = lm_head_linear(self, head, index, self._param.dtype)
        return () if linear is head else (linear,)

    def _draft_ids(self) -> torch.Tensor:
        """`[V']` the token id of every draft-vocabulary index."""
        m = self.d2t
        return cached_derived(
            self, "_draft_ids", (m,), lambda: self.draft_to_token(torch.arange(m.numel(), device=m.device))
        )

    def drafting_copy(self, dtype: torch.dtype) -> EagleHead:
        """This head computing in ``dtype`` (itself, or a cached copy bound to the same target; `derived.drafting_copy`)."""
        return drafting_copy(self, dtype, shared=("_target_embed", "_target_lm_head"))

    def draft_to_token(self, index: torch.Tensor) -> torch.Tensor:
        """Token ids of draft-vocabulary indices (identity without a draft vocabulary)."""
        if self.d2t is None:
            return index
        return index + self.d2t.to(index.device)[index]

    def forward(self, tokens: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced pass over whole sequences (training, tests): causal attention, positions from 0.

        Args:
            tokens: `[B, T]` token ``t + 1`` of each pair.
            features: `[B, T, F]` feature ``t``.
        Returns:
            ``(out, logits)``: `[B, T, H]` predicted next features and `[B, T, V']` fp32 logits.
        """
        b, t = tokens.shape
        kvh, d = self.config.num_key_value_heads, _head_dim(self.config)
        empty = self._param.new_zeros(b, kvh, 0, d)
        pos = torch.arange(t, device=tokens.device).expand(b, t)
        mask = torch.ones(t, t, dtype=torch.bool, device=self._param.device).tril().expand(b, t, t)
        out, _, _ = self.layer_forward(tokens, features, pos, mask, empty, empty)
        return out, self.logits(out)

    def new_cache(self, rows: int, capacity: int = 256) -> DraftKVCache:
        """An empty `DraftKVCache` for ``rows`` rows in the head's dtype and device."""
        kvh, d = self.config.num_key_value_heads, _head_dim(self.config)
        return DraftKVCache(rows, kvh, d, self._param.dtype, self._param.device, capacity)

    # ------------------------------------------------------------------------------------------ Hub I/O
    def config_dict(self) -> dict:
        """What ``config.json`` holds: the Llama fields upstream writes, plus ours."""
        fields = {k: getattr(self.config, k) for k in _LLAMA_FIELDS if getattr(self.config, k, None) is not None}
        fields.pop("rope_scaling", None)
        return {
            **fields,
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "bias": self.fc.bias is not None,
            "head_type": "eagle",
            "eagle_version": self.version,
            "has_embed_tokens": self.embed_tokens is not None,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "aux_layers": self.aux_layers,
            "base_model_name_or_path": self.base_model_name_or_path,
            "tree": self.tree,
            "model_card": self.model_card,
            "eagle3_options": self.eagle3_options if self.version == 3 else None,
            "verifier_architectures": self.verifier_architectures,
            "source_format": self.source_format,
            "dtype": str(self._param.dtype).removeprefix("torch."),
        }

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor name this head saves, with its shape (the upstream names)."""
        return expected_shapes(self)

    def export_checkpoint(self, fmt: str) -> tuple[dict, dict[str, torch.Tensor]]:
        """``(config.json, tensors)`` of this head in an upstream layout (`PretrainedHead.save_pretrained`):

        - ``"speculators"``: vLLM's speculators format (EAGLE-3 heads only: neither the library nor vLLM has an
          EAGLE-1 kind); the verifier is ``base_model_name_or_path`` with ``verifier_architectures``.
        - ``"eagle"``: the upstream EAGLE layout that SGLang and vLLM load (EAGLE-1: ``fc``, ``layers.0.*``;
          EAGLE-3: SpecForge's ``midlayer.*`` with ``d2t`` / ``t2d``).
        """
        state = {k: v for k, v in self.state_dict().items() if not k.startswith("rotary_emb.")}
        if self.version == 3 and fmt in ("speculators", "eagle"):
            layers = list(self.feature_layers)
            if len(set(layers)) != len(layers):
                raise ValueError(f"this EAGLE-3 head reads the target's hidden states {layers}, which repeat a layer: "
                                 "vLLM, SGLang and the speculators library collect each layer once and need distinct "
                                 "ids (train the head with distinct aux_layers)")  # fmt: skip
        if fmt == "speculators":
            if self.version != 3:
                raise ValueError("the speculators format has no EAGLE-1 kind that vLLM or the speculators library "
                                 "reads; export this EAGLE-1 head with format='eagle'")  # fmt: skip
            check_verifier("EagleHead", self.base_model_name_or_path, self.verifier_architectures)
            config = speculators_eagle3_config(self, self.base_model_name_or_path, self.verifier_architectures)
            embed = None if self._target_embed is None else self._target_embed.weight
            return config, speculators_eagle3_tensors(state, embed)
        if fmt == "eagle":
            return eagle_upstream_config(self), state
        raise ValueError(f"EagleHead exports the formats {list(self.export_formats)}, not {fmt!r}")

    def card_config(self) -> dict:
        return {**self.config_dict(), "hidden_size": self.target_hidden_size}

    def _card_text(self, base: str, where: str) -> tuple[str, str, str, str]:
        kind = "EAGLE-1/2" if self.version == 1 else "EAGLE-3"
        description = (
            f"An {kind} draft head ([Li et al. 2024](https://arxiv.org/abs/2401.15077)) for speculative decoding with "
            "hf-specdec: one Llama decoder layer over the base model's features that drafts a dynamic token tree "
            "(EAGLE-2), which the base model verifies in one forward pass. Greedy output is identical to the base "
            "model's own; sampling is exact."
        )
        load = f'EagleHead.from_pretrained("{where}", base_model=model)'
        return f"{kind} head for {base}", description, "from hf_specdec import EagleHead", load

    def extra_repr(self) -> str:
        return (
            f"version={self.version}, hidden_size={self.hidden_size}, target_hidden_size={self.target_hidden_size}, "
            f"vocab_size={self.vocab_size}, draft_vocab_size={self.draft_vocab_size}"
        )


# --------------------------------------------------------------------------------------------------- layer
class _Eagle3Layer(nn.Module):
    """The EAGLE-3 decoder layer's parameters: q/k/v read the 2H-wide ``[input_layernorm(e); hidden_norm(h)]``."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        h = config.hidden_size
        self.self_attn = LlamaAttention(config, layer_idx=0)
        attn = self.self_attn
        bias = bool(getattr(config, "attention_bias", False))
        for name in ("q_proj", "k_proj", "v_proj"):
            out_features = getattr(attn, name).out_features
            setattr(attn, name, nn.Linear(2 * h, out_features, bias=bias))
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)


class _Eagle1Layer(nn.Module):
    """The EAGLE-1 decoder layer's parameters: a Llama layer without ``input_layernorm``."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx=0)
        self.mlp = LlamaMLP(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


def _decoder_layer(config: LlamaConfig, version: int) -> nn.Module:
    return _Eagle1Layer(config) if version == 1 else _Eagle3Layer(config)


def _eagle3_options(options: Mapping | None, version: int) -> dict[str, bool]:
    """Every EAGLE-3 option as a bool (False where not given); an unknown name, a non-bool value, an option on an
    EAGLE-1 head, or both fused-feature norms at once are errors."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(EAGLE3_OPTIONS))
    if unknown:
        raise ValueError(f"unknown EAGLE-3 options {unknown}; the known ones are {list(EAGLE3_OPTIONS)}")
    bad = {k: v for k, v in options.items() if not isinstance(v, bool)}
    if bad:
        raise ValueError(f"EAGLE-3 options must be true or false, got {bad}")
    out = {k: bool(options.get(k, False)) for k in EAGLE3_OPTIONS}
    if version != 3 and any(out.values()):
        raise ValueError(f"EAGLE-3 options {[k for k, v in out.items() if v]} on an EAGLE-{version} head")
    if out["norm_before_fc"] and out["fc_norm"]:
        raise ValueError("EAGLE-3 options norm_before_fc and fc_norm exclude each other (one norm over the fused "
                         "features, or one per feature layer)")  # fmt: skip
    return out


def _llama_config(config: LlamaConfig | Mapping) -> LlamaConfig:
    if isinstance(config, LlamaConfig):
        config = config.to_dict()
    fields = {k: v for k, v in dict(config).items() if k in _LLAMA_FIELDS}
    for extra in ("bias", "target_hidden_size", "draft_vocab_size"):
        if config.get(extra) is not None:
            fields[extra] = config[extra]
    if fields.get("rope_parameters") is not None:
        fields.pop("rope_theta", None)
        fields.pop("rope_scaling", None)
    cfg = LlamaConfig(**fields, num_hidden_layers=1)
    cfg._attn_implementation = "sdpa"
    return cfg


def eagle3_feature_layers(model: nn.Module) -> tuple[int, ...]:
    """The entries of ``model``'s ``hidden_states`` tuple an EAGLE-3 head reads by default (upstream's low, middle
    and high layers: 2, L // 2, L - 3; 1, L // 2, L - 1 for targets under 6 layers)."""
    layers = _num_layers(model)
    return (2, layers // 2, layers - 3) if layers >= 6 else (1, layers // 2, layers - 1)


def _head_dim(config: LlamaConfig) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _architectures(model: nn.Module) -> list[str]:
    """The model's config ``architectures`` (what a checkpoint's config.json says), else its class name (a model
    built from a config has none)."""
    return list(getattr(model.config, "architectures", None) or [type(model).__name__])


def _num_layers(model: nn.Module) -> int:
    config = text_config(model)
    return int(config.num_hidden_layers)


# --------------------------------------------------------------------------------------------------- checkpoints
def expected_shapes(head: EagleHead | None = None, *, init: Mapping | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor name a head of this shape stores, with its shape (the upstream names)."""
    if head is None:
        with torch.device("meta"):
            head = EagleHead(**init)
    return {k: tuple(v.shape) for k, v in head.state_dict().items() if not k.startswith("rotary_emb.")}


__all__ = [
    "EagleHead",
    "DraftKVCache",
    "eagle3_feature_layers",
    "expected_shapes",
]
