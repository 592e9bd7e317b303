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
"""

LEGEND = (
    '<div class="hfsd-legend"><span class="hfsd-drafted">accepted draft token</span>'
    '<span class="hfsd-target">the target\'s own token</span></div>'
)


def speed_line(tokens: int, seconds: float, done: bool, extra: str = "") -> str:
    """``"42 tokens · 3.1 s · 13.5 tokens/s"`` (with "running…" until done)."""
    rate = tokens / seconds if seconds > 0 else 0.0
    state = "" if done else " · running…"
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


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def depth_chart(per_depth: Sequence[float]):
    """A bar chart of the fraction of verification steps that accepted at least d draft tokens, d = 1, 2, ...

    Args:
        per_depth: ``spec_stats.per_depth_acceptance`` (entry d-1 for depth d).
    Returns:
        a matplotlib figure (closed for pyplot, so figures do not pile up in a long-running server).
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 2.8))
    depths = list(range(1, len(per_depth) + 1))
    ax.bar(depths, list(per_depth), color="#22c55e")
    ax.set_xlabel("depth d (drafted tokens accepted in one step)")
    ax.set_ylabel("steps accepting ≥ d")
    ax.set_ylim(0, 1)
    ax.set_xticks(depths or [1])
    if not depths:
        ax.set_title("no drafted token was accepted")
    fig.tight_layout()
    plt.close(fig)
    return fig


def bench_chart(summary: Sequence[dict], category: str):
    """Median speedup and τ per method on one Spec-Bench category, side by side.

    Args:
        summary: `hf_specdec.bench.report.summarize` rows.
        category: the category to plot.
    Returns:
        a matplotlib figure.
    """
    plt = _pyplot()
    rows = [r for r in summary if r["category"] == category and r["method"] != "vanilla"]
    methods = [r["method"] for r in rows]
    fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(10, 3.4))
    ax_s.bar(methods, [r["median_speedup"] or 0.0 for r in rows], color="#3b82f6")
    ax_s.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax_s.set_ylabel("speedup over vanilla (median)")
    ax_t.bar(methods, [r["tau"] or 0.0 for r in rows], color="#22c55e")
    ax_t.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax_t.set_ylabel("τ (mean accepted length)")
    for ax in (ax_s, ax_t):
        ax.tick_params(axis="x", rotation=15)
        ax.set_title(category)
    fig.tight_layout()
    plt.close(fig)
    return fig
