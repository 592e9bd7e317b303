"""Benchmark results: per-prompt records -> per method/category summary -> results.md, results.json, results.png.

A *record* is one timed generate() call of one method on one prompt (or batch), next to vanilla's call on the same
prompt in the same run::

    {"method", "setting", "category", "question_id", "batch", "new_tokens", "time_s", "vanilla_time_s",
     "speedup", "steps", "drafted", "accepted", "match", "first_diff", "error", "nodes_per_row",
     "accepted_per_depth", "time_propose", "time_verify", "time_other"}

``steps`` / ``drafted`` / ``accepted`` come from ``out.spec_stats`` (None where a method has none), and
``nodes_per_row`` from its tree budget ({nodes verified for a row in a step: how often}), ``accepted_per_depth``
(entry d - 1: the steps that accepted at least d draft tokens, ``SpecStats.accepted_per_depth``), ``time_propose`` /
``time_verify`` / ``time_other`` the call's wall seconds in the proposer, in target forwards and in the rest
(``SpecStats``); ``match`` is
whether the method's tokens equal vanilla's (greedy only, None otherwise), and ``near_tie`` (on a
mismatch only) whether every differing row first differs at a near-tie of vanilla's own logits (`bench.near_tie`).

Metric definitions (as in docs/results.md):

- speedup (the headline, per category and overall) = the method's throughput over vanilla's on the same prompts:
  (total generated tokens / total wall time) / (vanilla's total tokens / vanilla's total time). A user running the
  prompts one after another sees exactly this; one prompt that runs far slower weighs by the time it took. In greedy
  decoding both emit the same tokens, so it is vanilla's total time / the method's total time.
- median = the median over prompts of the per-prompt ratio (recorded per prompt as ``speedup``, a ratio of
  tokens/s), shown beside it: a typical prompt, insensitive to one slow one.
- slow prompts: every prompt whose own ratio is below `SLOW_PROMPT`, listed under the tables.
- τ = 1 + accepted / steps, acceptance rate = accepted / drafted.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path

from .questions import category_sort_key

OVERALL = "overall"
SLOW_PROMPT = 0.75  # a prompt whose own speedup is below this is listed under the tables
MAX_SLOW_LISTED = 12


def median_speedup(vanilla_times: Sequence[float], method_times: Sequence[float]) -> float:
    """Median over prompts of the per-prompt ratio vanilla time / method time (not a ratio of sums or means)."""
    if len(vanilla_times) != len(method_times) or not method_times:
        raise ValueError("need one vanilla time per method time, and at least one pair")
    return statistics.median(v / m for v, m in zip(vanilla_times, method_times))


def throughput_speedup(records: Sequence[dict]) -> float | None:
    """The method's total tokens / total time over vanilla's on the same prompts (the headline speedup).

    Only records with a per-prompt ``speedup`` count (both calls ran and emitted tokens), so the method and vanilla
    are summed over the same prompts. None when there is none.
    """
    both = [r for r in records if not r.get("error") and r.get("speedup") is not None]
    time_s = sum(r["time_s"] for r in both)
    vanilla_time_s = sum(r["vanilla_time_s"] for r in both)
    if not both or time_s <= 0 or vanilla_time_s <= 0:
        return None
    vanilla_rate = sum(r["vanilla_new_tokens"] for r in both) / vanilla_time_s
    return sum(r["new_tokens"] for r in both) / time_s / vanilla_rate


def summarize_group(records: Sequence[dict]) -> dict:
    """Aggregate metrics of the records of one method, setting and category: ``speedup`` (total throughput over
    vanilla's), ``median_speedup`` (median of the per-prompt ratios), ``tokens_per_s``, τ, acceptance, mismatches."""
    ok = [r for r in records if not r.get("error")]
    errors = [r["error"] for r in records if r.get("error")]
    row: dict = {"prompts": len(records), "ok": len(ok), "errors": len(errors), "error": errors[0] if errors else None}
    total_time = sum(r["time_s"] for r in ok)
    row["tokens_per_s"] = sum(r["new_tokens"] for r in ok) / total_time if ok and total_time > 0 else None
    speedups = [r["speedup"] for r in ok if r.get("speedup") is not None]
    row["speedup"] = throughput_speedup(ok)
    row["median_speedup"] = statistics.median(speedups) if speedups else None
    with_stats = [r for r in ok if r.get("steps") is not None]
    if ok and len(with_stats) == len(ok):
        steps = sum(r["steps"] for r in ok)
        drafted = sum(r["drafted"] for r in ok)
        accepted = sum(r["accepted"] for r in ok)
        row["tau"] = 1.0 + accepted / steps if steps else None
        row["acceptance_rate"] = accepted / drafted if drafted else None
        row["drafted_per_step"] = drafted / steps if steps else None
    else:
        row["tau"] = row["acceptance_rate"] = row["drafted_per_step"] = None
    checked = [r for r in ok if r.get("match") is not None]
    row["checked"] = len(checked)
    row["mismatches"] = sum(1 for r in checked if not r["match"]) if checked else None
    row["near_ties"] = sum(1 for r in checked if not r["match"] and r.get("near_tie")) if checked else None
    return row


def summarize(records: Iterable[dict]) -> list[dict]:
    """One row per (setting, method, category) plus an ``overall`` row per (setting, method) over all its prompts,
    in the order the records first name settings and methods, categories in Spec-Bench's order."""
    records = list(records)
    settings = list(dict.fromkeys(r["setting"] for r in records))
    methods = list(dict.fromkeys(r["method"] for r in records))
    rows = []
    for setting in settings:
        for method in methods:
            mine = [r for r in records if r["setting"] == setting and r["method"] == method]
            if not mine:
                continue
            categories = sorted(dict.fromkeys(r["category"] for r in mine), key=category_sort_key)
            for category in [*categories, OVERALL]:
                group = mine if category == OVERALL else [r for r in mine if r["category"] == category]
                rows.append({"setting": setting, "method": method, "category": category, **summarize_group(group)})
    return rows


# -------------------------------------------------------------------------------------------------- formatting
def _fmt(value, spec: str, blank: str = "") -> str:
    return blank if value is None else format(value, spec)


def _notes(row: dict) -> str:
    if not row["errors"]:
        return ""
    msg = str(row["error"]).splitlines()[0] if row["error"] else "error"
    if len(msg) > 90:
        msg = msg[:87] + "..."
    return f"{row['errors']}/{row['prompts']} failed: {msg}".replace("|", "\\|")


def _speedup_cell(row: dict | None, bold: bool = False) -> str:
    """A summary row's headline speedup as ``1.23x`` ("failed" when every call failed, blank when absent)."""
    if row is None:
        return ""
    if row["speedup"] is None:
        return "failed" if row["errors"] else ""
    text = f"{row['speedup']:.2f}x"
    return f"**{text}**" if bold else text


def mismatch_text(row: dict | None) -> str:
    """``mismatches/checked``, with how many of the mismatches the near-tie oracle explains when any does (outputs
    that first leave vanilla's where vanilla's own top-2 logits are within the dtype's rounding: docs/precision.md);
    "" where nothing was checked."""
    if row is None or row.get("mismatches") is None:
        return ""
    text = f"{row['mismatches']}/{row['checked']}"
    return text + (f" ({row['near_ties']} near-ties)" if row.get("near_ties") else "")


def _mismatch_cell(row: dict) -> str:
    mism = mismatch_text(row)
    return f"**{mism}**" if row["mismatches"] else mism


def _detail_line(row: dict, category: str | None) -> str:
    """One Markdown line of a details table: method, the category cell (None: no category column), prompts,
    tokens/s, speedup (bold on overall lines), median, τ, acceptance, mismatches, notes."""
    overall = row["category"] == OVERALL
    median = _fmt(row["median_speedup"], ".2f")
    cells = [row["method"], *([] if category is None else [category]), str(row["prompts"])]
    cells += [_fmt(row["tokens_per_s"], ".1f"), _speedup_cell(row, bold=overall), median + "x" if median else ""]
    cells += [_fmt(row["tau"], ".2f"), _fmt(row["acceptance_rate"], ".2f"), _mismatch_cell(row), _notes(row)]
    return "| " + " | ".join(cells) + " |"


DETAIL_COLUMNS = "prompts | tokens/s | speedup | median | τ | acceptance | mismatches vs vanilla | notes |"
DETAIL_ALIGN = "---:|---:|---:|---:|---:|---:|---:|---|"


def markdown_table(summary: Sequence[dict], setting: str) -> str:
    """The Markdown table of one setting (``greedy``, ``t=0.7 top_p=0.9`` ...): one line per method and category,
    then its overall line, in bold."""
    lines = ["| method | category | " + DETAIL_COLUMNS, "|---|---|" + DETAIL_ALIGN]
    for row in summary:
        if row["setting"] == setting:
            category = f"**{OVERALL}**" if row["category"] == OVERALL else row["category"]
            lines.append(_detail_line(row, category))
    return "\n".join(lines)


def category_table(summary: Sequence[dict], setting: str, category: str = OVERALL) -> str:
    """One line per method for one category (or overall) of one setting (the demo's Benchmark tab shows one
    category), the columns of `markdown_table`."""
    lines = ["| method | " + DETAIL_COLUMNS, "|---|" + DETAIL_ALIGN]
    for row in summary:
        if row["setting"] == setting and row["category"] == category:
            lines.append(_detail_line({**row, "category": OVERALL}, None))  # its headline in bold
    return "\n".join(lines)


def speedup_matrix(summary: Sequence[dict], setting: str) -> str:
    """A compact Markdown table of one setting: one row per method, the speedup (total tokens / total time over
    vanilla's) per category and overall, the median per-prompt ratio beside it, overall τ, tokens/s and mismatches
    (Spec-Bench's leaderboard layout)."""
    rows = [r for r in summary if r["setting"] == setting]
    categories = sorted(dict.fromkeys(r["category"] for r in rows if r["category"] != OVERALL), key=category_sort_key)
    head = ["method", *categories, OVERALL, "median", "τ", "tokens/s", "mismatches"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = {r["category"]: r for r in rows if r["method"] == method}
        total = mine[OVERALL]
        cells = [method, *(_speedup_cell(mine.get(c)) for c in categories), _speedup_cell(total, bold=True)]
        median = _fmt(total["median_speedup"], ".2f")
        cells += [median + "x" if median else "", _fmt(total["tau"], ".2f"), _fmt(total["tokens_per_s"], ".1f")]
        lines.append("| " + " | ".join([*cells, _mismatch_cell(total)]) + " |")
    return "\n".join(lines)


def slow_prompts(records: Iterable[dict], setting: str | None = None, below: float = SLOW_PROMPT) -> list[dict]:
    """The records (of ``setting``, or every setting) whose own speedup is below ``below``, slowest first; vanilla
    itself is never one."""
    slow = [
        r
        for r in records
        if r["method"] != "vanilla"
        and (setting is None or r["setting"] == setting)
        and not r.get("error")
        and r.get("speedup") is not None
        and r["speedup"] < below
    ]
    return sorted(slow, key=lambda r: r["speedup"])


def slow_prompts_section(records: Sequence[dict], setting: str, below: float = SLOW_PROMPT) -> str:
    """The prompts that ran far slower than vanilla, listed under a setting's tables (or a line saying none did)."""
    slow = slow_prompts(records, setting, below)
    if not slow:
        return f"No prompt ran below {below:.2f}x vanilla's speed."
    lines = [
        f"Prompts below {below:.2f}x vanilla's speed (they pull the overall figure down; the median hides them):",
        "",
        "| method | category | question | speedup | time | vanilla's time | tokens |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in slow[:MAX_SLOW_LISTED]:
        lines.append(
            f"| {r['method']} | {r['category']} | {r['question_id']} | {r['speedup']:.2f}x | {r['time_s']:.2f} s | "
            f"{r['vanilla_time_s']:.2f} s | {r['new_tokens']} |"
        )
    if len(slow) > MAX_SLOW_LISTED:
        lines.append(f"\n… and {len(slow) - MAX_SLOW_LISTED} more (results.json has every record).")
    return "\n".join(lines)


def markdown_report(summary: Sequence[dict], meta: dict, records: Sequence[dict] | None = None) -> str:
    """The whole results.md: a header with the run's settings, then per setting the speedup table, the slow prompts
    (when ``records`` are given) and the details."""
    out = ["# hf-specdec Spec-Bench results", ""]
    keys = (
        "model",
        "device",
        "dtype",
        "quantization",
        "threads",
        "batch",
        "max_new_tokens",
        "per_category",
        "draft",
        "draft_dtype",
        "questions",
        "prompt_format",
        "clock",
        "heads_from",
        "candidate_heads",
        "transformers",
        "hf_specdec",
    )
    for key in (*keys, "date"):
        if meta.get(key) is not None:
            out.append(f"- {key.replace('_', ' ')}: {meta[key]}")
    if meta.get("complete") is False:
        out.append("- **partial results**: the run was interrupted or is still going (records so far)")
    out += ["", METRICS]
    for setting in dict.fromkeys(r["setting"] for r in summary):
        out += ["", f"## {setting}", "", "Speedup over vanilla `generate` per category:", ""]
        out.append(speedup_matrix(summary, setting))
        if records is not None:
            out += ["", slow_prompts_section(records, setting)]
        out += ["", "Details:", "", markdown_table(summary, setting)]
    if meta.get("depth_acceptance"):
        out += ["", depth_acceptance_section(meta["depth_acceptance"])]
    if meta.get("step_times"):
        out += ["", step_times_section(meta["step_times"])]
    if meta.get("verify_cost"):
        out += ["", cost_curve_section(meta["verify_cost"], meta.get("budgets") or {})]
    return "\n".join(out) + "\n"


METRICS = (
    "speedup = the method's total generated tokens / total wall time over vanilla `generate`'s on the same prompts, "
    "each prompt run by vanilla and every method back to back in one process (in greedy decoding both emit the same "
    "tokens, so it is vanilla's total time / the method's). **overall** is that ratio over every prompt: what a user "
    "running them one after another sees. median = the median over prompts of the per-prompt ratio, shown beside "
    f"it; prompts below {SLOW_PROMPT:.2f}x are listed under the table. τ = 1 + accepted draft tokens / verification "
    "steps; acceptance = accepted / drafted draft tokens (blank where the method does not report them). tokens/s = "
    "generated tokens / wall time summed over the prompts. Mismatches: prompts whose tokens differ from vanilla's "
    "(greedy only)."
)


def depth_acceptance_by_method(records: Iterable[dict]) -> dict[str, list[float]]:
    """``{method / setting: [share of verify steps that accepted >= d draft tokens, d = 1, 2, ...]}`` over all prompts
    (methods whose calls report no steps are left out)."""
    steps: dict[str, int] = {}
    counts: dict[str, list[int]] = {}
    for r in records:
        if not r.get("steps") or r.get("accepted_per_depth") is None:
            continue
        name = f"{r['method']} / {r['setting']}"
        steps[name] = steps.get(name, 0) + int(r["steps"])
        acc = counts.setdefault(name, [])
        for d, n in enumerate(r["accepted_per_depth"]):
            if d == len(acc):
                acc.append(0)
            acc[d] += int(n)
    return {name: [n / steps[name] for n in acc] for name, acc in counts.items()}


def depth_acceptance_section(depth_acceptance: dict[str, list[float]], max_depth: int = 8) -> str:
    """Per-depth acceptance: how often a verify step accepted at least d draft tokens."""
    depth = min(max_depth, max((len(v) for v in depth_acceptance.values()), default=0))
    lines = [
        "## Per-depth acceptance",
        "",
        "Share of verify steps that accepted at least d draft tokens (all prompts; τ = 1 + the row's sum).",
        "",
        "| method / setting | " + " | ".join(f"d={d}" for d in range(1, depth + 1)) + " |",
        "|---|" + "---:|" * depth,
    ]
    for name, shares in depth_acceptance.items():
        cells = [f"{shares[d]:.3f}" if d < len(shares) else "0" for d in range(depth)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def step_times_by_method(records: Iterable[dict]) -> dict[str, dict[str, float]]:
    """``{method / setting: {"steps", "draft_ms", "verify_ms", "other_ms", "draft_share"}}`` pooled over the prompts:
    wall milliseconds per verify step of a row in the proposer, in the target's forwards and in the rest, and the
    proposer's share of the three (methods whose calls report no times are left out)."""
    sums: dict[str, list[float]] = {}
    for r in records:
        if not r.get("steps") or r.get("time_propose") is None:
            continue
        acc = sums.setdefault(f"{r['method']} / {r['setting']}", [0, 0.0, 0.0, 0.0])
        acc[0] += int(r["steps"])
        acc[1] += float(r["time_propose"])
        acc[2] += float(r["time_verify"] or 0.0)
        acc[3] += float(r["time_other"] or 0.0)
    return {
        name: {
            "steps": int(n),
            "draft_ms": 1e3 * d / n,
            "verify_ms": 1e3 * v / n,
            "other_ms": 1e3 * o / n,
            "draft_share": d / max(d + v + o, 1e-12),
        }  # fmt: skip
        for name, (n, d, v, o) in sums.items()
    }


def step_times_section(step_times: dict[str, dict[str, float]]) -> str:
    """Where a step's time goes, per method: drafting, the target's verify forward, the rest."""
    lines = [
        "## Time per step",
        "",
        "Wall milliseconds per verify step of a row, pooled over the prompts (prefill counted in verify): drafting (the "
        "proposer), the target's forwards, the rest; and drafting's share of the three. Wall time, also where the "
        "speedups above are CPU time: on a shared machine compare the shares.",
        "",
        "| method / setting | steps | drafting ms | verify ms | other ms | drafting share |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, t in step_times.items():
        lines.append(f"| {name} | {t['steps']} | {t['draft_ms']:.2f} | {t['verify_ms']:.2f} | {t['other_ms']:.2f} | "
                     f"{100 * t['draft_share']:.0f}% |")  # fmt: skip
    return "\n".join(lines)


def budgets_by_method(records: Iterable[dict]) -> dict[str, dict[int, int]]:
    """``{method / setting: {nodes verified for a row in a step: how often}}`` summed over the prompts."""
    out: dict[str, dict[int, int]] = {}
    for r in records:
        for nodes, count in (r.get("nodes_per_row") or {}).items():
            hist = out.setdefault(f"{r['method']} / {r['setting']}", {})
            hist[int(nodes)] = hist.get(int(nodes), 0) + int(count)
    return out


def cost_curve_section(verify_cost: dict, budgets: dict[str, dict[int, int]]) -> str:
    """The verify cost curve the tree budget measured on this machine, and the tree sizes it chose per method."""
    curve, samples = verify_cost.get("curve") or {}, verify_cost.get("samples") or {}
    one = verify_cost.get("one_token_s")
    lines = [
        "## Verify cost on this machine (tree budget)",
        "",
        "Seconds of one verify forward (+ acceptance) by packed tokens, learnt while decoding (median per size, made "
        "non-decreasing); relative = / the cost of 1 token. The tree budget sizes every tree from this curve.",
        "",
        "| tokens | ms | relative | samples |",
        "|---:|---:|---:|---:|",
    ]
    for n in sorted(curve, key=int):
        rel = f"{curve[n] / one:.2f}" if one else ""
        lines.append(f"| {n} | {curve[n] * 1000:.1f} | {rel} | {samples.get(n, '')} |")
    if budgets:
        lines += ["", "| method / setting | mean nodes per row and step | drafting nothing | most used sizes |"]
        lines.append("|---|---:|---:|---|")
        for name, hist in budgets.items():
            total = sum(hist.values())
            mean = sum(n * c for n, c in hist.items()) / total if total else 0.0
            top = sorted(hist.items(), key=lambda kv: -kv[1])[:4]
            sizes = ", ".join(f"{n} ({c / total:.0%})" for n, c in top)
            lines.append(f"| {name} | {mean:.1f} | {hist.get(0, 0) / total:.0%} | {sizes} |")
    return "\n".join(lines)


def plot_speedups(summary: Sequence[dict], path: str | Path) -> Path:
    """A bar chart of the speedup (total tokens / total time over vanilla's) per method and category (one panel per
    setting), written to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(r["setting"] for r in summary))
    fig, axes = plt.subplots(len(settings), 1, figsize=(13, 3.8 * len(settings)), squeeze=False)
    for ax, setting in zip(axes[:, 0], settings):
        rows = [r for r in summary if r["setting"] == setting and r["method"] != "vanilla"]
        methods = list(dict.fromkeys(r["method"] for r in rows))
        categories = list(dict.fromkeys(r["category"] for r in rows if r["category"] != OVERALL))
        categories = sorted(categories, key=category_sort_key) + [OVERALL]
        width = 0.8 / max(1, len(methods))
        for i, method in enumerate(methods):
            values = {r["category"]: r["speedup"] for r in rows if r["method"] == method}
            xs = [c + (i - (len(methods) - 1) / 2) * width for c in range(len(categories))]
            ax.bar(xs, [values.get(c) or 0.0 for c in categories], width, label=method)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(categories)))
        ax.set_xticklabels(categories, rotation=15)
        ax.set_ylabel("speedup over vanilla\n(total tokens / total time)")
        ax.set_title(setting)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_results(out_dir: str | Path, records: Sequence[dict], meta: dict, plot: bool = True) -> dict[str, Path]:
    """Write results.md, results.json (meta, summary and every record) and results.png into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(records)
    paths = {"md": out_dir / "results.md", "json": out_dir / "results.json"}
    payload = {"meta": meta, "summary": summary, "records": list(records)}
    # each file replaced whole (written aside, then renamed), so an interruption never leaves half a file
    for key, text in (
        ("md", markdown_report(summary, meta, records)),
        ("json", json.dumps(payload, indent=2, default=str)),
    ):
        tmp = paths[key].with_suffix(paths[key].suffix + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(paths[key])
    if plot:
        paths["png"] = plot_speedups(summary, out_dir / "results.png")
    return paths
