"""What the demo page shows: token panes as HTML, the per-depth acceptance chart and the benchmark charts."""

from __future__ import annotations

import html
from collections.abc import Sequence

from .speed import Spread
from .streaming import DRAFTED

CSS = """
.hfsd-pane {border: 1px solid var(--border-color-primary); border-radius: 8px; padding: 10px; min-height: 180px;}
.hfsd-head {font-size: 0.9em; margin-bottom: 6px; opacity: 0.85;}
.hfsd-text {white-space: pre-wrap; font-family: var(--font-mono); font-size: 0.92em; line-height: 1.5;}
.hfsd-drafted {background: rgba(34, 197, 94, 0.30); border-radius: 3px; box-shadow: inset -1px 0 0 rgba(0,0,0,0.25);}
.hfsd-target {background: rgba(59, 130, 246, 0.18); border-radius: 3px; box-shadow: inset -1px 0 0 rgba(0,0,0,0.25);}
.hfsd-legend span {padding: 1px 6px; margin-right: 8px;}
.hfsd-sampling:has(input:disabled) {opacity: 0.45;}
#bench-chart img {max-width: 760px;}
@media (max-width: 600px) {
  .hfsd-stack {flex-direction: column !important; flex-wrap: nowrap !important;}
  .hfsd-stack > * {width: 100% !important; min-width: 0 !important; max-width: 100% !important;}
  .hfsd-pane {min-height: 80px;}
  #depth, #bench-chart {width: 100% !important; min-width: 0 !important;}
  #depth img, #bench-chart img {width: 100% !important; max-width: 100%; height: auto !important;}
  #bench-table table {display: block; overflow-x: auto; white-space: nowrap;}  /* scrolls, never one letter a line */
}
"""

LEGEND = (
    '<div class="hfsd-legend"><span class="hfsd-drafted">accepted draft token</span>'
    '<span class="hfsd-target">the target\'s own token</span></div>'
)


def speedup_text(value: float | None) -> str:
    """``"1.23×"`` ("n/a" when not measured)."""
    return "n/a" if value is None else f"{value:.2f}×"


def spread_text(spread: Spread | None, unit: str = "×") -> str:
    """``"1.10× – 1.31× (median 1.20×, 3 runs)"``; "" for fewer than two runs (one run measures no spread)."""
    if spread is None or spread.n < 2:
        return ""
    return f"{spread.low:.2f}{unit} – {spread.high:.2f}{unit} (median {spread.median:.2f}{unit}, {spread.n} runs)"


def speed_line(tokens: int, seconds: float, done: bool, extra: str = "", stopped: bool = False) -> str:
    """``"42 tokens · 3.1 s · 13.5 tokens/s"`` (with "running…" until done, "stopped" when the user stopped it)."""
    rate = tokens / seconds if seconds > 0 else 0.0
    state = " · <b>stopped</b>" if stopped else ("" if done else " · running…")
    return f"{tokens} tokens · {seconds:.1f} s · <b>{rate:.1f} tokens/s</b>{extra}{state}"


def pane(title: str, head: str, pieces: Sequence[str], origins: Sequence[str] | None = None, elem_class="") -> str:
    """A titled box with a status line and the generated text; with ``origins`` every token is a coloured span.

    Args:
        title: e.g. "vanilla generate".
        head: the status line (HTML).
        pieces: the text of each token.
        origins: one origin per piece (`streaming.DRAFTED` / `streaming.TARGET`), or None for plain text.
        elem_class: an extra CSS class on the box (tests and the browser test find the panes by it).
    """
    if origins is None:
        body = html.escape("".join(pieces))
    else:
        body = "".join(
            f'<span class="hfsd-{origin}">{html.escape(piece)}</span>'
            for piece, origin in zip(pieces, origins)
            if piece
        )
    return (
        f'<div class="hfsd-pane {elem_class}"><div class="hfsd-head"><b>{html.escape(title)}</b> · {head}</div>'
        f'<div class="hfsd-text">{body}</div></div>'
    )


def origin_counts(origins: Sequence[str]) -> tuple[int, int]:
    """(accepted draft tokens, the target's own tokens)."""
    drafted = sum(1 for o in origins if o == DRAFTED)
    return drafted, len(origins) - drafted


# Charts are drawn on a transparent background in a grey that reads on Gradio's light and dark themes alike.
INK = "#8b95a5"
CHART_FONT = 12  # points, on figures about 5 inches wide: still legible when a phone shows them 330 px wide
GREEN, BLUE = "#22c55e", "#3b82f6"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _themed(fig, axes) -> None:
    """Transparent figure and axes, text, ticks and frames in `INK` (no white box in the dark theme)."""
    fig.patch.set_alpha(0.0)
    for ax in axes:
        ax.set_facecolor("none")
        ax.tick_params(colors=INK, which="both", labelsize=CHART_FONT)
        for spine in ax.spines.values():
            spine.set_color(INK)
        for text in (ax.title, ax.xaxis.label, ax.yaxis.label):
            text.set_color(INK)
            text.set_fontsize(CHART_FONT)


