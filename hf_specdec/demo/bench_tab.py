"""The demo's Benchmark tab: a few Spec-Bench questions of one category, every chosen method against vanilla
`generate` (greedy, batch 1), its progress streamed call by call.

How it times, so that no figure comes from a cold or busy moment: every method first runs once untimed (the
warm-up); then, question by question and run by run, vanilla and each method take turns (interleaved, the order
rotating), so a drifting machine load falls on all of them alike. A method's speedup is over its fastest runs, shown
with the spread of the per-run speedups, next to τ and the step cost those runs measured (`speed`). Stop ends the run
within one decoding step: the questions every run of a method and of vanilla finished on stay in its line, the call
cut short is dropped, and a method with none finished is marked stopped; a run stopped before any method finished a
question says that nothing was measured (no table, no chart).

Before a run the tab estimates how long it will take (`estimate_text`: every call counted at vanilla's speed for the
full token budget, vanilla's tokens/s as last measured on this server); while it runs, each finished question updates
the estimate of the time left from the questions' own pace.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers.generation import StoppingCriteriaList

from ..assistants import available_assistants
from ..bench.methods import BenchContext, Method, resolve_methods
from ..bench.questions import category_sort_key, find_questions_file, load_questions, sample_questions
from ..bench.spec_bench import Prompt, build_prompts, count_new_tokens, first_difference, timed_generate
from .render import bench_chart, bench_table
from .speed import Pair, Spread, step_cost
from .streaming import CancelCriteria

MAX_PER_CATEGORY = 8
MAX_NEW_TOKENS = 256
MAX_REPEATS = 3
WARMUP_TOKENS = 16

NOISE_NOTE = (
    "How to read this: every method and vanilla ran {runs} per question, taking turns after an untimed warm-up; "
    "**speedup** = total tokens / total time over vanilla's, each over its fastest runs (the two fastest may come "
    "from different runs, so it can fall outside the spread); **spread** = the lowest and highest per-run speedup (a CPU shared with other work moves them; differences inside the spread are "
    "noise). **step cost** = a speculative step's time (drafting and verifying) over vanilla's time per token, on "
    "those fastest runs: speedup ≈ τ ÷ step cost. τ is not a ceiling: a verify forward over a few tokens can cost "
    "less than a vanilla decode step (on a CPU it runs on pre-packed weights, vanilla on stock kernels), so a "
    "step cost below 1 and a speedup above τ are real measurements. "
    "`hf-specdec bench --full` (24 prompts) is the careful measurement."
)


def bench_categories() -> list[str]:
    """The pooled Spec-Bench categories of the question file, in Spec-Bench's order."""
    questions = load_questions(find_questions_file())
    return sorted({q["pooled_category"] for q in questions}, key=category_sort_key)


