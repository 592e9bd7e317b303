"""Format detection and conversion: published head checkpoints (FORMATS.md) -> our own tensors and config.

Medusa checkpoints come in five layouts; `read_medusa_checkpoint` finds the files in a folder or Hub repo, detects
which one it is, checks every shape against the config (errors name the key and both shapes) and returns a
`MedusaCheckpoint` in our layout:

- ``block_weight`` `[num_heads, num_layers, H, H]` and ``block_bias`` `[num_heads, num_layers, H]`: the ResBlocks
  ``x + SiLU(x W^T + b)``, stacked so that all heads run as one batched matmul;
- ``lm_head_weight`` `[num_heads, V', H]`: per-head output projections (absent when the heads reuse the base lm_head);
- ``token_map`` `[V']`: draft index -> target token id when the heads predict a truncated vocabulary (vLLM).

Layouts (the file name finds the candidates; the tensor names decide):

- ``hf-specdec``: our ``config.json`` (``head_type: "medusa"``) + ``model.safetensors``.
- ``medusa-1``: FasterDecoding v0.1, ``medusa_lm_head.pt`` (or ``.safetensors``) with ``{h}.{l}.linear.*`` and
  per-head ``{h}.{L}.weight``. Its config.json understates the head count (the vicuna heads hold 5, the config says
  2): head and layer counts come from the tensors, with a warning when the config disagrees.
- ``medusa-v2-heads``: ``medusa_lm_head.safetensors`` with ResBlocks only (``"version": "2"``); logits come from
  the base model's lm_head.
- ``vllm``: ``blocks.{h}.layers.{l}.weight`` (+ ``.bias`` with ``medusa_fc_bias``), ``lm_heads.{h}.weight``,
  optional ``token_map`` (``truncated_vocab_size``), ``original_lm_head`` (one stored copy of the base lm_head).
- ``medusa-2-checkpoint``: a full model whose shards also hold ``medusa_head.{h}.{l}.linear.*`` and
  ``medusa_head.{h}.{L}.weight``; only the shards holding heads are opened and only the head tensors read.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from .hub import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    HeadSource,
    check_reachable,
    check_shapes,
    read_sharded_tensors,
    read_tensors,
    tensor_names,
    warn_config_mismatch,
)

OWNER = "MedusaHeads"
MEDUSA_HEAD_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
FULL_MODEL_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
FULL_MODEL_FILES = ("model.safetensors", "pytorch_model.bin")

_RES_LINEAR = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")
_RES_LM_HEAD = re.compile(r"^(\d+)\.(\d+)\.weight$")
_VLLM_BLOCK = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
_VLLM_LM_HEAD = re.compile(r"^lm_heads\.(\d+)\.weight$")


@dataclass
class MedusaCheckpoint:
    """Medusa heads read from any published layout, in our layout (see the module docstring)."""

    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int | None  # the base model's vocabulary; None = unknown (heads that reuse the base lm_head)
    share_lm_head: bool
    block_bias: bool
    tensors: dict[str, torch.Tensor]
    draft_vocab_size: int | None = None
    base_model_name_or_path: str | None = None
    tree_choices: list[list[int]] | None = None
    model_card: dict = field(default_factory=dict)
    source_format: str = "hf-specdec"

    def init_kwargs(self) -> dict:
        """Arguments of `MedusaHeads.__init__` that rebuild this checkpoint's module."""
        return dict(
            num_heads=self.num_heads,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            share_lm_head=self.share_lm_head,
            block_bias=self.block_bias,
            draft_vocab_size=self.draft_vocab_size,
            base_model_name_or_path=self.base_model_name_or_path,
            tree_choices=self.tree_choices,
            model_card=self.model_card,
        )


def medusa_expected_shapes(
    num_heads: int,
    num_layers: int,
    hidden_size: int,
    share_lm_head: bool,
    block_bias: bool,
    lm_head_rows: int | None,
    draft_vocab_size: int | None,
) -> dict[str, tuple[int, ...]]:
    """Shapes of our layout's tensors."""
    shapes = {"block_weight": (num_heads, num_layers, hidden_size, hidden_size)}
    if block_bias:
        shapes["block_bias"] = (num_heads, num_layers, hidden_size)
    if not share_lm_head:
        shapes["lm_head_weight"] = (num_heads, int(lm_head_rows), hidden_size)
    if draft_vocab_size is not None:
        shapes["token_map"] = (draft_vocab_size,)
    return shapes


