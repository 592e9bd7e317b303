"""One source for every figure: a speedup (``1.35x``) or τ (``τ 1.27``) that a page quotes (in prose or in a table's
τ column) is a figure of the results file(s) its section cites (``docs/results/NAME.md`` / ``.json``), and the
generated blocks (``<!-- results:begin ... -->``, tools/render.py) equal what the data renders today.

A section is the text from one ``##`` heading to the next. The figures a section may quote are those of the
files it links or names (`figures_of`), at 1 to 4 decimals: a bench run's speedups (committed and recomputed summary,
each record's, the verify cost curve) and its τ values; any number of another results file (teacher-forced
evaluations, kernel timings). ``1.00x`` and τ 1.00 (vanilla, no
accepted draft) need no source. Figures inside a generated block come from the data by construction (the freshness
test holds them to it), and the section's prose may quote them too (an ``exclude=`` block recomputes a run without
some records).
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import pytest

from hf_specdec.bench.report import summarize
from tools import render

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"

FIGURE = re.compile(r"(?<![\w.])(\d+\.\d+)\s?[x×](?!\w)|τ\s*(?:=|≈|of|is|:)?\s*(\d+\.\d+)")
CITATION = re.compile(r"results/([\w.+-]+)\.(?:md|json|png)\b")
SECTION = re.compile(r"(?m)^(?=## )")
NEED_NO_SOURCE = {"1.00", "1.0"}

# Pages other work is rewriting now, with figures their sections do not cite yet. The test below fails once a page
# here passes, so the entry must then go.
PENDING: set[str] = set()


def notebook_markdown(path: Path) -> str:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


# docs/cli.md is left out: it is the argparse help of the commands, generated (scripts/write_cli_reference.py), and
# its figures are the code's help strings
PAGES = [
    ROOT / "README.md",
    *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "cli.md"),
    *sorted((ROOT / "docs" / "lab").glob("*.md")),
    *sorted((ROOT / "hf_specdec" / "assets").glob("*/README.md")),
    ROOT / "custom_generate" / "README.md",
    *sorted((ROOT / "notebooks").glob("*.ipynb")),
]


def page_text(path: Path) -> str:
    return notebook_markdown(path) if path.suffix == ".ipynb" else path.read_text(encoding="utf-8")


def _numbers(obj, out: set[str]) -> None:
    if isinstance(obj, dict):
        for value in obj.values():
            _numbers(value, out)
    elif isinstance(obj, list):
        for value in obj:
            _numbers(value, out)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out.update(format(obj, spec) for spec in (".1f", ".2f", ".3f", ".4f"))


SPEEDUP_KEYS = ("speedup", "median_speedup")


def _summary_values(rows: list[dict], keys: tuple[str, ...], out: set[str]) -> None:
    _numbers([row.get(k) for row in rows for k in keys], out)


@cache
def figures_of(name: str) -> tuple[frozenset[str], frozenset[str]]:
    """``(speedups, τ values)`` the results file ``docs/results/<name>.json`` holds (empty if there is no such file).

    A bench run's speedups are its summary's ``speedup`` and ``median_speedup`` (committed and recomputed from the
    records), each record's own speedup and the verify cost curve the tree budget learnt (relative to one token); its
    τ values are the summary's ``tau``. Another results file (teacher-forced evaluations, kernel timings) may be
    quoted for any number it holds."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        return frozenset(), frozenset()
    data = json.loads(path.read_text(encoding="utf-8"))
    speedups: set[str] = set()
    taus: set[str] = set()
    if isinstance(data, dict) and "records" in data and "summary" in data:
        rows = [*data["summary"], *summarize(data["records"])]
        _summary_values(rows, SPEEDUP_KEYS, speedups)
        _summary_values(rows, ("tau",), taus)
        _numbers([r.get("speedup") for r in data["records"]], speedups)
        _numbers(((data.get("meta") or {}).get("verify_cost") or {}).get("relative") or {}, speedups)
    else:
        _numbers(data, speedups)
        taus = speedups
    return frozenset(speedups), frozenset(taus)