def depth_chart(per_depth: Sequence[float]):
    """A bar chart of the fraction of verification steps that accepted at least d draft tokens, d = 1, 2, ...

    Args:
        per_depth: ``spec_stats.per_depth_acceptance`` (entry d-1 for depth d).
    Returns:
        a matplotlib figure (closed for pyplot, so figures do not pile up in a long-running server), titled inside
        the figure (the page shows it without a label over it).
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(4.6, 2.9))
    depths = list(range(1, len(per_depth) + 1))
    ax.bar(depths, list(per_depth), color=GREEN)
    ax.set_xlabel("d: drafted tokens accepted in one verify step")
    ax.set_ylabel("share of steps accepting ≥ d")
    ax.set_ylim(0, 1)
    ax.set_xticks(depths or [1])
    ax.set_title("Per-depth acceptance" if depths else "Per-depth acceptance: no drafted token was accepted")
    _themed(fig, [ax])
    fig.tight_layout()
    plt.close(fig)
    return fig


BENCH_COLUMNS = (
    "| method | questions | tokens/s | speedup | spread over runs | τ | step cost | acceptance | identical |"
)


def bench_line(row: dict) -> str:
    """One Markdown line of the Benchmark tab's table (`bench_tab.Board.rows`)."""
    questions = f"{row['questions']}/{row['of']}"
    if row["status"] != "done":
        note = f"error: {str(row['error']).splitlines()[0][:90]}" if row["status"] == "error" else row["status"]
        return f"| {row['method']} | {questions} | {note.replace('|', '/')} | | | | | | |"
    rate = f"{row['tokens_per_s']:.1f}"
    if row["method"] == "vanilla":
        return f"| vanilla | {questions} | {rate} | 1.00× (baseline) | | | | | |"
    cost = row["step_cost"]
    cells = [row["method"], questions, rate, f"**{speedup_text(row['speedup'])}**",
             spread_text(row["spread"]) or "one run", f"{row['tau']:.2f}",
             "n/a" if cost is None else f"{cost:.2f}×", f"{row['acceptance']:.2f}", row["identical"]]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def bench_table(rows: Sequence[dict], category: str) -> str:
    """The Benchmark tab's results: one line per method (vanilla first), on ``category``."""
    align = "|---|---:|---:|---:|---|---:|---:|---:|---:|"
    return "\n".join([f"**{category}**, greedy, batch 1", "", BENCH_COLUMNS, align, *map(bench_line, rows)])


def bench_chart(rows: Sequence[dict], category: str):
    """The speedup per method (bars, with the spread over runs as a whisker) and τ, as horizontal bars in two panels
    one above the other (readable on a phone's narrow screen as on a desktop).

    Args:
        rows: `bench_tab.Board.rows` (methods without a finished question are left out).
        category: the chart's title.
    Returns:
        a matplotlib figure.
    """
    plt = _pyplot()
    rows = [r for r in rows if r["status"] == "done" and r["method"] != "vanilla"][::-1]  # first chosen on top
    names = [r["method"] for r in rows]
    height = 1.2 + 0.42 * max(1, len(rows))
    fig, (ax_s, ax_t) = plt.subplots(2, 1, figsize=(4.8, 2 * height), sharey=True)
    ax_s.barh(names, [r["speedup"] for r in rows], color=BLUE)
    _whiskers(ax_s, rows)
    ax_s.axvline(1.0, color=INK, linewidth=0.8, linestyle="--")
    ax_s.set_xlabel("speedup over vanilla (— = spread over runs)")
    ax_t.barh(names, [r["tau"] for r in rows], color=GREEN)
    ax_t.axvline(1.0, color=INK, linewidth=0.8, linestyle="--")
    ax_t.set_xlabel("τ (tokens per verify step)")
    fig.suptitle(category, color=INK, fontsize=CHART_FONT + 1)
    _themed(fig, [ax_s, ax_t])
    fig.tight_layout()
    plt.close(fig)
    return fig


def _whiskers(ax, rows: Sequence[dict]) -> None:
    """The spread over runs as a whisker on each bar."""
    for y, row in enumerate(rows):
        spread = row.get("spread")
        if spread is not None and spread.n > 1:
            ax.plot([spread.low, spread.high], [y, y], color=INK, linewidth=1.5)
    highs = [r["spread"].high for r in rows if r.get("spread") is not None]
    ax.set_xlim(0, max([r["speedup"] for r in rows] + highs + [1.0]) * 1.15)