def duration_text(seconds: float) -> str:
    """``"45 s"``, ``"3 min 20 s"``, ``"1 h 05 min"``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds // 60 % 60:02d} min"


def estimate_text(methods: int, questions: int, max_new_tokens: int, repeats: int, rate: float | None) -> str:
    """The estimate shown before a run: ``questions × repeats`` rounds of vanilla and ``methods`` methods, each call
    counted at vanilla's ``rate`` (tokens/s; None: not measured yet) for the whole ``max_new_tokens``, plus the
    warm-up call of each (`WARMUP_TOKENS`). Answers that end early and methods faster than vanilla take less."""
    calls = (1 + methods) * questions * repeats
    what = (f"{questions} question(s) × {repeats} run(s) × {1 + methods} calls (vanilla + {methods} method(s)) of "
            f"up to {max_new_tokens} new tokens, after a warm-up call of each")  # fmt: skip
    if not methods or calls <= 0:
        return "**Estimated time:** pick one or more methods."
    if not rate:
        return (f"**Estimated time:** not known yet: no vanilla call has been measured on this server. The run "
                f"estimates it after its first question. {what}.")  # fmt: skip
    tokens = calls * max_new_tokens + (1 + methods) * min(WARMUP_TOKENS, max_new_tokens)
    return (f"**Estimated time: up to about {duration_text(tokens / rate)}**: {what}, each counted at vanilla's "
            f"{rate:.1f} tokens/s measured on this server; answers that end early and methods faster than vanilla "
            "take less.")  # fmt: skip


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


@dataclass
class Call:
    """One finished timed call: seconds, tokens (up to the first EOS), decode forwards after the prefill (vanilla),
    verification steps and accepted / drafted tokens (speculative), and its `[1, W + G]` ids."""

    seconds: float
    tokens: int
    forwards: int
    sequences: torch.Tensor
    steps: int | None = None
    accepted: int | None = None
    drafted: int | None = None


class Board:
    """The calls finished so far, by (method, question), and the lines of the results table they make."""

    def __init__(self, methods: Sequence[str], questions: int, repeats: int):
        self.methods, self.questions, self.repeats = list(methods), questions, repeats
        self.calls: dict[tuple[str, int], list[Call]] = {}
        self.errors: dict[str, str] = {}

    def add(self, method: str, question: int, call: Call) -> None:
        self.calls.setdefault((method, question), []).append(call)

    def finished(self, method: str) -> list[int]:
        """The questions on which every run of ``method`` and of vanilla finished."""
        full = [q for q in range(self.questions) if len(self.calls.get((method, q), ())) == self.repeats]
        return [q for q in full if len(self.calls.get(("vanilla", q), ())) == self.repeats]

    def rows(self, stopped: bool = False) -> list[dict]:
        """One dict per method (vanilla first) for `render.bench_table` / `render.bench_chart`."""
        return [self._row(m, stopped) for m in self.methods]

    def _row(self, method: str, stopped: bool) -> dict:
        qs = self.finished(method)
        error = self.errors.get(method) or (self.errors.get("vanilla") and f"vanilla failed: {self.errors['vanilla']}")
        row = {"method": method, "questions": len(qs), "of": self.questions, "error": error}
        if not qs:
            return {**row, "status": "error" if row["error"] else ("stopped" if stopped else "running")}
        fast = [min(self.calls[(method, q)], key=lambda c: c.seconds) for q in qs]
        base = [min(self.calls[("vanilla", q)], key=lambda c: c.seconds) for q in qs]
        rate = sum(c.tokens for c in fast) / sum(c.seconds for c in fast)
        row.update(status="done", tokens_per_s=rate)
        if method == "vanilla":
            return row
        per_run = [self._run_speedup(method, qs, r) for r in range(self.repeats)]
        steps, accepted = sum(c.steps or 0 for c in fast), sum(c.accepted or 0 for c in fast)
        drafted = sum(c.drafted or 0 for c in fast)
        pairs = [Pair(b.seconds, b.tokens, c.seconds, c.steps or 0) for b, c in zip(base, fast)]
        same = sum(first_difference(c.sequences, b.sequences, 0) is None for b, c in zip(base, fast))
        return {**row, "speedup": rate / (sum(b.tokens for b in base) / sum(b.seconds for b in base)),
                "spread": Spread.of(per_run), "tau": 1.0 + accepted / steps if steps else 1.0,
                "acceptance": accepted / drafted if drafted else 0.0, "step_cost": step_cost(pairs),
                "identical": f"{same}/{len(qs)}"}  # fmt: skip

    def _run_speedup(self, method: str, qs: list[int], r: int) -> float:
        """The speedup of run ``r`` alone (that run of the method over that run of vanilla, on ``qs``)."""
        mine = [self.calls[(method, q)][r] for q in qs]
        base = [self.calls[("vanilla", q)][r] for q in qs]
        return (sum(c.tokens for c in mine) / sum(c.seconds for c in mine)) / (
            sum(c.tokens for c in base) / sum(c.seconds for c in base)
        )


class Runner:
    """Runs the warm-up and the interleaved timed calls (`run`) in a worker thread, reporting through ``log``."""

    def __init__(self, model, prompts: list[Prompt], methods: list[Method], budget: int, repeats: int, cancel, log,
                 on_vanilla=None):  # fmt: skip
        self.model, self.prompts, self.methods = model, prompts, methods
        self.budget, self.repeats, self.cancel, self.log = budget, repeats, cancel, log
        self.on_vanilla = on_vanilla  # called with (tokens, seconds) of every timed vanilla call
        self.ctx = BenchContext(model)
        self.stopped = False  # whether Stop ended the run before its last call
        self.warmed_up = False  # whether the warm-up ran to its end (Stop during it: nothing was measured)
        self.board = Board([m.name for m in methods], len(prompts), repeats)
        eos = model.generation_config.eos_token_id
        self.eos = set() if eos is None else set(torch.as_tensor(eos).reshape(-1).tolist())

    def call(self, method: Method, prompt: Prompt, budget: int) -> Call | str | None:
        """One call: a `Call`, the error's message, or None when Stop cut it short (not a measurement)."""
        ids = prompt.ids[None].to(self.model.device)  # [1, W]
        try:
            extra = method.kwargs(self.ctx)  # a fresh assistant (loading its weights may fail)
        except Exception as exc:  # noqa: BLE001 - shown in the method's line
            return f"{type(exc).__name__}: {exc}"
        kwargs = {"max_new_tokens": budget, "do_sample": False, "temperature": None, "top_p": None, "top_k": None,
                  "stopping_criteria": StoppingCriteriaList([CancelCriteria(self.cancel)]), **extra}  # fmt: skip
        if method.spec_stats:
            kwargs["return_dict_in_generate"] = True
        res = timed_generate(self.model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, kwargs, 0)
        if self.cancel.is_set():
            self.stopped = True
            return None
        if res.error:
            return res.error
        tokens = count_new_tokens(res.sequences, ids.shape[1], self.eos)
        call = Call(res.time_s, tokens, tokens - 1, res.sequences[:, ids.shape[1] :].cpu())
        stats = res.stats
        if stats is not None:
            call.steps, call.accepted, call.drafted = stats.steps, stats.accepted_tokens, stats.drafted_tokens
        return call

    def warm_up(self) -> None:
        """One short untimed call of every method on the first question (loads heads, warms caches and kernels)."""
        budget = min(WARMUP_TOKENS, self.budget)
        for i, method in enumerate(self.methods, 1):
            if self.cancel.is_set():
                self.stopped = True
                return
            self.log(f"  warm-up {i}/{len(self.methods)}: {method.name} (untimed, {budget} tokens)")
            result = self.call(method, self.prompts[0], budget)
            if isinstance(result, str):
                self.board.errors[method.name] = result
                self.log(f"  {method.name} fails, skipped: {result.splitlines()[0]}")
        self.warmed_up = not self.stopped

    def run(self) -> None:
        """The timed calls: per question, ``repeats`` rounds of vanilla and every method, the order rotating; each
        finished question logs the estimated time left (the questions' pace so far times the questions left)."""
        turn = 0
        start = time.perf_counter()
        for qi, prompt in enumerate(self.prompts):
            for r in range(self.repeats):
                k = turn % len(self.methods)
                turn += 1
                for method in self.methods[k:] + self.methods[:k]:
                    if self.cancel.is_set():
                        self.stopped = True
                        return
                    self._timed(method, qi, r, prompt)
            left = len(self.prompts) - qi - 1
            pace = (time.perf_counter() - start) / (qi + 1)
            estimate = f"; about {duration_text(pace * left)} left" if left else ""
            self.log(f"question {qi + 1}/{len(self.prompts)} done{estimate}")

    def _timed(self, method: Method, qi: int, r: int, prompt: Prompt) -> None:
        if method.name in self.board.errors:
            return
        where = f"q{qi + 1}/{len(self.prompts)} run {r + 1}/{self.repeats}"
        result = self.call(method, prompt, self.budget)
        if result is None:
            self.log(f"  {where}: {method.name} cut short by Stop (not counted)")
        elif isinstance(result, str):
            self.board.errors[method.name] = result
            self.log(f"  {where}: {method.name} failed: {result.splitlines()[0]}")
        else:
            self.board.add(method.name, qi, result)
            if method.name == "vanilla" and self.on_vanilla is not None:
                self.on_vanilla(result.tokens, result.seconds)
            self.log(f"  {where}: {method.name} {result.tokens} tokens in {result.seconds:.2f} s")


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
    vanilla_rate: float | None = None,
    on_vanilla=None,
) -> Iterator[tuple[str, str, object]]:
    """Benchmark ``methods`` against vanilla on ``per_category`` questions of ``category`` (greedy, batch 1).

    Args:
        model / tokenizer: the shared default model.
        category: a pooled Spec-Bench category (`bench_categories`).
        methods: names from `available_assistants()`.
        per_category: questions to run.
        max_new_tokens: budget per answer.
        cancel: a `threading.Event`; once set the running call ends within one step and the run stops.
        lock: held for the whole run (the demo's one-generation-at-a-time lock), or None.
        repeats: timed runs per method and question (interleaved with vanilla's).
        vanilla_rate: vanilla's tokens/s as last measured on this server, for the time estimate (None: the estimate
            comes after the first question).
        on_vanilla: called with (tokens, seconds) of every timed vanilla call (the server keeps vanilla's speed).
    Yields:
        (log text, Markdown results, matplotlib figure or None) as each call starts and each question ends; the
        results grow question by question, and the last one says whether the run was stopped.
    """
    _check(category, methods, per_category, max_new_tokens, repeats)
    questions = sample_questions(load_questions(find_questions_file()), int(per_category), categories=[category])
    prompts = build_prompts(tokenizer, questions)
    lines: queue.Queue = queue.Queue()
    runner = Runner(model, prompts, resolve_methods(["vanilla", *methods]), int(max_new_tokens), int(repeats),
                    cancel, lines.put, on_vanilla)  # fmt: skip
    header = _header(len(prompts), category, methods, max_new_tokens, repeats, vanilla_rate)
    yield from _follow(runner, lock, lines, category, header)


