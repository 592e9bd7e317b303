"""vLLM's ``speculators`` format (PyPI ``speculators``; served by ``vllm serve <folder>``) for EAGLE heads.

A speculators checkpoint is a folder with ``config.json`` and ``model.safetensors``. The config names the kind in
``speculators_model_type`` and describes the draft decoder layer in ``transformer_layer_config`` (a transformers
config dict), the verifier (the target) in ``speculators_config.verifier``, and the chain length the head was trained
for in ``speculators_config.proposal_methods[0].speculative_tokens``.

Kinds (``speculators_model_type``):

- ``"eagle3"`` (``Eagle3Speculator``; read and written): our EAGLE-3 head. Keys ``fc.weight``, ``layers.0.*`` (our
  ``midlayer.*``), ``norm.weight``, ``lm_head.weight``, optional ``embed_tokens.weight``, ``d2t`` / ``t2d`` when
  ``draft_vocab_size`` is below the vocabulary, ``input_norm.weight`` (``norm_before_fc``), ``fc_norm.{i}.weight``
  (``fc_norm``); config fields ``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids``
  (indices into transformers' ``hidden_states`` tuple, as our ``aux_layers``), ``norm_before_residual``,
  ``norm_before_fc``, ``fc_norm``, ``norm_output`` (our ``eagle3_options``).
- ``"eagle"`` (``EagleSpeculator`` of speculators < 0.9; read only): an EAGLE-1 head. Keys ``fusion_fc.*`` (our
  ``fc.*``) and ``transformer.*`` (our ``layers.0.*``); ``layernorms: true`` (HASS's extra norms) is refused.
- ``"dflash"`` (``DFlashSpeculator``; read and written for `hf_specdec.heads.dflash.DFlashHead`, not EagleHead):
  a block drafter. Keys ``fc.weight``, ``hidden_norm.weight``, ``layers.{i}.*`` (Qwen3-style layers, q/k norms),
  ``norm.weight``, and ``lm_head.weight`` / ``d2t`` / ``t2d`` only with a draft vocabulary (the full-vocabulary
  lm_head and ``embed_tokens`` are the verifier's, never stored); config fields ``block_size``,
  ``aux_hidden_state_layer_ids`` (indices into ``hidden_states``), ``mask_token_id``, ``draft_vocab_size``,
  ``sample_from_anchor``, ``sliding_window_non_causal``.
- every other kind is refused by name (`REFUSED_KINDS` says why).

An EAGLE draft decoder layer must be a one-layer Llama layer (``transformer_layer_config.model_type == "llama"``,
``num_hidden_layers == 1``): EagleHead builds transformers' Llama attention and MLP. What hf-specdec adds (tree
defaults, model-card facts) travels in a ``hf_specdec`` block of the config, which the library and vLLM ignore, so
that a head exported here loads back unchanged.

This module maps configs and tensor names, and reads an EAGLE folder (`read_speculators_checkpoint`: the weights
file and the shape checks are `hf_specdec.heads.formats.eagle`'s); `hf_specdec.heads.dflash` reads a DFlash folder
with `speculators_dflash_init` and `speculators_dflash_tensors_to_ours`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from ...kinds import HEAD_KINDS, split_path
from ..hub import CONFIG_NAME, HeadSource
from .common import rename_prefixes
from .eagle import ExpectedShapes, check_eagle_tensors, read_eagle_weights

# the library release whose layout `speculators_config` writes (the field the library itself fills on save)
SPECULATORS_VERSION = "0.9.0"
READ_KINDS = ("eagle3", "eagle")  # the kinds `speculators_eagle_init` reads
WRITE_KINDS = ("eagle3",)
REFUSED_KINDS = {
    "peagle": "P-EAGLE drafts several positions at once from a learnt mask state (mask_hidden); hf-specdec has no "
    "parallel-drafting proposer",
    "mtp": "a separate MTP checkpoint; hf-specdec drafts with the MTP layers a model ships in its own checkpoint "
    "(assistant=\"mtp\"), not with a speculators MTP folder",
    "dflash2": "DFlash2 drafts a whole block at once by block diffusion; hf-specdec has no block-diffusion proposer",
    "dspark": "DSpark drafts a whole block at once (block diffusion with a Markov head); hf-specdec has no such "
    "proposer",
    "xpress": "XPress drafts a whole block at once; hf-specdec has no block-drafting proposer",
}
# EAGLE-3 variants the library trains (EagleHead's ``eagle3_options``), each a config field of kind ``eagle3``
EAGLE3_OPTIONS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def reading_class(kind: str | None) -> str | None:
    """The head class that reads speculators checkpoints of ``kind`` (``"DFlashHead (hf_specdec.heads.dflash)"``), as
    the head kinds' descriptors say (`HeadKind.speculators_kinds`), or None."""
    for head_kind in HEAD_KINDS.values():
        if kind in head_kind.speculators_kinds:
            module, name = split_path(head_kind.head)
            return f"{name} ({module})"
    return None


