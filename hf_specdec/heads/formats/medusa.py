"""Medusa heads' checkpoint layouts (docs/formats.md, "Medusa"): detection and conversion to our own tensors and
config, and the vLLM layout `medusa_to_vllm` writes.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ..hub import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    HeadSource,
    check_reachable,
    check_shapes,
    config_int,
    read_sharded_tensors,
    read_tensors,
    tensor_names,
    warn_config_mismatch,
)
from .common import rename_prefixes

OWNER = "MedusaHeads"
MEDUSA_HEAD_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
FULL_MODEL_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
FULL_MODEL_FILES = ("model.safetensors", "pytorch_model.bin")


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


# ------------------------------------------------------------------------------------------------ checks
def check_tree_choices(choices, num_heads: int, vocab: int | None, where: str) -> list[list[int]] | None:
    """A Medusa choices list, checked field by field: a list of paths, each a list of integer ranks >= 0 (``[0, 1]``:
    head 0's best guess, then head 1's second best under it), at most ``num_heads`` deep, each rank below the
    ``vocab`` tokens the heads draft from (when known), and every path's prefix also in the list (a path hangs under
    its prefix). ``where`` names what is checked (a file and its field, or an argument) in the error.

    Returns:
        the paths as lists of ints (empty paths, the root, dropped), or None for None.
    """
    if choices is None:
        return None
    example = "a list of paths such as [[0], [0, 0], [1]] (each path: the ranks of heads 0, 1, ... along it)"
    if isinstance(choices, (str, bytes)) or not isinstance(choices, (list, tuple)):
        raise TypeError(f"{where} must be {example}, got {choices!r} ({type(choices).__name__})")
    paths: list[tuple[int, ...]] = []
    for i, path in enumerate(choices):
        if isinstance(path, (str, bytes)) or not isinstance(path, (list, tuple)):
            raise TypeError(f"{where}: entry {i} is {path!r} ({type(path).__name__}); it must be {example}")
        for rank in path:
            if isinstance(rank, bool) or not isinstance(rank, int):
                raise TypeError(
                    f"{where}: path {i} {list(path)!r} holds {rank!r} ({type(rank).__name__}); ranks are integers "
                    "(0 = a head's best guess, 1 = its second best, ...)"
                )
            if rank < 0:
                raise ValueError(f"{where}: path {i} {list(path)} has the negative rank {rank}; ranks start at 0")
            if vocab is not None and rank >= vocab:
                raise ValueError(
                    f"{where}: path {i} {list(path)} uses rank {rank}, but the heads draft from {vocab} tokens "
                    f"(ranks 0..{vocab - 1})"
                )
        if len(path) > num_heads:
            raise ValueError(
                f"{where}: path {i} {list(path)} is {len(path)} deep but the Medusa heads have {num_heads} heads "
                f"(one per depth); use paths at most {num_heads} deep"
            )
        if path:
            paths.append(tuple(int(r) for r in path))
    known = set(paths)
    for path in paths:
        if len(path) > 1 and path[:-1] not in known:
            raise ValueError(
                f"{where}: path {list(path)} hangs under {list(path[:-1])}, which is not in the list; every prefix of "
                "a path must be a path too"
            )
    return [list(p) for p in paths]


def check_token_map(token_map: torch.Tensor | None, vocab: int | None, where: str, vocab_source: str) -> None:
    """``token_map`` `[V']` (draft index -> token id) must hold integer ids in ``[0, vocab)``; ``where`` names the
    tensor and ``vocab_source`` where ``vocab`` comes from, in the error."""
    if token_map is None:
        return
    if token_map.is_floating_point() or token_map.is_complex() or token_map.dtype == torch.bool:
        raise ValueError(f"{where} must hold integer token ids, got dtype {token_map.dtype}")
    if vocab is None or token_map.numel() == 0:
        return
    bad = ((token_map < 0) | (token_map >= vocab)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(
            f"{where} maps draft index {i} to token id {int(token_map[i])}, outside the vocabulary of {vocab} ids "
            f"(0..{vocab - 1}) of {vocab_source}; the map must hold the target's token ids: rebuild it, or load heads "
            "made for this vocabulary"
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
    path = f"{where}/{CONFIG_NAME}"
    for key, minimum in (("num_heads", 1), ("num_layers", 0), ("hidden_size", 1)):
        config_int(OWNER, config, key, path, minimum=minimum)
    share = bool(config.get("share_lm_head", True))
    bias = bool(config.get("block_bias", True))
    vocab = config_int(OWNER, config, "vocab_size", path, required=False)
    draft_vocab = config_int(OWNER, config, "draft_vocab_size", path, required=False)
    if not share and vocab is None:
        raise ValueError(f"{OWNER}: {where}/{CONFIG_NAME} has share_lm_head=false but no vocab_size")
    rows = draft_vocab if draft_vocab is not None else vocab
    expected = medusa_expected_shapes(
        config["num_heads"], config["num_layers"], config["hidden_size"], share, bias, rows, draft_vocab
    )
    check_shapes(OWNER, tensors, expected, f"{where}/{WEIGHTS_NAME}")
    check_token_map(
        tensors.get("token_map"), vocab, f"{OWNER}: tensor 'token_map' of {where}/{WEIGHTS_NAME}",
        f"the field 'vocab_size' of {path}",
    )  # fmt: skip
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


# ------------------------------------------------------------------------------------------- upstream layouts
@dataclass(frozen=True)
class MedusaLayout:
    """How one upstream layout names the heads' tensors; `medusa_from_layout` does the rest for every layout.

    Attributes:
        name: ``"resblock"`` (FasterDecoding: Medusa-1, version-2 heads, Medusa-2 models) or ``"vllm"``.
        block / lm_head: patterns of a ResBlock tensor (groups: head, layer, ``weight``/``bias``) and of a
            per-head lm_head (group 1: head).
        block_key / lm_head_key: the names, formatted with ``h``, ``layer``, ``kind`` / ``h``, ``L`` (layers).
        extra: other tensor names the layout may hold.
        num_heads_config / num_layers_config: config keys that state the head and layer counts (first found wins).
        hint: what the layout's tensor names look like, for the unexpected-tensor error.
        lm_heads: the layout's lm_head rules (shared or per head, vocabulary, token map), see `_LmHeads`.
    """

    name: str
    block: re.Pattern
    lm_head: re.Pattern
    block_key: str
    lm_head_key: str
    extra: tuple[str, ...]
    num_heads_config: tuple[str, ...]
    num_layers_config: tuple[str, ...]
    hint: str
    lm_heads: Callable[[dict[str, torch.Tensor], Mapping, _Found, int, str], _LmHeads]


@dataclass
class _Found:
    """What the tensor names say: ResBlock layers per head, per-head lm_head keys, whether blocks have biases."""

    blocks: dict[int, set[int]] = field(default_factory=dict)
    lm_heads: dict[int, str] = field(default_factory=dict)
    bias: bool = False

    @property
    def num_heads(self) -> int:
        return max(set(self.blocks) | set(self.lm_heads)) + 1

    @property
    def num_layers(self) -> int:
        return max((len(v) for v in self.blocks.values()), default=0)


@dataclass
class _LmHeads:
    """A layout's verdict on the output projections.

    Attributes:
        share: the heads use the base model's lm_head (no per-head weights kept).
        vocab: the base vocabulary (None = unknown).
        expected: upstream lm_head/token-map key -> expected shape.
        keys: per head, the upstream key of its lm_head (empty when shared).
        draft_vocab: rows of a truncated vocabulary (None = full).
        token_map: `[draft_vocab]` draft index -> token id, when truncated.
    """

    share: bool
    vocab: int | None
    expected: dict[str, tuple[int, ...]] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)
    draft_vocab: int | None = None
    token_map: torch.Tensor | None = None


def _config_int(config: Mapping, *names: str) -> tuple[str, int] | None:
    for name in names:
        if isinstance(config.get(name), int):
            return name, config[name]
    return None


def _scan(tensors: Mapping[str, torch.Tensor], layout: MedusaLayout, where: str) -> _Found:
    found = _Found()
    for key in tensors:
        if m := layout.block.match(key):
            found.blocks.setdefault(int(m[1]), set()).add(int(m[2]))
            found.bias |= m[3] == "bias"
        elif m := layout.lm_head.match(key):
            found.lm_heads[int(m[1])] = key
        elif key not in layout.extra:
            raise ValueError(f"{OWNER}: unexpected tensor {key!r} in {where}; {layout.hint}")
    if not found.blocks and not found.lm_heads:
        raise ValueError(f"{OWNER}: {where} holds no Medusa head tensors")
    return found


def _warn_config_counts(config: Mapping, layout: MedusaLayout, found: _Found, where: str) -> None:
    """Published head counts can be wrong (docs/formats.md): the tensors decide, with a warning."""
    for names, actual in ((layout.num_heads_config, found.num_heads), (layout.num_layers_config, found.num_layers)):
        stated = _config_int(config, *names)
        if stated and stated[1] != actual:
            warn_config_mismatch(where, stated[0], stated[1], actual)


def _resblock_lm_heads(tensors, config: Mapping, found: _Found, hidden: int, where: str) -> _LmHeads:
    """FasterDecoding: a head has its own lm_head ``{h}.{L}.weight`` or none at all (version 2: the base's)."""
    share = not found.lm_heads
    if share and found.num_layers == 0:
        raise ValueError(f"{OWNER}: {where} holds neither ResBlocks nor lm_heads")
    if str(config.get("version", "")) == "2" and not share:
        warn_config_mismatch(where, "version", '"2" (ResBlocks only, base lm_head)', "per-head lm_heads")
    vocab = config.get("vocab_size") if isinstance(config.get("vocab_size"), int) else None
    if share:
        return _LmHeads(share=True, vocab=vocab)
    if vocab is None:
        vocab = int(tensors[found.lm_heads[min(found.lm_heads)]].shape[0])
    keys = [f"{h}.{found.num_layers}.weight" for h in range(found.num_heads)]
    return _LmHeads(share=False, vocab=vocab, expected={k: (vocab, hidden) for k in keys}, keys=keys)


def _vllm_lm_heads(tensors, config: Mapping, found: _Found, hidden: int, where: str) -> _LmHeads:
    """vLLM's `Medusa.load_weights` semantics: ``token_map`` only when ``truncated_vocab_size < vocab_size`` (full-
    vocabulary lm_heads are then cut to its rows); ``original_lm_head`` (one stored copy of the base lm_head as
    ``lm_heads.0.weight``) means the base model's own lm_head is used."""
    if bool(config.get("medusa_fc_bias", found.bias)) != found.bias:
        warn_config_mismatch(where, "medusa_fc_bias", config.get("medusa_fc_bias"), found.bias)
    logit_scale = config.get("logit_scale", 1.0)
    if logit_scale not in (None, 1, 1.0):
        warnings.warn(
            f"{where}: logit_scale={logit_scale} is not applied (a positive scale does not change the heads' top-k)",
            stacklevel=4,
        )
    vocab = config.get("vocab_size") if isinstance(config.get("vocab_size"), int) else None
    truncated = config.get("truncated_vocab_size")
    use_map = isinstance(truncated, int) and vocab is not None and truncated < vocab
    token_map = tensors.get("token_map")
    if use_map and token_map is None:
        raise ValueError(
            f"{OWNER}: {where} has truncated_vocab_size={truncated} < vocab_size={vocab} but no 'token_map' tensor "
            "(draft index -> token id); add it or drop truncated_vocab_size"
        )
    draft_vocab = int(truncated) if use_map else None
    share = bool(config.get("original_lm_head", False))
    if not share and vocab is None:
        if "lm_heads.0.weight" not in tensors:
            raise ValueError(f"{OWNER}: {where} has no config vocab_size and no 'lm_heads.0.weight'")
        vocab = int(tensors["lm_heads.0.weight"].shape[0])
    lm = _LmHeads(share=share, vocab=vocab, draft_vocab=draft_vocab)
    if share and "lm_heads.0.weight" in tensors:
        lm.expected["lm_heads.0.weight"] = (
            vocab if vocab is not None else tensors["lm_heads.0.weight"].shape[0],
            hidden,
        )
    if not share:
        lm.keys = [f"lm_heads.{h}.weight" for h in range(found.num_heads)]
        for key in lm.keys:  # vLLM also accepts full-vocabulary lm_heads with a token map, and slices them
            full = use_map and key in tensors and tensors[key].shape[0] == vocab
            lm.expected[key] = (vocab if full or draft_vocab is None else draft_vocab, hidden)
    if token_map is not None:
        lm.expected["token_map"] = tuple(token_map.shape)
        if use_map and tuple(token_map.shape) != (draft_vocab,):
            raise ValueError(
                f"{OWNER}: tensor 'token_map' in {where} has shape {list(token_map.shape)}, expected [{draft_vocab}] "
                "(truncated_vocab_size)"
            )
        lm.token_map = token_map.to(torch.long) if use_map else None
    return lm


RESBLOCK_LAYOUT = MedusaLayout(
    name="resblock",
    block=re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$"),
    lm_head=re.compile(r"^(\d+)\.(\d+)\.weight$"),
    block_key="{h}.{layer}.linear.{kind}",
    lm_head_key="{h}.{L}.weight",
    extra=(),
    num_heads_config=("medusa_num_heads", "num_heads"),
    num_layers_config=("medusa_num_layers", "num_layers"),
    hint="Medusa heads hold '{head}.{layer}.linear.weight', '.bias' and '{head}.{num_layers}.weight'",
    lm_heads=_resblock_lm_heads,
)
VLLM_LAYOUT = MedusaLayout(
    name="vllm",
    block=re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$"),
    lm_head=re.compile(r"^lm_heads\.(\d+)\.weight$"),
    block_key="blocks.{h}.layers.{layer}.{kind}",
    lm_head_key="lm_heads.{h}.weight",
    extra=("token_map",),
    num_heads_config=("num_heads", "medusa_num_heads"),
    num_layers_config=("num_hidden_layers", "medusa_num_layers"),
    hint="vLLM Medusa heads hold 'blocks.{head}.layers.{layer}.weight', 'lm_heads.{head}.weight' and 'token_map'",
    lm_heads=_vllm_lm_heads,
)


def medusa_from_layout(
    tensors: dict[str, torch.Tensor], config: Mapping, where: str, layout: MedusaLayout, source_format: str
) -> MedusaCheckpoint:
    """Convert upstream tensors named as ``layout`` says: head and layer counts from the names (a config that
    disagrees is warned about), every shape checked (errors name the key and both shapes), ResBlocks and lm_heads
    stacked into our layout."""
    found = _scan(tensors, layout, where)
    _warn_config_counts(config, layout, found, where)
    num_heads, num_layers = found.num_heads, found.num_layers
    hidden = config.get("hidden_size")
    if not isinstance(hidden, int):
        probe = tensors.get(layout.block_key.format(h=0, layer=0, kind="weight"))
        probe = probe if probe is not None else tensors.get(layout.lm_head_key.format(h=0, L=num_layers))
        hidden = int((probe if probe is not None else next(iter(tensors.values()))).shape[-1])
    lm = layout.lm_heads(tensors, config, found, hidden, where)
    kinds = ("weight", "bias") if found.bias else ("weight",)
    block_keys = {  # kind -> [num_heads][num_layers] upstream keys
        kind: [
            [layout.block_key.format(h=h, layer=la, kind=kind) for la in range(num_layers)] for h in range(num_heads)
        ]
        for kind in kinds
    }
    expected = {k: (hidden, hidden) for row in block_keys["weight"] for k in row}
    expected.update({k: (hidden,) for row in block_keys.get("bias", []) for k in row})
    expected.update(lm.expected)
    check_shapes(OWNER, tensors, expected, where)
    first = tensors[next(iter(expected))]  # its dtype is the checkpoint's
    out = {}
    for kind, name, shape in (("weight", "block_weight", (hidden, hidden)), ("bias", "block_bias", (hidden,))):
        if kind in block_keys:
            per_head = [
                torch.stack([tensors[k] for k in row]) if row else first.new_zeros((0, *shape))
                for row in block_keys[kind]
            ]
            out[name] = torch.stack(per_head).to(first.dtype)  # [num_heads, num_layers, H(, H)]
    if lm.token_map is not None:
        check_token_map(lm.token_map, lm.vocab, f"{OWNER}: tensor 'token_map' in {where}", "its config's vocab_size")
        out["token_map"] = lm.token_map
    if lm.keys:
        weights = [tensors[k] for k in lm.keys]  # cut full-vocabulary rows to the token map's
        weights = [w[lm.token_map] if lm.token_map is not None and w.shape[0] != lm.draft_vocab else w for w in weights]
        out["lm_head_weight"] = torch.stack(weights).to(first.dtype)  # [num_heads, V', H]
    return MedusaCheckpoint(
        num_heads=num_heads,
        num_layers=num_layers,
        hidden_size=hidden,
        vocab_size=lm.vocab,
        share_lm_head=lm.share,
        block_bias=found.bias,
        tensors=out,
        draft_vocab_size=lm.draft_vocab,
        base_model_name_or_path=config.get("base_model_name_or_path"),
        tree_choices=config.get("tree_choices"),  # written by `medusa_to_vllm`, absent upstream
        model_card=dict(config.get("model_card") or {}),
        source_format=source_format,
    )


# ------------------------------------------------------------------------------------------------ writing
def medusa_to_vllm(heads, base_lm_head: torch.Tensor | None) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config.json, tensors)`` of `MedusaHeads` in vLLM's Medusa layout (what `VLLM_LAYOUT` reads back).

    Args:
        heads: the `MedusaHeads`.
        base_lm_head: `[V, H]` the base model's lm_head weight, stored once as ``lm_heads.0.weight`` with
            ``original_lm_head: true`` when the heads share it (vLLM's Medusa cannot reach the target's lm_head);
            None for heads with their own lm_heads.
    """
    if heads.vocab_size is None:
        raise ValueError(f"{OWNER}: vLLM's Medusa config needs the vocabulary size; bind the heads to the base model "
                         "(MedusaHeads.from_pretrained(..., base_model=model)) before exporting")  # fmt: skip
    n, layers = heads.num_heads, heads.num_layers
    tensors = {}
    for h in range(n):
        for layer in range(layers):
            tensors[VLLM_LAYOUT.block_key.format(h=h, layer=layer, kind="weight")] = heads.block_weight[h, layer]
            if heads.block_bias is not None:
                tensors[VLLM_LAYOUT.block_key.format(h=h, layer=layer, kind="bias")] = heads.block_bias[h, layer]
    if heads.share_lm_head:
        if base_lm_head is None:
            raise ValueError(f"{OWNER}: these heads use the base model's lm_head, which vLLM's Medusa layout stores "
                             "as lm_heads.0.weight: bind them to the base model before exporting")  # fmt: skip
        tensors["lm_heads.0.weight"] = base_lm_head.detach().to(heads.block_weight.dtype)  # [V, H]
    else:
        for h in range(n):
            tensors[VLLM_LAYOUT.lm_head_key.format(h=h)] = heads.lm_head_weight[h]  # [V', H]
    if heads.token_map is not None:
        tensors["token_map"] = heads.token_map
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        "num_heads": n,
        "num_hidden_layers": layers,
        "truncated_vocab_size": heads.draft_vocab_size or heads.vocab_size,
        "medusa_fc_bias": heads.block_bias is not None,
        "original_lm_head": heads.share_lm_head,
        "base_model_name_or_path": heads.base_model_name_or_path,
        "tree_choices": heads.tree_choices,
        "model_card": heads.model_card,
    }
    return config, {k: v.detach() for k, v in tensors.items()}


# ------------------------------------------------------------------------------------------------ detection
def detect_medusa_layout(keys) -> str | None:
    """``"vllm"``, ``"resblock"`` (FasterDecoding) or ``"full"`` (heads inside a Medusa-2 model), from tensor names."""
    keys = list(keys)
    if any(k.startswith("medusa_head.") for k in keys):
        return "full"
    stripped = [k.removeprefix("medusa_heads.") for k in keys]
    if any(VLLM_LAYOUT.block.match(k) for k in stripped):
        return "vllm"
    if any(RESBLOCK_LAYOUT.block.match(k) or RESBLOCK_LAYOUT.lm_head.match(k) for k in keys):
        return "resblock"
    return None


def medusa_from_tensors(
    tensors: dict[str, torch.Tensor], config: Mapping, where: str, default_format: str
) -> MedusaCheckpoint:
    """Convert tensors of any upstream layout (detected from their names)."""
    layout = detect_medusa_layout(tensors)
    if layout == "vllm":
        tensors = rename_prefixes(tensors, {"medusa_heads.": ""})
        return medusa_from_layout(tensors, config, where, VLLM_LAYOUT, "vllm")
    if layout == "full":
        heads = {k[len("medusa_head.") :]: v for k, v in tensors.items() if k.startswith("medusa_head.")}
        return medusa_from_layout(heads, config, where, RESBLOCK_LAYOUT, "medusa-2-checkpoint")
    if layout == "resblock":
        ckpt = medusa_from_layout(tensors, config, where, RESBLOCK_LAYOUT, default_format)
        if ckpt.share_lm_head and default_format == "medusa-1":
            ckpt.source_format = "medusa-v2-heads"  # ResBlocks only: FasterDecoding's version-2 heads
        return ckpt
    raise ValueError(f"{OWNER}: {where} holds no Medusa head tensors (first keys: {list(tensors)[:5]})")


def read_medusa_checkpoint(source: HeadSource) -> MedusaCheckpoint:
    """Find, detect and convert the Medusa heads of a folder or Hub repo (any layout of docs/formats.md); the
    config's ``tree_choices`` are checked field by field (`check_tree_choices`)."""
    ckpt = _read_medusa_checkpoint(source)
    ckpt.tree_choices = check_tree_choices(
        ckpt.tree_choices,
        ckpt.num_heads,
        ckpt.draft_vocab_size or ckpt.vocab_size,
        f"{OWNER}: {source}/{CONFIG_NAME} field 'tree_choices'",
    )
    return ckpt


def _read_medusa_checkpoint(source: HeadSource) -> MedusaCheckpoint:
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
            tensors = rename_prefixes(read_tensors(path), {"medusa_head.": ""})
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
