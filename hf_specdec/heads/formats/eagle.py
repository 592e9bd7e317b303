"""Upstream EAGLE checkpoints (docs/formats.md, "EAGLE-1 / EAGLE-2" and "EAGLE-3") and our EagleHead format: reading
the config and weights, telling the layout from the tensor names, renaming vLLM's names, and the upstream config that
``format="eagle"`` writes.

Layouts (the keys decide):

- **EAGLE-1/2**: ``fc.*``, ``layers.0.*``, optional ``embed_tokens.weight`` (and, written here, ``d2t`` / ``t2d``).
- **EAGLE-3 / SpecForge**: ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``;
  feature layers in ``eagle_config.eagle_aux_hidden_state_layer_ids`` (where a config carries them).
- **vLLM's EAGLE-3 names**: ``layers.0.*`` with ``hidden_norm``, ``draft_id_to_target_id`` for ``d2t``, no ``t2d``.
- **ours**: the same tensor names, with ``head_type: "eagle"`` and our fields in the (Llama) config.

Shapes are checked against the head the config builds, which `hf_specdec.heads.eagle` passes in
(``expected_shapes``); the speculators layout is read by `hf_specdec.heads.formats.speculators`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from huggingface_hub.errors import StrictDataclassError

from ..checks import check_choice, check_tree
from ..hub import CONFIG_NAME, HeadSource, check_shapes, config_int, read_json, read_tensors
from .common import check_d2t, rename_prefixes

OWNER = "EagleHead"
WEIGHT_CANDIDATES = ("model.safetensors", "pytorch_model.bin")
_REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
# integer fields a config may carry besides the required ones (each checked: an integer >= 1)
_OPTIONAL_INT_FIELDS = (
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "target_hidden_size",
    "draft_vocab_size",
)
# `hf_specdec.heads.eagle.expected_shapes`: name -> shape of every tensor of the head ``init=`` builds
ExpectedShapes = Callable[..., dict[str, tuple[int, ...]]]


# ------------------------------------------------------------------------------------------------------- files
def read_eagle_weights(source: HeadSource) -> tuple[dict[str, torch.Tensor], str]:
    """``(tensors, path)`` of the head's weights file; the rotary frequencies older checkpoints store are dropped (they
    are rebuilt from the config). A file that cannot be read is an error naming it."""
    for name in WEIGHT_CANDIDATES:
        path = source.file(name)
        if path is None:
            continue
        try:
            tensors = read_tensors(path)
        except Exception as err:  # noqa: BLE001 - any parse failure of a weights file is reported the same way
            raise ValueError(
                f"{OWNER}: cannot read {path} as a weights file ({type(err).__name__}: {err}); expected a "
                "safetensors file or a torch.save state dict (loaded with weights_only=True)"
            ) from err
        return {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}, str(path)
    raise FileNotFoundError(f"{OWNER}: {source.describe_missing(WEIGHT_CANDIDATES)}")


def _read_config(source: HeadSource) -> tuple[dict, str]:
    path = source.require(CONFIG_NAME, "the EAGLE head's Llama config")
    try:
        config = read_json(path)
    except ValueError as err:
        raise ValueError(f"{OWNER}: {err}") from err
    missing = [k for k in _REQUIRED_FIELDS if config.get(k) is None]
    if missing:
        raise ValueError(f"{OWNER}: {path} lacks {missing}; an EAGLE config is a Llama config of the draft layer")
    for key in (*_REQUIRED_FIELDS, *_OPTIONAL_INT_FIELDS):
        config_int(OWNER, config, key, str(path), required=False)
    layers = config.get("num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(
            f"{OWNER}: {path} says num_hidden_layers={layers}; EAGLE heads have exactly one decoder layer (is this "
            "a full model rather than a draft head?)"
        )
    return config, str(path)


def check_eagle_tensors(
    init: dict, tensors: dict[str, torch.Tensor], where: str, config_path: str, expected_shapes: ExpectedShapes
) -> None:
    """Every tensor of the head ``init`` builds present with its shape, nothing else, and ``d2t`` mapping into the
    vocabulary (made int64 in place), the tree defaults within the limits (`checks.check_tree`); errors name the
    file, the key and both shapes."""
    check_tree(OWNER, init.get("tree"), config_path)
    try:
        expected = expected_shapes(init=init)
    except (TypeError, ValueError, StrictDataclassError) as err:  # transformers' config checks name the field
        raise ValueError(f"{OWNER}: cannot build a head from {config_path}: {err}") from err
    check_shapes(OWNER, tensors, expected, f"{where} (config {config_path})")
    check_d2t(OWNER, tensors, int(init["config"]["vocab_size"]), where)


# ------------------------------------------------------------------------------------------------------- reading
def read_eagle_checkpoint(
    source: HeadSource, expected_shapes: ExpectedShapes
) -> tuple[dict, dict[str, torch.Tensor], str]:
    """Read and check an EAGLE head: ``(EagleHead kwargs, tensors, source format)``.

    The layout is told by the keys: ``midlayer.*`` = EAGLE-3, ``layers.0.*`` = EAGLE-1/2. vLLM's EAGLE-3 names
    (``layers.0.`` with ``hidden_norm``, ``draft_id_to_target_id``) are accepted too. Every expected tensor must be
    present with its shape (``expected_shapes``, `check_eagle_tensors`) and nothing else may be (errors name the key,
    both shapes and the file).
    """
    config, config_path = _read_config(source)
    tensors, where = read_eagle_weights(source)
    tensors, version = _eagle_layout(rename_prefixes(tensors, {"model.": ""}), where)
    _check_version(config, version, config_path, where)
    draft = config.get("draft_vocab_size") if version == 3 or "d2t" in tensors else None
    if draft is not None and int(draft) == int(config["vocab_size"]) and "d2t" not in tensors:
        draft = None
    if version == 3 and draft is not None and "t2d" not in tensors and "d2t" in tensors:
        tensors["t2d"] = _t2d_from_d2t(tensors["d2t"], int(config["vocab_size"]))
    init = {
        "config": config,
        "version": version,
        "has_embed_tokens": "embed_tokens.weight" in tensors,
        "draft_vocab_size": None if draft is None else int(draft),
        "aux_layers": config.get("aux_layers") or _upstream_aux_layers(config),
        "base_model_name_or_path": config.get("base_model_name_or_path"),
        "tree": config.get("tree"),
        "model_card": config.get("model_card"),
        "eagle3_options": config.get("eagle3_options"),
        "verifier_architectures": config.get("verifier_architectures"),
    }
    check_eagle_tensors(init, tensors, where, config_path, expected_shapes)
    fmt = "hf-specdec" if config.get("head_type") == "eagle" else ("eagle3" if version == 3 else "eagle")
    return init, tensors, fmt


def _eagle_layout(tensors: dict[str, torch.Tensor], where: str) -> tuple[dict[str, torch.Tensor], int]:
    """``(tensors under EagleHead's names, version)``: vLLM's EAGLE-3 names renamed, the version told by the keys."""
    if any(k.startswith("layers.0.hidden_norm") for k in tensors):  # vLLM's EAGLE-3 names
        tensors = rename_prefixes(tensors, {"layers.0.": "midlayer."})
        if "draft_id_to_target_id" in tensors:
            tensors["d2t"] = tensors.pop("draft_id_to_target_id")
    if any(k.startswith("midlayer.") for k in tensors):
        return tensors, 3
    if any(k.startswith("layers.0.") for k in tensors):
        return tensors, 1
    raise ValueError(
        f"{OWNER}: {where} holds neither EAGLE-1 (layers.0.*) nor EAGLE-3 (midlayer.*) decoder tensors; found "
        f"{sorted(tensors)[:6]}"
    )


def _check_version(config: Mapping, version: int, config_path: str, where: str) -> None:
    """Our config's ``eagle_version`` (upstream ones have none) is a version EagleHead runs, and the one the tensors
    hold: a value this version does not know is refused, never read as EAGLE-1."""
    check_choice(OWNER, config, "eagle_version", (1, 3), config_path)
    stated = config.get("eagle_version")
    if stated is not None and stated != version:
        raise ValueError(f"{OWNER}: {config_path} field 'eagle_version' is {stated}, but {where} holds EAGLE-{version} "
                         f"tensors ({'midlayer' if version == 3 else 'layers.0'}.*)")  # fmt: skip


def _upstream_aux_layers(config: Mapping) -> list[int] | None:
    """Feature layer ids some EAGLE-3 configs carry (``eagle_config.eagle_aux_hidden_state_layer_ids``)."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return [int(i) for i in ids] if ids else None


def _t2d_from_d2t(d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[V]` bool: which token ids the draft vocabulary of ``d2t`` `[V']` holds."""
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.arange(d2t.numel()) + d2t.long()] = True
    return t2d


# ------------------------------------------------------------------------------------------------------- writing
def eagle_upstream_config(head) -> dict:
    """The Llama config upstream EAGLE / SpecForge write beside the weights (plus our tree and card facts), for
    ``head`` (an `EagleHead`)."""
    used = [k for k, v in head.eagle3_options.items() if v]
    if used:
        raise ValueError(f"the upstream EAGLE-3 layout has no {used} (SGLang's and SpecForge's layer lacks these "
                         "norms); export this head with format='speculators' for vLLM")  # fmt: skip
    if head.aux_layers is None and head.version == 3:
        raise ValueError("this EAGLE-3 head does not know its target's feature layers yet; call head.bind(model)")
    config = head.config_dict()
    for key in ("head_type", "eagle_version", "eagle3_options", "source_format", "has_embed_tokens"):
        config.pop(key)
    arch = "LlamaForCausalLMEagle3" if head.version == 3 else "LlamaForCausalLMEagle"
    config.update(architectures=[arch], tie_word_embeddings=False)
    if head.version == 3:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(head.aux_layers)}
        config["draft_vocab_size"] = head.draft_vocab_size or head.vocab_size
    return config


__all__ = [
    "WEIGHT_CANDIDATES",
    "check_eagle_tensors",
    "eagle_upstream_config",
    "read_eagle_checkpoint",
    "read_eagle_weights",
]