def unsourced_figures(text: str) -> list[str]:
    """``line: figure (cites ...)`` for every quoted figure that no file its section cites holds."""
    found = []
    line_no = 1
    for section in SECTION.split(text):
        cited = sorted(set(CITATION.findall(section)))
        speedups = set(NEED_NO_SOURCE).union(*(figures_of(n)[0] for n in cited))
        taus = set(NEED_NO_SOURCE).union(*(figures_of(n)[1] for n in cited))
        generated = "".join(found.group("body") for found in render.BLOCK.finditer(section))
        for m in FIGURE.finditer(generated):
            (speedups if m.group(1) else taus).add(m.group(1) or m.group(2))
        tau_column = None  # the index of a table's "τ" column, while inside that table
        for offset, line in enumerate(section.splitlines()):
            cells = [c.strip().strip("*") for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
            if not cells:
                tau_column = None
            elif tau_column is None and "τ" in cells:
                tau_column = cells.index("τ")
            elif tau_column is not None and tau_column < len(cells) and re.fullmatch(r"\d+\.\d+", cells[tau_column]):
                if cells[tau_column] not in taus and line not in generated:
                    where = ", ".join(cited) if cited else "no results file"
                    found.append(f"line {line_no + offset}: τ column {cells[tau_column]!r} (section cites {where})")
            for match in FIGURE.finditer(line):
                value = match.group(1) or match.group(2)
                if value not in (speedups if match.group(1) else taus):
                    where = ", ".join(cited) if cited else "no results file"
                    found.append(f"line {line_no + offset}: {match.group(0)!r} (section cites {where})")
        line_no += section.count("\n")
    return found


def test_the_figure_check_catches_a_figure_the_data_does_not_hold():
    cited = "## Run\n\nSee [run](results/amd_sharegpt_eagle_batch1_seed0.md): medusa {} with τ 1.27.\n"
    assert unsourced_figures(cited.format("1.35x")) == []
    assert [f.split(": ", 1)[1] for f in unsourced_figures(cited.format("1.41x"))] == [
        "'1.41x' (section cites amd_sharegpt_eagle_batch1_seed0)"
    ]
    # a table's τ column is held to the run's τ values
    table = "\n| method | overall | τ |\n|---|---:|---:|\n| medusa | 1.35x | {} |\n"
    assert unsourced_figures(cited.format("1.35x") + table.format("1.27")) == []
    assert [f.split(": ", 1)[1] for f in unsourced_figures(cited.format("1.35x") + table.format("1.41"))] == [
        "τ column '1.41' (section cites amd_sharegpt_eagle_batch1_seed0)"
    ]
    # a figure in a section that cites nothing has no source
    assert len(unsourced_figures("## Other\n\nmedusa 1.35x\n" + cited.format("1.35x"))) == 1
    # medians of an older run count, and so do its totals recomputed from the records
    assert unsourced_figures("results/greedy_batch1.md: 1.29x, τ 1.88\n") == []
    # a speedup is not any number of the run: vanilla's 23.0 tokens/s is no "23.00x", a τ is no speedup
    assert len(unsourced_figures(cited.format("23.00x"))) == 1
    assert len(unsourced_figures(cited.format("2.59x"))) == 1  # a τ of the run (ngram on rag), not a speedup


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_quoted_figure_is_in_the_data_it_cites(page):
    rel = str(page.relative_to(ROOT))
    found = unsourced_figures(page_text(page))
    if rel in PENDING:
        assert found, f"{rel} now quotes only figures its sections cite: remove it from PENDING"
        pytest.skip(f"{rel}: {len(found)} figures without a cited source, being rewritten elsewhere")
    assert not found, (
        f"{rel} quotes figures that are not in the results its section cites (cite the run, or take the figure "
        "from it; a generated block: python scripts/render_results.py):\n" + "\n".join(found)
    )


def test_the_generated_blocks_are_fresh():
    stale = render.stale_blocks(ROOT)
    assert not stale, "blocks that differ from their data (python scripts/render_results.py):\n" + "\n".join(stale)


def test_the_pages_quote_the_newest_runs_through_generated_blocks():
    """The README's headline table, docs/results.md and every model card hold generated figures."""
    names = {(str(b.page.relative_to(ROOT)), b.name) for page in render.pages(ROOT) for b in render.blocks(page)}
    assert ("README.md", "headline") in names
    assert ("docs/results.md", "runs") in names
    for card in sorted((ROOT / "hf_specdec" / "assets").glob("*/README.md")):
        assert (str(card.relative_to(ROOT)), "card") in names, f"{card.parent.name}: no generated figures"


def test_a_hand_edited_block_is_stale(tmp_path):
    page = tmp_path / "README.md"
    source = "docs/results/amd_sharegpt_eagle_batch1_seed0.json"
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / source).write_bytes((ROOT / source).read_bytes())
    page.write_text(f"x\n<!-- results:begin card {source} method=medusa -->\nold\n<!-- results:end -->\ny\n")
    assert render.stale_blocks(tmp_path) == [f"README.md: card {source}"]
    page.write_text(render.render_page(page, tmp_path))
    assert render.stale_blocks(tmp_path) == []
    text = page.read_text()
    assert text.startswith("x\n") and text.endswith("y\n") and "| `medusa` | 1.27 | 1.35x |" in text