# ------------------------------------------------------------------------------------------------ our format
def medusa_from_ours(config: Mapping, tensors: dict[str, torch.Tensor], where: str) -> MedusaCheckpoint:
    """Our own format: the config is authoritative, every tensor shape is checked against it."""
    for key in ("num_heads", "num_layers", "hidden_size"):
        if not isinstance(config.get(key), int):
            raise ValueError(f"{OWNER}: {where}/{CONFIG_NAME} lacks an integer {key!r}")
    share = bool(config.get("share_lm_head", True))
    bias = bool(config.get("block_bias", True))
    vocab = config.get("vocab_size")
    draft_vocab = config.get("draft_vocab_size")
    if not share and vocab is None:
        raise ValueError(f"{OWNER}: {where}/{CONFIG_NAME} has share_lm_head=false but no vocab_size")
    rows = draft_vocab if draft_vocab is not None else vocab
    expected = medusa_expected_shapes(
        config["num_heads"], config["num_layers"], config["hidden_size"], share, bias, rows, draft_vocab
    )
    check_shapes(OWNER, tensors, expected, f"{where}/{WEIGHTS_NAME}")
    return MedusaCheckpoint(
        num_heads=config["num_heads"],
        num_layers=config["num_layers"],
        hidden_size=config["hidden_size"],
        vocab_size=vocab,
        share_lm_head=share,
        block_bias=bias,
        tensors=dict(tensors),
        draft_vocab_size=draft_vocab,
        base_model_name_or_path=config.get("base_model_name_or_path"),
        tree_choices=config.get("tree_choices"),
        model_card=dict(config.get("model_card") or {}),
        source_format=config.get("source_format", "hf-specdec"),
    )


# ------------------------------------------------------------------------------------- FasterDecoding layout
def _config_int(config: Mapping, *names: str) -> tuple[str, int] | None:
    for name in names:
        if isinstance(config.get(name), int):
            return name, config[name]
    return None


def medusa_from_resblock_layout(
    tensors: dict[str, torch.Tensor],
    config: Mapping,
    where: str,
    source_format: str,
) -> MedusaCheckpoint:
    """FasterDecoding's layout: ``{h}.{l}.linear.weight/bias`` then an optional per-head lm_head ``{h}.{L}.weight``.

    Used by Medusa-1 v0.1 (``medusa_lm_head.pt``), the version-2 ResBlock-only heads and, after stripping the
    ``medusa_head.`` prefix, Medusa-2 full checkpoints. Head and layer counts come from the keys.
    """
    linear: dict[int, set[int]] = {}
    lm_index: dict[int, int] = {}
    bias_seen = False
    for key in tensors:
        m = _RES_LINEAR.match(key)
        if m:
            linear.setdefault(int(m[1]), set()).add(int(m[2]))
            bias_seen |= m[3] == "bias"
            continue
        m = _RES_LM_HEAD.match(key)
        if m:
            lm_index[int(m[1])] = int(m[2])
            continue
        raise ValueError(
            f"{OWNER}: unexpected tensor {key!r} in {where}; Medusa heads hold '{{head}}.{{layer}}.linear.weight', "
            "'.bias' and '{head}.{num_layers}.weight'"
        )
    if not linear and not lm_index:
        raise ValueError(f"{OWNER}: {where} holds no Medusa head tensors")
    heads = set(linear) | set(lm_index)
    num_heads = max(heads) + 1
    num_layers = max((len(v) for v in linear.values()), default=0)
    share = not lm_index
    if share and num_layers == 0:
        raise ValueError(f"{OWNER}: {where} holds neither ResBlocks nor lm_heads")

    # config quirks: published head counts are wrong (FORMATS.md); the tensors decide, with a warning.
    found = _config_int(config, "medusa_num_heads", "num_heads")
    if found and found[1] != num_heads:
        warn_config_mismatch(where, found[0], found[1], num_heads)
    found = _config_int(config, "medusa_num_layers", "num_layers")
    if found and found[1] != num_layers:
        warn_config_mismatch(where, found[0], found[1], num_layers)
    if str(config.get("version", "")) == "2" and not share:
        warn_config_mismatch(where, "version", '"2" (ResBlocks only, base lm_head)', "per-head lm_heads")

    hidden = config.get("hidden_size") if isinstance(config.get("hidden_size"), int) else None
    if hidden is None:
        probe = tensors.get("0.0.linear.weight", tensors.get(f"0.{num_layers}.weight"))
        if probe is None:
            probe = next(iter(tensors.values()))
        hidden = int(probe.shape[-1])
    vocab = config.get("vocab_size") if isinstance(config.get("vocab_size"), int) else None
    if not share and vocab is None:
        vocab = int(tensors[f"{min(lm_index)}.{lm_index[min(lm_index)]}.weight"].shape[0])

    expected: dict[str, tuple[int, ...]] = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            expected[f"{h}.{layer}.linear.weight"] = (hidden, hidden)
            if bias_seen:
                expected[f"{h}.{layer}.linear.bias"] = (hidden,)
        if not share:
            expected[f"{h}.{num_layers}.weight"] = (vocab, hidden)
    check_shapes(OWNER, tensors, expected, where)

    dtype = tensors[next(iter(expected))].dtype
    out = {
        "block_weight": torch.stack(
            [torch.stack([tensors[f"{h}.{la}.linear.weight"] for la in range(num_layers)]) for h in range(num_heads)]
        ).to(dtype)
    }
    if bias_seen:
        out["block_bias"] = torch.stack(
            [torch.stack([tensors[f"{h}.{la}.linear.bias"] for la in range(num_layers)]) for h in range(num_heads)]
        ).to(dtype)
    if not share:
        out["lm_head_weight"] = torch.stack([tensors[f"{h}.{num_layers}.weight"] for h in range(num_heads)]).to(dtype)
    return MedusaCheckpoint(
        num_heads=num_heads,
        num_layers=num_layers,
        hidden_size=hidden,
        vocab_size=vocab,
        share_lm_head=share,
        block_bias=bias_seen,
        tensors=out,
        base_model_name_or_path=config.get("base_model_name_or_path"),
        source_format=source_format if not (share and source_format == "medusa-1") else "medusa-v2-heads",
    )


