"""Losslessness of speculative sampling: the generated tokens follow the target distribution exactly.

Verifier level (no model): a toy target is a fixed random table context -> distribution over V = 5 tokens (fp64),
optionally masked like top-k / top-p warpers (-inf scores); a toy draft is a noisy copy of it. Speculative
generation of the first L = 3 tokens is simulated with `verify_tree` over trees built like the proposers build them
(sampled chain, deterministic top-k trees, sampled-without-replacement and i.i.d. siblings, duplicate siblings,
zero-probability children, leaves at several depths -> bonus tokens). The Monte-Carlo joint distribution of the first
1, 2 and 3 tokens is chi-squared against the exact enumeration (docs/algorithms.md, "Testing losslessness").

Power: with N = 4000 samples a bias of 0.03 on a cell of probability 0.2-0.3 is a 4.1-4.7 sigma effect, 0.035 a
5 sigma one (N = 25 p (1 - p) / delta^2 for 5 sigma); the negative controls (deliberately wrong verifiers, implemented here, not
in the package) must fail the same test with p < 1e-6.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable
from functools import cache

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from hf_specdec.generation.proposers.base import Proposer
from hf_specdec.generation.tree import DraftSampling, DraftTree
from hf_specdec.generation.verify import Verdict, verify_greedy, verify_tree
from hf_specdec.testing import torch_threads

V = 5
PROMPT = (3, 1)
L = 3  # joint distribution of the first L generated tokens
N_SAMPLES = 4000
N_NEGATIVE = 2500  # the wrong rules below are off by far more than 0.03 somewhere
P_PASS = 1e-4  # a correct verifier must not be rejected at this level ...
P_CATCH = 1e-6  # ... and a wrong one must be rejected at this one


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The rules run tiny per-row tensor ops: intra-op threads only add wake-up latency (badly so on a busy box)."""
    with torch_threads(1):
        yield


# ------------------------------------------------------------------------------------------------- toy models
def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


class ToyPair:
    """A toy target (fixed random logits per context, optionally masked) and a toy draft (a noisy copy).

    Args:
        mask: None, ``"top2"`` / ``"top3"`` (keep the k largest target logits) or ``"top_p"`` (keep the smallest
            set of most likely tokens with mass >= 0.7): the masked tokens get -inf scores, like the warpers.
        seed: table seed.
    """

    def __init__(self, mask: str | None = None, seed: int = 0):
        self.mask, self.seed = mask, seed

    @cache  # noqa: B019 (a handful of instances per test session)
    def target_logits(self, ctx: tuple[int, ...]) -> np.ndarray:
        """`[V]` float64 processed scores at ``ctx`` (-inf = masked)."""
        logits = np.random.default_rng([self.seed, 1, len(ctx), *ctx]).normal(0.0, 1.5, V)
        order = np.argsort(-logits)
        if self.mask in ("top2", "top3"):
            keep = order[: int(self.mask[-1])]
        elif self.mask == "top_p":
            cum = np.cumsum(_softmax(logits)[order])
            keep = order[: int(np.searchsorted(cum, 0.7)) + 1]
        else:
            keep = order
        out = np.full(V, -np.inf)
        out[keep] = logits[keep]
        return out

    @cache  # noqa: B019
    def target_scores(self, ctx: tuple[int, ...]) -> torch.Tensor:
        return torch.from_numpy(self.target_logits(ctx))

    @cache  # noqa: B019
    def p(self, ctx: tuple[int, ...]) -> np.ndarray:
        return _softmax(self.target_logits(ctx))

    @cache  # noqa: B019
    def q(self, ctx: tuple[int, ...]) -> np.ndarray:
        """`[V]` the draft's distribution: the unmasked target logits plus noise (so it drafts masked tokens too)."""
        raw = np.random.default_rng([self.seed, 1, len(ctx), *ctx]).normal(0.0, 1.5, V)
        noise = np.random.default_rng([self.seed, 2, len(ctx), *ctx]).normal(0.0, 1.0, V)
        return _softmax(raw + noise)

    def exact_joint(self, length: int) -> dict[tuple[int, ...], float]:
        """The target's distribution of the first ``length`` generated tokens, by enumeration."""
        out = {}
        for seq in itertools.product(range(V), repeat=length):
            prob, ctx = 1.0, PROMPT
            for tok in seq:
                prob *= self.p(ctx)[tok]
                ctx = ctx + (tok,)
            if prob > 0:
                out[seq] = prob
        return out


