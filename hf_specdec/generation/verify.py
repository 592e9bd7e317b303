"""Verification of draft trees against the target: which nodes are accepted, and the next root token.

One module for every rule (ALGORITHMS.md). Inputs are per row: the `DraftTree` and the target's processed scores at
every tree position (after the same logits processors vanilla `generate` applies, each node with its own context).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import DraftTree


@dataclass
class Verdict:
    """Outcome of verifying one row's tree.

    Attributes:
        accepted: `[1 + a]` int64 accepted tree positions, root (0) first, parents before children.
        next_token: the token that follows the last accepted position (correction or bonus token).
    """

    accepted: torch.Tensor
    next_token: int

    @property
    def num_accepted(self) -> int:
        """Accepted draft nodes (the root does not count)."""
        return int(self.accepted.numel()) - 1


def verify_greedy(tree: DraftTree, scores: torch.Tensor) -> Verdict:
    """Greedy acceptance: a node is accepted iff it and all its ancestors equal the target's argmax at their parent.

    Args:
        tree: the row's draft tree (siblings carry distinct tokens, so at most one child per node can match).
        scores: `[T + 1, V]` processed target scores at the root and every node.
    """
    best = scores.argmax(dim=-1)  # [T + 1]
    if tree.num_nodes == 0:
        return Verdict(torch.zeros(1, dtype=torch.long, device=scores.device), int(best[0]))
    pos_parent = tree.position_parents().to(best.device)  # [T]
    match = torch.cat([torch.ones(1, dtype=torch.bool, device=best.device), tree.tokens.to(best.device) == best[pos_parent]])
    anc = tree.ancestor_mask().to(best.device)  # [T + 1, T + 1]
    ok = ~(anc & ~match[None, :]).any(dim=-1)  # position accepted iff every ancestor-or-self matches
    depth = torch.cat([torch.zeros(1, dtype=torch.long, device=best.device), tree.depth.to(best.device)])
    deepest = int(torch.where(ok, depth, torch.full_like(depth, -1)).argmax())
    accepted = anc[deepest].nonzero().flatten()  # ancestors of the deepest accepted node, in position order
    return Verdict(accepted, int(best[deepest]))


def verify_tree(tree: DraftTree, scores: torch.Tensor, *, do_sample: bool, generator=None, **kwargs) -> Verdict:
    """Entry point of the loop (greedy only until exact sampling lands)."""
    if do_sample:
        raise NotImplementedError("do_sample=True with an assistant: exact tree sampling is not implemented yet")
    return verify_greedy(tree, scores)


def sample_from_scores(scores: torch.Tensor, generator=None) -> torch.Tensor:
    """`[B]` tokens drawn from softmax(scores) `[B, V]`."""
    return torch.multinomial(torch.softmax(scores.float(), dim=-1), 1, generator=generator).squeeze(1)
