"""The results page (docs/results.md) and the README's Results section name, for every figure, the record it comes
from, and that record holds it (issue 69: one source for every figure a user reads).

A page is cut into units: a generated block (``<!-- results:begin RENDERER FILES ... -->``, written by
``python scripts/render_results.py``), a table row, a bullet item, a paragraph. A unit's records are the results
files (``docs/results/NAME.json``; a link to the run's ``NAME.md`` report or ``NAME.png`` chart names the same
record) that the unit links, a generated block's are the files its marker names, and a table row that links none
has its table's: those the paragraph right above the table links. Every figure of a unit must be held by its records:

- a speedup (``1.59x``) by a bench run's speedups (the summary's overall and median ratios, committed and recomputed
  from the records, each record's own ratio, the verify cost curve relative to one token; a block with ``exclude=``
  also the summary without those records), or by any number of another results file (an evaluation, a kernel
  timing);
- a τ (``τ 2.65``) by the run's τ values; a cell of a table's τ column or ``overall`` column by the τ or speedup
  of the row's method over all its prompts (not a category's);
- any other decimal number (tokens/s, top-1, a seconds figure) by any number of the records, to the decimals shown.

``1.00x`` and τ ``1.00`` (vanilla, or no accepted draft) need no record. test_figures.py holds each generated
block to exactly what its data renders; this test holds the hand-written figures to a record named beside them.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import pytest

from hf_specdec.bench.report import summarize

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"

SPEEDUP = re.compile(r"(?<![\w.])(\d+\.\d+)\s?[x×](?!\w)")
TAU = re.compile(r"(?:τ|\btau\b)\s*(?:=|≈|of|is|:)?\s*(\d+\.\d+)(?![\w.]|\s?[x×])")
DECIMAL = re.compile(r"(?<![\w.\-/])(\d+\.\d+)(?![\w.]|\s?[x×%])")
CITATION = re.compile(r"results/([\w.+-]+?)\.(?:md|json|png)\b")
BLOCK = re.compile(r"<!-- results:begin (?P<spec>[^>]*?) -->\n(?P<body>.*?)<!-- results:end -->", re.DOTALL)
NEED_NO_RECORD = {"1.00", "1.0"}


def _formatted(values, out: set[str]) -> None:
    """Every number in ``values`` (nested lists and dicts), as it may be printed: 1 to 4 decimals."""
    if isinstance(values, dict):
        for value in values.values():
            _formatted(value, out)
    elif isinstance(values, (list, tuple)):
        for value in values:
            _formatted(value, out)
    elif isinstance(values, (int, float)) and not isinstance(values, bool):
        out.update(format(values, f".{d}f") for d in (1, 2, 3, 4))


class Held:
    """The figures a set of records holds, per method: ``speedups``, ``taus``, and ``numbers`` (any number in them)."""

    def __init__(self) -> None:
        self.by_method: dict[str, dict[str, set[str]]] = {}
        self.numbers: set[str] = set(NEED_NO_RECORD)

    def add(self, name: str, exclude: tuple[str, ...] = (), per_record: bool = False) -> bool:
        """Adds record ``name``'s figures (``per_record``: each record's own speedup too); False if there is no
        ``docs/results/<name>.json``."""
        by_method, numbers = record_figures(name, exclude, per_record)
        if not numbers:
            return False
        for method, figures in by_method.items():
            mine = self.by_method.setdefault(method, {kind: set(NEED_NO_RECORD) for kind in KINDS})
            for kind in KINDS:
                mine[kind].update(figures[kind])
        self.numbers |= numbers
        return True

    def pools(self, methods: set[str]) -> dict[str, set[str]]:
        """What a figure beside ``methods`` may be (every method's where none of them is the records')."""
        picked = [self.by_method[m] for m in methods if m in self.by_method] or list(self.by_method.values())
        pools = {kind: set(NEED_NO_RECORD).union(*(p[kind] for p in picked)) for kind in KINDS}
        return {**pools, "number": self.numbers}


# a speedup or τ anywhere in the run, and one of a method's overall rows (what a table's overall and τ columns show)
KINDS = ("speedup", "τ", "overall speedup", "overall τ")
ANY = "*"  # the method of a results file that is not a bench run: its numbers are any method's


@cache
def record_figures(name: str, exclude: tuple[str, ...] = (), per_record: bool = False) -> tuple[dict, frozenset]:
    """``({method: (speedups, τ values)}, every number)`` of ``docs/results/<name>.json`` (empty if none).

    A bench run's speedups are, per method (``eagle@candidate`` counts as ``eagle``), its summary's overall and
    per-category ratios and medians, committed and recomputed from the records (and without ``exclude``), and the
    verify cost curve relative to one token; ``per_record``: each record's own ratio too (what a generated sample
    prints). Another results file's numbers may be any figure."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        return {}, frozenset()
    data = json.loads(path.read_text(encoding="utf-8"))
    numbers: set[str] = set()
    _formatted(data, numbers)
    if not (isinstance(data, dict) and "summary" in data and "records" in data and isinstance(data["summary"], list)):
        return {ANY: {kind: frozenset(numbers) for kind in KINDS}}, frozenset(numbers)
    records = data["records"]
    rows = [*data["summary"], *summarize(records)]
    if exclude:
        rows += summarize([r for r in records if str(r.get("question_id")) not in exclude])
    _formatted(rows, numbers)
    by_method: dict[str, dict[str, set[str]]] = {}
    curve: set[str] = set()
    _formatted(((data.get("meta") or {}).get("verify_cost") or {}).get("relative") or {}, curve)
    for row in rows:
        mine = by_method.setdefault(row["method"].split("@")[0], {kind: set() for kind in KINDS})
        mine["speedup"].update(curve)
        _formatted([row.get("speedup"), row.get("median_speedup")], mine["speedup"])
        _formatted(row.get("tau"), mine["τ"])
        if row.get("category") == "overall":
            _formatted(row.get("speedup"), mine["overall speedup"])
            _formatted(row.get("tau"), mine["overall τ"])
    if per_record:
        for record in records:
            mine = by_method.setdefault(record["method"].split("@")[0], {kind: set() for kind in KINDS})
            _formatted(record.get("speedup"), mine["speedup"])
    return by_method, frozenset(numbers)