# ------------------------------------------------------------------------------------------------ vLLM layout
def medusa_from_vllm_layout(tensors: dict[str, torch.Tensor], config: Mapping, where: str) -> MedusaCheckpoint:
    """vLLM's layout (``model_type: "medusa"``); follows vLLM's `Medusa.load_weights` semantics.

    ``token_map`` is used only when ``truncated_vocab_size < vocab_size`` (as in vLLM); full-vocabulary lm_heads are
    then restricted to the token map's rows. ``original_lm_head`` (a single stored copy of the base lm_head as
    ``lm_heads.0.weight``) becomes ``share_lm_head``: the base model's own lm_head is used.
    """
    blocks: dict[int, set[int]] = {}
    lm_heads: set[int] = set()
    bias_seen = False
    token_map = tensors.get("token_map")
    for key in tensors:
        m = _VLLM_BLOCK.match(key)
        if m:
            blocks.setdefault(int(m[1]), set()).add(int(m[2]))
            bias_seen |= m[3] == "bias"
        elif _VLLM_LM_HEAD.match(key):
            lm_heads.add(int(_VLLM_LM_HEAD.match(key)[1]))
        elif key != "token_map":
            raise ValueError(
                f"{OWNER}: unexpected tensor {key!r} in {where}; vLLM Medusa heads hold "
                "'blocks.{head}.layers.{layer}.weight', 'lm_heads.{head}.weight' and 'token_map'"
            )
    if not blocks:
        raise ValueError(f"{OWNER}: {where} holds no 'blocks.*' tensors")
    num_heads = max(set(blocks) | lm_heads) + 1
    num_layers = max(len(v) for v in blocks.values())
    found = _config_int(config, "num_heads", "medusa_num_heads")
    if found and found[1] != num_heads:
        warn_config_mismatch(where, found[0], found[1], num_heads)
    found = _config_int(config, "num_hidden_layers", "medusa_num_layers")
    if found and found[1] != num_layers:
        warn_config_mismatch(where, found[0], found[1], num_layers)
    if bool(config.get("medusa_fc_bias", bias_seen)) != bias_seen:
        warn_config_mismatch(where, "medusa_fc_bias", config.get("medusa_fc_bias"), bias_seen)
    logit_scale = config.get("logit_scale", 1.0)
    if logit_scale not in (None, 1, 1.0):
        warnings.warn(
            f"{where}: logit_scale={logit_scale} is not applied (a positive scale does not change the heads' top-k)",
            stacklevel=3,
        )

    hidden = config.get("hidden_size")
    if not isinstance(hidden, int):
        hidden = int(tensors["blocks.0.layers.0.weight"].shape[-1])
    vocab = config.get("vocab_size") if isinstance(config.get("vocab_size"), int) else None
    truncated = config.get("truncated_vocab_size")
    use_map = isinstance(truncated, int) and vocab is not None and truncated < vocab
    if use_map and token_map is None:
        raise ValueError(
            f"{OWNER}: {where} has truncated_vocab_size={truncated} < vocab_size={vocab} but no 'token_map' tensor "
            "(draft index -> token id); add it or drop truncated_vocab_size"
        )
    share = bool(config.get("original_lm_head", False))
    if not share and vocab is None:
        vocab = int(tensors["lm_heads.0.weight"].shape[0]) if "lm_heads.0.weight" in tensors else None
        if vocab is None:
            raise ValueError(f"{OWNER}: {where} has no config vocab_size and no 'lm_heads.0.weight'")

    expected: dict[str, tuple[int, ...]] = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            expected[f"blocks.{h}.layers.{layer}.weight"] = (hidden, hidden)
            if bias_seen:
                expected[f"blocks.{h}.layers.{layer}.bias"] = (hidden,)
    draft_vocab = int(truncated) if use_map else None
    lm_rows = {}
    if share:
        if "lm_heads.0.weight" in tensors:
            lm_rows["lm_heads.0.weight"] = (
                vocab if vocab is not None else tensors["lm_heads.0.weight"].shape[0],
                hidden,
            )
    else:
        for h in range(num_heads):
            key = f"lm_heads.{h}.weight"
            # vLLM accepts full-vocabulary lm_heads with a token map and slices them
            rows = draft_vocab
            if use_map and key in tensors and tensors[key].shape[0] == vocab:
                rows = vocab
            lm_rows[key] = (rows if rows is not None else vocab, hidden)
    expected.update(lm_rows)
    if token_map is not None:
        expected["token_map"] = tuple(token_map.shape)
        if use_map and tuple(token_map.shape) != (draft_vocab,):
            raise ValueError(
                f"{OWNER}: tensor 'token_map' in {where} has shape {list(token_map.shape)}, expected [{draft_vocab}] "
                "(truncated_vocab_size)"
            )
    check_shapes(OWNER, tensors, expected, where)

    dtype = tensors["blocks.0.layers.0.weight"].dtype
    out = {
        "block_weight": torch.stack(
            [
                torch.stack([tensors[f"blocks.{h}.layers.{la}.weight"] for la in range(num_layers)])
                for h in range(num_heads)
            ]
        ).to(dtype)
    }
    if bias_seen:
        out["block_bias"] = torch.stack(
            [
                torch.stack([tensors[f"blocks.{h}.layers.{la}.bias"] for la in range(num_layers)])
                for h in range(num_heads)
            ]
        ).to(dtype)
    if use_map:
        tmap = token_map.to(torch.long)
        if vocab is not None and (int(tmap.max()) >= vocab or int(tmap.min()) < 0):
            raise ValueError(f"{OWNER}: 'token_map' in {where} holds token ids outside [0, {vocab})")
        out["token_map"] = tmap
    if not share:
        heads_w = []
        for h in range(num_heads):
            w = tensors[f"lm_heads.{h}.weight"]
            if use_map and w.shape[0] == vocab:
                w = w[out["token_map"]]
            heads_w.append(w)
        out["lm_head_weight"] = torch.stack(heads_w).to(dtype)
    return MedusaCheckpoint(
        num_heads=num_heads,
        num_layers=num_layers,
        hidden_size=hidden,
        vocab_size=vocab,
        share_lm_head=share,
        block_bias=bias_seen,
        tensors=out,
        draft_vocab_size=draft_vocab,
        base_model_name_or_path=config.get("base_model_name_or_path"),
        source_format="vllm",
    )


