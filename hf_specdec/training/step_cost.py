"""What one speculative step costs on this machine, relative to one plain decoding forward.

Tree sizing (Sequoia-style: the tree with the best ``tau(n) / cost(n)``) needs ``cost(n)``: the time of verifying an
``n``-node tree (plus drafting the next one) over the time of a plain one-token forward. `verify_cost_curve` times
the target's forward over a random ``n``-node tree above a committed context, through the hf_specdec backend (as the
speculative loop runs it) and optionally through transformers' ``sdpa``; `step_cost_curve` turns it into the
relative cost table the tuners use. The GPU kernel benchmark (``hf_specdec.bench.kernels``)
reports the same curve on real-shape models.

    cost = step_cost_curve(model, sizes=(1, 4, 16), draft_step=lambda: heads.topk_tokens(hidden, 8))
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache

from ..cache.model_arg import cache_kwarg
from ..generation.target import PlannedModel
from ..generation.tree import DraftTree

Timer = Callable[[Callable[[], object]], float]  # runs a call, returns its time in µs


def cpu_timer(repeats: int) -> Timer:
    """A `Timer`: one warm-up call, then the median wall-clock time (µs) of ``repeats`` calls."""

    def timer(fn: Callable[[], object]) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    return timer


def random_tree_mask(nodes: int, gen: torch.Generator) -> torch.Tensor:
    """`[nodes, nodes]` ancestor mask of a random tree: a root and ``nodes - 1`` drafts, each under an earlier one."""
    parent = [int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(nodes - 1)]
    return DraftTree.from_parents(torch.zeros(nodes - 1, dtype=torch.long), parent).ancestor_mask()  # [n, n]


def _hf_specdec_curve(
    model, prompt: torch.Tensor, trees: dict, timer: Timer, after, attention: str | None = None
) -> tuple[dict, torch.Tensor]:
    """Times of verifying each of ``trees`` (``n -> ([n, n] mask, [n] ids)``) over ``prompt`` `[L]` with the
    hf_specdec backend, and the logits `[n_max, V]` of the last tree."""
    device, context = prompt.device, prompt.numel()
    with PlannedModel(model, backend=attention) as target:
        (row,) = target.add_rows(1)
        target.forward([row], prompt, torch.arange(context, device=device), [context])
        target.commit_chunks([row], [context])
        curve = {}
        for n, (mask, ids) in trees.items():
            positions = (context + mask.sum(1) - 1).to(device)  # [n] the root's position + each node's depth

            def verify(mask=mask, ids=ids, positions=positions):
                out = target.forward([row], ids, positions, [ids.numel()], [mask])  # not committed
                if after is not None:
                    after()
                return out

            curve[n] = timer(verify)
        return curve, verify().logits.float()


def _sdpa_curve(model, prompt: torch.Tensor, trees: dict, timer: Timer) -> tuple[dict, torch.Tensor]:
    """As `_hf_specdec_curve`, with stock transformers: ``sdpa``, a DynamicCache and a 4D tree mask."""
    device, context = prompt.device, prompt.numel()
    saved = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"
    try:
        past = DynamicCache(config=model.config)
        model(input_ids=prompt[None], use_cache=True, **cache_kwarg(model.forward, past))
        curve = {}
        for n, (mask, ids) in trees.items():
            positions = (context + mask.sum(1) - 1).to(device)  # [n]
            full = torch.ones(1, 1, n, context + n, dtype=torch.bool, device=device)  # [1, 1, n, L + n]
            full[0, 0, :, context:] = mask.to(device)

            def verify(ids=ids, positions=positions, full=full):
                out = model(
                    input_ids=ids[None],
                    position_ids=positions[None],
                    attention_mask=full,
                    use_cache=True,
                    **cache_kwarg(model.forward, past),
                )
                past.crop(-ids.numel())  # drop the tree again (negative = tokens to remove)
                return out

            curve[n] = timer(verify)
        return curve, verify().logits[0].float()
    finally:
        model.config._attn_implementation = saved


@torch.no_grad()
def verify_cost_curve(
    model,
    context: int,
    nodes: Sequence[int],
    timer: Timer,
    backends: Sequence[str] = ("hf_specdec", "sdpa"),
    seed: int = 0,
    after: Callable[[], object] | None = None,
    attention: str | None = None,
) -> tuple[dict[str, dict[int, float]], float | None]:
    """Forward time (µs) of verifying a random ``n``-node tree over ``context`` committed tokens, per backend.

    The ``hf_specdec`` backend runs as the speculative loop runs it (on CPU fp32: pre-packed linear weights,
    `generation.packed_linears`); ``sdpa`` is stock transformers.

    Args:
        model: the target.
        context: committed tokens before the tree.
        nodes: tree sizes to time (root included: 1 = a plain decoding forward).
        timer: how to time one call (`cpu_timer`, or CUDA events in the kernel benchmark).
        backends: any of ``"hf_specdec"`` and ``"sdpa"``.
        seed: of the random prompt and trees.
        after: run after each timed hf_specdec forward and timed with it (e.g. a drafter's step): run alone in a
            loop, a small drafter would keep its weights in cache, which the target's forward evicts in decoding.
        attention: the hf_specdec attention path, ``"triton"`` or ``"torch"`` (None: as a generate call chooses).
    Returns:
        ``({backend: {n: µs}}, diff)``: diff is the largest logit difference between the two backends on the
        largest tree (a check that both verify the same), None unless both ran.
    """
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (context,), generator=gen).to(device)  # [L]
    trees = {n: (random_tree_mask(n, gen), torch.randint(3, vocab, (n,), generator=gen).to(device)) for n in nodes}
    curves: dict[str, dict[int, float]] = {}
    last_logits: dict[str, torch.Tensor] = {}  # [n_max, V] per backend
    if "hf_specdec" in backends:
        curves["hf_specdec"], last_logits["hf_specdec"] = _hf_specdec_curve(
            model, prompt, trees, timer, after, attention
        )
    if "sdpa" in backends:
        curves["sdpa"], last_logits["sdpa"] = _sdpa_curve(model, prompt, trees, timer)
    diff = None
    if len(last_logits) == 2:
        a, b = last_logits.values()
        diff = float((a - b).abs().max())
    return curves, diff


def step_cost_curve(
    model,
    sizes: Sequence[int],
    draft_step: Callable[[], object] | None = None,
    context: int = 384,
    repeats: int = 7,
) -> dict[int, float]:
    """``cost[n]``: time of one speculative step with an ``n``-node draft tree relative to one plain decoding forward,
    on this machine (medians of ``repeats``, CPU wall clock).

    Args:
        model: the target.
        sizes: draft nodes per tree (root excluded); 0 costs 1.0 by definition.
        draft_step: the drafter's work per step (e.g. the heads over one hidden state), timed right after each
            verify forward of ``n + 1`` tokens (with ``n`` > 0), so its weights are as cache-cold as in decoding.
        context: committed tokens before the tree.
        repeats: timed calls per size.
    Returns:
        ``{n: cost}`` for every ``n`` in ``sizes``.
    """
    timer = cpu_timer(repeats)
    tokens = sorted({n + 1 for n in sizes if n > 0})
    plain = verify_cost_curve(model, context, [1], timer, backends=("hf_specdec",))[0]["hf_specdec"]
    curves, _ = verify_cost_curve(model, context, tokens, timer, backends=("hf_specdec",), after=draft_step)
    with_draft = curves["hf_specdec"]
    return {n: (with_draft[n + 1] / plain[1] if n else 1.0) for n in sizes}