# ------------------------------------------------------------------------------------------------ tree builders
# A builder returns (tokens, parents, sampling, draft rows) for one step at context ctx; `draft rows` is None or the
# list of q rows per tree position (root first), as a proposer fills DraftTree.draft_probs.
Draft = tuple[list[int], list[int], DraftSampling, list[np.ndarray] | None]


def _top(q: np.ndarray, k: int) -> list[int]:
    return [int(i) for i in np.argsort(-q, kind="stable")[:k]]


def _without_replacement(q: np.ndarray, k: int, rng: np.random.Generator) -> list[int]:
    """k draws from q without replacement (Gumbel-top-k = successive sampling)."""
    keys = np.log(np.where(q > 0, q, 1e-300)) + rng.gumbel(size=q.shape)
    return [int(i) for i in np.argsort(-keys)[: min(k, int((q > 0).sum()))]]


def chain_sampled(toy: ToyPair, ctx, rng) -> Draft:
    """A draft model's chain: x1 ~ q(ctx), x2 ~ q(ctx + x1) (Leviathan/Chen)."""
    x1 = int(rng.choice(V, p=toy.q(ctx)))
    x2 = int(rng.choice(V, p=toy.q(ctx + (x1,))))
    rows = [toy.q(ctx), toy.q(ctx + (x1,)), np.full(V, 1.0 / V)]
    return [x1, x2], [-1, 0], DraftSampling.WITHOUT_REPLACEMENT, rows


def det_tree(toy: ToyPair, ctx, rng) -> Draft:
    """Top-k of the draft (Medusa/EAGLE-like): root -> top-2; the best child -> its top-2, the other is a leaf."""
    a, b = _top(toy.q(ctx), 2)
    c, d = _top(toy.q(ctx + (a,)), 2)
    return [a, b, c, d], [-1, -1, 0, 0], DraftSampling.DETERMINISTIC, None


def det_duplicates(toy: ToyPair, ctx, rng) -> Draft:
    """Duplicate siblings with different subtrees: root -> [a, a, b]; first a -> c, second a -> d."""
    a, b = _top(toy.q(ctx), 2)
    c, d = _top(toy.q(ctx + (a,)), 2)
    return [a, a, b, c, d], [-1, -1, -1, 0, 1], DraftSampling.DETERMINISTIC, None


def wor_tree(toy: ToyPair, ctx, rng) -> Draft:
    """Sequoia-like: 3 children of the root drawn without replacement, 2 under the first, 1 under the second."""
    kids = _without_replacement(toy.q(ctx), 3, rng)
    tokens, parents = list(kids), [-1] * len(kids)
    rows = [toy.q(ctx)] + [toy.q(ctx + (k,)) for k in kids]
    for i, n in zip(range(len(kids)), (2, 1)):
        grand = _without_replacement(toy.q(ctx + (kids[i],)), n, rng)
        tokens += grand
        parents += [i] * len(grand)
        rows += [np.full(V, 1.0 / V)] * len(grand)
    return tokens, parents, DraftSampling.WITHOUT_REPLACEMENT, rows


def iid_tree(toy: ToyPair, ctx, rng) -> Draft:
    """SpecInfer-like: 3 i.i.d. children of the root (duplicates kept as drawn), each with one i.i.d. child."""
    q0 = toy.q(ctx)
    kids = [int(k) for k in rng.choice(V, size=3, p=q0)]
    tokens, parents = list(kids), [-1] * 3
    rows = [q0] + [toy.q(ctx + (k,)) for k in kids]
    for i, k in enumerate(kids):
        tokens.append(int(rng.choice(V, p=toy.q(ctx + (k,)))))
        parents.append(i)
        rows.append(np.full(V, 1.0 / V))
    return tokens, parents, DraftSampling.IID, rows


