"""Figures on the documentation pages, generated from the bench's results (docs/results/*.json). Lab equipment of
this repository (tools/, not installed): what `hf-specdec bench` prints is `hf_specdec.bench.report`'s.

A page holds a generated block between two marker comments; the text around it is the page's own::

    <!-- results:begin headline docs/results/amd_sharegpt_eagle_batch1_seed0.json -->
    ... generated, do not edit ...
    <!-- results:end -->

The first word after ``results:begin`` names the renderer (`RENDERERS`), then one or more results files (paths from
the repository root, comma-separated), then optional ``key=value`` options (``method=medusa``,
``exclude=email/1,email/2``). ``python scripts/render_results.py`` rewrites every block of every page
(`PAGES`); ``--check`` only says which blocks are stale (tests/unit/test_figures.py runs it).

The figures come from each file's committed ``summary`` (what `hf_specdec.bench.report.summarize` wrote when the run
ended), except where a block leaves records out (``exclude=``): then the summary is recomputed from the remaining
records with the same function.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hf_specdec.bench.questions import category_sort_key
from hf_specdec.bench.report import OVERALL, mismatch_text, summarize

ROOT = Path(__file__).resolve().parents[1]

# the pages that hold generated blocks (the test holds every one of them to the data)
PAGE_GLOBS = ("README.md", "docs/*.md", "docs/lab/*.md", "hf_specdec/assets/*/README.md", "custom_generate/README.md")

BLOCK = re.compile(
    r"(?P<begin><!-- results:begin (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(?P<end><!-- results:end -->)", re.DOTALL
)

# how the README and the model cards name a method (the bench's name in backticks first)
METHOD_LABELS = {
    "ngram+medusa": "`ngram+medusa` (n-gram, else the shipped Medusa heads)",
    "ngram+eagle": "`ngram+eagle` (n-gram, else the shipped EAGLE head)",
    "ngram": "`ngram` (`NgramAssistant`)",
    "suffix": "`suffix` (`SuffixAssistant`, one store for the run)",
    "mlp_speculator": "`mlp_speculator` (shipped)",
    "medusa": "`medusa` (shipped heads)",
    "eagle": "`eagle` (shipped head)",
    "ngram+dflash": "`ngram+dflash` (n-gram, else the shipped DFlash head)",
    "dflash": "`dflash` (shipped DFlash head, DDTrees)",
    "null": "`null`: the loop with no drafts",
    "hf-prompt-lookup": "`hf-prompt-lookup`: transformers' prompt lookup",
    "arctic-suffix": "`arctic-suffix`: Arctic Inference's suffix tree in this loop",
    "draft": "`draft` (layer-skip draft model)",
    "hf-assisted": "`hf-assisted`: transformers' `assistant_model=`",
}
SHORT_CATEGORY = {"multi-turn conversation": "multi-turn", "math_reasoning": "math"}


@dataclass
class Run:
    """One results file: its path from the repository root, meta, summary rows and records."""

    path: str
    meta: dict
    summary: list[dict]
    records: list[dict] = field(default_factory=list)

    @classmethod
    def load(cls, path: str, root: Path = ROOT, exclude: Sequence[str] = ()) -> Run:
        data = json.loads((root / path).read_text(encoding="utf-8"))
        records = data.get("records") or []
        summary = data["summary"]
        if exclude:
            records = [r for r in records if str(r.get("question_id")) not in set(exclude)]
            summary = summarize(records)
        return cls(path, data.get("meta") or {}, summary, records)

    def row(self, method: str, category: str = OVERALL, setting: str = "greedy") -> dict | None:
        for r in self.summary:
            if r["method"] == method and r["category"] == category and r["setting"] == setting:
                return r
        return None

    def methods(self, setting: str = "greedy") -> list[str]:
        return list(dict.fromkeys(r["method"] for r in self.summary if r["setting"] == setting))

    def categories(self, setting: str = "greedy") -> list[str]:
        cats = {r["category"] for r in self.summary if r["setting"] == setting and r["category"] != OVERALL}
        return sorted(cats, key=category_sort_key)

    def report_link(self, page: Path, root: Path = ROOT) -> str:
        """A Markdown link from ``page`` to the run's results.md (its .json where there is no .md)."""
        md = (root / self.path).with_suffix(".md")
        target = md if md.exists() else root / self.path
        return f"[{target.relative_to(root).as_posix()}]({os.path.relpath(target, page.parent)})"

    def date(self) -> str:
        return str(self.meta.get("date") or "")[:10]