def units(text: str, first_line: int = 1) -> list[tuple[int, str, str, list[str]]]:
    """``(line, kind, text, records)`` for every generated block, table row, bullet item and paragraph of ``text``
    outside code fences; ``records`` are the ``(name, exclude)`` results files the unit names (module docstring)."""
    out: list = []
    lines = text.splitlines()
    i = 0
    lead_in: list[str] = []  # the records of the paragraph just above, for a table that follows it
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].lstrip().startswith("```")), len(lines))
            i, lead_in = end + 1, []
            continue
        block = BLOCK.match("\n".join(lines[i:]) + "\n")
        if block:
            words = block.group("spec").split()
            options = dict(w.split("=", 1) for w in words[2:] if "=" in w)
            exclude = tuple(q for q in options.get("exclude", "").split(",") if q)
            names = [Path(s).stem for s in words[1].split(",")] if len(words) > 1 else []
            body = block.group("body")
            records = [(n, exclude) for n in names] + [(n, ()) for n in CITATION.findall(body)]
            out.append((first_line + i, "generated block", body, records))
            i += block.group(0).count("\n") + 1
            lead_in = []
            continue
        if line.lstrip().startswith("|"):
            table_records, header = lead_in + [(n, ()) for n in CITATION.findall(lines[i])], lines[i]
            i += 1
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                row = lines[i]
                own = [(n, ()) for n in CITATION.findall(row)]
                if not re.fullmatch(r"[|:\-\s]+", row):  # the rule under the header
                    out.append((first_line + i, "table row", f"{header}\n{row}", own or table_records))
                i += 1
            lead_in = []
            continue
        if not line.strip() or line.lstrip().startswith(("#", "<!--")):
            i += 1
            if line.strip():
                lead_in = []
            continue
        start, part = i, [line]
        i += 1
        bullet = line.lstrip().startswith(("- ", "* "))
        while i < len(lines) and lines[i].strip() and not lines[i].lstrip().startswith(("|", "#", "<!--", "```")):
            if bullet and lines[i].lstrip().startswith(("- ", "* ")):
                break
            part.append(lines[i])
            i += 1
        paragraph = "\n".join(part)
        records = [(n, ()) for n in CITATION.findall(paragraph)]
        out.append((first_line + start, "bullet" if bullet else "paragraph", paragraph, records))
        lead_in = records
    return out