# ------------------------------------------------------------------------------------------------ detection
def _strip(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in tensors.items()}


def detect_medusa_layout(keys) -> str | None:
    """``"vllm"``, ``"resblock"`` (FasterDecoding) or ``"full"`` (heads inside a Medusa-2 model), from tensor names."""
    keys = list(keys)
    if any(k.startswith("medusa_head.") for k in keys):
        return "full"
    stripped = [k.removeprefix("medusa_heads.") for k in keys]
    if any(_VLLM_BLOCK.match(k) for k in stripped):
        return "vllm"
    if any(_RES_LINEAR.match(k) or _RES_LM_HEAD.match(k) for k in keys):
        return "resblock"
    return None


def medusa_from_tensors(
    tensors: dict[str, torch.Tensor], config: Mapping, where: str, default_format: str
) -> MedusaCheckpoint:
    """Convert tensors of any upstream layout (detected from their names)."""
    layout = detect_medusa_layout(tensors)
    if layout == "vllm":
        return medusa_from_vllm_layout(_strip(tensors, "medusa_heads."), config, where)
    if layout == "full":
        heads = {k[len("medusa_head.") :]: v for k, v in tensors.items() if k.startswith("medusa_head.")}
        ckpt = medusa_from_resblock_layout(heads, config, where, "medusa-2-checkpoint")
        ckpt.source_format = "medusa-2-checkpoint"
        return ckpt
    if layout == "resblock":
        return medusa_from_resblock_layout(tensors, config, where, default_format)
    raise ValueError(f"{OWNER}: {where} holds no Medusa head tensors (first keys: {list(tensors)[:5]})")


