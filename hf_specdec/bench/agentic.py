"""``hf-specdec bench --workload agentic``: speculative decoding where the model rewrites what it wrote before.

Three kinds of sessions, written for this benchmark (no benchmark text is reused):

- **multi-turn revision**: a conversation whose later turns ask to revise, extend or reformat an earlier answer; each
  turn's prompt is the whole conversation so far (the chat template over the earlier turns and answers);
- **agent edit loop**: an agent asks the model for a file (code or a README), then gives one small instruction per
  call with the current file in the prompt ("rename the function", "add an Installation section") and takes the
  complete updated file back;
- **structured output**: the same JSON schema or table layout for many inputs, one independent call each.

Later prompts are built from vanilla's answers (greedy answers are the same for every method; a method that differs
is reported as a mismatch). Every method keeps *one* assistant for the whole run, as a user's application would,
so `SuffixAssistant`'s store holds the earlier answers of the run and Arctic's cache its earlier requests; every other
method gets the same treatment. Methods run interleaved per turn, in rotating order, and the report is the one of
``hf-specdec bench`` (`hf_specdec.bench.report`), plus the overall throughput ratio (total tokens over total time)
and the size of each suffix store after the workload.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..cli_args import UsageError, check_chat_template_option, check_model_argument, load_model_argument
from ..generation.packed_linears import packed_weights
from ..generation.proposers.base import Proposer
from ..models import chat_ids, chat_rendering
from .arctic import arctic_available
from .methods import BenchContext, Method, resolve_methods
from .report import (
    OVERALL,
    budgets_by_method,
    depth_acceptance_by_method,
    markdown_report,
    step_times_by_method,
    summarize,
    write_results,
)
from .spec_bench import DEFAULT_OUT as SPEC_BENCH_OUT
from .spec_bench import (
    CallResult,
    Prompt,
    Setting,
    _BenchRunner,
    _cpu_name,
    _sigterm_as_interrupt,
    _Terminated,
    _verify_cost,
    call_clock,
    settings_for,
)

REVISION, AGENT, STRUCTURED = "multi-turn revision", "agent edit loop", "structured output"
CATEGORIES = (REVISION, AGENT, STRUCTURED)
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_OUT = "hf-specdec-bench-agentic"


def default_methods() -> list[str]:
    """vanilla, suffix, ngram, transformers' prompt lookup, and Arctic's suffix decoding where it is installed."""
    return ["vanilla", "suffix", "ngram", "hf-prompt-lookup"] + (["arctic-suffix"] if arctic_available() else [])


# ------------------------------------------------------------------------------------------------- the sessions
@dataclass(frozen=True)
class Session:
    """One session: its category, a name, and its turns (user messages or agent instructions)."""

    category: str
    name: str
    turns: tuple[str, ...]


_CONVERSATIONS = (
    (
        "email",
        "Write a short email to my team announcing that the weekly meeting moves from Monday to Tuesday at 10am.",
        "Make the email more formal.",
        "Add a sentence asking everyone to confirm by Friday, and keep the rest of the email as it is.",
        "Now rewrite the email as a bulleted list of the key points.",
    ),
    (
        "product",
        "Write a short product description for a stainless steel water bottle that keeps drinks cold for 24 hours.",
        "Make the description shorter, under 60 words.",
        "Add a line about the lifetime warranty at the end.",
        "Rewrite the description for a children's audience.",
    ),
    (
        "binary-search",
        "Explain in a few sentences how binary search works.",
        "Extend the explanation with a short Python example.",
        "Repeat the Python example with a comment on every line.",
    ),
)

_AGENT_SYSTEM = (
    "You are an editing agent. You apply the instruction to the current file and reply with the complete updated "
    "file only."
)
_AGENT_TASKS = (
    (
        "python-function",
        "Write a Python function `average(numbers)` that returns the mean of a list of numbers.",
        "Rename the function to `mean_value`.",
        "Make the function return 0.0 when the list is empty.",
        "Add a docstring to the function.",
        "Add type hints to the function.",
    ),
    (
        "readme",
        "Write a short README for a command-line tool called `notes` that saves text notes.",
        "Add an Installation section that says to run `pip install notes`.",
        "Change the tool name from `notes` to `jot` everywhere.",
        'Add a Usage section with the example `jot add "buy milk"`.',
    ),
)

_JSON_INSTRUCTION = (
    'Extract the person\'s details from the text as a JSON object with the keys "name", "age", "city" and '
    '"occupation". Reply with the JSON object only.\n\nText: '
)
_PEOPLE = (
    "Maria Lopez is a 34-year-old nurse who lives in Madrid.",
    "Tom Becker, 52, works as a carpenter in Hamburg.",
    "Aiko Tanaka is a software engineer from Osaka. She is 29 years old.",
    "At 41, Samuel Okafor teaches history at a school in Lagos.",
    "Lena Novak (27) is a graphic designer living in Prague.",
    "The baker Pierre Martin is 63 and has lived in Lyon all his life.",
)
_TABLE_INSTRUCTION = (
    "Make a markdown table with the columns Item, Quantity and Unit price for this shopping list. Reply with the "
    "table only.\n\nList: "
)
_LISTS = (
    "3 apples at $0.50 each, 2 loaves of bread at $2.20 each, 1 bottle of milk at $1.10.",
    "4 cans of tomatoes at $0.90 each, 1 bag of rice at $3.50, 6 eggs at $0.30 each.",
    "2 bars of soap at $1.25 each, 1 toothbrush at $2.99, 3 rolls of paper towels at $1.80 each.",
)


def sessions() -> list[Session]:
    """Every session of the workload, the categories interleaved (a run cut short still covers all three)."""
    revision = [Session(REVISION, name, tuple(turns)) for name, *turns in _CONVERSATIONS]
    agent = [Session(AGENT, name, tuple(turns)) for name, *turns in _AGENT_TASKS]
    structured = [
        Session(STRUCTURED, "json", tuple(_JSON_INSTRUCTION + p for p in _PEOPLE)),
        Session(STRUCTURED, "table", tuple(_TABLE_INSTRUCTION + x for x in _LISTS)),
    ]
    out = []
    for i in range(max(map(len, (revision, agent, structured)))):
        out += [group[i] for group in (revision, agent, structured) if i < len(group)]
    return out


def turn_prompt(tokenizer, session: Session, turn: int, answers: Sequence[str]) -> torch.Tensor:
    """`[n]` token ids of turn ``turn`` of ``session``, given the answers (vanilla's) to its earlier turns."""
    if session.category == REVISION:  # the whole conversation so far
        messages = []
        for user, answer in zip(session.turns[:turn], answers):
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": session.turns[turn]})
    elif session.category == AGENT and turn > 0:  # the current file and one instruction
        request = f"Current file:\n\n{answers[-1]}\n\nInstruction: {session.turns[turn]}\nReply with the complete file."
        messages = [{"role": "system", "content": _AGENT_SYSTEM}, {"role": "user", "content": request}]
    else:  # the agent's first request, or one independent structured-output call
        messages = [{"role": "user", "content": session.turns[turn]}]
    return torch.tensor(chat_ids(tokenizer, messages), dtype=torch.long)


# ------------------------------------------------------------------------------------------------- the run
class _SessionRunner(_BenchRunner):
    """`_BenchRunner` that keeps vanilla's last answer (the next prompt is built from it)."""

    last_vanilla: CallResult | None = None

    def call(self, inputs: dict, method: Method, setting: Setting, budget: int, repeats: int) -> CallResult:
        res = super().call(inputs, method, setting, budget, repeats)
        if method.name == "vanilla":
            self.last_vanilla = res
        return res


@dataclass
class AgenticRun:
    """What `run_agentic` returns: the records (`hf_specdec.bench.report`) and each method's assistant."""

    records: list[dict] = field(default_factory=list)
    assistants: dict[str, Proposer] = field(default_factory=dict)


def _kept_for_the_run(method: Method, ctx: BenchContext) -> tuple[Method, Proposer | None]:
    """``method`` with its generate() arguments built once and reused by every call of the run (one assistant, as
    an application would keep it), and that assistant (None for methods without one)."""
    kwargs = method.kwargs(ctx)
    return replace(method, kwargs=lambda _ctx: kwargs), kwargs.get("assistant")


def run_agentic(
    model,
    tokenizer,
    methods: Sequence[Method],
    settings: Sequence[Setting],
    chosen: Sequence[Session],
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    seed: int = 0,
    repeats: int = 1,
    log: Callable[[str], None] | None = None,
    on_turn: Callable[[list[dict]], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> AgenticRun:
    """Every turn of every session, every method back to back (vanilla first in the list, order rotating).

    Returns:
        the records, one per method and turn (``question_id``: ``session/turn``), and the assistants kept.
    """
    if not methods or methods[0].name != "vanilla":
        raise ValueError("the first method must be vanilla (the baseline of every speedup)")
    log = log or (lambda _msg: None)
    ctx = BenchContext(model)
    runner = _SessionRunner(model, methods, ctx, 1, seed, log)
    runner.clock = clock
    run = AgenticRun()
    total = sum(len(s.turns) for s in chosen) * len(settings)
    for setting in settings:
        runner.broken.clear()
        runner.methods = list(methods)  # warm-up with fresh assistants: nothing of it reaches a kept store
        runner.warm_up(setting, [Prompt(None, "", turn_prompt(tokenizer, chosen[0], 0, []))])
        kept = [_kept_for_the_run(m, ctx) for m in methods]
        runner.methods = [m for m, _ in kept]
        run.assistants.update({m.name: a for m, a in kept if a is not None})
        done = 0
        for session in chosen:
            answers: list[str] = []
            for turn in range(len(session.turns)):
                ids = turn_prompt(tokenizer, session, turn, answers)
                prompt = Prompt(f"{session.name}/{turn}", session.category, ids)
                run.records += runner.run_group(setting, [prompt], max_new_tokens, repeats, done, total)
                done += 1
                vanilla = runner.last_vanilla.sequences[0, ids.numel() :]
                answers.append(tokenizer.decode(vanilla, skip_special_tokens=True).strip())
                if on_turn is not None:
                    on_turn(run.records)
    return run


# ------------------------------------------------------------------------------------------------- the report
def throughput_section(summary: Sequence[dict]) -> str:
    """Overall figure per method: total generated tokens over total wall time, relative to vanilla's (the same
    ratio per category), next to the median per-turn speedup of the main table."""
    lines = [
        "## Throughput (total tokens / total time)",
        "",
        "Each method's generated tokens summed over the turns, divided by its wall time summed over the turns, "
        "relative to vanilla's.",
        "",
    ]
    for setting in dict.fromkeys(r["setting"] for r in summary):
        rows = [r for r in summary if r["setting"] == setting]
        base = {r["category"]: r["tokens_per_s"] for r in rows if r["method"] == "vanilla"}
        categories = list(dict.fromkeys(r["category"] for r in rows))
        lines += [
            f"### {setting}",
            "",
            "| method | " + " | ".join(categories) + " |",
            "|---|" + "---:|" * len(categories),
        ]
        for method in dict.fromkeys(r["method"] for r in rows):
            mine = {r["category"]: r["tokens_per_s"] for r in rows if r["method"] == method}
            cells = []
            for c in categories:
                v, b = mine.get(c), base.get(c)
                cell = f"{v / b:.2f}x" if v and b else ""
                cells.append(f"**{cell}**" if c == OVERALL and cell else cell)
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def store_section(assistants: dict[str, Proposer]) -> str:
    """The size of every `SuffixStore` held by the run's assistants after the workload."""
    from ..generation.proposers.fallback import FallbackAssistant
    from ..generation.proposers.suffix import SuffixAssistant

    rows = []
    for name, assistant in assistants.items():
        parts = assistant.proposers if isinstance(assistant, FallbackAssistant) else [assistant]
        for p in parts:
            if isinstance(p, SuffixAssistant):
                s = p.store
                rows.append(
                    f"| {name} | {s.num_documents} | {s.num_tokens} | {s.nbytes / 1e3:.1f} | "
                    f"{s.max_tokens} | {s.evicted_tokens} |"
                )
    if not rows:
        return ""
    head = [
        "## Suffix store after the workload",
        "",
        "| method | documents | tokens | kB | max tokens | evicted tokens |",
    ]
    return "\n".join([*head, "|---|---:|---:|---:|---:|---:|", *rows]) + "\n"


# ------------------------------------------------------------------------------------------------- CLI
def checked_arguments(args: argparse.Namespace) -> tuple[list[Method], list[Setting], list[Session]]:
    """The methods, settings and sessions of ``hf-specdec bench --workload agentic`` (before any model loads)."""
    for option, value, default in (("--batch", args.batch, 1), ("--questions", args.questions, None)):
        if value != default:
            raise UsageError(f"{option} does not apply to --workload agentic (its sessions are built in, batch 1)")
    if args.full:
        raise UsageError("--full does not apply to --workload agentic; choose --methods")
    names = args.methods or ",".join(default_methods())
    try:
        methods = resolve_methods(names)
    except ValueError as err:
        raise UsageError(f"--methods {names}: {err}") from err
    settings = settings_for(args.do_sample, greedy=not args.no_greedy)
    if not settings:
        raise UsageError("--no-greedy without --sample leaves nothing to run: add --sample or drop --no-greedy")
    chosen = sessions()
    if args.categories:
        wanted = [c.strip() for c in args.categories.split(",")]
        unknown = [c for c in wanted if c not in CATEGORIES]
        if unknown:
            raise UsageError(f"--categories {args.categories}: unknown {unknown}; the agentic ones are {CATEGORIES}")
        chosen = [s for s in chosen if s.category in wanted]
    if args.per_category:
        rank = {id(s): [x for x in chosen if x.category == s.category].index(s) for s in chosen}
        chosen = [s for s in chosen if rank[id(s)] < args.per_category]
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out}: a file is there; pass a folder for results.md, results.json, results.png")
    args.model = check_model_argument(args.model)
    check_chat_template_option(args)
    return methods, settings, chosen


def main(args: argparse.Namespace) -> int:
    """Run ``hf-specdec bench --workload agentic``; prints the report. Returns 0, or 130 / 143 after Ctrl-C /
    SIGTERM (the finished turns are reported and kept)."""
    import hf_specdec  # noqa: F401  (registers assistant=)

    methods, settings, chosen = checked_arguments(args)
    max_new = args.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    out_dir = args.out if args.out != SPEC_BENCH_OUT else DEFAULT_OUT
    if args.threads:
        torch.set_num_threads(args.threads)
    bar = tqdm(total=sum(len(s.turns) for s in chosen) * len(settings), desc="agentic", disable=args.quiet)

    def log(msg: str) -> None:
        if not args.quiet:
            bar.write(msg, file=sys.stderr)

    t0 = time.perf_counter()
    model, tokenizer, model_name = load_model_argument(args.model, chat_template=getattr(args, "chat_template", None))
    records: list[dict] = []
    assistants: dict[str, Proposer] = {}

    def meta(done: bool) -> dict:
        return {
            "model": model_name,
            "device": f"cpu ({_cpu_name()}), torch {torch.__version__}",
            "threads": torch.get_num_threads(),
            "batch": 1,
            "max_new_tokens": max_new,
            "clock": "CPU time of the process" if getattr(args, "cpu_time", False) else "wall time",
            "questions": f"agentic workload: {len(chosen)} sessions, {sum(len(s.turns) for s in chosen)} turns",
            "prompt_format": chat_rendering(tokenizer),
            "methods": {m.name: m.description for m in methods},
            "wall_s": time.perf_counter() - t0,
            "complete": done,
            "verify_cost": _verify_cost(model),
            "budgets": budgets_by_method(records),
            "depth_acceptance": depth_acceptance_by_method(records),
            "step_times": step_times_by_method(records),
        }

    def report(done: bool) -> str:
        summary = summarize(records)
        text = markdown_report(summary, meta(done), records).replace(
            "# hf-specdec Spec-Bench results", "# hf-specdec agentic"
        )
        return "\n".join([text, throughput_section(summary), store_section(assistants)])

    def save(so_far: list[dict]) -> None:
        records[:] = so_far
        bar.update(1)
        if out_dir:
            write_results(out_dir, so_far, meta(done=False), plot=False)

    try:
        with _sigterm_as_interrupt(), packed_weights(model):
            run = run_agentic(
                model,
                tokenizer,
                methods,
                settings,
                chosen,
                max_new,
                args.seed,
                args.repeats,
                log,
                save,
                call_clock(args),
            )
        records[:], assistants = run.records, run.assistants
    except KeyboardInterrupt as interrupt:
        log(f"interrupted: {len(records)} records kept")
        if records:
            print(report(done=False), flush=True)
        return 143 if isinstance(interrupt, _Terminated) else 130
    bar.close()
    text = report(done=True)
    print(text)
    if out_dir:
        paths = write_results(out_dir, records, meta(done=True))
        paths["md"].write_text(text, encoding="utf-8")
        log("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