def _header(n: int, category: str, methods: Sequence[str], max_new_tokens: int, repeats: int,
            rate: float | None = None) -> str:  # fmt: skip
    calls = (1 + len(methods)) * n * repeats
    if rate:
        tokens = calls * max_new_tokens + (1 + len(methods)) * min(WARMUP_TOKENS, max_new_tokens)
        estimate = f"estimated time: up to about {duration_text(tokens / rate)} (at vanilla's {rate:.1f} tokens/s)"
    else:
        estimate = "estimated time: after the first question (vanilla's speed is not measured yet)"
    return (f"{n} {category} questions × vanilla, {', '.join(methods)}; {max_new_tokens} new tokens, greedy, "
            f"{repeats} timed run(s) each, interleaved after a warm-up; {estimate}")  # fmt: skip


def _follow(runner: Runner, lock, lines: queue.Queue, category: str, text: str):
    """Start ``runner`` in a thread and yield the page as its log lines arrive (results after each question)."""
    failure: list[BaseException] = []

    def work() -> None:
        try:
            with lock if lock is not None else contextlib.nullcontext():
                runner.warm_up()
                if "vanilla" in runner.board.errors:
                    raise RuntimeError(f"vanilla generate fails on this model: {runner.board.errors['vanilla']}")
                runner.run()
        except BaseException as exc:  # noqa: BLE001 - shown in the page
            failure.append(exc)
        lines.put(None)

    threading.Thread(target=work, name="hf-specdec-demo-bench", daemon=True).start()
    table = ""
    yield text, table, None
    try:
        while (msg := lines.get()) is not None:
            text += "\n" + msg
            if msg.startswith("question "):
                table = bench_table(runner.board.rows(), category) + f"\n\n_{msg}; running…_"
            elif not table and msg.startswith("  q"):
                table = "_Running the first question; the estimate of the time left comes once it is done…_"
            yield text, table, None
    finally:
        runner.cancel.set()  # the page stopped listening (or the run ended): stop the worker too
    if failure:
        raise failure[0]
    yield _final(runner, text, category)