BUILDERS: dict[str, Callable] = {f.__name__: f for f in (chain_sampled, det_tree, det_duplicates, wor_tree, iid_tree)}


# --------------------------------------------------------------------------------------------------- simulation
Verifier = Callable[[DraftTree, torch.Tensor, torch.Generator, ToyPair, list], object]


def real_verifier(tree, scores, generator, toy, node_ctx):
    return verify_tree(tree, scores, do_sample=True, generator=generator)


def _step_inputs(toy: ToyPair, ctx, draft: Draft, cache: dict) -> tuple[DraftTree, torch.Tensor, list]:
    """The DraftTree, the `[T + 1, V]` target scores at its positions and each position's context (memoised)."""
    tokens, parents, sampling, rows = draft
    key = (ctx, tuple(tokens), tuple(parents))
    if key not in cache:
        node_ctx = [ctx]
        for tok, par in zip(tokens, parents):
            node_ctx.append(node_ctx[par + 1] + (tok,))
        q = None if rows is None else torch.from_numpy(np.stack(rows))
        tree = DraftTree.from_parents(tokens, parents, sampling=sampling, draft_probs=q)
        scores = torch.stack([toy.target_scores(c) for c in node_ctx])
        cache[key] = (tree, scores, node_ctx)
    return cache[key]


def simulate(toy: ToyPair, builder: Callable, verifier: Verifier = real_verifier, n=N_SAMPLES, seed=0) -> Counter:
    """Counter of the first L tokens over n speculative generations from PROMPT."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    cache: dict = {}
    counts = Counter()
    for _ in range(n):
        ctx, out = PROMPT, []
        while len(out) < L:
            tree, scores, node_ctx = _step_inputs(toy, ctx, builder(toy, ctx, rng), cache)
            v = verifier(tree, scores, gen, toy, node_ctx)
            acc = v.accepted.tolist()
            new = [int(tree.tokens[i - 1]) for i in acc[1:]] + [v.next_token]
            out += new
            ctx = ctx + tuple(new)
        counts[tuple(out[:L])] += 1
    return counts


def chi_square_p_values(counts: Counter, exact_joint: Callable[[int], dict]) -> dict[int, float]:
    """p-values of the chi-square tests of the first 1, 2, ... tokens against the exact joint distributions.

    Args:
        counts: Counter of generated token tuples (all of the same length).
        exact_joint: ``length -> {token tuple: probability}`` (zero-probability tuples may be left out).
    """
    n = sum(counts.values())
    out = {}
    for length in range(1, len(next(iter(counts))) + 1):
        exact = exact_joint(length)
        observed = Counter()
        for seq, c in counts.items():
            observed[seq[:length]] += c
        if any(exact.get(seq, 0.0) == 0 for seq in observed):
            out[length] = 0.0  # a sequence of target probability 0 was generated
            continue
        big = [s for s, prob in exact.items() if prob * n >= 5]  # cells with >= 5 expected counts, the rest pooled
        small = [s for s in exact if s not in big]
        f_obs = [observed[s] for s in big] + ([sum(observed[s] for s in small)] if small else [])
        f_exp = [exact[s] * n for s in big] + ([sum(exact[s] for s in small) * n] if small else [])
        f_exp = np.asarray(f_exp) * (n / sum(f_exp))  # exact probabilities sum to 1 up to rounding
        out[length] = float(chisquare(f_obs, f_exp).pvalue)
    return out


def _describe(counts: Counter, exact_joint: Callable[[int], dict], length: int = 1) -> str:
    """Observed vs exact frequencies of the first ``length`` tokens, for failure messages."""
    n = sum(counts.values())
    exact = exact_joint(length)
    first = Counter()
    for seq, c in counts.items():
        first[seq[:length]] += c
    return ", ".join(f"{s}: {first[s] / n:.3f} vs {exact.get(s, 0.0):.3f}" for s in sorted(set(exact) | set(first)))


CASES = [  # (tree builder, target mask, table seed)
    ("chain_sampled", None, 0),
    ("chain_sampled", "top3", 0),
    ("det_tree", None, 0),
    ("det_tree", "top2", 0),  # the draft's top-k often hits masked tokens: zero-probability children
    ("det_duplicates", "top_p", 2),  # seed 2: both copies' subtrees are likely, a selection bias would show
    ("wor_tree", None, 0),
    ("wor_tree", "top_p", 0),
    ("iid_tree", None, 0),
    ("iid_tree", "top3", 0),
]


@pytest.mark.parametrize("builder,mask,seed", CASES, ids=[f"{b}-{m}" for b, m, _ in CASES])
def test_speculative_sampling_matches_the_target_distribution(builder, mask, seed):
    toy = ToyPair(mask, seed)
    counts = simulate(toy, BUILDERS[builder])
    p_values = chi_square_p_values(counts, toy.exact_joint)
    assert min(p_values.values()) > P_PASS, (
        f"{builder} with mask {mask}: chi-square p-values {p_values}; first token (observed vs exact): "
        f"{_describe(counts, toy.exact_joint)}"
    )


# ------------------------------------------------------------------------------------- negative controls
def wrong_ratio_with_draft_softmax(tree, scores, generator, toy, node_ctx):
    """The known bug: deterministic top-k children verified with min(1, p/q), q = the draft's softmax."""
    q = torch.from_numpy(np.stack([toy.q(c) for c in node_ctx]))
    as_sampled = DraftTree(tree.tokens, tree.parent, tree.depth, DraftSampling.WITHOUT_REPLACEMENT, q)
    return verify_tree(as_sampled, scores, do_sample=True, generator=generator)


