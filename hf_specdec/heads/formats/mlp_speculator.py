"""IBM's MLP speculator checkpoints (fms-extras; docs/formats.md, "IBM MLP speculator") and our MLPSpeculator format:
reading and checking them into `MLPSpeculator` arguments and tensors.

- **Published "accelerator" layout** (``ibm-ai-platform/*-accelerator``): ``config.json`` with ``model_type:
  "mlp_speculator"`` (``emb_dim``, ``inner_dim``, ``vocab_size``, ``n_predict``, ``top_k_tokens_per_head``,
  ``n_candidates``, ``tie_weights``, ``scale_input``); weights in ``model.safetensors``, a sharded safetensors index
  or ``pytorch_model.bin``; keys with or without the ``speculator.`` prefix; tied copies stored once or repeated.
- **Ours**: ``head_type: "mlp_speculator"``, the same key names, optionally a truncated draft vocabulary
  (``draft_vocab_size``, ``token_map`` `[V']`).

Keys: ``emb.{i}.weight``, ``proj.{i}.weight``, ``head.{i}.weight``, ``ln.{i}.weight`` / ``.bias`` (`speculator_shapes`;
with ``tie_weights`` one copy of each shared group).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..checks import check_token_ids, check_tree
from ..hub import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    HeadSource,
    check_reachable,
    check_shapes,
    config_int,
    read_json,
    read_sharded_tensors,
    read_tensors,
)
from .common import rename_prefixes

OWNER = "MLPSpeculator"
HEAD_TYPE = "mlp_speculator"
PREFIX = "speculator."
SHARD_INDEX = "model.safetensors.index.json"
BIN_NAME = "pytorch_model.bin"


def speculator_shapes(kwargs: Mapping) -> dict[str, tuple[int, ...]]:
    """Shapes of the stored tensors (tied copies once) for `MLPSpeculator.__init__` arguments ``kwargs``."""
    h, vocab, n = kwargs["emb_dim"], kwargs["vocab_size"], kwargs["n_predict"]
    inner = kwargs["inner_dim"] or h
    draft = kwargs.get("draft_vocab_size")
    tied = bool(kwargs.get("tie_weights"))
    in_rows, out_rows = (vocab, vocab) if draft is None else (draft + 1, draft)
    n_own = 1 if tied else n
    n_proj = min(n, 2) if tied else n
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(n_own):
        shapes[f"emb.{i}.weight"] = (in_rows, inner)
        shapes[f"head.{i}.weight"] = (out_rows, inner)
        shapes[f"ln.{i}.weight"] = (inner,)
        shapes[f"ln.{i}.bias"] = (inner,)
    for i in range(n_proj):
        shapes[f"proj.{i}.weight"] = (inner, h if i == 0 else inner)
    if draft is not None:
        shapes["token_map"] = (draft,)
    return shapes


def _read_config(source: HeadSource) -> tuple[dict, str]:
    """``(config, path)`` of the source's config.json; a missing or unparsable file is an error naming it."""
    path = source.file(CONFIG_NAME)
    if path is None:
        check_reachable(source, False)
        raise FileNotFoundError(
            f"{OWNER}: {source.describe_missing([CONFIG_NAME])}; an MLP speculator needs its config"
        )
    try:
        config = read_json(path)
    except ValueError as err:
        raise ValueError(f"{OWNER}: {err} (expected the speculator's config.json)") from err
    return config, str(path)


