"""The checks every head's loading and binding share: tree defaults within stated limits, finite weights, token ids
inside a vocabulary, known values of a config field, a verifier name an engine can load.

Each raises a `ValueError` naming the head class (``owner``), where the value came from (``where``: a file, or the
head's source) and the field, so that a bad file fails when it is loaded or bound, never deep inside ``generate``.

Tree limits (a head's ``tree`` defaults and a proposer's own arguments; far above any tree that pays, low enough
that a typo cannot ask for a tree no machine can verify):

- `MAX_TREE_DEPTH`: draft tokens on one path (``depth``, the length of ``widths``);
- `MAX_TREE_NODES`: nodes of one tree (``num_nodes``, each of ``widths``);
- `MAX_TREE_TOP_K`: children of one node (``top_k``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Collection, Mapping

import torch

MAX_TREE_DEPTH = 64
MAX_TREE_NODES = 1024
MAX_TREE_TOP_K = 64

# tree field -> (its limit, the limit's name)
_TREE_INTS = {
    "depth": (MAX_TREE_DEPTH, "MAX_TREE_DEPTH"),
    "num_nodes": (MAX_TREE_NODES, "MAX_TREE_NODES"),
    "top_k": (MAX_TREE_TOP_K, "MAX_TREE_TOP_K"),
}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")  # a Hub repo id: owner/name


# --------------------------------------------------------------------------------------------------- trees
def tree_int(owner: str, field: str, value, where: str, minimum: int = 1) -> int:
    """``value`` of the tree field ``field`` (``depth``, ``num_nodes``, ``top_k``): an integer in
    ``minimum .. its limit`` (`MAX_TREE_DEPTH`, `MAX_TREE_NODES`, `MAX_TREE_TOP_K`)."""
    limit, name = _TREE_INTS[field.rpartition(".")[2]]
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= limit:
        raise ValueError(
            f"{owner}: {where} field {field!r} must be an integer in {minimum}..{limit} "
            f"(hf_specdec.heads.checks.{name}), got {value!r}"
        )
    return value


def check_tree_sizes(owner: str, where: str, **sizes: int | None) -> None:
    """A proposer's tree arguments (``depth=``, ``num_nodes=``, ``top_k=``; None: not given) within the limits;
    ``num_nodes`` may be 0 (draft nothing)."""
    for field, value in sizes.items():
        if value is not None:
            tree_int(owner, field, value, where, minimum=0 if field == "num_nodes" else 1)


def check_tree(owner: str, tree, where: str, field: str = "tree") -> None:
    """A head's tree defaults (``tree`` in its config): absent, or an object whose ``depth`` / ``num_nodes`` /
    ``top_k`` lie within the limits, whose ``widths`` are at most `MAX_TREE_DEPTH` node counts of at most
    `MAX_TREE_NODES`, and whose ``step_cost`` maps node counts to finite positive costs. Other keys (facts recorded
    by the tuner) are not read by any proposer and pass."""
    if tree is None:
        return
    if not isinstance(tree, Mapping):
        raise ValueError(f"{owner}: {where} field {field!r} must be an object of tree defaults (depth, num_nodes, "
                         f"top_k, widths, step_cost), got {tree!r} ({type(tree).__name__})")  # fmt: skip
    for key in _TREE_INTS:
        if tree.get(key) is not None:
            tree_int(owner, f"{field}.{key}", tree[key], where)
    _check_widths(owner, tree.get("widths"), where, f"{field}.widths")
    _check_step_cost(owner, tree.get("step_cost"), where, f"{field}.step_cost")


def _check_widths(owner: str, widths, where: str, field: str) -> None:
    if widths is None:
        return
    ok = isinstance(widths, list) and 1 <= len(widths) <= MAX_TREE_DEPTH
    if not ok or not all(isinstance(w, int) and not isinstance(w, bool) and 1 <= w <= MAX_TREE_NODES for w in widths):
        raise ValueError(
            f"{owner}: {where} field {field!r} must list 1..{MAX_TREE_DEPTH} node counts (MAX_TREE_DEPTH) in "
            f"1..{MAX_TREE_NODES} (MAX_TREE_NODES), one per depth, got {_short(widths)}"
        )


def _check_step_cost(owner: str, cost, where: str, field: str) -> None:
    if cost is None:
        return
    if not isinstance(cost, Mapping) or not all(_is_count(n) and _is_positive(c) for n, c in cost.items()):
        raise ValueError(f"{owner}: {where} field {field!r} must map node counts to finite positive step costs, "
                         f"got {_short(cost)}")  # fmt: skip


def _is_count(n) -> bool:
    return (isinstance(n, int) and not isinstance(n, bool) and n >= 0) or (isinstance(n, str) and n.isdigit())


def _is_positive(c) -> bool:
    return isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) and c > 0


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --------------------------------------------------------------------------------------------------- config fields
def check_choice(owner: str, config: Mapping, key: str, known: Collection, where: str) -> None:
    """The config field ``key``, when present, is one of ``known`` (a value this version does not know is refused,
    never read as a default)."""
    value = config.get(key)
    if value is not None and (isinstance(value, bool) or value not in known):
        raise ValueError(f"{owner}: {where} field {key!r} must be one of {sorted(known)}, got {value!r}")


def check_token_ids(owner: str, field: str, ids, vocab: int, where: str) -> None:
    """Token ids (an int or a tensor `[...]` of them) in ``field`` lie in the vocabulary ``[0, vocab)``."""
    if ids is None:
        return
    t = torch.as_tensor(ids)
    if t.is_floating_point() or t.dtype == torch.bool:
        raise ValueError(f"{owner}: {where} field {field!r} must hold integer token ids, got {t.dtype}")
    if t.numel() == 0:
        return
    low, high = int(t.min()), int(t.max())
    if low < 0 or high >= vocab:
        bad = high if high >= vocab else low
        raise ValueError(f"{owner}: {where} field {field!r} holds the token id {bad}, outside the vocabulary "
                         f"[0, {vocab}); the head was made for another model or the file is damaged")  # fmt: skip


# --------------------------------------------------------------------------------------------------- tensors
def check_finite(owner: str, tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """Every floating tensor holds finite values only (NaN or inf weights would draft garbage without a word)."""
    for key, value in tensors.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ValueError(f"{owner}: tensor {key!r} in {where} holds NaN or infinite values; the checkpoint is "
                             "damaged (or its training diverged): download or train it again")  # fmt: skip


# --------------------------------------------------------------------------------------------------- exports
def is_model_reference(name: str | None) -> bool:
    """Whether ``name`` is something a serving engine can load a model from: an existing folder, an absolute path
    (a folder on the machine that serves), or a Hub id ``owner/name``."""
    if not name:
        return False
    return os.path.isdir(name) or os.path.isabs(name) or bool(HUB_ID.match(name))


def check_verifier(owner: str, name: str | None, architectures: list[str] | None) -> None:
    """The verifier a speculators config names (the target an engine loads beside the head): a folder or a Hub id
    (`is_model_reference`; not a bare name such as ``SmolLM2-135M-Instruct``), and its architectures."""
    if not is_model_reference(name) or not architectures:
        raise ValueError(
            f"{owner}: a speculators config names its verifier, the target an engine loads beside the head: a Hub id "
            f"(owner/name) or a folder, and its architectures; now {name!r} (architectures {architectures}). Bind the "
            "head to its target first (from_pretrained(..., base_model=model) or head.bind(model)) and set "
            "head.base_model_name_or_path to the target's Hub id or folder (hf-specdec export: --verifier)"
        )


__all__ = [
    "HUB_ID",
    "MAX_TREE_DEPTH",
    "MAX_TREE_NODES",
    "MAX_TREE_TOP_K",
    "check_choice",
    "check_finite",
    "check_token_ids",
    "check_tree",
    "check_tree_sizes",
    "check_verifier",
    "is_model_reference",
    "tree_int",
]
