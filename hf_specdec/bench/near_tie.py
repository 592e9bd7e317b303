"""The near-tie oracle: whether a speculative greedy output that leaves vanilla's does so only where vanilla's own
best logits are within the dtype's rounding of each other (`near_tie`), or is a wrong token. `hf-specdec bench` judges
its mismatches by it (`bench.spec_bench`), the tests and the fuzzer too (through `hf_specdec.testing`, which
re-exports it); docs/precision.md explains the bound."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

# ----------------------------------------------------------------------------------- the near-tie oracle
# A greedy output of a half-precision target may leave vanilla's where vanilla's own best two logits are within the
# dtype's rounding of each other: the verify forward computes the same logits in another order (other GEMM shapes,
# other kernels), so a near-tie can break the other way. `near_tie` decides whether a difference is such a tie; any
# other difference is a wrong token. At the first differing position, with vanilla's logits ``l`` there:
#
#     max(l) - l[t] <= k * eps(dtype) * max(max_v |l[v]|, 1)   for t = vanilla's token and for the speculative one
#
# (so the speculative token must itself be one of the near-best, not merely follow a close top-2). eps is the dtype's
# machine epsilon (bf16 2**-7, fp16 2**-10, fp32 2**-23); ``eps * max|l|`` is about one rounding step of the largest
# logits (a ulp of x is between eps*|x|/2 and eps*|x|), and the rounding a logit carries is proportional to the size
# of the products it sums, which the largest logit measures better than the best one does (the best can be small
# while others are large).
#
# k: a speculative token that wins a near-tie needs vanilla's gap within one disagreement between two computations of
# the same logits (the verify forward against vanilla's decode), and the oracle reads the gap from a third (its plain
# forward): two disagreements, each at most about 2 units of eps * max|l| in bf16 and fp16, so k = 5
# (docs/precision.md, "Why k = 5", has the measurement and the price: how often vanilla's own top-2 is that close).
#
# A mixture of experts makes a discrete choice upstream: its router keeps the top-k experts of each token, and where
# the k-th and (k+1)-th router logits are within the same bound (of the router logits' own magnitude) the two orders
# can route a token to different experts, which moves the final logits by far more than rounding (docs/precision.md,
# "Mixtures of experts"). When the final logits are not a near-tie, `near_tie` recomputes the prefix's router logits
# (modules with an int ``top_k`` whose class name has "Router") and accepts the difference only where such a routing
# near-tie can reach the position's logits: at the last position in any layer, or at an earlier one in a layer before
# the last (whose output later layers attend to).
NEAR_TIE_K = 5.0


@dataclass(frozen=True)
class NearTie:
    """The oracle's verdict on one row (`near_tie`).

    ``position``: the generated index of the first token where the speculative output leaves vanilla's (None: equal);
    ``vanilla_token`` / ``speculative_token``: the tokens there; ``top2_gap``: vanilla's best logit minus its second
    there; ``gap``: vanilla's best logit minus the lower of the two tokens' logits (>= ``top2_gap``); ``bound``:
    ``k * eps(dtype) * max(max|l|, 1)``; ``units``: ``gap`` in units of ``eps * max(max|l|, 1)``; ``near_tie``: ``gap
    <= bound``. ``ok``: equal, or first different at a near-tie.
    """

    position: int | None
    vanilla_token: int | None = None
    speculative_token: int | None = None
    top2_gap: float = 0.0
    gap: float = 0.0
    bound: float = 0.0
    units: float = 0.0
    near_tie: bool = True
    dtype: str = ""
    router: str = ""  # the routing near-tie that explains the difference, when the final logits do not

    @property
    def ok(self) -> bool:
        return self.position is None or self.near_tie

    def __str__(self) -> str:
        if self.position is None:
            return "equal to vanilla"
        verdict = "near-tie" if self.near_tie else "WRONG TOKEN"
        if self.router:
            verdict = f"near-tie upstream ({self.router})"
        return (
            f"{verdict} at generated position {self.position}: vanilla {self.vanilla_token}, speculative "
            f"{self.speculative_token}; gap {self.gap:.4g} (top-2 gap {self.top2_gap:.4g}, {self.units:.2f} eps units), "
            f"bound {self.bound:.4g} ({self.dtype})"
        )


def first_difference(a: list[int], b: list[int], pad: int | None = None) -> int | None:
    """The first index where two token lists differ (a missing token reads as ``pad``), or None."""
    for t in range(max(len(a), len(b))):
        x = a[t] if t < len(a) else pad
        y = b[t] if t < len(b) else pad
        if x != y:
            return t
    return None


def near_tie(
    model,
    prompt,
    vanilla,
    speculative,
    *,
    scores: torch.Tensor | None = None,
    pad_token_id: int | None = None,
    k: float | None = None,
) -> NearTie:
    """Whether a speculative greedy output equals vanilla's, or first leaves it where vanilla's own top-2 logits are
    within the dtype's rounding of each other (the bound is in the comment above `NEAR_TIE_K`).

    Args:
        model: the target (its parameters' dtype sets eps).
        prompt: `[P]` the prompt's tokens (padding removed).
        vanilla, speculative: the generated tokens (after the prompt) of vanilla generate and of the speculative call.
        scores: `[G, V]` or a list of `[V]`: vanilla's own processed scores per generated step (``output_scores``), to
            judge calls with logits processors; None: vanilla's logits at the position are recomputed by one plain
            forward of ``prompt + vanilla[:position]`` (batch 1, no padding) in the model's dtype.
        pad_token_id: what a missing token reads as (a row one output ended earlier).
        k: the bound's factor (default `NEAR_TIE_K`).
    """
    to_list = lambda x: x.tolist() if torch.is_tensor(x) else list(x)  # noqa: E731
    prompt, vanilla, speculative = to_list(prompt), to_list(vanilla), to_list(speculative)
    pos = first_difference(vanilla, speculative, pad_token_id)
    dtype = next(model.parameters()).dtype
    if pos is None:
        return NearTie(None, dtype=str(dtype).removeprefix("torch."))
    v = vanilla[pos] if pos < len(vanilla) else pad_token_id
    s = speculative[pos] if pos < len(speculative) else pad_token_id
    if scores is not None:
        logits = scores[pos].reshape(-1).float() if pos < len(scores) else None
    else:
        device = next(model.parameters()).device
        ids = torch.tensor([prompt + vanilla[:pos]], device=device)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1].float().cpu()
    eps = torch.finfo(dtype).eps
    k = NEAR_TIE_K if k is None else k
    if logits is None or v is None or s is None:
        return NearTie(
            pos, v, s, float("inf"), float("inf"), 0.0, float("inf"), False, str(dtype).removeprefix("torch.")
        )
    top = logits.topk(2).values
    best = float(top[0])
    finite = logits[torch.isfinite(logits)]
    scale = eps * max(float(finite.abs().max()) if finite.numel() else 0.0, 1.0)
    gap = best - min(float(logits[v]), float(logits[s]))
    gap = gap if gap == gap else float("inf")  # nan (inf - inf): not a tie
    bound = k * scale
    router = "" if gap <= bound else _routing_near_tie(model, prompt + vanilla[:pos], eps, k)
    return NearTie(
        pos,
        v,
        s,
        float(top[0] - top[1]),
        gap,
        bound,
        gap / scale,
        gap <= bound or bool(router),
        str(dtype).removeprefix("torch."),
        router,
    )


def _routing_near_tie(model, ids: list[int], eps: float, k: float) -> str:
    """The first mixture-of-experts routing near-tie of a plain forward of ``ids`` (a router's k-th and (k+1)-th
    logits within ``k * eps * max(max|router logit|, 1)`` at some position), described, or "" (none, or no router)."""
    routers = [(n, m) for n, m in model.named_modules() if isinstance(getattr(m, "top_k", None), int)
               and "router" in type(m).__name__.lower()]  # fmt: skip
    if not routers or not ids:
        return ""
    found: list[str] = []
    layer_of = lambda name: int(m.group(1)) if (m := re.search(r"layers\.(\d+)\.", name)) else -1  # noqa: E731
    last_layer = max(layer_of(n) for n, _ in routers)

    def hook(name: str, top_k: int):
        def record(module, args, out):
            r = None if found else _router_logits(out, top_k)  # [positions, experts]
            if r is None:
                return
            ranked = r.sort(-1, descending=True).values
            gap = ranked[:, top_k - 1] - ranked[:, top_k]
            bound = k * eps * r.abs().amax(-1).clamp_min(1.0)
            hits = [p for p in (gap <= bound).nonzero().flatten().tolist()
                    if p == r.shape[0] - 1 or layer_of(name) < last_layer or layer_of(name) < 0]  # fmt: skip
            if hits:
                p = hits[0]
                found.append(f"{name} at prefix position {p}: experts' logits {float(ranked[p, top_k - 1]):.4g} and "
                             f"{float(ranked[p, top_k]):.4g} around its top-{top_k}")  # fmt: skip

        return record

    handles = [m.register_forward_hook(hook(n, m.top_k)) for n, m in routers]
    try:
        device = next(model.parameters()).device
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            model(input_ids=x, attention_mask=torch.ones_like(x))
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else ""


def _router_logits(out, top_k: int) -> torch.Tensor | None:
    """`[positions, experts]` router logits from a router's output: of its tensors wider than ``top_k``, the one with
    the most distinct values (the logits; scores masked to the top-k have fewer, and Llama 4's router returns such
    scores before its logits), or None."""
    tensors = [t for t in (out if isinstance(out, tuple) else (out,))
               if torch.is_tensor(t) and t.is_floating_point() and t.dim() and t.shape[-1] > top_k]  # fmt: skip
    if not tensors:
        return None
    best = max(tensors, key=lambda t: t.unique().numel())  # the first of equals
    return best.detach().float().reshape(-1, best.shape[-1])


def near_ties(model, input_ids, attention_mask, vanilla, speculative, *, pad_token_id: int | None = None):
    """`near_tie` of every row of a left-padded batch: ``input_ids`` / ``attention_mask`` `[B, W]`, ``vanilla`` and
    ``speculative`` the two generate outputs (`[B, W + G]`, sequences). Returns one `NearTie` per row."""
    width = input_ids.shape[1]
    if pad_token_id is None:
        pad = model.generation_config.pad_token_id
        pad_token_id = int(torch.as_tensor(pad).reshape(-1)[0]) if pad is not None else None
    out = []
    for r in range(input_ids.shape[0]):
        prompt = input_ids[r][attention_mask[r].bool()] if attention_mask is not None else input_ids[r]
        out.append(near_tie(model, prompt, vanilla[r, width:], speculative[r, width:], pad_token_id=pad_token_id))
    return out