def is_speculators_config(config: Mapping | None) -> bool:
    """Whether a parsed ``config.json`` is in the speculators format."""
    return isinstance(config, Mapping) and "speculators_model_type" in config


# ------------------------------------------------------------------------------------------------------- reading
def speculators_eagle_init(config: Mapping, where: str) -> tuple[dict, str]:
    """``(EagleHead kwargs, kind)`` of a speculators config; kinds, layers and options EagleHead cannot run are
    refused by name. ``has_embed_tokens`` is ``"checkpoint"`` (the weights decide) or None (the stored embeddings
    are the target's, written by hf-specdec's export, and are dropped)."""
    kind = config.get("speculators_model_type")
    if kind not in READ_KINDS and reading_class(kind) is not None:
        raise ValueError(f"EagleHead: {where} is a speculators {kind!r} checkpoint: load it with "
                         f"{reading_class(kind)}")  # fmt: skip
    if kind in REFUSED_KINDS:
        raise ValueError(f"EagleHead: {where} is a speculators {kind!r} checkpoint, which hf-specdec cannot run: "
                         f"{REFUSED_KINDS[kind]}. It reads the kinds {list(READ_KINDS)}")  # fmt: skip
    if kind not in READ_KINDS:
        raise ValueError(f"EagleHead: {where} is a speculators checkpoint of unknown kind {kind!r}; hf-specdec reads "
                         f"the kinds {list(READ_KINDS)}")  # fmt: skip
    layer = _layer_config(config, where, kind)
    provenance = _provenance(config, where, "EagleHead")
    fields = {k: v for k, v in layer.items() if v is not None}  # EagleHead keeps the Llama fields it reads
    # an hf-specdec export stores the target's embeddings for the library (`speculators_eagle3_tensors`): drop them
    drop_embed = bool(_hf_specdec_block(config).get("embed_tokens_from_target"))
    if kind == "eagle":
        if config.get("layernorms"):
            raise ValueError(f"EagleHead: {where} has layernorms=true (HASS's extra embedding and pre-lm_head norms), "
                             "which EagleHead's EAGLE-1 layout does not have")  # fmt: skip
        fields["bias"] = bool(config.get("fusion_bias", False))
        version, options, draft = 1, None, None
    else:
        version = 3
        options = {k: config[k] for k in EAGLE3_OPTIONS if k in config}
        draft = config.get("draft_vocab_size")
        if config.get("target_hidden_size") is not None:
            fields["target_hidden_size"] = config["target_hidden_size"]
        if draft is not None:
            fields["draft_vocab_size"] = draft
    init = {
        "config": fields,
        "version": version,
        "draft_vocab_size": None if draft is None or draft == fields.get("vocab_size") else int(draft),
        "aux_layers": config.get("eagle_aux_hidden_state_layer_ids") if version == 3 else None,
        **provenance,
        "eagle3_options": options,
        "has_embed_tokens": None if drop_embed else "checkpoint",
    }
    return init, kind


def _layer_config(config: Mapping, where: str, kind: str) -> dict:
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, Mapping):
        raise ValueError(f"EagleHead: {where} lacks the 'transformer_layer_config' of the draft layer")
    arch = layer.get("model_type", "llama")
    if arch != "llama":
        raise ValueError(f"EagleHead: {where} has a {arch!r} draft layer (transformer_layer_config.model_type); "
                         "EagleHead builds Llama decoder layers only")  # fmt: skip
    layers = layer.get("num_hidden_layers", 1)
    if layers != 1 and kind != "eagle":  # the old EAGLE-1 kind keeps the verifier's config and builds one layer
        raise ValueError(f"EagleHead: {where} has {layers} draft decoder layers (transformer_layer_config."
                         "num_hidden_layers); EagleHead has exactly one")  # fmt: skip
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in layer]
    if missing:
        raise ValueError(f"EagleHead: {where} lacks {missing} in transformer_layer_config")
    if "sliding_attention" in (layer.get("layer_types") or []):
        warnings.warn(
            f"{where}: the draft layer was trained with sliding-window attention (window "
            f"{layer.get('sliding_window')}); EagleHead attends to the whole context, so drafts past the window can "
            "differ from the library's (the output stays exact: the target verifies every token)",
            stacklevel=4,
        )
    return dict(layer)


