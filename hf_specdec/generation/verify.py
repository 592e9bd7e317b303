"""Verification of draft trees against the target: which nodes are accepted, and the next root token.

One module for every rule (docs/algorithms.md). Inputs are per row: the `DraftTree` and the target's processed scores at
every tree position (after the same logits processors vanilla `generate` applies, each node with its own context).
The loop calls `verify_tree` for every row; it dispatches on ``do_sample``, ``acceptance`` and ``tree.sampling``:

- greedy (``do_sample=False``): `verify_greedy`, the target's argmax path.
- exact sampling (``acceptance="exact"``), lossless: the emitted tokens are distributed exactly as vanilla sampling
  from the target, whatever the draft proposed.
    - `DraftSampling.DETERMINISTIC` children (top-k / n-gram / Medusa / static trees): residual accept-and-remove,
      equivalent to drawing y ~ p and taking the first child equal to y (one categorical draw per level).
    - `DraftSampling.WITHOUT_REPLACEMENT` children: recursive rejection sampling (Sequoia, Chen et al. 2024;
      Jeon et al. 2024, "Recursive Speculative Decoding"). A chain with a sampled draft is its one-child case,
      i.e. Leviathan et al. 2023 / Chen et al. 2023 speculative sampling.
    - `DraftSampling.IID` children: SpecInfer's multi-step speculative sampling (Miao et al. 2024).
- typical acceptance (``acceptance="typical"``, Medusa, Cai et al. 2024): lossy, opt-in, see `verify_typical`.

Random draws take an optional ``torch.Generator`` (a fixed seed reproduces the verdicts); categorical draws use the
exponential race (``argmax p / E``, ``E ~ Exp(1)``): exact, one vectorised pass over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import DraftSampling, DraftTree

ACCEPTANCE_RULES = ("exact", "typical")

# The unnormalised residual's mass M after some rejections is the probability of those rejections (the rejection
# probability of a child is the mass of max(0, R - D)). Below this, the residual is rounding noise and the branch is
# reached with probability < 1e-12: the correction is then drawn from p instead.
_RESIDUAL_EPS = 1e-12
_TINY = 1e-300


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
    match = torch.cat(
        [torch.ones(1, dtype=torch.bool, device=best.device), tree.tokens.to(best.device) == best[pos_parent]]
    )
    anc = tree.ancestor_mask().to(best.device)  # [T + 1, T + 1]
    ok = ~(anc & ~match[None, :]).any(dim=-1)  # position accepted iff every ancestor-or-self matches
    depth = torch.cat([torch.zeros(1, dtype=torch.long, device=best.device), tree.depth.to(best.device)])
    deepest = int(torch.where(ok, depth, torch.full_like(depth, -1)).argmax())
    accepted = anc[deepest].nonzero().flatten()  # ancestors of the deepest accepted node, in position order
    return Verdict(accepted, int(best[deepest]))


def verify_tree(
    tree: DraftTree,
    scores: torch.Tensor,
    *,
    do_sample: bool,
    generator: torch.Generator | None = None,
    acceptance: str = "exact",
    typical_epsilon: float = 0.09,
    typical_delta: float = 0.3,
) -> Verdict:
    """Verify one row's draft tree: the accepted path and the next root token.

    Args:
        tree: the row's draft tree; ``tree.sampling`` says how its children were chosen and, for sampled drafts,
            ``tree.draft_probs`` `[T + 1, V]` holds the draft distribution q each position's children came from.
        scores: `[T + 1, V]` the target's processed scores (after every logits processor and warper, masked tokens
            at -inf) at the root (position 0) and at every node (position ``i + 1``).
        do_sample: False -> greedy (`verify_greedy`, whatever ``acceptance`` says); True -> sampling.
        generator: torch.Generator for every random draw (a fixed seed reproduces the verdict).
        acceptance: ``"exact"`` (lossless rejection sampling) or ``"typical"`` (Medusa's typical acceptance,
            lossy: the output does *not* follow the target distribution).
        typical_epsilon / typical_delta: the typical-acceptance threshold ``min(epsilon, delta * exp(-H(p)))``.

    Returns:
        `Verdict` with the accepted tree positions (root first) and the next token.
    """
    if acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"acceptance={acceptance!r} is not a verification rule; use one of {ACCEPTANCE_RULES}")
    if scores.dim() != 2 or scores.shape[0] != tree.num_nodes + 1:
        raise ValueError(
            f"scores must be [T + 1, V] = [{tree.num_nodes + 1}, V] for a tree of {tree.num_nodes} nodes, "
            f"got {list(scores.shape)}"
        )
    if not do_sample:
        return verify_greedy(tree, scores)
    if acceptance == "typical":
        return verify_typical(tree, scores, generator=generator, epsilon=typical_epsilon, delta=typical_delta)
    return verify_exact(tree, scores, generator=generator)


# ----------------------------------------------------------------------------------------------- exact sampling
def verify_exact(tree: DraftTree, scores: torch.Tensor, *, generator: torch.Generator | None = None) -> Verdict:
    """Lossless speculative sampling on a tree (rule chosen by ``tree.sampling``, see the module docstring).

    Walks from the root one level at a time: at the current position the children are tested against the target
    distribution p there (deterministic children: one categorical draw and one host sync per level; sampled
    children: one sync per child tested, stopping at the first accepted); an accepted child becomes the current
    position; when no child is accepted, or the position is a leaf, the next token is drawn from the
    residual (from p itself at a leaf: the bonus token). Ancestor rejections never look at a subtree, so an accepted
    child's subtree is verified with that child's own p and q rows.

    Edge cases, all exact: duplicate siblings (the deterministic rule gives a duplicate residual mass 0 after its
    first rejection; the sampled rules treat every sibling as its own draw, which is what they were), children of
    target probability 0 (never accepted), a sampled child with draft probability q(x) = 0 (it cannot have been
    drawn from q, so it is skipped as if absent, leaving R and D untouched), a residual of ~zero mass after a rejection
    (reached with ~zero probability; the correction is then drawn from p, never from rounding noise).

    Args:
        tree: the row's draft tree.
        scores: `[T + 1, V]` processed target scores.
        generator: optional torch.Generator.

    Raises:
        ValueError: a sampled tree without ``draft_probs`` `[T + 1, V]`, or a visited position whose scores mask
            every token (vanilla sampling fails there too).
    """
    device = scores.device
    sampled = tree.sampling != DraftSampling.DETERMINISTIC
    if sampled and tree.num_nodes and tree.draft_probs is None:
        raise ValueError(
            f"a {tree.sampling.value} draft tree needs draft_probs ([T + 1, V] draft distribution per position) for "
            "exact sampling; the proposer must fill DraftTree.draft_probs when do_sample=True"
        )
    if sampled and tree.num_nodes and tuple(tree.draft_probs.shape) != tuple(scores.shape):
        raise ValueError(
            f"draft_probs has shape {list(tree.draft_probs.shape)} but the target's scores are {list(scores.shape)}: "
            "a sampled tree needs one draft distribution over the target's vocabulary per tree position"
        )
    tokens, parents = torch.stack([tree.tokens, tree.parent]).tolist() if tree.num_nodes else ([], [])
    children: list[list[int]] = [[] for _ in range(tree.num_nodes + 1)]  # tree positions
    for i, par in enumerate(parents):
        children[par + 1].append(i + 1)
    samplable = torch.isfinite(scores.amax(dim=-1)).tolist()  # [T + 1] one sync for the whole tree

    accepted = [0]
    pos = 0
    while True:
        if not samplable[pos]:
            raise _all_masked_error(pos)
        p = torch.softmax(scores[pos].to(torch.float64), dim=-1)  # [V] target distribution, -inf -> 0
        kids = children[pos]
        if not kids:  # leaf (or empty tree): bonus token from p
            next_token = int(_categorical(p, generator))
            break
        kid_tokens = [tokens[k - 1] for k in kids]
        if sampled:
            q = tree.draft_probs[pos].to(device=device, dtype=torch.float64)
            first, token = _sampled_level(
                p,
                q,
                kid_tokens,
                without_replacement=tree.sampling == DraftSampling.WITHOUT_REPLACEMENT,
                generator=generator,
            )
        else:
            first, token = _deterministic_level(p, kid_tokens, generator)
        if first < 0:
            next_token = token
            break
        pos = kids[first]
        accepted.append(pos)
    return Verdict(torch.tensor(accepted, dtype=torch.long, device=device), next_token)


def _deterministic_level(p: torch.Tensor, kid_tokens: list[int], generator) -> tuple[int, int]:
    """(index of the accepted child or -1, the token drawn): y ~ p, the first child equal to y is accepted.

    Same law as residual accept-and-remove (R := p; child x accepted w.p. R(x); on rejection R(x) := 0, renormalise;
    none accepted -> next ~ R): both pick child x with probability p(x) (its first occurrence; a duplicate sibling's
    residual is 0 after the first rejection) and otherwise a token y outside the children with probability p(y).
    """
    y = int(_categorical(p, generator))
    first = kid_tokens.index(y) if y in kid_tokens else -1
    return first, y


def _sampled_level(
    p: torch.Tensor, q: torch.Tensor, kid_tokens: list[int], *, without_replacement: bool, generator
) -> tuple[int, int]:
    """(index of the accepted child or -1, the correction token) for children drawn from q.

    R := p, D := q. Child x: accepted with probability min(1, R(x) / D(x)); on rejection R := norm(max(0, R - D))
    (with D before x is removed), then, without replacement, D(x) := 0 and D := norm(D). None accepted -> the
    correction token is drawn from R.

    Children are tested one at a time and the level stops at the first acceptance (usually the first child), so a
    level costs one host sync per tested child and no residual is built that is not needed. R and D are kept
    unnormalised: R = U / M with M = sum(U), D = Q / s with s = sum(Q). A child with D(x) = 0 cannot have been drawn
    from D: it is skipped as if absent (acceptance probability 0, R and D unchanged), which keeps the rule exact for
    the other children; without replacement a repeated sibling has D(x) = 0 by construction.
    """
    u = _uniform((len(kid_tokens),), p.device, generator)  # [k] one uniform per child
    U, M = p, p.new_ones(())  # [V], scalar
    Q = q.clamp(min=0)  # [V], a fresh tensor: updated in place below
    s = Q.sum()
    uniforms: list[float] = []
    for i, x in enumerate(kid_tokens):
        head = torch.stack([U[x], Q[x], M, s])  # R(x) = r / m, D(x) = d / tot
        if i == 0:  # the uniforms come back with the first child's numbers: one sync
            vals = torch.cat([head, u]).tolist()
            (r, d, m, tot), uniforms = vals[:4], vals[4:]
        else:
            r, d, m, tot = head.tolist()
        if d <= 0:  # not drawable from D (or, without replacement, a sibling already removed): skip
            continue
        if uniforms[i] * m * d < r * tot:  # u < min(1, (r / m) / (d / tot)), as u < 1
            return i, -1
        U = (U - (m / tot) * Q).clamp(min=0)  # M * max(0, R - D)
        M = U.sum()
        if without_replacement:
            Q[x] = 0
            s = Q.sum()
    # A residual of ~zero mass is only reached through rejections of ~zero probability (the rejection probability
    # is that mass): draw from p there rather than from numerical noise.
    return -1, int(_categorical(torch.where(M > _RESIDUAL_EPS, U, p), generator))


# --------------------------------------------------------------------------------------------- typical acceptance
def verify_typical(
    tree: DraftTree,
    scores: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
    epsilon: float = 0.09,
    delta: float = 0.3,
) -> Verdict:
    """Medusa's typical acceptance (Cai et al. 2024). LOSSY: the output does NOT follow the target distribution.

    A node x with parent position a passes if ``p_a(x) > min(epsilon, delta * exp(-H(p_a)))`` (H = entropy of the
    target distribution at a; Medusa's ``posterior_threshold`` / ``posterior_alpha``). A node is accepted if it and
    all its ancestors pass. Of the accepted nodes the deepest wins; among equally deep ones the path with the larger
    sum of log p (Medusa's tie-break). The next token is sampled from the full target distribution p at the last
    accepted node, so the correction/bonus token itself is an ordinary sample given the accepted prefix (Medusa's
    reference code instead samples it from p truncated to the same typical set; we keep plain p). The acceptance
    itself favours high-probability drafts, which is where the distribution shifts.

    Args:
        tree: the row's draft tree (``sampling`` and ``draft_probs`` are not used).
        scores: `[T + 1, V]` processed target scores.
        generator: optional torch.Generator for the next-token draw.
        epsilon: hard threshold (default 0.09).
        delta: entropy-scaled threshold factor (default 0.3).
    """
    device = scores.device
    logp = torch.log_softmax(scores.to(torch.float64), dim=-1)  # [T + 1, V]
    probs = logp.exp()
    entropy = -torch.special.xlogy(probs, probs).sum(-1)  # [T + 1]
    threshold = torch.clamp(delta * torch.exp(-entropy), max=epsilon)  # [T + 1]
    par = tree.position_parents().to(device)  # [T]
    tok = tree.tokens.to(device)  # [T]
    node_logp = logp[par, tok]  # [T]
    passes = torch.cat([torch.ones(1, dtype=torch.bool, device=device), node_logp.exp() > threshold[par]])  # [T + 1]
    anc = tree.ancestor_mask().to(device)  # [T + 1, T + 1]
    ok = ~(anc & ~passes[None, :]).any(dim=-1)  # [T + 1] every ancestor-or-self passes
    path_logp = torch.where(anc, torch.cat([node_logp.new_zeros(1), node_logp])[None, :], 0.0).sum(-1)  # [T + 1]
    depth = torch.cat([torch.zeros(1, dtype=torch.long, device=device), tree.depth.to(device)])
    deepest = torch.where(ok, depth, -1).max()
    best = torch.where(ok & (depth == deepest), path_logp, -torch.inf).argmax()  # root: depth 0, path_logp 0
    valid = torch.isfinite(scores.amax(dim=-1))[best]
    y = _categorical(torch.where(valid, probs[best], 1.0), generator)
    best, y, valid = torch.stack([best, y, valid.to(torch.long)]).tolist()
    if not valid:
        raise _all_masked_error(best)
    return Verdict(anc[best].nonzero().flatten(), y)


# ------------------------------------------------------------------------------------------------------- helpers
def sample_from_scores(scores: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """`[B]` tokens drawn from softmax(scores) `[B, V]`, exactly as vanilla `generate` samples.

    Uses ``torch.multinomial(softmax(scores.float()), 1)`` like transformers' sampling step, so with the global RNG
    (``generator=None``) and the same seed it reproduces vanilla's draw for the same scores.
    """
    probs = torch.softmax(scores.float(), dim=-1)  # [B, V]
    if not bool(torch.isfinite(scores.amax(dim=-1)).all()):
        bad = (~torch.isfinite(scores.amax(dim=-1))).nonzero().flatten().tolist()
        raise ValueError(
            f"cannot sample rows {bad}: their scores mask every token (all -inf) or contain NaN/+inf; check the "
            "logits processors (vanilla sampling fails on such rows too)"
        )
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def _all_masked_error(pos: int) -> ValueError:
    return ValueError(
        f"the target's processed scores at tree position {pos} mask every token (all -inf) or contain NaN/+inf, so "
        "there is nothing to sample (vanilla sampling fails here too); check the logits processors and warpers"
    )


def _uniform(shape, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """float64 uniforms in [0, 1), drawn on the generator's device."""
    gen_device = generator.device if generator is not None else device
    return torch.rand(shape, dtype=torch.float64, device=gen_device, generator=generator).to(device)


def _categorical(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """`[...]` int64 draws from the distributions `[..., V]` (non-negative, need not be normalised).

    Exponential race: argmax_v probs[v] / E[v] with E ~ Exp(1) i.i.d. picks v with probability probs[v] / sum(probs)
    (the Gumbel-max trick in another guise); one vectorised pass, no host sync.
    """
    gen_device = generator.device if generator is not None else probs.device
    e = torch.empty(probs.shape, dtype=torch.float64, device=gen_device).exponential_(generator=generator)
    return (probs / e.to(probs.device).clamp(min=_TINY)).argmax(dim=-1)
