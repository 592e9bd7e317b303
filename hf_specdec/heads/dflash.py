"""DFlash block drafter (z-lab, "DFlash: block diffusion for flash speculative decoding",
https://z-lab.ai/projects/dflash/): a few decoder layers that draft a whole block of tokens in one forward.

What the weights compute (the layout of vLLM's ``speculators`` library, kind ``dflash``; `hf_specdec.heads.formats.speculators`):

- **Context.** The target's hidden states at the layers ``aux_layers`` (indices into transformers' ``hidden_states``
  tuple) are concatenated per committed token and fused: ``c_j = hidden_norm(fc([h_a(j); h_b(j); ...]))`` `[H]`. In
  every draft layer the context's keys and values are that layer's own projections of ``c_j`` (``k_norm(k_proj(c_j))``
  with RoPE at position j, ``v_proj(c_j)``); the context never runs through the layers, so its keys and values are
  computed once per committed token and cached (`context_kv`).
- **Block.** After the last committed token comes the anchor (the root: the token the target chose last, not yet
  through the target) and ``block_size - 1`` copies of ``mask_token_id``, at positions ``n .. n + block_size - 1``.
  They enter as the target's input embeddings and run through the layers (Qwen3-style: q/k RMS-normed per head,
  pre-norm residual blocks), each block token attending to the whole context before the anchor and to *every* token
  of its block (bidirectional). ``lm_head(norm(x))`` at block slot i is the draft's distribution of the token at
  position ``n + i`` (``sample_from_anchor``: ``n + i + 1``), i.e. tree depth i (i + 1): one forward drafts every depth.
- The logits are over a draft vocabulary (``lm_head`` `[V', H]` with ``d2t`` / ``t2d``, ``id = i + d2t[i]``) or, when
  the head drafts over the full vocabulary, they come from the bound target's own lm_head, which the checkpoint does
  not store (as the library rebuilds it from the verifier). ``embed_tokens`` are always the target's.

The head follows the `PretrainedHead` pattern: ``from_pretrained`` reads our format (``head_type: "dflash"``) or a
speculators ``dflash`` folder (local or Hub), ``save_pretrained(dir, format="speculators")`` writes the latter.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from ..text_config import text_config
from .checks import check_token_ids, check_tree, check_verifier
from .derived import dense_weight, drafting_copy, lm_head_logits
from .draft_cache import DraftKVCache
from .eagle import EagleHead, _architectures, _num_layers
from .formats.common import check_d2t
from .formats.speculators import (
    is_speculators_config,
    speculators_dflash_config,
    speculators_dflash_init,
    speculators_dflash_tensors_to_ours,
)
from .hub import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    HeadSource,
    PretrainedHead,
    base_model_dims,
    base_model_name,
    check_shapes,
    config_int,
    read_tensors,
)
from .target_layers import copy_target_layers

# Qwen3 config fields the draft layers need (a speculators ``transformer_layer_config`` is a full transformers config)
LAYER_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "max_position_embeddings",
    "hidden_act",
    "attention_bias",
    "vocab_size",
)
DEFAULT_BLOCK_SIZE = 8
QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")  # Qwen3-style; a Llama target has none


class DFlashHead(
    nn.Module,
    PretrainedHead,
    library_name="hf-specdec",
    tags=["speculative-decoding", "dflash"],
    paper_url="https://z-lab.ai/projects/dflash/",
):
    """A DFlash block drafter.

    Args:
        config: the draft layers' transformers config (Qwen3 fields; ``num_hidden_layers`` = draft layers,
            ``vocab_size`` = the target's vocabulary, ``hidden_size`` = the target's hidden size).
        aux_layers: indices into the target's ``hidden_states`` tuple whose states form the context (None: filled in
            by `bind`, `default_feature_layers`).
        block_size: tokens per block (the anchor included).
        mask_token_id: the token id of the block's mask slots (None: filled in by `bind`).
        draft_vocab_size: size of the draft vocabulary (``lm_head``, ``d2t``, ``t2d``); None = the full vocabulary
            through the target's lm_head.
        sample_from_anchor: the anchor's slot drafts too (slot i = depth i + 1, ``block_size`` depths); else slot i =
            depth i and the block drafts ``block_size - 1`` depths.
        base_model_name_or_path / verifier_architectures: the target the head was built for (checked by `bind`).
        tree: DDTree defaults (``top_k``, ``num_nodes``, ``step_cost``); model_card: facts for the model card.
    """

    head_type = "dflash"
    export_formats = ("hf-specdec", "speculators")

    def __init__(
        self,
        config: Qwen3Config | Mapping,
        aux_layers: list[int] | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        mask_token_id: int | None = None,
        draft_vocab_size: int | None = None,
        sample_from_anchor: bool = False,
        base_model_name_or_path: str | None = None,
        verifier_architectures: list[str] | None = None,
        tree: dict | None = None,
        model_card: dict | None = None,
    ):
        super().__init__()
        self.config = layer_config(config)
        h = self.config.hidden_size
        self.hidden_size, self.vocab_size = int(h), int(self.config.vocab_size)
        self.aux_layers = None if aux_layers is None else [int(i) for i in aux_layers]
        self.block_size = int(block_size)
        if self.block_size < 2:
            raise ValueError(
                f"a DFlash block holds the anchor and at least one mask token, got block_size={block_size}"
            )
        self.mask_token_id = None if mask_token_id is None else int(mask_token_id)
        self.draft_vocab_size = None if draft_vocab_size in (None, self.vocab_size) else int(draft_vocab_size)
        self.sample_from_anchor = bool(sample_from_anchor)
        self.base_model_name_or_path = base_model_name_or_path
        self.verifier_architectures = None if verifier_architectures is None else list(verifier_architectures)
        self.tree, self.model_card = dict(tree or {}), dict(model_card or {})
        self.source, self.source_format = None, "hf-specdec"
        self._target_embed = self._target_lm_head = None  # plain attributes: never saved with the head
        features = len(self.aux_layers) if self.aux_layers else 3
        self.fc = nn.Linear(features * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=self.config.rms_norm_eps)
        self.layers = nn.ModuleList([_DFlashLayer(self.config, i) for i in range(self.config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(h, eps=self.config.rms_norm_eps)
        if self.draft_vocab_size is not None:
            self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(self.vocab_size, dtype=torch.bool))
        else:
            self.lm_head = self.d2t = self.t2d = None
        self.rotary_emb = Qwen3RotaryEmbedding(self.config)

    # ------------------------------------------------------------------------------------------ construction
    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Indices into the target's ``hidden_states`` tuple the context is built from."""
        if self.aux_layers is None:
            raise ValueError("this DFlashHead does not know its target's feature layers yet; call head.bind(model)")
        return tuple(self.aux_layers)

    @property
    def num_depths(self) -> int:
        """Tree depths one block drafts."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @property
    def kv_heads(self) -> int:
        return int(self.config.num_key_value_heads)

    @property
    def head_dim(self) -> int:
        return int(self.config.head_dim)

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        num_layers: int = 1,
        block_size: int = DEFAULT_BLOCK_SIZE,
        draft_vocab: torch.Tensor | None = None,
        **kwargs,
    ) -> DFlashHead:
        """A fresh head whose layers are shaped like ``model``'s decoder layers, bound to it.

        Args:
            model: the target (a transformers causal LM).
            num_layers: draft decoder layers.
            block_size: tokens per block (the anchor included).
            draft_vocab: optional `[V']` token ids the head drafts over (distinct); its lm_head starts as the
                target's rows at those ids.
            **kwargs: `DFlashHead` arguments (``aux_layers``, ``mask_token_id``, ``tree``, ``model_card``...).
        """
        text = text_config(model)
        hidden, vocab = base_model_dims(model)
        fields = {k: getattr(text, k) for k in LAYER_FIELDS if getattr(text, k, None) is not None}
        fields.update(hidden_size=hidden, vocab_size=vocab, num_hidden_layers=num_layers)
        kwargs.setdefault("aux_layers", default_feature_layers(_num_layers(model)))
        head = cls(
            fields,
            block_size=block_size,
            draft_vocab_size=None if draft_vocab is None else int(draft_vocab.numel()),
            base_model_name_or_path=kwargs.pop("base_model_name_or_path", base_model_name(model)),
            **kwargs,
        )
        if draft_vocab is not None:
            head.set_draft_vocab(draft_vocab)
            with torch.no_grad():
                head.lm_head.weight.copy_(dense_weight(model.get_output_embeddings().weight)[draft_vocab])
        norm = getattr(model.get_decoder(), "norm", None)  # the target's final norm: what its lm_head expects
        if getattr(norm, "weight", None) is not None and norm.weight.shape == head.norm.weight.shape:
            with torch.no_grad():
                head.norm.weight.copy_(norm.weight.detach())
        return head.bind(model)

    def copy_target_layers(self, model: nn.Module, first: int) -> list[int]:
        """Start draft layer i as the target's decoder layer ``first + i`` (negative: counted from the end): its
        attention projections, MLP and norms; a target without q / k norms leaves the head's at ones
        (`target_layers.copy_target_layers`, which raises ValueError where the shapes differ). Returns the layers."""
        return copy_target_layers(self.layers, model, first, "DFlashHead", QK_NORMS)

    # the same d2t / t2d buffers as EagleHead's: its vocabulary mapping serves both heads
    set_draft_vocab = EagleHead.set_draft_vocab
    draft_to_token = EagleHead.draft_to_token

    # ------------------------------------------------------------------------------------------ target
    def check_compatible(self, model: nn.Module) -> None:
        """Refuse a target whose hidden size, vocabulary, depth or architecture do not fit (naming both sides), or
        whose vocabulary lacks the mask token."""
        hidden, vocab = base_model_dims(model)
        trained = f" (it was built for {self.base_model_name_or_path})" if self.base_model_name_or_path else ""
        for what, ours, theirs in (("hidden size", self.hidden_size, hidden), ("vocabulary", self.vocab_size, vocab)):
            if ours != theirs:
                raise ValueError(f"DFlashHead for a target of {what} {ours} cannot serve {type(model).__name__} with "
                                 f"{what} {theirs}{trained}; load or train a head for this model")  # fmt: skip
        layers = _num_layers(model)
        if self.aux_layers is not None and not all(0 <= i <= layers for i in self.aux_layers):
            raise ValueError(f"DFlashHead reads the target's hidden states {self.aux_layers}, but "
                             f"{type(model).__name__} has {layers} layers (valid indices 0..{layers})")  # fmt: skip
        theirs = _architectures(model)
        if self.verifier_architectures and not set(theirs) & set(self.verifier_architectures):
            raise ValueError(f"DFlashHead was trained for a verifier {self.base_model_name_or_path or '(unnamed)'} of "
                             f"architecture {self.verifier_architectures}, but the target is {theirs}; load or train "
                             "a head for this model")  # fmt: skip
        check_token_ids("DFlashHead", "mask_token_id", self.mask_token_id, vocab, self.source or "the head")
        for getter in ("get_input_embeddings",) + (() if self.lm_head is not None else ("get_output_embeddings",)):
            if getattr(model, getter, lambda: None)() is None:
                raise ValueError(f"DFlashHead uses {type(model).__name__}.{getter}(), which is None")

    def bind(self, model: nn.Module) -> DFlashHead:
        """Check ``model``, remember its embeddings (and lm_head for a full-vocabulary head), fill in the default
        feature layers and mask token; returns self."""
        if self.aux_layers is None:
            self.aux_layers = default_feature_layers(_num_layers(model))
            if len(self.aux_layers) * self.hidden_size != self.fc.in_features:
                raise ValueError(f"DFlashHead: its fc fuses {self.fc.in_features // self.hidden_size} target layers, "
                                 f"but the default layers of this target are {self.aux_layers}: pass aux_layers")  # fmt: skip
        self.check_compatible(model)
        if self.verifier_architectures is None:
            self.verifier_architectures = _architectures(model)
        if self.mask_token_id is None:
            self.mask_token_id = _default_mask_token(model)
        object.__setattr__(self, "_target_embed", model.get_input_embeddings())
        if self.lm_head is None:
            object.__setattr__(self, "_target_lm_head", model.get_output_embeddings())
        return self

    # ------------------------------------------------------------------------------------------ math
    @property
    def _param(self) -> torch.Tensor:
        return self.fc.weight

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """`[..., H]` the target's input embeddings of ``tokens``, in the head's dtype."""
        if self._target_embed is None:
            raise ValueError("DFlashHead embeds with the target's embeddings: call head.bind(target) first")
        w = self._target_embed.weight
        return F.embedding(tokens.to(w.device), w).to(device=self._param.device, dtype=self._param.dtype)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's keys and values of committed tokens, from the target's states at them.

        Args:
            features: `[B, S, n H]` the target's hidden states at the ``aux_layers``, concatenated.
            positions: `[B, S]` the tokens' positions.
        Returns:
            ``(key, value)``, each `[B, layers * kv_heads, S, D]` (layer l's heads at ``l * kv_heads``), keys with RoPE.
        """
        ctx = self.hidden_norm(self.fc(features.to(device=self._param.device, dtype=self._param.dtype)))  # [B, S, H]
        cos, sin = self.rotary_emb(ctx, positions.to(ctx.device))
        keys, values = zip(*(layer.self_attn_kv(ctx, cos, sin) for layer in self.layers))
        return torch.cat(keys, dim=1), torch.cat(values, dim=1)

    def block_hidden(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        past_key: torch.Tensor,
        past_value: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """The layers over block tokens; the context enters as cached keys and values only.

        Args:
            tokens: `[B, Q]` block tokens (anchors and mask tokens).
            positions: `[B, Q]` their positions.
            past_key / past_value: `[B, layers * kv_heads, S, D]` the context (`context_kv`).
            mask: `[B, Q, S + Q]` bool, which context entries and which block tokens each block token sees.
        Returns:
            `[B, Q, H]` the final normed states (what the lm_head reads).
        """
        x = self.embed(tokens)  # [B, Q, H]
        cos, sin = self.rotary_emb(x, positions.to(x.device))
        kvh, dev = self.kv_heads, x.device
        attn_mask = mask.to(dev)[:, None]  # [B, 1, Q, S + Q]
        for i, layer in enumerate(self.layers):
            past = (past_key[:, i * kvh : (i + 1) * kvh].to(dev), past_value[:, i * kvh : (i + 1) * kvh].to(dev))
            x = layer(x, cos, sin, past, attn_mask)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[..., V']` fp32 logits over the draft vocabulary (the target's lm_head without one). The product runs on
        2-D rows: on the CPU a 3-D bf16 ``F.linear`` over a large lm_head is an order of magnitude slower
        (docs/lab/measurements.md, "Figures that stood in the package's docstrings")."""
        flat = hidden.reshape(-1, hidden.shape[-1])  # [n, H]
        if self.lm_head is not None:
            out = self.lm_head(flat)
        elif self._target_lm_head is None:
            raise ValueError("a full-vocabulary DFlashHead uses the target's lm_head: call head.bind(target) first")
        else:
            out = lm_head_logits(self, self._target_lm_head, flat, None, self._param.dtype)
        return out.float().view(*hidden.shape[:-1], -1)

    def block_tokens(self, anchors: torch.Tensor) -> torch.Tensor:
        """`[..., block_size]` blocks of the anchors `[...]`: the anchor, then mask tokens."""
        if self.mask_token_id is None:
            raise ValueError("this DFlashHead has no mask_token_id: set it, or call head.bind(target)")
        block = anchors.new_full((*anchors.shape, self.block_size), self.mask_token_id)
        block[..., 0] = anchors
        return block

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Teacher-forced blocks at several anchors of whole sequences (training, tests), as the library trains.

        Args:
            tokens: `[B, T]` token ids; features: `[B, T, n H]` the target's states at them.
            anchors: `[B, A]` anchor positions (each block sees the context before its anchor and its own block).
        Returns:
            `[B, A, block_size, V']` fp32 logits of every block slot.
        """
        b, t = tokens.shape
        a, k, dev = anchors.shape[1], self.block_size, tokens.device
        key, value = self.context_kv(features, torch.arange(t, device=dev).expand(b, t))
        offsets = torch.arange(k, device=dev)
        block = self.block_tokens(tokens.gather(1, anchors)).reshape(b, a * k)  # [B, A k]
        positions = (anchors[..., None] + offsets).reshape(b, a * k)
        query_anchor = anchors.repeat_interleave(k, dim=1)  # [B, A k]
        sees_ctx = torch.arange(t, device=dev)[None, None, :] < query_anchor[..., None]  # [B, A k, T]
        blocks = torch.arange(a * k, device=dev) // k
        sees_block = (blocks[:, None] == blocks[None, :]).expand(b, a * k, a * k)  # [B, A k, A k]
        hidden = self.block_hidden(block, positions, key, value, torch.cat([sees_ctx, sees_block], dim=-1))
        return self.logits(hidden).view(b, a, k, -1)

    def new_cache(self, rows: int, capacity: int = 256) -> DraftKVCache:
        """An empty context cache for ``rows`` rows: every layer's keys and values side by side in the head axis."""
        heads = self.kv_heads * len(self.layers)
        return DraftKVCache(rows, heads, self.head_dim, self._param.dtype, self._param.device, capacity)

    def drafting_copy(self, dtype: torch.dtype) -> DFlashHead:
        """This head computing in ``dtype`` (itself, or a cached copy bound to the same target; `derived.drafting_copy`)."""
        return drafting_copy(self, dtype, shared=("_target_embed", "_target_lm_head"))

    def _place(self, dtype: torch.dtype | None, device: torch.device | str | None) -> None:
        """Cast / move the loaded head; the rotary frequencies (never stored) are rebuilt in fp32 where it lies."""
        del self.rotary_emb  # built on the meta device, it cannot move
        super()._place(dtype, device)
        with torch.device(self._param.device):
            self.rotary_emb = Qwen3RotaryEmbedding(self.config)

    # ------------------------------------------------------------------------------------------ Hub I/O
    def config_dict(self) -> dict:
        """What our ``config.json`` holds: the layer config, the target's sizes and every other init argument."""
        return {
            "head_type": "dflash",
            "transformer_layer_config": _layer_dict(self.config),
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            **{k: getattr(self, k) for k in _INIT_KEYS},
            "source_format": self.source_format,
            "dtype": str(self._param.dtype).removeprefix("torch."),
        }

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor name this head saves, with its shape."""
        return {k: tuple(v.shape) for k, v in self.state_dict().items()}

    @classmethod
    def _read_checkpoint(cls, source: HeadSource) -> tuple[dict, dict, str]:
        """``(init kwargs, tensors, source format)`` of the DFlash head in ``source`` (ours or speculators')."""
        config_path = f"{source}/{CONFIG_NAME}"
        config = source.json(CONFIG_NAME)
        if config is None:
            raise FileNotFoundError(f"DFlashHead: {source.describe_missing([CONFIG_NAME])}")
        if is_speculators_config(config):
            init, fmt = speculators_dflash_init(config, config_path), "speculators"
        elif config.get("head_type") == "dflash":
            init = {k: config.get(k) for k in _INIT_KEYS if k in config}
            init["config"], fmt = config["transformer_layer_config"], "hf-specdec"
        else:
            raise ValueError(f"DFlashHead: {config_path} is neither a speculators 'dflash' config nor an hf-specdec "
                             f"DFlash config (head_type {config.get('head_type')!r})")  # fmt: skip
        check_tree("DFlashHead", init.get("tree"), config_path)
        config_int("DFlashHead", init, "mask_token_id", config_path, required=False, minimum=0)
        weights = source.require(WEIGHTS_NAME, "the DFlash head's weights")
        tensors = read_tensors(weights)
        if fmt == "speculators":  # what the library keeps of the verifier: never the head's own
            tensors = speculators_dflash_tensors_to_ours(tensors, init.get("draft_vocab_size"))
        try:
            with torch.device("meta"):
                expected = cls(**init).expected_shapes()
        except (TypeError, ValueError) as err:
            raise ValueError(f"DFlashHead: cannot build a head from {config_path}: {err}") from err
        check_shapes("DFlashHead", tensors, expected, f"{weights} (config {config_path})")
        vocab = int(init["config"]["vocab_size"])
        check_d2t("DFlashHead", tensors, vocab, weights)
        check_token_ids("DFlashHead", "mask_token_id", init.get("mask_token_id"), vocab, config_path)
        return init, tensors, fmt

    def export_checkpoint(self, fmt: str) -> tuple[dict, dict[str, torch.Tensor]]:
        """``(config.json, tensors)`` in vLLM's speculators layout (``fmt="speculators"``)."""
        if fmt != "speculators":
            raise ValueError(f"DFlashHead exports the formats {list(self.export_formats)}, not {fmt!r}")
        check_verifier("DFlashHead", self.base_model_name_or_path, self.verifier_architectures)
        if self.mask_token_id is None:
            raise ValueError("a speculators DFlash config names its mask token: bind the head to its target first "
                             "(head.bind(model)), or set head.mask_token_id")  # fmt: skip
        config = speculators_dflash_config(self, _layer_dict(self.config))
        return config, dict(self.state_dict())  # the library's names are ours

    def _card_text(self, base: str, where: str) -> tuple[str, str, str, str]:
        description = (
            "A DFlash block drafter ([z-lab](https://z-lab.ai/projects/dflash/)) for speculative decoding with "
            f"hf-specdec: {len(self.layers)} decoder layer(s) over the base model's hidden states that draft a block "
            f"of {self.block_size} tokens in one forward; hf-specdec builds a DDTree from the block's per-depth "
            "distributions and the base model verifies it in one forward. Greedy output is identical to the base "
            "model's own; sampling is exact."
        )
        load = f'DFlashHead.from_pretrained("{where}", base_model=model)'
        return f"DFlash drafter for {base}", description, "from hf_specdec.heads.dflash import DFlashHead", load

    def extra_repr(self) -> str:
        return (f"layers={len(self.layers)}, block_size={self.block_size}, aux_layers={self.aux_layers}, "
                f"mask_token_id={self.mask_token_id}, draft_vocab_size={self.draft_vocab_size}")  # fmt: skip


_INIT_KEYS = ("aux_layers", "block_size", "mask_token_id", "draft_vocab_size", "sample_from_anchor",
              "base_model_name_or_path", "verifier_architectures", "tree", "model_card")  # fmt: skip


# --------------------------------------------------------------------------------------------------- layer
class _DFlashLayer(nn.Module):
    """One draft decoder layer (the library's ``Qwen3DFlashDecoderLayer`` parameters, transformers' Qwen3 modules)."""

    def __init__(self, config: Qwen3Config, index: int):
        super().__init__()
        self.self_attn = Qwen3Attention(config, layer_idx=index)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def self_attn_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[B, kv_heads, S, D]` keys (normed, RoPE) and values of ``x`` `[B, S, H]` (cos / sin `[B, S, D]`)."""
        attn = self.self_attn
        b, s, _ = x.shape
        key = attn.k_norm(attn.k_proj(x).view(b, s, -1, attn.head_dim)).transpose(1, 2)
        value = attn.v_proj(x).view(b, s, -1, attn.head_dim).transpose(1, 2)
        return _rope(key, cos, sin), value

    def forward(self, x: torch.Tensor, cos, sin, past: tuple[torch.Tensor, torch.Tensor], mask) -> torch.Tensor:
        """`[B, Q, H]` block states after the layer; ``past`` `[B, kv_heads, S, D]` keys / values of the context,
        ``mask`` `[B, 1, Q, S + Q]` bool."""
        attn = self.self_attn
        b, q, _ = x.shape
        h = self.input_layernorm(x)
        query = _rope(attn.q_norm(attn.q_proj(h).view(b, q, -1, attn.head_dim)).transpose(1, 2), cos, sin)
        key, value = self.self_attn_kv(h, cos, sin)
        key, value = torch.cat([past[0], key], dim=2), torch.cat([past[1], value], dim=2)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=attn.scaling, enable_gqa=True)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, q, -1))
        return x + self.mlp(self.post_attention_layernorm(x))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on `[B, heads, S, D]` with cos / sin `[B, S, D]` (rotate-half convention)."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# --------------------------------------------------------------------------------------------------- helpers
def layer_config(config: Qwen3Config | Mapping) -> Qwen3Config:
    """The draft layers' `Qwen3Config` from a transformers config or dict (any ``model_type``: the layer is always
    Qwen3-style, as the library builds it); sliding-window layers are refused."""
    if not isinstance(config, Mapping):
        config = config.to_dict()
    if "sliding_attention" in (config.get("layer_types") or []):
        raise ValueError("DFlashHead: the draft layers use sliding-window attention (layer_types), which DFlashHead "
                         "does not run; only full-attention draft layers are supported")  # fmt: skip
    fields = {k: config[k] for k in LAYER_FIELDS if config.get(k) is not None}
    if fields.get("rope_parameters") is not None:
        fields.pop("rope_theta", None)
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in fields]
    if missing:
        raise ValueError(f"DFlashHead: the draft layer config lacks {missing}")
    cfg = Qwen3Config(**fields)
    cfg._attn_implementation = "sdpa"
    return cfg


def _layer_dict(config: Qwen3Config) -> dict:
    """The layer config's fields that describe the draft layers (written into config.json)."""
    out = {k: getattr(config, k) for k in LAYER_FIELDS if getattr(config, k, None) is not None}
    out.pop("rope_theta", None)
    return {"model_type": "qwen3", **out}


def default_feature_layers(layers: int) -> list[int]:
    """The target layers a fresh head reads: the library's default 2, L // 2, L - 3 where those are distinct and past
    the embeddings, else 1, L // 2, L - 1 (distinct ids only: the library and vLLM collect each layer once)."""
    ids = (2, layers // 2, layers - 3)
    if len(set(ids)) < 3 or min(ids) < 1:
        ids = (1, layers // 2, layers - 1)
    return sorted({i for i in ids if i >= 1} or {layers})


def _default_mask_token(model: nn.Module) -> int:
    """The mask token of a fresh head: the target's pad token, else its EOS token, else 0."""
    config = text_config(model)
    for key in ("pad_token_id", "eos_token_id"):
        value = getattr(config, key, None)
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int):
            return value
    return 0


__all__ = ["DFlashHead", "default_feature_layers", "layer_config"]