def read_medusa_checkpoint(source: HeadSource) -> MedusaCheckpoint:
    """Find, detect and convert the Medusa heads of a folder or Hub repo (any layout of FORMATS.md)."""
    config = source.json(CONFIG_NAME) or {}
    head_type = config.get("head_type")
    if head_type is not None:
        if head_type != "medusa":
            raise ValueError(
                f"{source} holds a {head_type!r} head, not Medusa heads; load it with the {head_type} head class"
            )
        path = source.require(WEIGHTS_NAME)
        return medusa_from_ours(config, read_tensors(path), str(source))

    # FasterDecoding head files (Medusa-1 v0.1, version-2 heads)
    for name in MEDUSA_HEAD_FILES:
        path = source.file(name)
        if path is not None:
            tensors = _strip(read_tensors(path), "medusa_head.")
            return _with_base(medusa_from_tensors(tensors, config, f"{source}/{name}", "medusa-1"), config, source)

    # heads inside a sharded full checkpoint: read only the medusa tensors of the shards that hold them
    for index_name in FULL_MODEL_INDEXES:
        index = source.json(index_name)
        if index is None:
            continue
        names = list(index.get("weight_map", {}))
        layout = detect_medusa_layout(names)
        if layout is None:
            raise ValueError(
                f"{OWNER}: {source} is a checkpoint without Medusa heads ({index_name} lists no 'medusa_head.*' "
                "tensors); pass the Medusa head repo, not the base model"
            )
        prefix = "medusa_head." if layout == "full" else ""
        tensors, _ = read_sharded_tensors(source, index_name, lambda k, prefix=prefix: k.startswith(prefix))
        return _with_base(medusa_from_tensors(tensors, config, f"{source} ({index_name})", "medusa-1"), config, source)

    # single-file checkpoints: vLLM heads or a (small) Medusa-2 full model
    for name in FULL_MODEL_FILES:
        path = source.file(name)
        if path is None:
            continue
        names = tensor_names(path)
        layout = detect_medusa_layout(names)
        if layout is None:
            raise ValueError(
                f"{OWNER}: {source}/{name} holds no Medusa head tensors ('medusa_head.*', 'blocks.*' or "
                f"'{{head}}.{{layer}}.linear.weight'); first keys: {names[:5]}"
            )
        select = (lambda k: k.startswith("medusa_head.")) if layout == "full" else None
        tensors = read_tensors(path, select)
        return _with_base(medusa_from_tensors(tensors, config, f"{source}/{name}", "medusa-1"), config, source)

    candidates = [*MEDUSA_HEAD_FILES, *FULL_MODEL_INDEXES, *FULL_MODEL_FILES]
    check_reachable(source, found_any=False)
    raise FileNotFoundError(f"no Medusa heads found: {source.describe_missing(candidates)}")


def _with_base(ckpt: MedusaCheckpoint, config: Mapping, source: HeadSource) -> MedusaCheckpoint:
    """Fill the base model's id: a Medusa-2 full checkpoint *is* its own (fine-tuned) base."""
    if ckpt.source_format == "medusa-2-checkpoint":
        ckpt.base_model_name_or_path = str(source)
        if ckpt.vocab_size is None and isinstance(config.get("vocab_size"), int):
            ckpt.vocab_size = config["vocab_size"]
    return ckpt
