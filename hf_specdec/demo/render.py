"""What the demo page shows: token panes as HTML, the per-depth acceptance chart and the benchmark charts."""

from __future__ import annotations

import html
from collections.abc import Sequence

from .streaming import DRAFTED

CSS = """
.hfsd-pane {border: 1px solid var(--border-color-primary); border-radius: 8px; padding: 10px; min-height: 180px;}
.hfsd-head {font-size: 0.9em; margin-bottom: 6px; opacity: 0.85;}
.hfsd-text {white-space: pre-wrap; font-family: var(--font-mono); font-size: 0.92em; line-height: 1.5;}
.hfsd-drafted {background: rgba(34, 197, 94, 0.30); border-radius: 3px; box-shadow: inset -1px 0 0 rgba(0,0,0,0.25);}
.hfsd-target {background: rgba(59, 130, 246, 0.18); border-radius: 3px; box-shadow: inset -1px 0 0 rgba(0,0,0,0.25);}
.hfsd-legend span {padding: 1px 6px; margin-right: 8px;}
.hfsd-sampling:has(input:disabled) {opacity: 0.45;}
"""

LEGEND = (
    '<div class="hfsd-legend"><span class="hfsd-drafted">accepted draft token</span>'
    '<span class="hfsd-target">the target\'s own token</span></div>'
)


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
        ax.tick_params(colors=INK, which="both")
        for spine in ax.spines.values():
            spine.set_color(INK)
        for text in (ax.title, ax.xaxis.label, ax.yaxis.label):
            text.set_color(INK)


def depth_chart(per_depth: Sequence[float]):
    """A bar chart of the fraction of verification steps that accepted at least d draft tokens, d = 1, 2, ...

    Args:
        per_depth: ``spec_stats.per_depth_acceptance`` (entry d-1 for depth d).
    Returns:
        a matplotlib figure (closed for pyplot, so figures do not pile up in a long-running server), titled inside
        the figure (the page shows it without a label over it).
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.0))
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


def bench_chart(summary: Sequence[dict], category: str):
    """The speedup (total tokens / total time over vanilla's) and τ per method on one Spec-Bench category, as
    horizontal bars (the method names stay readable however many there are).

    Args:
        summary: `hf_specdec.bench.report.summarize` rows.
        category: the category to plot.
    Returns:
        a matplotlib figure.
    """
    plt = _pyplot()
    rows = [r for r in summary if r["category"] == category and r["method"] != "vanilla"][::-1]  # best-known on top
    methods = [r["method"] for r in rows]
    fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(10, 0.9 + 0.45 * max(1, len(rows))), sharey=True)
    ax_s.barh(methods, [r["speedup"] or 0.0 for r in rows], color=BLUE)
    ax_s.axvline(1.0, color=INK, linewidth=0.8, linestyle="--")
    ax_s.set_xlabel("speedup over vanilla (total tokens / total time)")
    ax_t.barh(methods, [r["tau"] or 0.0 for r in rows], color=GREEN)
    ax_t.axvline(1.0, color=INK, linewidth=0.8, linestyle="--")
    ax_t.set_xlabel("τ (tokens per verify step)")
    fig.suptitle(category, color=INK)
    _themed(fig, [ax_s, ax_t])
    fig.tight_layout()
    plt.close(fig)
    return fig
