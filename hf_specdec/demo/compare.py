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
from .render import depth_chart, origin_counts, pane, speed_line
from .streaming import CancelCriteria, IncrementalText, Progress, follow_generate, mark_origins

MAX_NEW_TOKENS = 1024
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
    """Stream vanilla then speculative generation of ``req.prompts[0]``; yields the page after each update."""
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
        view.details = {
            "method": req.method,
            "cancelled": True,
            "vanilla": _side(van, vanilla_text),
            "speculative": None,
        }
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
    speedup = spec.tokens_per_s / van.tokens_per_s if van.tokens_per_s else None
    view.details = {
        "method": req.method,
        "do_sample": req.do_sample,
        "speedup": speedup,
        "identical_to_vanilla": None if cancel.is_set() else spec.tokens == van.tokens,
        "cancelled": cancel.is_set(),
        "vanilla": _side(van, vanilla_text),
        "speculative": _side(
            spec,
            "".join(pieces),
            {"drafted_tokens_emitted": drafted, "own_tokens_emitted": own, **stats.to_dict()},
        ),
    }
    view.summary = summary_markdown(view.details)
    view.depth_figure = depth_chart(stats.per_depth_acceptance)
    yield view


def stopped_markdown(vanilla_tokens: int, speculative_tokens: int | None) -> str:
    """The summary of a run the user stopped during the vanilla call (``speculative_tokens`` None)."""
    return (
        f"### Stopped\n- Stopped by the user during the vanilla run, after {vanilla_tokens} tokens (kept above); the "
        "speculative run did not start. Press Generate to run the comparison again."
    )


def summary_markdown(details: dict) -> str:
    """The verdict under the panes: speedup, τ, acceptance and whether the output equals vanilla's."""
    spec = details["speculative"]
    speedup = details["speedup"]
    lines = [
        f"### Speedup: **{speedup:.2f}×** ({spec['tokens_per_s']:.1f} vs {details['vanilla']['tokens_per_s']:.1f} "
        "tokens/s)"
        if speedup
        else "### Speedup: n/a",
        f"- **τ = {spec['tau']:.2f}** tokens per target forward ({spec['steps']} verification steps); "
        f"acceptance rate {spec['acceptance_rate']:.2f} of {spec['drafted_tokens']} drafted tokens",
    ]
    if "drafted_tokens_emitted" in spec:
        lines.append(
            f"- {spec['drafted_tokens_emitted']} of {spec['new_tokens']} output tokens were accepted draft tokens"
        )
    if details["cancelled"]:
        lines[0] = "### Stopped" + (f" · speedup so far **{speedup:.2f}×**" if speedup else "")
        lines.append(
            "- Stopped by the user during the speculative run: both outputs are kept as far as they got (the "
            "speculative one is shorter), so they are not compared"
        )
    elif not details["do_sample"]:
        if details["identical_to_vanilla"]:
            lines.append("- Greedy: the output is **token-for-token identical** to vanilla `generate` ✓")
        else:
            lines.append("- Greedy: the output **differs** from vanilla `generate` ✗ (please report this)")
    elif details["identical_to_vanilla"]:
        lines.append(
            "- Sampling: both runs drew the same text (the distribution is peaked here); each token is drawn from "
            "the target's own distribution, so a different text would be as correct"
        )
    else:
        lines.append(
            "- Sampling: the texts differ, as two samples do: each run draws its own random tokens (speculative "
            "decoding uses the random numbers differently), and every token is drawn from the target's distribution"
        )
    return "\n".join(lines)


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
    view.summary = summary_markdown(view.details) + "\n- (batch: token origins are shown for single prompts only)"
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
    return {
        "method": req.method,
        "do_sample": req.do_sample,
        "speedup": sides["speculative"]["tokens_per_s"] / sides["vanilla"]["tokens_per_s"]
        if sides["vanilla"]["tokens_per_s"]
        else None,
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


def warm_up(model, tokenizer, assistants: list[str] | None = None) -> None:
    """One short greedy call of vanilla and of every ready-made assistant (or of ``assistants``): loads their heads
    and runs the one-time setup of the speculative path, so that the first user's tokens/s measure decoding, not
    setup."""
    ids = chat_prompt_ids(tokenizer, "Hello").to(model.device)  # [1, W]
    kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 4, "do_sample": False}
    model.generate(ids, **kwargs)
    for name in available_assistants() if assistants is None else assistants:
        model.generate(ids, assistant=load_default_assistant(name), **kwargs)
