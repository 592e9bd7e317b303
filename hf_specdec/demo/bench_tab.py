"""The demo's Benchmark tab: `hf_specdec.bench` on a few questions of one Spec-Bench category, with its log streamed."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator, Sequence

from ..assistants import available_assistants
from ..bench.methods import resolve_methods
from ..bench.questions import category_sort_key, find_questions_file, load_questions, sample_questions
from ..bench.report import markdown_table, summarize
from ..bench.spec_bench import GREEDY, build_prompts, run_bench, settings_for
from .render import bench_chart

MAX_PER_CATEGORY = 8
MAX_NEW_TOKENS = 256


class Cancelled(Exception):
    """Raised inside the benchmark's log callback once the user pressed Stop."""


def bench_categories() -> list[str]:
    """The pooled Spec-Bench categories of the question file, in Spec-Bench's order."""
    questions = load_questions(find_questions_file())
    return sorted({q["pooled_category"] for q in questions}, key=category_sort_key)


def _check(category: str, methods: Sequence[str], per_category: int, max_new_tokens: int) -> None:
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


def run_category(
    model,
    tokenizer,
    category: str,
    methods: Sequence[str],
    per_category: int,
    max_new_tokens: int,
    cancel,
    lock=None,
) -> Iterator[tuple[str, str, object]]:
    """Benchmark ``methods`` against vanilla on ``per_category`` questions of ``category`` (greedy, batch 1).

    Args:
        model / tokenizer: the shared default model.
        category: a pooled Spec-Bench category (`bench_categories`).
        methods: names from `available_assistants()`.
        per_category: questions to run.
        max_new_tokens: budget per answer.
        cancel: a `threading.Event`; once set the run stops after the current prompt.
        lock: held for the whole run (the demo's one-generation-at-a-time lock), or None.
    Yields:
        (log text, Markdown results table, matplotlib figure or None) after every prompt; the last has the table
        and the speedup / τ chart.
    """
    _check(category, methods, per_category, max_new_tokens)
    questions = sample_questions(load_questions(find_questions_file()), int(per_category), categories=[category])
    prompts = build_prompts(tokenizer, questions)
    lines: queue.Queue = queue.Queue()
    result: dict = {}

    def log(msg: str) -> None:
        lines.put(msg)
        if cancel.is_set():
            raise Cancelled("stopped by the user")

    def work() -> None:
        try:
            with lock if lock is not None else contextlib.nullcontext():
                result["records"] = run_bench(
                    model,
                    prompts,
                    resolve_methods(["vanilla", *methods]),
                    settings_for(sample=False),
                    max_new_tokens=int(max_new_tokens),
                    log=log,
                )
        except BaseException as exc:  # noqa: BLE001 - shown in the page
            result["error"] = exc
        lines.put(None)

    threading.Thread(target=work, name="hf-specdec-demo-bench", daemon=True).start()
    text = f"{len(prompts)} {category} questions × vanilla, {', '.join(methods)}; {max_new_tokens} new tokens, greedy"
    yield text, "", None
    try:
        while (msg := lines.get()) is not None:
            text += "\n" + msg
            yield text, "", None
    finally:
        cancel.set()
    if "error" in result:
        raise result["error"]
    summary = summarize(result["records"])
    yield text + "\ndone.", markdown_table(summary, GREEDY), bench_chart(summary, category)