def wrong_correction_from_p(tree, scores, generator, toy, node_ctx):
    """Chain rule with the correction drawn from p instead of norm(max(0, p - q))."""
    accepted, pos = [0], 0
    while True:
        p = torch.softmax(scores[pos], -1)
        kids = (tree.parent == pos - 1).nonzero().flatten().tolist()
        if not kids:
            break
        x = int(tree.tokens[kids[0]])
        q = tree.draft_probs[pos]
        if float(torch.rand((), dtype=torch.float64, generator=generator)) >= min(1.0, float(p[x] / q[x])):
            break
        pos = kids[0] + 1
        accepted.append(pos)
    token = int(torch.multinomial(torch.softmax(scores[pos], -1), 1, generator=generator))
    return Verdict(torch.tensor(accepted), token)


def wrong_deepest_match(tree, scores, generator, toy, node_ctx):
    """Vectorised 'sampled greedy': draw y ~ p at every position, accept matching nodes, keep the deepest path.

    Exact without duplicate siblings; with them it picks whichever copy's subtree matched (selection bias).
    """
    y = torch.multinomial(torch.softmax(scores, -1), 1, generator=generator).squeeze(1)  # [T + 1]
    onehot = torch.full_like(scores, -torch.inf).scatter(1, y[:, None], 0.0)
    return verify_greedy(tree, onehot)


NEGATIVE = [
    ("det_tree", None, 0, wrong_ratio_with_draft_softmax),
    ("chain_sampled", None, 0, wrong_correction_from_p),
    ("det_duplicates", "top_p", 2, wrong_deepest_match),
]


@pytest.mark.parametrize("builder,mask,seed,verifier", NEGATIVE, ids=[v.__name__ for *_, v in NEGATIVE])
def test_a_wrong_verifier_is_caught(builder, mask, seed, verifier):
    toy = ToyPair(mask, seed)
    counts = simulate(toy, BUILDERS[builder], verifier, n=N_NEGATIVE)
    p_values = chi_square_p_values(counts, toy.exact_joint)
    assert min(p_values.values()) < P_CATCH, f"{verifier.__name__} was not caught: p-values {p_values}"