def speedup(row: dict | None) -> str:
    return "" if row is None or row.get("speedup") is None else f"{row['speedup']:.2f}x"


def median(row: dict | None) -> str:
    return "" if row is None or row.get("median_speedup") is None else f"{row['median_speedup']:.2f}x"


def tau(row: dict | None) -> str:
    return "" if row is None or row.get("tau") is None else f"{row['tau']:.2f}"


mismatches = mismatch_text


def by_overall(run: Run, setting: str = "greedy") -> list[str]:
    """The run's methods other than vanilla, fastest overall first."""
    methods = [m for m in run.methods(setting) if m != "vanilla"]
    return sorted(methods, key=lambda m: -((run.row(m, setting=setting) or {}).get("speedup") or 0.0))


def vanilla_rate(run: Run, setting: str = "greedy") -> str:
    row = run.row("vanilla", setting=setting)
    return f"{row['tokens_per_s']:.1f}" if row and row.get("tokens_per_s") else "?"


def machine(run: Run) -> str:
    meta = run.meta
    device = str(meta.get("device", "an unknown device"))
    parts = ["a CPU " + device[4:] if device.startswith("cpu (") else device]
    if meta.get("threads"):
        threads = int(meta["threads"])
        parts.append(f"{threads} torch thread{'' if threads == 1 else 's'}")
    if meta.get("transformers"):
        parts.append(f"transformers {meta['transformers']}")
    return ", ".join(parts)


def draft_dtype(run: Run) -> str:
    """``; heads drafting in bfloat16`` where the run recorded the heads' draft dtype."""
    value = str(run.meta.get("draft_dtype") or "")
    return f"; heads drafting in {value.split()[0]}" if value else ""


