"""One comparison of the demo: the same prompt through vanilla `generate` and through speculative decoding.

The two calls run one after the other (not at the same time), so each tokens/s is measured on the same machine
without the other competing for the cores; both stream into the page as they go. With several prompts (a batch)
both calls run without streaming (transformers' streamers take one row) and report per-batch throughput.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers.generation import StoppingCriteriaList

from ..assistants import available_assistants, load_default_assistant
from ..bench.spec_bench import left_pad
from ..models import chat_prompt_ids
from .render import depth_chart, origin_counts, pane, speed_line, speedup_text, spread_text
from .speed import Spread
from .streaming import CancelCriteria, IncrementalText, Progress, follow_generate, mark_origins

MAX_NEW_TOKENS = 1024
MAX_RUNS = 5  # timed runs of each side (the first streamed, the others interleaved without streaming)
REFRESH_S = 0.1  # at most ten page updates a second per pane


@dataclass(frozen=True)
class Request:
    """What the user asked for (validated by `check`)."""

    prompts: tuple[str, ...]
    method: str
    do_sample: bool = False
    temperature: float = 0.7
    top_p: float = 0.9
    seed: int = 0
    max_new_tokens: int = 128
    runs: int = 1

    def check(self) -> None:
        """Raise ValueError naming the field, the value and what is expected."""
        if not self.prompts or not all(p.strip() for p in self.prompts):
            raise ValueError("the prompt is empty: type a question or instruction for the model")
        methods = available_assistants()
        if self.method not in methods:
            raise ValueError(f"unknown assistant {self.method!r}; choose one of {', '.join(methods)}")
        if not 1 <= int(self.max_new_tokens) <= MAX_NEW_TOKENS:
            raise ValueError(f"max new tokens must be between 1 and {MAX_NEW_TOKENS}, got {self.max_new_tokens}")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature} (untick sampling)")
        if self.do_sample and not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 1 <= int(self.runs) <= MAX_RUNS:
            raise ValueError(f"timed runs must be between 1 and {MAX_RUNS}, got {self.runs}")

    def generate_kwargs(self) -> dict:
        """The generate() options both calls share."""
        kwargs = {"max_new_tokens": int(self.max_new_tokens), "return_dict_in_generate": True}
        if self.do_sample:
            kwargs.update(do_sample=True, temperature=float(self.temperature), top_p=float(self.top_p))
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        return kwargs


@dataclass
class View:
    """What the Compare tab shows (the handler's outputs, in order)."""

    vanilla_html: str = ""
    speculative_html: str = ""
    summary: str = ""
    depth_figure: object | None = None
    details: dict | None = None

    def outputs(self) -> tuple:
        return self.vanilla_html, self.speculative_html, self.summary, self.depth_figure, self.details


def _streamed(model, tokenizer, inputs: dict, kwargs: dict, seed: int, cancel, lock) -> Iterator[tuple[Progress, list]]:
    """Follow one streamed call; yields (progress, token pieces) at most every `REFRESH_S` and once when done (the
    seed is set once the call holds the lock, so that a concurrent request cannot draw in between)."""
    text = IncrementalText(tokenizer)
    last = 0.0
    for progress in follow_generate(model, inputs, kwargs, cancel, lock, seed=seed):
        text.extend(progress.tokens[len(text.ids) :])
        if progress.done or not progress.started or progress.elapsed - last >= REFRESH_S:
            last = progress.elapsed
            yield progress, text.pieces
    if progress.error is not None:
        raise progress.error


def _side(progress: Progress, text: str, extra: dict | None = None) -> dict:
    return {"text": text, "new_tokens": len(progress.tokens), "seconds": progress.elapsed,
            "tokens_per_s": progress.tokens_per_s, **(extra or {})}  # fmt: skip


def _head(progress: Progress, extra: str = "", stopped: bool = False) -> str:
    if not progress.started:
        return "stopped before it started" if stopped else "waiting for the model (another generation is running)…"
    return speed_line(len(progress.tokens), progress.elapsed, progress.done, extra, stopped=stopped and progress.done)


def compare_one(model, tokenizer, req: Request, cancel: threading.Event, lock=None) -> Iterator[View]:
    """Stream vanilla then speculative generation of ``req.prompts[0]``, then the further timed runs
    (``req.runs``); yields the page after each update."""
    ids = chat_prompt_ids(tokenizer, req.prompts[0]).to(model.device)  # [1, W]
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    kwargs = req.generate_kwargs()
    view = View(summary="Running vanilla `generate`…")
    for van, pieces in _streamed(model, tokenizer, inputs, kwargs, req.seed, cancel, lock):
        view.vanilla_html = pane(
            "vanilla generate", _head(van, stopped=cancel.is_set()), pieces, elem_class="hfsd-vanilla"
        )
        yield view
    vanilla_text = "".join(pieces)
    if cancel.is_set():  # stopped during the vanilla run: keep what it wrote, do not start the speculative one
        view.speculative_html = pane(f"speculative · {req.method}", "not started (stopped)", [], elem_class="hfsd-spec")
        view.summary = stopped_markdown(len(van.tokens), None)
        view.details = {"method": req.method, "cancelled": True, "vanilla": _side(van, vanilla_text),
                        "speculative": None}  # fmt: skip
        yield view
        return
    view.summary = f"Running speculative decoding with `{req.method}`…"
    spec_kwargs = {**kwargs, "assistant": load_default_assistant(req.method)}  # one assistant per request
    for spec, pieces in _streamed(model, tokenizer, inputs, spec_kwargs, req.seed, cancel, lock):
        stats = getattr(spec.output, "spec_stats", None)
        origins = mark_origins(spec.steps, True, stats.accepted_tokens if stats is not None else None)
        drafted, own = origin_counts(origins)
        head = _head(spec, f" · {drafted} drafted + {own} own", stopped=cancel.is_set())
        view.speculative_html = pane(f"speculative · {req.method}", head, pieces, origins, "hfsd-spec")
        yield view
    if stats is None:
        raise RuntimeError("the speculative call returned no spec_stats (expected with return_dict_in_generate)")
    runs = {"vanilla": [(len(van.tokens), van.elapsed)], "speculative": [(len(spec.tokens), spec.elapsed)]}
    yield from _more_runs(model, inputs, kwargs, req, cancel, lock, runs, view)
    spec_side = _side(spec, "".join(pieces), {"drafted_tokens_emitted": drafted, "own_tokens_emitted": own,
                                              "accepted_tokens_not_emitted": max(0, stats.accepted_tokens - drafted),
                                              **stats.to_dict()})  # fmt: skip
    view.details = {
        "method": req.method,
        "do_sample": req.do_sample,
        "seed": req.seed,
        "identical_to_vanilla": None if cancel.is_set() else spec.tokens == van.tokens,
        "cancelled": cancel.is_set(),
        **_timing(runs, stats),
        "vanilla": _side(van, vanilla_text),
        "speculative": spec_side,
    }
    view.summary = summary_markdown(view.details)
    view.depth_figure = depth_chart(stats.per_depth_acceptance)
    yield view


def _more_runs(model, inputs: dict, kwargs: dict, req: Request, cancel, lock, runs: dict, view: View):
    """Runs 2 .. ``req.runs`` of both sides, without streaming, interleaved (the side that goes first alternates);
    each finished call's (tokens, seconds) is appended to ``runs``; a call cut short by Stop is not."""
    for r in range(1, int(req.runs)):
        for name in ("speculative", "vanilla") if r % 2 else ("vanilla", "speculative"):
            if cancel.is_set():
                return
            view.summary = f"Timed run {r + 1}/{req.runs}: {name}…"
            yield view
            extra = {"assistant": load_default_assistant(req.method)} if name == "speculative" else {}
            criteria = StoppingCriteriaList([CancelCriteria(cancel)])
            with lock if lock is not None else contextlib.nullcontext():
                torch.manual_seed(req.seed)
                t0 = time.perf_counter()
                out = model.generate(**inputs, **kwargs, **extra, stopping_criteria=criteria)
                seconds = time.perf_counter() - t0
            if not cancel.is_set():
                runs[name].append((out.sequences.shape[1] - inputs["input_ids"].shape[1], seconds))


def _timing(runs: dict, stats) -> dict:
    """The speedup over the fastest run of each side, the per-run speedups (runs where both sides finished), the
    tokens/s of every run, and the step cost of those fastest runs (`speed`: a speculative step's time over
    vanilla's time per token, so that speedup = (tokens / steps) / step cost), with its split by what the
    speculative call spent its time on (``spec_stats``' propose, verify and other times)."""
    rates = {name: [n / s if s > 0 else 0.0 for n, s in pairs] for name, pairs in runs.items()}
    van, spec = rates["vanilla"], rates["speculative"]
    per_run = [s / v for v, s in zip(van, spec) if v > 0]
    speedup = max(spec) / max(van) if max(van) > 0 else None
    per_step = runs["speculative"][0][0] / stats.steps if stats.steps else None  # output tokens per step
    cost = per_step / speedup if speedup and per_step else None
    spent = stats.time_propose + stats.time_verify + stats.time_other
    split = None
    if cost is not None and spent > 0:
        split = {"drafting": cost * stats.time_propose / spent, "verifying": cost * stats.time_verify / spent,
                 "other": cost * stats.time_other / spent}  # fmt: skip
    return {
        "speedup": speedup,
        "speedup_per_run": per_run,
        "step_cost": cost,
        "step_cost_split": split,
        "tokens_per_step": per_step,
        "tokens_per_s_per_run": rates,
    }


def stopped_markdown(vanilla_tokens: int, speculative_tokens: int | None) -> str:
    """The summary of a run the user stopped during the vanilla call (``speculative_tokens`` None)."""
    return (
        f"### Stopped\n- Stopped by the user during the vanilla run, after {vanilla_tokens} tokens (kept above); the "
        "speculative run did not start. Press Generate to run the comparison again."
    )


def summary_markdown(details: dict) -> str:
    """The verdict under the panes: speedup with its step cost and noise, τ, acceptance and whether the output
    equals vanilla's (greedy) or what equal or different samples mean (sampling)."""
    spec = details["speculative"]
    lines = _speed_lines(details)
    lines.extend(acceptance_lines(spec))
    if details["cancelled"]:
        so_far = f" · speedup so far **{speedup_text(details['speedup'])}**"
        lines[0] = "### Stopped" + (so_far if details["speedup"] else "")
        lines.append(
            "- Stopped by the user during the speculative run: both outputs are kept as far as they got (the "
            "speculative one is shorter), so they are not compared"
        )
    else:
        lines.append(_identity_line(details))
    return "\n".join(lines)


def acceptance_lines(spec: dict) -> list[str]:
    """τ and the acceptance rate with the counts they are made of (``spec_stats``' definitions: accepted draft
    tokens exclude the target's own token of each step, τ = 1 + accepted / steps counts it), then how many output
    tokens are accepted draft tokens. The loop counts a draft token as accepted once verification accepts it, also
    when the answer ends before it (an end-of-text token earlier in the same accepted draft, the token budget, Stop),
    so the output may hold fewer accepted draft tokens than ``spec_stats``; the difference is said, not hidden."""
    accepted, drafted, steps = spec["accepted_tokens"], spec["drafted_tokens"], spec["steps"]
    lines = [f"- **τ = {spec['tau']:.2f}** tokens per verify step (1 + {accepted} accepted draft tokens / {steps} "
             f"steps); acceptance rate {spec['acceptance_rate']:.2f} = {accepted} of {drafted} drafted tokens "
             "accepted"]  # fmt: skip
    if "drafted_tokens_emitted" in spec:
        shown = spec["drafted_tokens_emitted"]
        line = f"- In the output: {shown} of {spec['new_tokens']} tokens are accepted draft tokens"
        cut = accepted - shown
        if cut > 0:
            line += (f"; {cut} more accepted draft token{'s' if cut > 1 else ''} came after the answer ended (at an "
                     "end-of-text token inside the accepted draft, the token budget or Stop) and "
                     f"{'were' if cut > 1 else 'was'} cut with the rest of that draft (τ and the acceptance rate "
                     f"count {'them' if cut > 1 else 'it'})")  # fmt: skip
        lines.append(line)
    return lines


def _speed_lines(details: dict) -> list[str]:
    """The speedup (over the fastest run of each side), what it is made of (τ and the step cost), and its noise."""
    speedup, cost = details["speedup"], details.get("step_cost")
    rates = details["tokens_per_s_per_run"]
    if speedup is None:
        return ["### Speedup: n/a"]
    n = min(len(rates["vanilla"]), len(rates["speculative"]))
    runs = "one run each" if n == 1 else f"fastest of {n} runs each"
    lines = [f"### Speedup: **{speedup_text(speedup)}** ({max(rates['speculative']):.1f} vs "
             f"{max(rates['vanilla']):.1f} tokens/s, {runs})"]  # fmt: skip
    if cost is not None:
        split = details.get("step_cost_split")
        parts = f" (drafting {split['drafting']:.2f}×, verifying {split['verifying']:.2f}×)" if split else ""
        lines.append(f"- Step cost: a speculative step took **{cost:.2f}×** vanilla's time per token{parts}, so "
                     f"speedup = {details['tokens_per_step']:.2f} output tokens per step ÷ {cost:.2f} (about τ ÷ "
                     "step cost). τ is not a ceiling: a verify forward over a few tokens can cost less than a "
                     "vanilla decode step (on a CPU it runs on pre-packed weights, vanilla on stock kernels)")  # fmt: skip
    spread = Spread.of(details["speedup_per_run"])
    if spread is not None and spread.n > 1:
        lines.append(f"- Noise: per-run speedups {spread_text(spread)}; differences inside it are noise")
    else:
        lines.append("- Noise: one run each, so the run-to-run noise is not measured: on a CPU shared with other "
                     "work two runs of one call often differ by 10-20%, and a figure that close to 1.00× is neither "
                     "a gain nor a loss. Raise **Timed runs** to see the spread")  # fmt: skip
    if speedup < 1:
        cost_text = f" ({cost:.2f}× vanilla's time per token)" if cost is not None else ""
        lines.append(f"- Slower than vanilla here: a speculative step{cost_text} cost more than "
                     f"τ = {details['speculative']['tau']:.2f} tokens pay for on this prompt, or the gap is noise "
                     "(above)")  # fmt: skip
    return lines


def _identity_line(details: dict) -> str:
    """Greedy: whether the output is vanilla's. Sampling: what equal or different texts mean, truthfully."""
    if not details["do_sample"]:
        if details["identical_to_vanilla"]:
            return "- Greedy: the output is **token-for-token identical** to vanilla `generate` ✓"
        return "- Greedy: the output **differs** from vanilla `generate` ✗ (please report this)"
    seed = details.get("seed", 0)
    if details["identical_to_vanilla"]:
        return (f"- Sampling (seed {seed}): both runs drew the same text. Both calls start torch's random stream "
                "from the same seed, so where they draw their tokens the same way they read the same random numbers "
                "and pick the same tokens: equal texts are one sample drawn twice, not a sign of anything about the "
                "distribution. Every token is drawn from the target's distribution; another seed gives another "
                "sample")  # fmt: skip
    return (f"- Sampling (seed {seed}): the texts differ, as two samples may. Both calls start from the same seed, "
            "but speculative decoding reads extra random numbers to test drafted tokens, so from then on the two "
            "draw different samples of the same distribution (the target's)")  # fmt: skip


def compare_batch(model, tokenizer, req: Request, cancel: threading.Event, lock=None) -> Iterator[View]:
    """Vanilla then speculative generation of all of ``req.prompts`` as one left-padded batch (no streaming)."""
    rows = [chat_prompt_ids(tokenizer, p)[0] for p in req.prompts]
    pad = model.generation_config.pad_token_id
    pad = int(torch.as_tensor(pad if pad is not None else tokenizer.eos_token_id).reshape(-1)[0])
    ids, mask = left_pad(rows, pad)  # [B, W], [B, W]
    ids, mask = ids.to(model.device), mask.to(model.device)
    kwargs = req.generate_kwargs()
    kwargs["stopping_criteria"] = StoppingCriteriaList([CancelCriteria(cancel)])
    view = View(summary=f"Running vanilla `generate` on a batch of {len(rows)} prompts…")
    yield view
    outs = {}
    for name, extra in (("vanilla", {}), ("speculative", {"assistant": load_default_assistant(req.method)})):
        with lock if lock is not None else contextlib.nullcontext():
            torch.manual_seed(req.seed)
            t0 = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, **kwargs, **extra)
            outs[name] = (out, time.perf_counter() - t0)
        texts = _batch_texts(tokenizer, out.sequences[:, ids.shape[1] :], pad)
        n = sum(len(t) for t in texts)
        html_text = [
            f"── prompt {i + 1} ──\n{tokenizer.decode(t, skip_special_tokens=True)}\n" for i, t in enumerate(texts)
        ]
        head = speed_line(n, outs[name][1], True, stopped=cancel.is_set())
        elem_class = "hfsd-vanilla" if name == "vanilla" else "hfsd-spec"
        setattr(view, f"{name}_html", pane(name, head, html_text, elem_class=elem_class))
        if cancel.is_set() and name == "vanilla":  # stopped: keep what vanilla wrote, do not start the other run
            view.speculative_html = pane(
                f"speculative · {req.method}", "not started (stopped)", [], elem_class="hfsd-spec"
            )
            view.summary = stopped_markdown(n, None)
            yield view
            return
        view.summary = f"Running speculative decoding with `{req.method}` on the batch…"
        yield view
    view.details = _batch_details(req, outs, ids.shape[1], tokenizer, pad, cancel)
    note = "\n- (batch: one run each; token origins are shown for single prompts only)"
    view.summary = summary_markdown(view.details) + note
    view.depth_figure = depth_chart(outs["speculative"][0].spec_stats.per_depth_acceptance)
    yield view