def test_the_known_bug_gives_five_ninths():
    """docs/algorithms.md: q = (0.9, 0.1), p = (0.5, 0.5), deterministic child A: the buggy ratio rule accepts A with 5/9."""
    p = torch.tensor([0.5, 0.5], dtype=torch.float64).log()
    tree = DraftTree.chain([0], draft_probs=torch.tensor([[0.9, 0.1], [0.5, 0.5]], dtype=torch.float64))
    scores = torch.stack([p, p])
    n = 4000
    gen = torch.Generator().manual_seed(0)
    right = sum(verify_tree(tree, scores, do_sample=True, generator=gen).num_accepted for _ in range(n)) / n
    bug = DraftTree(tree.tokens, tree.parent, tree.depth, DraftSampling.WITHOUT_REPLACEMENT, tree.draft_probs)
    wrong = sum(verify_tree(bug, scores, do_sample=True, generator=gen).num_accepted for _ in range(n)) / n
    sigma = math.sqrt(0.25 / n)
    assert abs(right - 0.5) < 5 * sigma and abs(wrong - 5 / 9) < 5 * sigma, (right, wrong)


# ============================================================================================ end to end, tiny model
# `model.generate(ids, assistant=X, do_sample=True, ...)` on a tiny Llama with V = 8, batched over many identical
# prompts in one call; the exact distribution of the first 3 generated tokens is enumerated in fp64 from the scores
# vanilla `generate` itself computes (its own temperature / top-k / top-p warpers) for every context.
E2E_V = 8
E2E_PROMPT = [1, 5, 3, 6]
E2E_ROWS = 3000  # 5 sigma on a cell of probability 0.3 at N = 3000: a bias of 0.042
E2E_CONFIGS = {
    "temperature_top_k": dict(temperature=0.8, top_k=4),
    "top_p": dict(top_p=0.85),
}


@pytest.fixture(scope="module")
def e2e_model():
    from hf_specdec.testing import tiny_causal_lm

    model = tiny_causal_lm(vocab_size=E2E_V, hidden_size=32, num_layers=2, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)  # peaked (top token ~0.6) but not degenerate next-token distributions
    return model


def _vanilla_scores(model, contexts: list[tuple[int, ...]], warpers: dict) -> dict[tuple[int, ...], np.ndarray]:
    """Vanilla `generate`'s processed scores (output_scores) for the next token after each context (equal lengths)."""
    ids = torch.tensor([list(c) for c in contexts])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        max_new_tokens=1,
        output_scores=True,
        return_dict_in_generate=True,
        **warpers,
    )
    return {c: out.scores[0][i].to(torch.float64).numpy() for i, c in enumerate(contexts)}


class ExactTarget:
    """The target's distribution of the first 3 generated tokens, enumerated in fp64 (EOS ends a row: pad after)."""

    def __init__(self, model, warpers: dict):
        self.eos = int(model.generation_config.eos_token_id)
        self.pad = int(model.generation_config.pad_token_id)
        prompt = tuple(E2E_PROMPT)
        firsts = [prompt + (a,) for a in range(E2E_V) if a != self.eos]
        seconds = [c + (b,) for c in firsts for b in range(E2E_V) if b != self.eos]
        scores = {}
        for contexts in ([prompt], firsts, seconds):
            scores.update(_vanilla_scores(model, contexts, warpers))
        self.p = {c: _softmax(s) for c, s in scores.items()}  # generated-prefix context -> [V] fp64

    def next_probs(self, generated: tuple[int, ...]) -> np.ndarray | None:
        return self.p.get(tuple(E2E_PROMPT) + generated)

    def joint(self, length: int) -> dict[tuple[int, ...], float]:
        out: dict[tuple[int, ...], float] = {}

        def walk(prefix: tuple[int, ...], prob: float) -> None:
            if len(prefix) == length:
                out[prefix] = out.get(prefix, 0.0) + prob
            elif self.eos in prefix:
                walk(prefix + (self.pad,), prob)  # the row stopped at EOS: vanilla pads it
            else:
                for tok, p_tok in enumerate(self.next_probs(prefix)):
                    if p_tok > 0:
                        walk(prefix + (tok,), prob * p_tok)

        walk((), 1.0)
        return out