def _final(runner: Runner, text: str, category: str) -> tuple[str, str, object]:
    """The last page: the table, the stopped-or-done note, the note on noise and the chart; a run stopped before
    any method finished a question says so instead (no lines of zeros, no empty chart)."""
    board = runner.board
    stopped = runner.stopped
    rows = board.rows(stopped=stopped)
    if stopped and not any(r["status"] == "done" and r["method"] != "vanilla" for r in rows):
        where = "during the warm-up" if not runner.warmed_up else "before any method finished a question"
        note = (f"**Stopped by the user {where}: nothing was measured.** Press Run benchmark to start again "
                "(the estimate above says how long a run takes).")  # fmt: skip
        return text + f"\nstopped by the user {where}; nothing was measured.", note, None
    runs = "once" if board.repeats == 1 else f"{board.repeats} times"
    parts = [bench_table(rows, category), NOISE_NOTE.format(runs=runs)]
    if stopped:
        done = min((len(board.finished(m)) for m in board.methods if m not in board.errors), default=0)
        parts.insert(1, f"**Stopped by the user** after {done} of {board.questions} questions: each line keeps the "
                        "questions it finished (with vanilla's); a line with none says stopped. Press Run to start "
                        "again.")  # fmt: skip
    finished = any(r["status"] == "done" and r["method"] != "vanilla" for r in rows)
    chart = bench_chart(rows, category) if finished else None
    return text + ("\nstopped by the user." if stopped else "\ndone."), "\n\n".join(parts), chart