def _figures(kind: str, text: str) -> list[tuple[str, str]]:
    """``(what, value)`` of every figure in a unit: ``speedup``, ``τ`` or ``number``."""
    plain = re.sub(r"\]\([^)]*\)", "]", text)  # a link's address holds no figures
    plain = re.sub(r"`[^`]*`", "", plain)  # nor does code (a method name, a command's options)
    found: list[tuple[str, str]] = []
    taken: set[int] = set()
    for m in SPEEDUP.finditer(plain):
        found.append(("speedup", m.group(1)))
        taken.update(range(*m.span(1)))
    for m in TAU.finditer(plain):
        found.append(("τ", m.group(1)))
        taken.update(range(*m.span(1)))
    header: list[str] = []
    for line in plain.splitlines():
        if not line.lstrip().startswith("|"):
            header = []
            continue
        cells = [c.strip().strip("*").strip() for c in line.strip().strip("|").split("|")]
        if not header:
            header = cells
            continue
        for col, cell in enumerate(cells):
            if col < len(header) and (header[col] == "τ" or header[col].endswith(" τ")) and DECIMAL.fullmatch(cell):
                found.append(("overall τ", cell))
            elif col < len(header) and (header[col] == "overall" or header[col].endswith(" overall")):
                overall = SPEEDUP.fullmatch(cell)
                if overall:
                    found.append(("overall speedup", overall.group(1)))
                    found.remove(("speedup", overall.group(1)))
    tau_cells = {v for w, v in found if w.endswith("τ")}
    for m in DECIMAL.finditer(plain):
        if m.start(1) not in taken and m.group(1) not in tau_cells:
            found.append(("number", m.group(1)))
    return found


METHOD = re.compile(r"`([a-z][\w+-]*)`")
SENTENCE_END = re.compile(r"(?<=[.;!?])\s+(?=[A-Z`(*\[])")
# a figure goes with the methods named in its own clause: "`eagle` 1.09x, `medusa` 1.02x, the heads 1.10x"
CLAUSE = re.compile(r"[;,:]\s|\s(?:and|against|vs\.?|versus|than|while)\s")


def pieces(kind: str, body: str) -> list[tuple[set[str], str]]:
    """``(methods, text)``: a table row with the method its first cell names, a paragraph's clauses with the
    methods each names in code (``eagle``; none: any method of the records); a generated block as a whole (its rows are held to exactly what the data
    renders by test_figures.py)."""
    if kind == "generated block":
        return [(set(), body)]
    if kind == "table row":
        first = body.splitlines()[-1].strip().strip("|").split("|")[0]
        named = METHOD.findall(first) or re.findall(r"^\s*([a-z][\w+-]*)", first)
        return [(set(named[:1]), body)]
    joined = " ".join(body.split())
    clauses = [c for sentence in SENTENCE_END.split(joined) for c in CLAUSE.split(sentence)]
    return [(set(METHOD.findall(clause)), clause) for clause in clauses]