class RankedTreeProposer(Proposer):
    """Deterministic trees from the target's own ranking (so drafts are often accepted), with the awkward cases.

    Under the root: [r0, r0 (duplicate sibling), r6 (masked by top-k / top-p: a zero-probability child)]; when two
    levels fit: under the first r0 its r0, under the duplicate its r1 (a different subtree: a verifier that picked
    whichever copy's subtree matched would over-produce r1 there).
    """

    sampling = DraftSampling.DETERMINISTIC

    def __init__(self, exact: ExactTarget):
        self.exact = exact

    def _ranked(self, generated: tuple[int, ...]) -> list[int]:
        p = self.exact.next_probs(generated)
        if p is None:  # deeper than the table: any fixed ranking will do
            return [(generated[-1] + i) % E2E_V for i in range(E2E_V)]
        return [int(i) for i in np.argsort(-p, kind="stable")]

    def propose(self, rows):
        trees = []
        for row in rows:
            if row.max_depth == 0:
                trees.append(DraftTree.empty())
                continue
            gen = tuple(row.tokens[row.prompt_len :].tolist())
            r = self._ranked(gen)
            tokens, parents = [r[0], r[0], r[6]], [-1, -1, -1]
            if row.max_depth >= 2:
                below = self._ranked(gen + (r[0],))
                tokens += [below[0], below[1]]
                parents += [0, 1]
            trees.append(DraftTree.from_parents(tokens, parents))
        return trees


class SampledChainProposer(Proposer):
    """A draft model's chain: x1 ~ q(ctx), x2 ~ q(ctx + x1), q = mix * the target's p + (1 - mix) * a random table."""

    sampling = DraftSampling.WITHOUT_REPLACEMENT

    def __init__(self, exact: ExactTarget, seed: int = 0, mix: float = 0.5):
        self.exact, self.mix = exact, mix
        self.rng = np.random.default_rng(seed)

    def q(self, generated: tuple[int, ...]) -> np.ndarray:
        noise = _softmax(np.random.default_rng([7, len(generated), *generated]).normal(0.0, 1.5, E2E_V))
        p = self.exact.next_probs(generated)
        return noise if p is None else self.mix * p + (1.0 - self.mix) * noise

    def propose(self, rows):
        trees = []
        for row in rows:
            gen = tuple(row.tokens[row.prompt_len :].tolist())
            tokens, rows_q = [], []
            for _ in range(min(row.max_depth, 2)):
                q = self.q(gen + tuple(tokens))
                rows_q.append(q)
                tokens.append(int(self.rng.choice(E2E_V, p=q)))
            if not tokens:
                trees.append(DraftTree.empty())
                continue
            draft_probs = torch.from_numpy(np.stack(rows_q + [np.full(E2E_V, 1.0 / E2E_V)]))
            trees.append(DraftTree.chain(tokens, sampling=self.sampling, draft_probs=draft_probs))
        return trees


E2E_CASES = [
    ("ranked_tree", "temperature_top_k"),
    ("sampled_chain", "top_p"),
]


