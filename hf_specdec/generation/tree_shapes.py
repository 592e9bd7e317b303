"""Static tree shapes: which ranked guesses at which depths a tree holds, chosen for a measured acceptance profile.

`optimal_tree_choices` is Sequoia's dynamic programme (Chen et al. 2024, "Sequoia: Scalable, Robust, and
Hardware-aware Speculative Decoding", arXiv:2402.12374) with depth-dependent acceptance: given the measured
probability ``acceptance[d][k]`` that the k-th ranked guess at depth d + 1 is accepted (its parent accepted), it
returns the tree of at most n nodes with the largest expected number of accepted tokens. Trees are Medusa choices
lists (paths of ranks, `DraftTree.from_choices` semantics). Used by the Medusa assistant's default tree and by the
tree tuners of ``training/``.
"""

from __future__ import annotations

from collections.abc import Sequence


def expected_accepted_tokens(choices: Sequence[Sequence[int]], acceptance: Sequence[Sequence[float]]) -> float:
    """E[accepted draft tokens] of a static tree: the sum over its nodes of the product of ``acceptance`` along the
    node's path (``acceptance[d][k]`` = P(the rank-k guess at depth d + 1 is accepted | its parent was))."""
    total = 0.0
    for path in {tuple(c) for c in choices}:
        p = 1.0
        for d, k in enumerate(path):
            p *= acceptance[d][k] if d < len(acceptance) and k < len(acceptance[d]) else 0.0
        total += p
    return total


def optimal_tree_choices(acceptance: Sequence[Sequence[float]], num_nodes: int) -> list[list[int]]:
    """The static tree of at most ``num_nodes`` nodes that maximises the expected number of accepted tokens.

    Sequoia's dynamic programme (arXiv:2402.12374, section 3.1), generalised to depth-dependent acceptance. With
    ``f(d, n)`` the best value of a subtree whose children sit at depth d + 1 and use at most n nodes, children are
    filled slot by slot (ranks in order of decreasing acceptance); giving slot k a subtree of m nodes is worth
    ``a[d][k] * (1 + f(d + 1, m - 1))``.

    Args:
        acceptance: ``acceptance[d][k]`` in [0, 1]: probability that the rank-k guess at depth d + 1 is accepted
            given its parent was. Rows may differ in length; the tree is at most ``len(acceptance)`` deep.
        num_nodes: node budget (the root is not counted).
    Returns:
        a Medusa choices list (paths of ranks), sorted by (length, path), every prefix included.
    """
    if num_nodes < 0:
        raise ValueError(f"num_nodes must be >= 0, got {num_nodes}")
    a = [[float(x) for x in row] for row in acceptance]
    for d, row in enumerate(a):
        for k, x in enumerate(row):
            if not 0.0 <= x <= 1.0:
                raise ValueError(f"acceptance[{d}][{k}] = {x} is not a probability")
    depth, n_max = len(a), num_nodes
    # slot order per depth: ranks by decreasing acceptance (ties: lower rank first); zero-acceptance ranks are useless
    slots = [[k for k in sorted(range(len(row)), key=lambda k, row=row: (-row[k], k)) if row[k] > 0] for row in a]
    f = [[0.0] * (n_max + 1) for _ in range(depth + 1)]  # f[depth] = 0: no head left
    # take[d][i][n] = nodes given to slot i (0 = slot unused) in the best use of n nodes by slots i.. at depth d
    take: list[list[list[int]]] = [[] for _ in range(depth)]
    for d in range(depth - 1, -1, -1):
        row, order = a[d], slots[d]
        h_next = [0.0] * (n_max + 1)  # value of slots i+1.. (starts as "no slot left")
        tables = []
        for i in range(len(order) - 1, -1, -1):
            p = row[order[i]]
            h = list(h_next)
            choice = [0] * (n_max + 1)
            for n in range(1, n_max + 1):
                for m in range(1, n + 1):
                    v = p * (1.0 + f[d + 1][m - 1]) + h_next[n - m]
                    if v > h[n] + 1e-15:
                        h[n], choice[n] = v, m
            tables.append(choice)
            h_next = h
        take[d] = tables[::-1]
        f[d] = h_next

    choices: list[list[int]] = []

    def build(d: int, n: int, prefix: list[int]) -> None:
        for i, rank in enumerate(slots[d] if d < depth else []):
            m = take[d][i][n]
            if m == 0:
                continue
            path = [*prefix, rank]
            choices.append(path)
            build(d + 1, m - 1, path)
            n -= m

    build(0, n_max, [])
    return sorted(choices, key=lambda c: (len(c), c))


def prior_acceptance(depth: int, ranks: int = 8) -> list[list[float]]:
    """A generic acceptance profile for untuned trees: top-1 acceptance 0.55 at depth 1 shrinking by 0.8 per level,
    each next rank 0.4 times as likely (the shape of the Medusa paper's head accuracies; measure yours and use
    `optimal_tree_choices` for a tree tuned to your heads and hardware)."""
    return [[0.55 * 0.8**d * 0.4**k for k in range(ranks)] for d in range(depth)]