def unheld_figures(text: str, first_line: int = 1, only: tuple[str, ...] = ()) -> list[str]:
    """``line: figure (kind names ...)`` for every figure its unit's records do not hold, and every unit with a
    figure that names no record; ``only``: just those kinds of figure (``speedup``, ``τ``, ...)."""
    problems = []

    def wanted(what: str) -> bool:
        return not only or any(what.endswith(kind) for kind in only)

    for line, kind, body, records in units(text, first_line):
        figures = [(w, v) for w, v in _figures(kind, body) if v not in NEED_NO_RECORD and wanted(w)]
        if not figures:
            continue
        if not records:
            values = ", ".join(v for _, v in figures[:4])
            problems.append(f"line {line}: a {kind} with figures ({values}) names no record")
            continue
        held = Held()
        per_record = kind == "generated block"
        missing = [f"{n}.json" for n, exclude in dict.fromkeys(records) if not held.add(n, exclude, per_record)]
        if missing:
            problems.append(f"line {line}: a {kind} names {', '.join(missing)}, which does not exist")
        names = ", ".join(dict.fromkeys(n for n, _ in records))
        for methods, piece in pieces(kind, body):
            pools = held.pools(methods)
            for what, value in _figures(kind, piece):
                if value not in NEED_NO_RECORD and wanted(what) and value not in pools[what]:
                    whose = f" for {', '.join(sorted(methods))}" if methods & set(held.by_method) else ""
                    problems.append(
                        f"line {line}: {what} {value}{whose} is not in the record(s) its {kind} names ({names})"
                    )
    return problems


def section(text: str, heading: str) -> tuple[int, str]:
    """``(first line number, text)`` of the ``## heading`` section of a page."""
    start = text.index(f"\n## {heading}\n") + 1
    end = text.find("\n## ", start + 1)
    return text.count("\n", 0, start) + 1, text[start : end if end > 0 else len(text)]


def test_the_check_catches_a_figure_without_its_record():
    cite = "[record](results/amd_sharegpt_eagle_batch1_seed0.md)"
    assert unheld_figures(f"`medusa` 1.35x, τ 1.27 ({cite}).\n") == []
    assert unheld_figures(f"`medusa` 1.41x, τ 1.27 ({cite}).\n") == [
        "line 1: speedup 1.41 for medusa is not in the record(s) its paragraph names (amd_sharegpt_eagle_batch1_seed0)"
    ]
    # a figure is held by the method it is quoted for: 1.25x is `eagle`'s, not `medusa`'s
    assert unheld_figures(f"`eagle` 1.25x ({cite}).\n") == []
    assert unheld_figures(f"`medusa` 1.25x, τ 1.27 ({cite}).\n") == [
        "line 1: speedup 1.25 for medusa is not in the record(s) its paragraph names (amd_sharegpt_eagle_batch1_seed0)"
    ]
    assert unheld_figures(f"`eagle` 1.26x, `medusa` 1.35x (τ 1.27), the heads 1.43x ({cite}).\n") == []
    assert unheld_figures(f"`medusa` 1.35x, τ 4.71 ({cite}).\n") == [
        "line 1: τ 4.71 is not in the record(s) its paragraph names (amd_sharegpt_eagle_batch1_seed0)"
    ]
    # the record is named where the figure stands: the paragraph before names it, the next paragraph does not
    assert unheld_figures(f"See {cite}.\n\n`medusa` 1.35x.\n") == [
        "line 3: a paragraph with figures (1.35) names no record"
    ]
    # a record that does not exist, a tokens/s figure no record holds
    assert unheld_figures("`medusa` 1.35x ([r](results/no_such_run.md)).\n") == [
        "line 1: a paragraph names no_such_run.json, which does not exist",
        "line 1: speedup 1.35 is not in the record(s) its paragraph names (no_such_run)",
    ]
    assert unheld_figures(f"vanilla at 23.0 tokens/s, 99.5 tokens/s with `medusa` ({cite}).\n") == [
        "line 1: number 99.5 for medusa is not in the record(s) its paragraph names (amd_sharegpt_eagle_batch1_seed0)"
    ]


