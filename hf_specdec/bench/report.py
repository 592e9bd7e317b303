"""Benchmark results: per-prompt records -> per method/category summary -> results.md, results.json, results.png.

A *record* is one timed generate() call of one method on one prompt (or batch), next to vanilla's call on the same
prompt in the same run::

    {"method", "setting", "category", "question_id", "batch", "new_tokens", "time_s", "vanilla_time_s",
     "speedup", "steps", "drafted", "accepted", "match", "first_diff", "error", "nodes_per_row",
     "accepted_per_depth"}

``steps`` / ``drafted`` / ``accepted`` come from ``out.spec_stats`` (None where a method has none), and
``nodes_per_row`` from its tree budget ({nodes verified for a row in a step: how often}), ``accepted_per_depth``
(entry d - 1: the steps that accepted at least d draft tokens, ``SpecStats.accepted_per_depth``); ``match`` is
whether the method's tokens equal vanilla's (greedy only, None otherwise). Metric definitions (as in
docs/results.md): speedup = vanilla wall time / method wall time on the same prompt (the median over prompts is
reported; recorded as the ratio of tokens/s, which is the same number whenever both calls emit the same tokens, as
in greedy decoding, and stays meaningful when sampled answers differ in length), τ = 1 + accepted / steps,
acceptance rate = accepted / drafted.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path

from .questions import category_sort_key

OVERALL = "overall"


def median_speedup(vanilla_times: Sequence[float], method_times: Sequence[float]) -> float:
    """Median over prompts of the per-prompt ratio vanilla time / method time (not a ratio of sums or means)."""
    if len(vanilla_times) != len(method_times) or not method_times:
        raise ValueError("need one vanilla time per method time, and at least one pair")
    return statistics.median(v / m for v, m in zip(vanilla_times, method_times))


def summarize_group(records: Sequence[dict]) -> dict:
    """Aggregate metrics of the records of one method, setting and category."""
    ok = [r for r in records if not r.get("error")]
    errors = [r["error"] for r in records if r.get("error")]
    row: dict = {"prompts": len(records), "ok": len(ok), "errors": len(errors), "error": errors[0] if errors else None}
    total_time = sum(r["time_s"] for r in ok)
    row["tokens_per_s"] = sum(r["new_tokens"] for r in ok) / total_time if ok and total_time > 0 else None
    speedups = [r["speedup"] for r in ok if r.get("speedup") is not None]
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


def markdown_table(summary: Sequence[dict], setting: str) -> str:
    """The Markdown table of one setting (``greedy``, ``t=0.7 top_p=0.9`` ...)."""
    lines = [
        "| method | category | prompts | tokens/s | speedup (median) | τ | acceptance | mismatches vs vanilla | notes |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in summary:
        if row["setting"] != setting:
            continue
        overall = row["category"] == OVERALL
        category = f"**{OVERALL}**" if overall else row["category"]
        mism = "" if row["mismatches"] is None else f"{row['mismatches']}/{row['checked']}"
        if row["mismatches"]:
            mism = f"**{mism}**"
        speed = _fmt(row["median_speedup"], ".2f")
        if overall and speed:
            speed = f"**{speed}x**"
        elif speed:
            speed += "x"
        lines.append(
            f"| {row['method']} | {category} | {row['prompts']} | {_fmt(row['tokens_per_s'], '.1f')} | {speed} | "
            f"{_fmt(row['tau'], '.2f')} | {_fmt(row['acceptance_rate'], '.2f')} | {mism} | {_notes(row)} |"
        )
    return "\n".join(lines)


def speedup_matrix(summary: Sequence[dict], setting: str) -> str:
    """A compact Markdown table of one setting: one row per method, the median speedup per category, overall τ and
    mismatches (Spec-Bench's leaderboard layout)."""
    rows = [r for r in summary if r["setting"] == setting]
    categories = sorted(dict.fromkeys(r["category"] for r in rows if r["category"] != OVERALL), key=category_sort_key)
    head = ["method", *categories, OVERALL, "τ", "tokens/s", "mismatches"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = {r["category"]: r for r in rows if r["method"] == method}
        total = mine[OVERALL]
        cells = [method]
        for c in [*categories, OVERALL]:
            r = mine.get(c)
            if r is None or r["median_speedup"] is None:
                cells.append("failed" if r is not None and r["errors"] else "")
            else:
                cells.append(f"{r['median_speedup']:.2f}x")
        mism = "" if total["mismatches"] is None else f"{total['mismatches']}/{total['checked']}"
        cells += [_fmt(total["tau"], ".2f"), _fmt(total["tokens_per_s"], ".1f"), mism]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_report(summary: Sequence[dict], meta: dict) -> str:
    """The whole results.md: a header with the run's settings, then one table per setting."""
    out = ["# hf-specdec Spec-Bench results", ""]
    keys = (
        "model",
        "device",
        "threads",
        "batch",
        "max_new_tokens",
        "per_category",
        "draft",
        "draft_dtype",
        "questions",
        "clock",
    )
    for key in (*keys, "date"):
        if meta.get(key) is not None:
            out.append(f"- {key.replace('_', ' ')}: {meta[key]}")
    if meta.get("complete") is False:
        out.append("- **partial results**: the run was interrupted or is still going (records so far)")
    out += [
        "",
        "speedup = vanilla `generate` wall time / method wall time on the same prompt, interleaved in one process "
        "(computed as the ratio of tokens/s, which differs only where sampled answers differ in length); the "
        "median over prompts is shown. τ = 1 + accepted draft tokens / verification steps; acceptance = accepted / "
        "drafted draft tokens (blank where the method does not report them). tokens/s = generated tokens / wall time "
        "summed over the category's prompts. Mismatches: prompts whose tokens differ from vanilla's (greedy only).",
    ]
    for setting in dict.fromkeys(r["setting"] for r in summary):
        out += [
            "",
            f"## {setting}",
            "",
            "Median speedup over vanilla per category:",
            "",
            speedup_matrix(summary, setting),
            "",
            "Details:",
            "",
            markdown_table(summary, setting),
        ]
    if meta.get("depth_acceptance"):
        out += ["", depth_acceptance_section(meta["depth_acceptance"])]
    if meta.get("verify_cost"):
        out += ["", cost_curve_section(meta["verify_cost"], meta.get("budgets") or {})]
    return "\n".join(out) + "\n"


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
    """A bar chart of the median speedup per method and category (one panel per setting), written to ``path``."""
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
            values = {r["category"]: r["median_speedup"] for r in rows if r["method"] == method}
            xs = [c + (i - (len(methods) - 1) / 2) * width for c in range(len(categories))]
            ax.bar(xs, [values.get(c) or 0.0 for c in categories], width, label=method)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(categories)))
        ax.set_xticklabels(categories, rotation=15)
        ax.set_ylabel("speedup over vanilla (median)")
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
    for key, text in (("md", markdown_report(summary, meta)), ("json", json.dumps(payload, indent=2, default=str))):
        tmp = paths[key].with_suffix(paths[key].suffix + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(paths[key])
    if plot:
        paths["png"] = plot_speedups(summary, out_dir / "results.png")
    return paths