def _provenance(config: Mapping, where: str, owner: str) -> dict:
    """The init arguments every kind carries alike: the verifier (``speculators_config.verifier``: the target's name
    and architectures) and the tree defaults and model-card facts of the ``hf_specdec`` block."""
    spec = config.get("speculators_config")
    verifier = spec.get("verifier") if isinstance(spec, Mapping) else None
    if not isinstance(verifier, Mapping):
        raise ValueError(f"{owner}: {where} lacks speculators_config.verifier (the target the head drafts for)")
    extra = _hf_specdec_block(config)
    return {
        "base_model_name_or_path": verifier.get("name_or_path"),
        "verifier_architectures": verifier.get("architectures") or None,
        "tree": extra.get("tree", {}),
        "model_card": extra.get("model_card"),
    }


def _hf_specdec_block(config: Mapping) -> Mapping:
    """What hf-specdec adds to a config it exports (``hf_specdec``: tree defaults, model-card facts); {} if none."""
    return config.get("hf_specdec") if isinstance(config.get("hf_specdec"), Mapping) else {}


def speculators_tensors_to_ours(tensors: Mapping[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """Tensor names of a speculators checkpoint -> EagleHead's (upstream EAGLE's) names."""
    if kind == "eagle":
        return rename_prefixes(tensors, {"fusion_fc.": "fc.", "transformer.": "layers.0."})
    return rename_prefixes(tensors, {"layers.0.": "midlayer."})


def read_speculators_checkpoint(
    source: HeadSource, config: Mapping, expected_shapes: ExpectedShapes
) -> tuple[dict, dict[str, torch.Tensor], str]:
    """Read and check an EAGLE head in the speculators format: ``(EagleHead kwargs, tensors, "speculators")``; kinds
    other than EAGLE-3 / EAGLE-1 are refused by name, shapes checked against the head ``init=`` builds
    (``expected_shapes``, `hf_specdec.heads.formats.eagle.check_eagle_tensors`)."""
    config_path = f"{source}/{CONFIG_NAME}"
    init, kind = speculators_eagle_init(config, config_path)
    tensors, where = read_eagle_weights(source)
    tensors = speculators_tensors_to_ours(tensors, kind)
    if init["has_embed_tokens"] is None:  # the target's own embeddings, stored for the library: not the head's
        tensors.pop("embed_tokens.weight", None)
    init["has_embed_tokens"] = "embed_tokens.weight" in tensors
    check_eagle_tensors(init, tensors, where, config_path, expected_shapes)
    return init, tensors, "speculators"


# ------------------------------------------------------------------------------------------------------- writing
def speculators_eagle3_config(head, verifier_name: str, verifier_architectures: list[str]) -> dict:
    """The ``config.json`` of ``head`` (an EAGLE-3 `EagleHead`) as the speculators library writes it."""
    layer = head.config.to_diff_dict()  # the head's Llama layer config (with our extras, removed here)
    for key in ("bias", "target_hidden_size", "draft_vocab_size", "architectures", "_name_or_path",
                "transformers_version", "output_attentions", "return_dict"):  # fmt: skip
        layer.pop(key, None)
    layer.update(num_hidden_layers=1, tie_word_embeddings=False, dtype=str(head.fc.weight.dtype).removeprefix("torch."))
    chain = int(head.tree.get("depth") or 3)
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": head.draft_vocab_size or head.vocab_size,
        "target_hidden_size": head.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(head.feature_layers),
        **{k: head.eagle3_options[k] for k in EAGLE3_OPTIONS},
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "speculators_config": _speculators_config("eagle3", chain, verifier_name, verifier_architectures),
        "hf_specdec": {
            "tree": head.tree,
            "model_card": head.model_card,
            "embed_tokens_from_target": head.embed_tokens is None,
        },
    }


def _speculators_config(algorithm: str, chain: int, verifier_name: str, verifier_architectures: list[str]) -> dict:
    """The ``speculators_config`` block: the chain of ``chain`` greedy tokens vLLM drafts, and the verifier."""
    return {
        "algorithm": algorithm,
        "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": chain, "verifier_accept_k": 1, "accept_tolerance": 0.0}
        ],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier_name, "architectures": list(verifier_architectures)},
    }


