"""What several upstream readers share: renaming tensor-name prefixes, checking a draft vocabulary's ``d2t``."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def rename_prefixes(tensors: Mapping[str, torch.Tensor], renames: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """``tensors`` with each key's first prefix found in ``renames`` (old -> new, tried in order) replaced by its new
    one (``""``: stripped); keys with none of the prefixes are kept as they are, in the same order."""
    out = {}
    for key, value in tensors.items():
        for old, new in renames.items():
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        out[key] = value
    return out


def check_d2t(owner: str, tensors: dict[str, torch.Tensor], vocab: int, where: str) -> None:
    """A draft vocabulary's ``d2t`` `[V']` (token id = draft index + ``d2t[index]``), when ``tensors`` hold one, must
    map every draft index into ``[0, vocab)``; it is made int64 in place. ``where`` names the file in the error."""
    if "d2t" not in tensors:
        return
    ids = torch.arange(tensors["d2t"].numel()) + tensors["d2t"].long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"{owner}: d2t in {where} maps draft tokens outside the vocabulary [0, {vocab})")
    tensors["d2t"] = tensors["d2t"].long()