def _batch_texts(tokenizer, generated: torch.Tensor, pad: int) -> list[list[int]]:
    """Each row's generated ids (`generated` is `[B, G]`) up to and including its first EOS (padding dropped)."""
    eos = set(torch.as_tensor(tokenizer.eos_token_id).reshape(-1).tolist()) | {pad}
    out = []
    for row in generated.tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        out.append(row[:end])
    return out


def _batch_details(req: Request, outs: dict, width: int, tokenizer, pad: int, cancel) -> dict:
    sides = {}
    for name, (out, seconds) in outs.items():
        rows = _batch_texts(tokenizer, out.sequences[:, width:], pad)
        n = sum(len(r) for r in rows)
        side = {"texts": [tokenizer.decode(r, skip_special_tokens=True) for r in rows], "new_tokens": n,
                "seconds": seconds, "tokens_per_s": n / seconds if seconds else 0.0}  # fmt: skip
        if name == "speculative":
            stats = out.spec_stats
            side.update(stats.to_dict())
        sides[name] = side
    van, spec = outs["vanilla"][0].sequences, outs["speculative"][0].sequences
    runs = {name: [(side["new_tokens"], side["seconds"])] for name, side in sides.items()}
    return {
        "method": req.method,
        "do_sample": req.do_sample,
        "seed": req.seed,
        **_timing(runs, outs["speculative"][0].spec_stats),  # one run each
        "identical_to_vanilla": (van.shape == spec.shape and bool(torch.equal(van, spec)))
        if not cancel.is_set()
        else None,
        "cancelled": cancel.is_set(),
        **sides,
    }


