"""Tensor-parallel targets (transformers' ``tp_plan``, one process per rank): the ranks decide every step alike.

Under tensor parallelism every rank runs the whole loop on its shard of the target, and every verify forward runs
collectives (the all-reduces of the row-parallel layers, the all-gather of the lm_head) whose sizes follow from the
number of tokens the forward packs. So whatever shapes a forward must be decided the same on every rank: the tree
of each row and, through it, the accepted tokens and the next step's rows. The tokens agree by construction (every
rank sees the same, all-reduced logits, and the assistant drafts from them); what did not is the tree budget, which
sizes trees from the step times each rank measured itself (docs/design.md, "Tree budget"). `agreed_seconds` makes
those times the same on every rank (the slowest rank's, which is what a tensor-parallel step costs), so every
rank's budget learns the same cost curve and cuts the same trees. `check_same_trees` then compares a fingerprint of
each step's trees across the ranks and refuses, on every rank at once, an assistant that drafted differently on two
ranks (one whose drafts depend on the process, e.g. on per-process timings or unseeded randomness), instead of the
collectives' size mismatch or hang that would follow.

Nothing here runs for a model that is not sharded (`tp_group` is None): one process, no collective, no cost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .tree import DraftTree


def tp_group(model: torch.nn.Module):
    """The process group ``model`` is sharded over by transformers' tensor parallelism (None: not sharded)."""
    if not (dist.is_available() and dist.is_initialized()) or (getattr(model, "tp_size", None) or 1) <= 1:
        return None
    mesh = getattr(model, "_device_mesh", None) or getattr(model, "device_mesh", None)
    if mesh is not None and getattr(mesh, "ndim", 1) == 1:
        return mesh.get_group()
    if mesh is not None and "tp" in (getattr(mesh, "mesh_dim_names", None) or ()):
        return mesh["tp"].get_group()
    return dist.group.WORLD


def _device(group) -> torch.device:
    """Where the group's collectives take their tensors (NCCL: the current GPU; gloo: the CPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agreed_seconds(group, verify_s: float | None, propose_s: float | None, other_s: float | None):
    """The step's times as every rank of ``group`` records them: each the slowest rank's; a time None (not a fair
    sample) on every rank when it is None on one. Returns ``(verify_s, propose_s, other_s)``."""
    seconds = [math.inf if s is None else s for s in (verify_s, propose_s, other_s)]
    times = torch.tensor(seconds, dtype=torch.float64, device=_device(group))  # [3]
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return tuple(None if math.isinf(s) else s for s in times.tolist())


def _fingerprint(trees: Sequence[DraftTree]) -> torch.Tensor:
    """`[3]` int64: the rows, the nodes and a position-weighted checksum of the trees' tokens and parents."""
    nodes, check = 0, 0
    for row, tree in enumerate(trees):
        n = tree.num_nodes
        nodes += n
        if n:
            weight = torch.arange(1, n + 1, dtype=torch.long, device=tree.tokens.device)  # [n]
            mixed = tree.tokens.long() * 1_000_003 + tree.parent.long() + 1  # [n]
            check += (row + 1) * int((mixed * weight).sum())
    return torch.tensor([len(trees), nodes, check % (1 << 62)], dtype=torch.long)


def check_same_trees(group, trees: Sequence[DraftTree], assistant: str) -> None:
    """Raise on every rank of ``group`` when the ranks' trees of this step differ (see the module doc)."""
    mine = _fingerprint(trees).to(_device(group))  # [3]
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    if any(not torch.equal(every[0], other) for other in every[1:]):
        sizes = [int(f[1]) for f in every]
        raise RuntimeError(
            f"tensor-parallel ranks drafted different trees this step (nodes per rank: {sizes}): {assistant} does "
            "not draft the same on every rank, so the ranks' verify forwards would differ. Every rank must draft "
            "from the same inputs alike: seed sampling the same on every rank, and set HF_SPECDEC_DRAFT_DTYPE "
            "(float32 or bfloat16) so that no rank picks a head's dtype from its own timings."
        )