# ------------------------------------------------------------------------------------------------------ renderers
def render_headline(runs: list[Run], page: Path, options: dict) -> str:
    """The README's table: one row per method (fastest first), the speedup per category, overall, median, τ and
    mismatches, under a line naming the machine, the date and the questions."""
    (run,) = runs
    meta = run.meta
    cats = run.categories()
    head = ["method", *(SHORT_CATEGORY.get(c, c) for c in cats), "overall", "median", "τ", "mismatches"]
    lines = [
        f"Measured {run.date()} on {machine(run)}: greedy, {meta.get('max_new_tokens')} new tokens, "
        f"{meta.get('questions')}, vanilla `generate` at {vanilla_rate(run)} tokens/s{draft_dtype(run)}. "
        f"Source: {run.report_link(page)}.",
        "",
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1),
    ]
    for method in by_overall(run):
        total = run.row(method)
        cells = [METHOD_LABELS.get(method, f"`{method}`"), *(speedup(run.row(method, c)) for c in cats)]
        cells += [f"**{speedup(total)}**", median(total), tau(total), mismatches(total)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_matrix(runs: list[Run], page: Path, options: dict) -> str:
    """Every method of one run (vanilla first, then in the run's order): the speedup per category, overall, median,
    τ, tokens/s and mismatches, as `hf-specdec bench` prints it."""
    (run,) = runs
    setting = options.get("setting", "greedy")
    cats = run.categories(setting)
    head = ["method", *cats, "overall", "median", "τ", "tokens/s", "mismatches"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for method in run.methods(setting):
        total = run.row(method, setting=setting)
        cells = [method, *(speedup(run.row(method, c, setting)) for c in cats), f"**{speedup(total)}**"]
        tps = f"{total['tokens_per_s']:.1f}" if total and total.get("tokens_per_s") else ""
        cells += [median(total), tau(total), tps, mismatches(total)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\nSource: {run.report_link(page)} ({run.date()}, {machine(run)})."


def lowest_category(run: Run, method: str) -> str:
    """The lowest per-category speedup of ``method`` in ``run`` (greedy), with its category."""
    rows = [run.row(method, category) for category in run.categories()]
    rows = [r for r in rows if r is not None and r.get("speedup") is not None]
    if not rows:
        return ""
    low = min(rows, key=lambda r: r["speedup"])
    return f"{speedup(low)} ({low['category']})"


def _of_overall(cell: Callable[[dict | None], str]) -> Callable[[Run, str], str]:
    """A `RUN_COLUMNS` cell made of ``cell`` of the method's overall row."""
    return lambda run, method: cell(run.row(method))


RUN_COLUMNS = {  # the columns a `runs` block may show per run: header, cell(run, method)
    "overall": ("overall", _of_overall(speedup)),
    "lowest": ("lowest category", lowest_category),
    "median": ("median", _of_overall(median)),
    "tau": ("τ", _of_overall(tau)),
    "tokens_per_s": (
        "tokens/s",
        _of_overall(lambda row: f"{row['tokens_per_s']:.1f}" if row and row.get("tokens_per_s") else ""),
    ),
    "mismatches": ("mismatches", _of_overall(mismatches)),
}


def render_runs(runs: list[Run], page: Path, options: dict) -> str:
    """Several runs side by side: per method, each run's overall speedup, median and τ (methods of the first run,
    fastest first; vanilla too where tokens/s are shown). ``labels=seed_0,seed_1`` names the runs (an underscore
    stands for a space); ``columns=overall,lowest,tau,mismatches`` picks the columns of `RUN_COLUMNS` (default
    overall,median,tau; lowest: the method's lowest category)."""
    labels = options["labels"].replace("_", " ").split(",") if options.get("labels") else [r.path for r in runs]
    columns = options.get("columns", "overall,median,tau").split(",")
    unknown = [c for c in columns if c not in RUN_COLUMNS]
    if unknown:
        raise ValueError(f"unknown runs columns {unknown}; known: {sorted(RUN_COLUMNS)}")
    head = ["method"]
    for label in labels:
        head += [f"{label} {RUN_COLUMNS[c][0]}" if i == 0 else RUN_COLUMNS[c][0] for i, c in enumerate(columns)]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    methods = (["vanilla"] if "tokens_per_s" in columns else []) + by_overall(runs[0])
    for method in methods:
        cells = [method]
        for run in runs:
            cells += [RUN_COLUMNS[c][1](run, method) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    sources = ", ".join(f"{label}: {run.report_link(page)}" for label, run in zip(labels, runs))
    return "\n".join(lines) + f"\n\nSources: {sources}."


def render_card(runs: list[Run], page: Path, options: dict) -> str:
    """A model card's measured figures: the head alone and behind prompt lookup, with the run's machine and date.

    ``method=eagle@candidate``: the head ran as the candidate of an A/B run (``hf-specdec bench --candidate-head``);
    its rows (``eagle@candidate``, ``ngram+eagle@candidate``) are shown under the method's own names, followed by
    the rows of the head it was benched against in the same run."""
    (run,) = runs
    kind, _, variant = options["method"].partition("@")
    meta = run.meta
    lines = [
        f"Measured {run.date()} on {machine(run)}: {meta.get('questions')}, greedy, {meta.get('max_new_tokens')} "
        "new tokens; speedup = total tokens / total time against vanilla `generate` on the same prompts "
        f"(the run's report: `{Path(run.path).with_suffix('.md').as_posix()}` in hf-specdec's source).",
        "",
        "| method | mean accepted length τ | speedup over vanilla `generate` | median per prompt |",
        "|---|---:|---:|---:|",
    ]
    suffix = f"@{variant}" if variant else ""
    shown = [(f"`{name}`", name + suffix) for name in (kind, f"ngram+{kind}")] + [("`ngram`", "ngram")]
    if variant:  # the head it was benched against, in the same run
        shown += [(f"`{name}`, the head it replaced", name) for name in (kind, f"ngram+{kind}")]
    for label, name in shown:
        row = run.row(name)
        if row is not None:
            lines.append(f"| {label} | {tau(row)} | {speedup(row)} | {median(row)} |")
    return "\n".join(lines)


def render_agentic(runs: list[Run], page: Path, options: dict) -> str:
    """The agentic workload per category and overall; with ``exclude=`` an extra column recomputed without those
    turns (named in the line under the table)."""
    (run,) = runs
    exclude = [q for q in options.get("exclude", "").split(",") if q]
    trimmed = Run.load(run.path, exclude=exclude) if exclude else None
    cats = run.categories()
    head = ["method", *cats, "overall"]
    if trimmed:
        head.append(f"overall without {', '.join(exclude)}")
    head.append("τ")
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for method in by_overall(run):
        total = run.row(method)
        cells = [METHOD_LABELS.get(method, f"`{method}`"), *(speedup(run.row(method, c)) for c in cats)]
        cells.append(f"**{speedup(total)}**")
        if trimmed:
            cells.append(speedup(trimmed.row(method)))
        cells.append(tau(total))
        lines.append("| " + " | ".join(cells) + " |")
    return (
        "\n".join(lines)
        + f"\n\nSource: {run.report_link(page)} ({run.date() or 'date in the report'}, {machine(run)})."
    )


def render_sample(runs: list[Run], page: Path, options: dict) -> str:
    """What ``hf-specdec bench`` prints, rebuilt from a full run's records: the first question of each category
    (the quick bench's six prompts) through vanilla and ``methods=``, one line per prompt, then their table."""
    (run,) = runs
    methods = options.get("methods", "ngram+medusa,ngram").split(",")
    first: dict[str, str] = {}
    for r in run.records:
        first.setdefault(r["category"], str(r["question_id"]))
    cats = sorted(first, key=category_sort_key)
    picked = [r for r in run.records if first.get(r["category"]) == str(r["question_id"])]
    picked = [r for r in picked if r["method"] in ("vanilla", *methods)]
    lines = []
    for i, cat in enumerate(cats, 1):
        mine = {r["method"]: r for r in picked if r["category"] == cat}
        van = mine["vanilla"]
        parts = [f"vanilla {van['time_s']:.2f}s"]
        parts += [f"{m} {mine[m]['time_s']:.2f}s ({mine[m]['speedup']:.2f}x)" for m in methods if m in mine]
        lines.append(f"[greedy] {i}/{len(cats)} {cat} q{first[cat]}: {van['new_tokens']} tok; " + ", ".join(parts))
        if i == 2 and len(cats) > 3:
            lines.append("...")
            break
    sub = Run(run.path, run.meta, summarize(picked), picked)
    table = render_matrix([sub], page, {}).split("\n\nSource:")[0]
    seconds = sum(r["time_s"] for r in picked)
    return (
        "```text\n" + "\n".join(lines) + "\n" + table + "\n```\n\n"
        f"These records hold {seconds:.0f} s of generation ({len(cats)} prompts through vanilla and "
        f"{len(methods)} methods) on that machine; loading the model comes on top."
    )


RENDERERS: dict[str, Callable[[list[Run], Path, dict], str]] = {
    "headline": render_headline,
    "matrix": render_matrix,
    "runs": render_runs,
    "card": render_card,
    "agentic": render_agentic,
    "sample": render_sample,
}


# --------------------------------------------------------------------------------------------------- the pages
@dataclass
class Block:
    page: Path
    name: str
    sources: list[str]
    options: dict
    body: str
    start: int
    end: int


def parse_spec(spec: str) -> tuple[str, list[str], dict]:
    words = spec.split()
    if len(words) < 2:
        raise ValueError(f"results block {spec!r}: want '<renderer> <file.json>[,<file.json>] [key=value ...]'")
    options = dict(w.split("=", 1) for w in words[2:])
    return words[0], words[1].split(","), options


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    out = []
    for found in BLOCK.finditer(text):
        name, sources, options = parse_spec(found.group("spec"))
        out.append(Block(page, name, sources, options, found.group("body"), found.start("body"), found.end("body")))
    return out


def render_block(block: Block, root: Path = ROOT) -> str:
    if block.name not in RENDERERS:
        raise ValueError(f"{block.page}: no renderer {block.name!r} (known: {', '.join(RENDERERS)})")
    runs = [Run.load(s, root) for s in block.sources]
    return RENDERERS[block.name](runs, block.page, block.options).rstrip("\n") + "\n"


def render_page(page: Path, root: Path = ROOT) -> str:
    """The page's text with every block regenerated."""
    text = page.read_text(encoding="utf-8")
    for block in reversed(blocks(page)):
        text = text[: block.start] + render_block(block, root) + text[block.end :]
    return text


def pages(root: Path = ROOT) -> list[Path]:
    found = []
    for pattern in PAGE_GLOBS:
        found += sorted(root.glob(pattern))
    return [p for p in found if "results:begin" in p.read_text(encoding="utf-8")]


def stale_blocks(root: Path = ROOT) -> list[str]:
    """``page: renderer sources`` of every block whose committed text differs from what the data renders."""
    out = []
    for page in pages(root):
        for block in blocks(page):
            if render_block(block, root) != block.body:
                out.append(f"{page.relative_to(root)}: {block.name} {','.join(block.sources)}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only list stale blocks (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_blocks()
        for line in stale:
            print(f"stale: {line}")
        return 1 if stale else 0
    for page in pages():
        new = render_page(page)
        if new != page.read_text(encoding="utf-8"):
            page.write_text(new, encoding="utf-8")
            print(f"rewrote {page.relative_to(ROOT)}")
    return 0