# ------------------------------------------------------------------------------------------------------- DFlash
def speculators_dflash_init(config: Mapping, where: str) -> dict:
    """`DFlashHead` kwargs of a speculators ``dflash`` config; other kinds and what DFlashHead cannot run are refused
    by name."""
    kind = config.get("speculators_model_type")
    if kind != "dflash":
        reader = reading_class(kind)
        hint = f"load it with {reader}" if reader else REFUSED_KINDS.get(kind, "an unknown kind")
        raise ValueError(f"DFlashHead: {where} is a speculators {kind!r} checkpoint, not 'dflash' ({hint})")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, Mapping):
        raise ValueError(f"DFlashHead: {where} lacks the 'transformer_layer_config' of the draft layers")
    target_hidden = config.get("target_hidden_size")
    if target_hidden is not None and target_hidden != layer.get("hidden_size"):
        raise ValueError(f"DFlashHead: {where} has target_hidden_size {target_hidden} != the draft layers' hidden "
                         f"size {layer.get('hidden_size')}; the library's fc reads the draft's hidden size")  # fmt: skip
    aux = config.get("aux_hidden_state_layer_ids")
    if not aux:
        raise ValueError(f"DFlashHead: {where} lacks aux_hidden_state_layer_ids (the target layers it reads)")
    provenance = _provenance(config, where, "DFlashHead")
    draft = config.get("draft_vocab_size")
    return {
        "config": dict(layer),
        "aux_layers": [int(i) for i in aux],
        "block_size": int(config.get("block_size", 8)),
        "mask_token_id": config.get("mask_token_id"),
        "draft_vocab_size": None if draft is None or draft == layer.get("vocab_size") else int(draft),
        "sample_from_anchor": bool(config.get("sample_from_anchor", False)),
        **provenance,
    }


def speculators_dflash_tensors_to_ours(
    tensors: Mapping[str, torch.Tensor], draft_vocab_size: int | None
) -> dict[str, torch.Tensor]:
    """A speculators ``dflash`` checkpoint's tensors without what the library keeps of the verifier (never the
    head's own: ``embed_tokens``, ``verifier_norm``, ``verifier_lm_head``, and without a draft vocabulary the
    full-vocabulary ``lm_head`` / ``d2t`` / ``t2d``); the other names are DFlashHead's."""
    drop = {"embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight"}
    drop |= {"lm_head.weight", "d2t", "t2d"} if draft_vocab_size is None else set()
    return {k: v for k, v in tensors.items() if k not in drop}


def speculators_dflash_config(head, layer: dict) -> dict:
    """The ``config.json`` of ``head`` (a `DFlashHead` with draft layers ``layer``) as the library writes it."""
    layer = {**layer, "tie_word_embeddings": False, "dtype": str(head.fc.weight.dtype).removeprefix("torch.")}
    verifier = _speculators_config("dflash", head.num_depths, head.base_model_name_or_path, head.verifier_architectures)
    return {
        "speculators_model_type": "dflash",
        "architectures": ["DFlashSpeculator"],
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": head.draft_vocab_size or head.vocab_size,
        "block_size": head.block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": list(head.feature_layers),
        "mask_token_id": head.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": head.sample_from_anchor,
        "speculators_config": verifier,
        "hf_specdec": {"tree": head.tree, "model_card": head.model_card},
    }


def speculators_eagle3_tensors(
    state: Mapping[str, torch.Tensor], target_embed: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """EagleHead's EAGLE-3 tensors under the speculators names (``midlayer.`` -> ``layers.0.``).

    Args:
        state: the head's state dict.
        target_embed: `[V, H]` the target's input embeddings, stored as ``embed_tokens.weight`` when the head has
            none of its own: the library saves them with every EAGLE-3 checkpoint, and its loader does not fill them
            in from the verifier (with transformers 5.24 they stay uninitialised), so the export carries them.
    """
    out = rename_prefixes(state, {"midlayer.": "layers.0."})
    if "embed_tokens.weight" not in out:
        if target_embed is None:
            raise ValueError("the speculators format stores the target's input embeddings: bind the head first")
        out["embed_tokens.weight"] = target_embed.detach().to(state["fc.weight"].dtype)
    return out


__all__ = [
    "EAGLE3_OPTIONS",
    "reading_class",
    "READ_KINDS",
    "REFUSED_KINDS",
    "SPECULATORS_VERSION",
    "WRITE_KINDS",
    "is_speculators_config",
    "read_speculators_checkpoint",
    "speculators_dflash_config",
    "speculators_dflash_init",
    "speculators_dflash_tensors_to_ours",
    "speculators_eagle3_config",
    "speculators_eagle3_tensors",
    "speculators_eagle_init",
    "speculators_tensors_to_ours",
]
