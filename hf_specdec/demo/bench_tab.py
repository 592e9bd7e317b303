"""The demo's Benchmark tab: a few Spec-Bench questions of one category, every chosen method against vanilla
`generate` (greedy, batch 1), its progress streamed call by call.

How it times, so that no figure comes from a cold or busy moment: every method first runs once untimed (the
warm-up); then, question by question and run by run, vanilla and each method take turns (interleaved, the order
rotating), so a drifting machine load falls on all of them alike. A method's speedup is over its fastest runs, shown
with the spread of the per-run speedups, next to the bound τ and the measured steps put on it (`bounds`); a figure
above its bound is flagged. Stop ends the run within one decoding step: the questions every run of a method and of
vanilla finished on stay in its line, the call cut short is dropped, and a method with none finished is marked
stopped.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers.generation import StoppingCriteriaList

from ..assistants import available_assistants
from ..bench.methods import BenchContext, Method, resolve_methods
from ..bench.questions import category_sort_key, find_questions_file, load_questions, sample_questions
from ..bench.spec_bench import Prompt, build_prompts, count_new_tokens, first_difference, timed_generate
from .bounds import Pair, Spread, speedup_bound
from .render import bench_chart, bench_table
from .streaming import CancelCriteria

MAX_PER_CATEGORY = 8
MAX_NEW_TOKENS = 256
MAX_REPEATS = 3
WARMUP_TOKENS = 16

NOISE_NOTE = (
    "How to read this: every method and vanilla ran {runs} per question, taking turns after an untimed warm-up; "
    "**speedup** = total tokens / total time over vanilla's, each over its fastest runs (the two fastest may come "
    "from different runs, so it can fall outside the spread); **spread** = the lowest and highest per-run speedup (a CPU shared with other work moves them; differences inside the spread are "
    "noise). **bound** = the largest speedup drafting can give with this τ and these step counts: a verify step "
    "runs the target once, so it costs at least one vanilla decode step, hence speedup ≤ τ for greedy output "
    "(see the assistant help in the Compare tab). A speedup above it is flagged: a timing was disturbed. "
    "`hf-specdec bench --full` (24 prompts) is the careful measurement."
)


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
        pairs = [Pair(b.seconds, b.tokens, b.forwards, c.tokens, c.steps or 0) for b, c in zip(base, fast)]
        same = sum(first_difference(c.sequences, b.sequences, 0) is None for b, c in zip(base, fast))
        return {**row, "speedup": rate / (sum(b.tokens for b in base) / sum(b.seconds for b in base)),
                "spread": Spread.of(per_run), "tau": 1.0 + accepted / steps if steps else 1.0,
                "acceptance": accepted / drafted if drafted else 0.0, "bound": speedup_bound(pairs),
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

    def __init__(self, model, prompts: list[Prompt], methods: list[Method], budget: int, repeats: int, cancel, log):
        self.model, self.prompts, self.methods = model, prompts, methods
        self.budget, self.repeats, self.cancel, self.log = budget, repeats, cancel, log
        self.ctx = BenchContext(model)
        self.stopped = False  # whether Stop ended the run before its last call
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

    def run(self) -> None:
        """The timed calls: per question, ``repeats`` rounds of vanilla and every method, the order rotating."""
        turn = 0
        for qi, prompt in enumerate(self.prompts):
            for r in range(self.repeats):
                k = turn % len(self.methods)
                turn += 1
                for method in self.methods[k:] + self.methods[:k]:
                    if self.cancel.is_set():
                        self.stopped = True
                        return
                    self._timed(method, qi, r, prompt)
            self.log(f"question {qi + 1}/{len(self.prompts)} done")

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
    Yields:
        (log text, Markdown results, matplotlib figure or None) as each call starts and each question ends; the
        results grow question by question, and the last one says whether the run was stopped.
    """
    _check(category, methods, per_category, max_new_tokens, repeats)
    questions = sample_questions(load_questions(find_questions_file()), int(per_category), categories=[category])
    prompts = build_prompts(tokenizer, questions)
    lines: queue.Queue = queue.Queue()
    runner = Runner(model, prompts, resolve_methods(["vanilla", *methods]), int(max_new_tokens), int(repeats),
                    cancel, lines.put)  # fmt: skip
    yield from _follow(runner, lock, lines, category, _header(len(prompts), category, methods, max_new_tokens, repeats))


def _header(n: int, category: str, methods: Sequence[str], max_new_tokens: int, repeats: int) -> str:
    return (f"{n} {category} questions × vanilla, {', '.join(methods)}; {max_new_tokens} new tokens, greedy, "
            f"{repeats} timed run(s) each, interleaved after a warm-up")  # fmt: skip


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
            yield text, table, None
    finally:
        runner.cancel.set()  # the page stopped listening (or the run ended): stop the worker too
    if failure:
        raise failure[0]
    yield _final(runner, text, category)


def _final(runner: Runner, text: str, category: str) -> tuple[str, str, object]:
    """The last page: the table, the stopped-or-done note, the note on noise and the chart."""
    board = runner.board
    stopped = runner.stopped
    rows = board.rows(stopped=stopped)
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