def test_a_runs_block_shows_the_columns_it_names(tmp_path):
    """``columns=overall,tau,mismatches,tokens_per_s``: those columns per run, vanilla first for its tokens/s; an
    unknown column is refused by name."""
    source = "docs/results/amd_sharegpt_eagle_batch1_seed0.json"
    run = render.Run.load(source, ROOT)
    text = render.render_runs(
        [run], tmp_path / "page.md", {"labels": "fp32", "columns": "overall,tau,mismatches,tokens_per_s"}
    )
    head, _rule, first, *rows = text.split("\n\n")[0].splitlines()
    assert head == "| method | fp32 overall | τ | mismatches | tokens/s |"
    assert first == f"| vanilla | 1.00x |  |  | {run.row('vanilla')['tokens_per_s']:.1f} |"
    eagle = run.row("eagle")
    assert f"| eagle | {eagle['speedup']:.2f}x | {eagle['tau']:.2f} | 0/24 | {eagle['tokens_per_s']:.1f} |" in rows
    with pytest.raises(ValueError, match="unknown runs columns \\['speed'\\]"):
        render.render_runs([run], tmp_path / "page.md", {"columns": "overall,speed"})


def test_a_card_of_a_candidate_shows_its_rows_under_the_methods_names_then_the_head_it_replaced(tmp_path):
    """``method=eagle@candidate``: the A/B run's ``eagle@candidate`` rows as ``eagle``, the replaced head's after."""
    run = render.Run.load("docs/results/amd_sharegpt_eagle_batch1_seed0.json", ROOT)
    twins = [{**r, "method": r["method"] + "@candidate", "tau": r["tau"] + 1.0} for r in run.summary
             if r["method"] in ("eagle", "ngram+eagle")]  # fmt: skip
    run.summary = run.summary + twins
    text = render.render_card([run], tmp_path / "README.md", {"method": "eagle@candidate"})
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert [row.split(" | ")[0] for row in rows] == [
        "| `eagle`", "| `ngram+eagle`", "| `ngram`", "| `eagle`, the head it replaced",
        "| `ngram+eagle`, the head it replaced",
    ]  # fmt: skip
    assert render.tau(run.row("eagle@candidate")) in rows[0] and render.tau(run.row("eagle")) in rows[3]
    assert "the head it replaced" not in render.render_card([run], tmp_path / "README.md", {"method": "eagle"})