def compare(model, tokenizer, req: Request, cancel: threading.Event | None = None, lock=None) -> Iterator[View]:
    """The Compare tab's run: one prompt streamed, or several as a batch. Raises ValueError on bad input.

    Args:
        model / tokenizer: the shared model.
        req: the request.
        cancel: set it to stop the run within one decoding step.
        lock: held around each generate() call (the demo's one-generation-at-a-time lock), or None.
    Yields:
        the page (`View`) after each update.
    """
    req.check()
    cancel = cancel if cancel is not None else threading.Event()
    run = compare_one if len(req.prompts) == 1 else compare_batch
    yield from run(model, tokenizer, req, cancel, lock)


def warm_up(model, tokenizer, assistants: list[str] | None = None, report=None) -> None:
    """One short greedy call of vanilla and of every ready-made assistant (or of ``assistants``): loads their heads
    and runs the one-time setup of the speculative path, so that the first user's tokens/s measure decoding, not
    setup. ``report`` (e.g. ``print``) gets one line per call, with its seconds."""
    report = report or (lambda _line: None)
    ids = chat_prompt_ids(tokenizer, "Hello").to(model.device)  # [1, W]
    kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 4, "do_sample": False}
    names = available_assistants() if assistants is None else assistants
    for i, name in enumerate(["vanilla", *names], 1):
        t0 = time.perf_counter()
        extra = {} if name == "vanilla" else {"assistant": load_default_assistant(name)}
        model.generate(ids, **kwargs, **extra)
        report(f"  warm-up {i}/{len(names) + 1}: {name} ({time.perf_counter() - t0:.1f} s)")
