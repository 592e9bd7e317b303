"""The demo's Benchmark tab: `hf_specdec.bench` on a few questions of one Spec-Bench category, its progress streamed
call by call, the result one line per method with a word on what the figures can and cannot tell."""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from collections.abc import Iterator, Sequence

from ..assistants import available_assistants
from ..bench.methods import Method, resolve_methods
from ..bench.questions import category_sort_key, find_questions_file, load_questions, sample_questions
from ..bench.report import OVERALL, category_table, slow_prompts_section, summarize
from ..bench.spec_bench import GREEDY, build_prompts, run_bench, settings_for
from .render import bench_chart

MAX_PER_CATEGORY = 8
MAX_NEW_TOKENS = 256
MAX_REPEATS = 3

NOISE_NOTE = (
    "How to read this: each figure comes from {runs} on a CPU that may be shared, so differences of "
    "5-10% between methods are within run-to-run noise; `hf-specdec bench --full` (24 prompts) is the careful "
    "measurement. speedup = total tokens / total time over vanilla's on these prompts; median = the median "
    "per-prompt ratio. τ 1.00 with acceptance 0.00 means no drafted token was accepted: the tree budget then drafts "
    "little or nothing, and the method's speed is vanilla's plus the loop's noise, not a gain from drafting."
)


class Cancelled(Exception):
    """Raised inside the benchmark's log callback once the user pressed Stop."""


def bench_categories() -> list[str]:
    """The pooled Spec-Bench categories of the question file, in Spec-Bench's order."""
    questions = load_questions(find_questions_file())
    return sorted({q["pooled_category"] for q in questions}, key=category_sort_key)


def _check(category: str, methods: Sequence[str], per_category: int, max_new_tokens: int, repeats: int = 1) -> None:
    if category not in bench_categories():
        raise ValueError(f"unknown category {category!r}; choose one of {', '.join(bench_categories())}")
    ready = available_assistants()
    unknown = [m for m in methods if m not in ready]
    if not methods or unknown:
        raise ValueError(f"pick one or more methods among {', '.join(ready)} (got {list(methods)})")
    if not 1 <= int(per_category) <= MAX_PER_CATEGORY:
        raise ValueError(f"questions must be between 1 and {MAX_PER_CATEGORY}, got {per_category}")
    if not 1 <= int(max_new_tokens) <= MAX_NEW_TOKENS:
        raise ValueError(f"max new tokens must be between 1 and {MAX_NEW_TOKENS}, got {max_new_tokens}")
    if not 1 <= int(repeats) <= MAX_REPEATS:
        raise ValueError(f"timed runs per method must be between 1 and {MAX_REPEATS}, got {repeats}")


def _announced(methods: Sequence[Method], say) -> list[Method]:
    """The methods, each announcing its calls through ``say(method name)`` as they start (progress per call, not
    per prompt: a prompt runs every method, which takes a while on a CPU)."""

    def announcing(method: Method) -> Method:
        def kwargs(ctx):
            say(method.name)
            return method.kwargs(ctx)

        return dataclasses.replace(method, kwargs=kwargs)

    return [announcing(m) for m in methods]


def run_category(
    model,
    tokenizer,
    category: str,
    methods: Sequence[str],
    per_category: int,
    max_new_tokens: int,
    cancel,
    lock=None,
    repeats: int = 1,
) -> Iterator[tuple[str, str, object]]:
    """Benchmark ``methods`` against vanilla on ``per_category`` questions of ``category`` (greedy, batch 1).

    Args:
        model / tokenizer: the shared default model.
        category: a pooled Spec-Bench category (`bench_categories`).
        methods: names from `available_assistants()`.
        per_category: questions to run.
        max_new_tokens: budget per answer.
        cancel: a `threading.Event`; once set the run stops before its next call.
        lock: held for the whole run (the demo's one-generation-at-a-time lock), or None.
        repeats: timed calls per method and prompt (the fastest is kept).
    Yields:
        (log text, Markdown results, matplotlib figure or None) as each call starts and each prompt ends; the last
        has one line per method, the slow prompts, a note on noise and the speedup / τ chart.
    """
    _check(category, methods, per_category, max_new_tokens, repeats)
    questions = sample_questions(load_questions(find_questions_file()), int(per_category), categories=[category])
    prompts = build_prompts(tokenizer, questions)
    chosen = resolve_methods(["vanilla", *methods])
    calls = len(chosen) * (1 + len(prompts))  # a warm-up call of each method, then each prompt (repeats inside)
    lines: queue.Queue = queue.Queue()
    result: dict = {}
    started = [0]

    def log(msg: str) -> None:
        lines.put(msg)
        if cancel.is_set():
            raise Cancelled("stopped by the user")

    def say(name: str) -> None:
        started[0] += 1
        what = "warm-up" if started[0] <= len(chosen) else "timed"
        log(f"  call {started[0]}/{calls}: {name} ({what})")

    def work() -> None:
        try:
            with lock if lock is not None else contextlib.nullcontext():
                result["records"] = run_bench(model, prompts, _announced(chosen, say), settings_for(sample=False),
                                              max_new_tokens=int(max_new_tokens), repeats=int(repeats), log=log)  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - shown in the page
            result["error"] = exc
        lines.put(None)

    threading.Thread(target=work, name="hf-specdec-demo-bench", daemon=True).start()
    text = (f"{len(prompts)} {category} questions × vanilla, {', '.join(methods)}; {max_new_tokens} new tokens, "
            f"greedy, {repeats} timed run(s) per method and prompt")  # fmt: skip
    yield text, "", None
    try:
        while (msg := lines.get()) is not None:
            text += "\n" + msg
            yield text, "", None
    finally:
        cancel.set()
    if "error" in result:
        if isinstance(result["error"], Cancelled):
            yield (
                text + "\nstopped by the user.",
                "Stopped before the end: no results (press Run to start again).",
                None,
            )
            return
        raise result["error"]
    records = result["records"]
    summary = summarize(records)
    runs = "one timed run per method and prompt" if int(repeats) == 1 else f"the fastest of {repeats} timed runs"
    table = "\n\n".join([category_table(summary, GREEDY, OVERALL), slow_prompts_section(records, GREEDY),
                          NOISE_NOTE.format(runs=runs)])  # fmt: skip
    yield text + "\ndone.", table, bench_chart(summary, category)