def _generate_first_tokens(
    model, assistant, warpers: dict, rows: int, pad: int, tree_budget=False, min_depth2: float = 0.05
) -> Counter:
    """Counter of the first 3 generated tokens of ``rows`` identical prompts, in one speculative generate call (the
    trees verified as proposed unless a ``tree_budget`` is given)."""
    import hf_specdec  # noqa: F401  (routes generate(assistant=...))

    ids = torch.tensor([E2E_PROMPT] * rows)
    torch.manual_seed(0)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        assistant=assistant,
        do_sample=True,
        max_new_tokens=4,
        return_dict_in_generate=True,
        tree_budget=tree_budget,
        **warpers,
    )
    stats = out.spec_stats
    depth2 = stats.accepted_per_depth[1] if len(stats.accepted_per_depth) > 1 else 0
    assert depth2 > min_depth2 * rows, f"the test is vacuous if two-token drafts are never accepted: {stats}"
    gen = out.sequences[:, len(E2E_PROMPT) :]
    gen = torch.cat([gen, torch.full((rows, 3), pad, dtype=torch.long)], dim=1)[:, :3]  # rows that stopped: pad
    return Counter(tuple(r) for r in gen.tolist())


def _make_assistant(name: str, exact: ExactTarget) -> Proposer:
    return RankedTreeProposer(exact) if name == "ranked_tree" else SampledChainProposer(exact)


@pytest.mark.parametrize("proposer,config", E2E_CASES, ids=[f"{p}-{c}" for p, c in E2E_CASES])
def test_generate_with_assistant_samples_the_target_distribution(e2e_model, proposer, config):
    warpers = E2E_CONFIGS[config]
    exact = ExactTarget(e2e_model, warpers)
    counts = _generate_first_tokens(e2e_model, _make_assistant(proposer, exact), warpers, E2E_ROWS, exact.pad)
    p_values = chi_square_p_values(counts, exact.joint)
    assert min(p_values.values()) > P_PASS, (
        f"{proposer} with {warpers}: chi-square p-values {p_values}; first two tokens (observed vs exact): "
        f"{_describe(counts, exact.joint, 2)}"
    )


def test_generate_with_a_wrong_verifier_is_caught(e2e_model, monkeypatch):
    """The end-to-end harness has the power to see a wrong rule: the loop's verifier swapped for a biased one."""
    import hf_specdec.generation.loop as loop

    gen = torch.Generator().manual_seed(1)
    monkeypatch.setattr(
        loop, "verify_tree", lambda tree, scores, **kw: wrong_correction_from_p(tree, scores, gen, None, None)
    )
    warpers = E2E_CONFIGS["top_p"]
    exact = ExactTarget(e2e_model, warpers)
    # a poor draft (q unrelated to p) rejects often, so the wrong correction shows with half the rows
    counts = _generate_first_tokens(e2e_model, SampledChainProposer(exact, mix=0.0), warpers, E2E_ROWS // 2, exact.pad)
    p_values = chi_square_p_values(counts, exact.joint)
    assert min(p_values.values()) < P_CATCH, f"wrong_correction_from_p was not caught end to end: p-values {p_values}"


class _WhereLastTokenIsEven(Proposer):
    """Drafts with ``inner`` only where the row's last token is even (a function of the context), else nothing."""

    def __init__(self, inner: Proposer):
        self.inner = inner

    def propose(self, rows):
        trees = self.inner.propose(rows)
        return [t if int(r.tokens[-1]) % 2 == 0 else DraftTree.empty() for t, r in zip(trees, rows)]


def test_fallback_assistant_mixing_draft_rules_samples_the_target_distribution(e2e_model):
    """`FallbackAssistant`: per row and step, a deterministic tree or a sampled chain, in one batch: still exact."""
    from hf_specdec import FallbackAssistant

    warpers = E2E_CONFIGS["top_p"]
    exact = ExactTarget(e2e_model, warpers)
    assistant = FallbackAssistant(_WhereLastTokenIsEven(RankedTreeProposer(exact)), SampledChainProposer(exact))
    counts = _generate_first_tokens(e2e_model, assistant, warpers, E2E_ROWS, exact.pad)
    p_values = chi_square_p_values(counts, exact.joint)
    assert min(p_values.values()) > P_PASS, (
        f"fallback with {warpers}: chi-square p-values {p_values}; first two tokens (observed vs exact): "
        f"{_describe(counts, exact.joint, 2)}"
    )