def test_a_table_row_takes_its_own_record_else_the_paragraph_above():
    lead = "From [the run](results/amd_sharegpt_eagle_batch1_seed0.md):\n\n"
    table = "| method | overall | τ | record |\n|---|---:|---:|---|\n| `medusa` | 1.35x | 1.27 | |\n"
    assert unheld_figures(lead + table) == []
    assert unheld_figures(table) == ["line 3: a table row with figures (1.35, 1.27) names no record"]
    other = table.replace("| |\n", "| [r](results/intel_full_batch1_seed1.md) |\n")
    assert unheld_figures(lead + other) == [
        "line 5: overall speedup 1.35 for medusa is not in the record(s) its table row names (intel_full_batch1_seed1)",
        "line 5: overall τ 1.27 for medusa is not in the record(s) its table row names (intel_full_batch1_seed1)",
    ]


def test_a_generated_block_takes_the_records_of_its_marker():
    body = "| method | overall | τ |\n|---|---:|---:|\n| `medusa` | 1.35x | 1.27 |\n"
    block = "<!-- results:begin runs docs/results/{}.json -->\n" + body + "<!-- results:end -->\n"
    assert unheld_figures(block.format("amd_sharegpt_eagle_batch1_seed0")) == []
    assert unheld_figures(block.format("intel_full_batch1_seed1")) == [
        "line 1: overall speedup 1.35 is not in the record(s) its generated block names (intel_full_batch1_seed1)",
        "line 1: overall τ 1.27 is not in the record(s) its generated block names (intel_full_batch1_seed1)",
    ]


def test_every_figure_of_the_results_page_is_held_by_the_record_it_names():
    text = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    found = unheld_figures(text)
    assert not found, "docs/results.md: figures without the record that holds them beside them:\n" + "\n".join(found)


@pytest.mark.parametrize("heading", ["Results"])
def test_every_figure_of_the_readme_results_is_held_by_the_record_it_names(heading):
    first_line, text = section((ROOT / "README.md").read_text(encoding="utf-8"), heading)
    found = unheld_figures(text, first_line)
    assert not found, f"README.md, ## {heading}: figures without the record that holds them:\n" + "\n".join(found)


def test_the_readme_recommendation_table_quotes_the_runs_its_header_names():
    """The README's table of assistants per situation: every speedup and τ is its row's method's in the headline or
    the agentic run, which its header links (version numbers and the like in the section's prose are not figures
    of a run)."""
    first_line, text = section((ROOT / "README.md").read_text(encoding="utf-8"), "Use it")
    table = [u for u in units(text, first_line) if u[1] == "table row"]
    assert table and all(u[3] for u in table), "the table's header names the runs"
    found = unheld_figures(text, first_line, only=("speedup", "τ"))
    assert not found, "README.md, ## Use it: figures its runs do not hold:\n" + "\n".join(found)


def test_a_table_header_names_the_records_of_its_rows():
    text = (
        "| method | speedup on [the run](results/amd_sharegpt_eagle_batch1_seed0.md) |\n|---|---:|\n"
        "| `medusa` | 1.35x |\n| `eagle` | 1.35x |\n"
    )
    assert unheld_figures(text) == [
        "line 4: speedup 1.35 for eagle is not in the record(s) its table row names (amd_sharegpt_eagle_batch1_seed0)"
    ]


def test_the_readme_headline_table_is_generated_from_a_record():
    first_line, text = section((ROOT / "README.md").read_text(encoding="utf-8"), "Results")
    blocks = [u for u in units(text, first_line) if u[1] == "generated block"]
    assert blocks and BLOCK.search(text).group("spec").startswith("headline docs/results/"), (
        "the README's Results section opens on a `headline` block generated from a record"
    )