def _config_kwargs(config: Mapping, where: str) -> tuple[dict, str]:
    """`MLPSpeculator.__init__` arguments from a config (ours or upstream's) and the format's name."""
    if config.get("head_type") == HEAD_TYPE:
        source_format = config.get("source_format", "hf-specdec")
    elif config.get("model_type") == HEAD_TYPE:
        source_format = "ibm-accelerator"
    else:
        raise ValueError(
            f"{OWNER}: {where} is not an MLP speculator config: expected model_type 'mlp_speculator' (published "
            f"accelerators) or head_type 'mlp_speculator' (hf-specdec), got model_type={config.get('model_type')!r}, "
            f"head_type={config.get('head_type')!r}"
        )
    for key in ("emb_dim", "vocab_size", "n_predict"):
        config_int(OWNER, config, key, where)
    for key in ("inner_dim", "n_candidates"):  # 0 or absent: the default
        config_int(OWNER, config, key, where, required=False, minimum=0)
    config_int(OWNER, config, "draft_vocab_size", where, required=False)
    hidden = config_int(OWNER, config, "hidden_size", where, required=False)  # ours: the base model's = emb_dim
    if hidden is not None and hidden != config["emb_dim"]:
        raise ValueError(
            f"{OWNER}: {where} field 'hidden_size' is {hidden} but 'emb_dim' is {config['emb_dim']}; a speculator "
            "reads the base model's hidden states, so both are the base model's hidden size"
        )
    check_tree(OWNER, config.get("tree"), where)
    n = config["n_predict"]
    top_k = config.get("top_k_tokens_per_head") or [1] * n
    if not isinstance(top_k, list) or len(top_k) != n or not all(isinstance(k, int) and k > 0 for k in top_k):
        raise ValueError(f"{OWNER}: {where} has top_k_tokens_per_head={top_k!r}; expected {n} positive integers")
    kwargs = dict(
        emb_dim=config["emb_dim"],
        inner_dim=int(config.get("inner_dim") or 0) or config["emb_dim"],
        vocab_size=config["vocab_size"],
        n_predict=n,
        top_k_tokens_per_head=top_k,
        n_candidates=int(config.get("n_candidates") or 5),
        tie_weights=bool(config.get("tie_weights", False)),
        scale_input=bool(config.get("scale_input", False)),
        draft_vocab_size=config.get("draft_vocab_size"),
        base_model_name_or_path=config.get("base_model_name_or_path") or config.get("base_model"),
        tree=config.get("tree"),
        model_card=config.get("model_card"),
    )
    return kwargs, source_format


def _read_weights(source: HeadSource) -> tuple[dict[str, torch.Tensor], str]:
    """Every tensor of the source's weights (single file, sharded safetensors or a pickled ``.bin``), prefix-stripped;
    a file that cannot be read is an error naming it."""
    for name in (WEIGHTS_NAME, SHARD_INDEX, BIN_NAME):
        path = source.file(name)
        if path is None:
            continue
        try:
            if name == SHARD_INDEX:
                tensors, _ = read_sharded_tensors(source, name, lambda key: True)
            else:
                tensors = read_tensors(path)
        except Exception as err:  # safetensors / pickle errors carry no file name
            raise ValueError(
                f"{OWNER}: cannot read the weights file {path}: {type(err).__name__}: {err}. The file is corrupt or "
                "not a safetensors / torch.save state dict; download it again"
            ) from err
        return rename_prefixes(tensors, {PREFIX: ""}), str(path)
    check_reachable(source, False)
    raise FileNotFoundError(f"{OWNER}: {source.describe_missing([WEIGHTS_NAME, SHARD_INDEX, BIN_NAME])}")


def _collapse_tied(tensors: dict[str, torch.Tensor], kwargs: Mapping, where: str) -> dict[str, torch.Tensor]:
    """With ``tie_weights``, keep one copy of each tied group (stage 0's, or ``proj.1``); stored copies must agree."""
    if not kwargs["tie_weights"]:
        return tensors
    groups = {"emb.{}.weight": 0, "head.{}.weight": 0, "ln.{}.weight": 0, "ln.{}.bias": 0, "proj.{}.weight": 1}
    out = dict(tensors)
    for pattern, first in groups.items():
        copies = [pattern.format(i) for i in range(first, kwargs["n_predict"]) if pattern.format(i) in out]
        if not copies:
            continue  # check_shapes reports the missing tensor
        kept = out.pop(copies[0])
        for other in copies[1:]:
            copy = out.pop(other)
            if copy.shape != kept.shape or not torch.equal(copy, kept):
                raise ValueError(
                    f"{OWNER}: {where} says tie_weights=true but {other!r} differs from {copies[0]!r} (shapes "
                    f"{list(copy.shape)} vs {list(kept.shape)}); the checkpoint is not tied: set tie_weights=false"
                )
        out[pattern.format(first)] = kept
    return out


def read_mlp_speculator_checkpoint(source: HeadSource) -> tuple[dict, dict[str, torch.Tensor], str]:
    """``(init kwargs, tensors in our layout, source format)`` of a speculator folder or Hub repo; every shape is
    checked against the config (errors name the file, the key and both shapes), every ``token_map`` id against its
    vocabulary."""
    config, config_path = _read_config(source)
    kwargs, source_format = _config_kwargs(config, config_path)
    tensors, weights_path = _read_weights(source)
    tensors = _collapse_tied(tensors, kwargs, weights_path)
    check_shapes(OWNER, tensors, speculator_shapes(kwargs), f"{weights_path} (config {config_path})")
    check_token_ids(OWNER, "token_map", tensors.get("token_map"), kwargs["vocab_size"], weights_path)
    return kwargs, tensors, source_format


__all__ = ["HEAD_TYPE", "OWNER", "read_mlp_speculator_checkpoint", "speculator_shapes"]
