"""The documentation a newcomer reads holds together: every relative link and anchor in README.md, docs/*.md, the
API reference (docs/api/) and the maintainers' log (docs/lab/) resolves (the file exists; a ``#fragment`` matches a
heading of the target page under GitHub's slug rules, or an ``<a id>`` anchor), and no user page, nor a shipped model
card, uses words that only make sense to the people who wrote it (the lab's pages may: they are the authors' log)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "docs" / "api" / "README.md"]
# the maintainers' log: its links are checked, its words are its authors'
LAB = sorted((ROOT / "docs" / "lab").glob("*.md"))
CARDS = sorted((ROOT / "hf_specdec" / "assets").glob("*/README.md"))
OTHER = [ROOT / "custom_generate" / "README.md", *sorted((ROOT / "notebooks").glob("*.ipynb"))]
# pages outside docs/ whose relative links (into docs/) must resolve too: the notebooks' markdown, developer notes
LINKED_FROM_ELSEWHERE = [*sorted((ROOT / "notebooks").glob("*.ipynb")), *sorted((ROOT / "scripts").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def without_inline_code(line: str) -> str:
    return re.sub(r"`[^`]*`", "", line)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: the rendered text lowercased, punctuation dropped (letters, digits,
    ``_``, ``-`` and spaces kept, in any script), spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = text.replace("`", "")
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


# an explicit anchor, <a id="name"></a>: GitHub links #name to it as to a heading (kept where a section moved)
HTML_ANCHOR = re.compile(r'<a\s+(?:id|name)="([^"]+)"\s*>')


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown page (repeated headings get -1, -2, ... as on GitHub), and its explicit
    ``<a id="...">`` anchors."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        out.update(HTML_ANCHOR.findall(line))
        found = HEADING.match(line)
        if not found:
            continue
        slug = github_slug(found.group(2))
        if slug in seen:
            seen[slug] += 1
            slug = f"{slug}-{seen[slug]}"
        else:
            seen[slug] = 0
        out.add(slug)
    return out


def relative_links(path: Path) -> list[tuple[int, str]]:
    """``(line number, target)`` of every link or image in the page's prose that is not an absolute URL."""
    text = "\n".join(without_inline_code(line) if "`" in line else line for _, line in prose_lines_keep(path))
    out = []
    for found in LINK.finditer(text):
        target = found.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # https:, mailto:, ...
            continue
        out.append((text.count("\n", 0, found.start()) + 1, target))
    return out


def prose_lines_keep(path: Path) -> list[tuple[int, str]]:
    """Every line, with fenced code blocks blanked (line numbers stay the file's)."""
    text = page_text(path)
    lines = text.splitlines()
    keep = dict(prose_lines(text))
    return [(n, keep.get(n, "")) for n in range(1, len(lines) + 1)]


def test_the_slug_rules_match_github():
    assert github_slug("Two suffix trees") == "two-suffix-trees"
    assert github_slug("tau (τ)") == "tau-τ"
    assert github_slug("Measured (2026-11-26, 2-core AMD EPYC, greedy)") == "measured-2026-11-26-2-core-amd-epyc-greedy"
    assert (
        github_slug("Without importing hf_specdec: `custom_generate`") == "without-importing-hf_specdec-custom_generate"
    )
    assert (
        github_slug("Metrics (same definitions as vLLM / Spec-Bench)") == "metrics-same-definitions-as-vllm--spec-bench"
    )


def test_the_link_extraction_skips_code_and_urls(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "See [a](a.md#x) and ![img](b.png).\n`[not](c.md)`\n```\n[not](d.md)\n```\n[web](https://x.org) [here](#y)\n",
        encoding="utf-8",
    )
    assert [t for _, t in relative_links(page)] == ["a.md#x", "b.png", "#y"]


@pytest.mark.parametrize("page", PAGES + LAB + LINKED_FROM_ELSEWHERE, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for line, target in relative_links(page):
        where, _, fragment = target.partition("#")
        dest = (page.parent / where).resolve() if where else page
        if not dest.exists():
            broken.append(f"line {line}: {target} (no such file)")
            continue
        if fragment and dest.suffix == ".md" and fragment.lower() not in anchors(dest):
            broken.append(f"line {line}: {target} (no heading with that anchor in {dest.name})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


# Words that mean something only to the people who wrote the project (its work items, review rounds, time boxes),
# or jargon that the glossary replaces with a plain phrase. name: (pattern, pages where it is defined and allowed).
INSIDER = {
    "the issue": (re.compile(r"\bthe issue\b|\bissue's\b|\bthe mix the issue\b", re.IGNORECASE), ()),
    "previous session": (re.compile(r"\b(previous|next|this|earlier|last) session\b", re.IGNORECASE), ()),
    "run A / run B": (re.compile(r"\brun [AB]\b"), ()),
    "review commit": (re.compile(r"\breview (commit|round)\b", re.IGNORECASE), ()),
    "the 30 minutes": (re.compile(r"\bfit the \d+ minutes\b", re.IGNORECASE), ()),
    "addition to the design": (re.compile(r"\ban addition to the design\b", re.IGNORECASE), ()),
    "six-task data": (re.compile(r"\bsix-task\b", re.IGNORECASE), ()),
    "row-steps": (re.compile(r"\brow-steps?\b", re.IGNORECASE), ()),
    "CEO": (re.compile(r"\bCEO\b"), ()),
    "probe": (re.compile(r"\bprob(e|es|ed|ing)\b", re.IGNORECASE), ("glossary.md", "design.md")),
    # `null` is a bench method name: in tables and code it stays, in prose it is "the loop with no drafts"
    "null in prose": (re.compile(r"\bnull\b"), ()),
    # the machines the figures came from are named by what they are (a 2-core AMD EPYC), not by how they were had
    "this VM": (re.compile(r"\b(this|these|that|the) VMs?\b", re.IGNORECASE), ()),
    "lent machine": (re.compile(r"\blent (H100|H200|GPU|machine)s?\b|\ba lent\b", re.IGNORECASE), ()),
    "device-minutes": (re.compile(r"\bdevice-minutes?\b", re.IGNORECASE), ()),
    "issue number": (re.compile(r"\bissues? \d+\b", re.IGNORECASE), ()),
    "candidate method name": (re.compile(r"\b[a-z][a-z+_]*@candidate\b"), ()),
    "head-major pools": (re.compile(r"\bhead-major pools\b", re.IGNORECASE), ()),
}
# Pages other work is rewriting at the moment: what they still hold is listed here. The test fails once a listed word
# is gone from the page, so an entry cannot outlive its reason.
KNOWN_ELSEWHERE: dict[str, set[str]] = {
    "docs/formats.md": {"τ"},
}
# A term the glossary defines may be used only with a link to its definition somewhere on the page:
# term: (the link, pages that define it themselves). τ is held to it on the README and docs/ (the model cards and
# custom_generate/README.md are Hub pages, where a relative link does not resolve: they define τ in a sentence).
LINKED_TERMS = {
    "chain τ": ("glossary.md#chain-τ", ()),
    "τ": ("glossary.md#tau-τ", ("algorithms.md",)),
}


def notebook_markdown(path: Path) -> str:
    """The markdown cells of a notebook, one after the other (line numbers are within that text)."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def page_text(path: Path) -> str:
    return notebook_markdown(path) if path.suffix == ".ipynb" else path.read_text(encoding="utf-8")


def insider_words(path: Path, ignore_known: bool = True) -> list[str]:
    rel = str(path.relative_to(ROOT))
    found = []
    text = page_text(path)
    for line_number, line in prose_lines(text):
        if line.lstrip().startswith("<!--"):  # a generated block's marker: its options are not prose
            continue
        table_row = line.lstrip().startswith("|")
        plain = re.sub(r"\]\([^)]*\)", "]", without_inline_code(line))  # link targets are addresses, not words
        for name, (pattern, allowed) in INSIDER.items():
            if path.name in allowed or (ignore_known and name in KNOWN_ELSEWHERE.get(rel, ())):
                continue
            if name == "null in prose" and (table_row or path.parent.name != "docs" and path.name != "README.md"):
                continue
            if pattern.search(plain):
                found.append(f"{rel}:{line_number}: {name!r}: {line.strip()[:120]}")
    docs_page = path.parent.name == "docs" or path.name == "README.md" and path.parent == ROOT
    for term, (target, defined_in) in LINKED_TERMS.items():
        if path.name == target.split("#")[0] or path.name in defined_in or (term == "τ" and not docs_page):
            continue
        if ignore_known and term in KNOWN_ELSEWHERE.get(rel, ()):
            continue
        if term.lower() in text.lower() and target not in text:
            found.append(f"{rel}:0: {term!r}: used without a link to {target}")
    return found


def test_the_insider_word_check_catches_them(tmp_path):
    page = tmp_path / "docs"
    page.mkdir()
    (page / "x.md").write_text("Far from the issue's target; run B\n| null | 1.00x |\nnull 0.98x\n", encoding="utf-8")
    found = insider_words_at(page / "x.md", tmp_path)
    assert [f.split(": ")[1] for f in found] == ["'the issue'", "'run A / run B'", "'null in prose'"]
    (page / "y.md").write_text("the chain τ of a head\n", encoding="utf-8")
    assert insider_words_at(page / "y.md", tmp_path) == [
        "docs/y.md:0: 'chain τ': used without a link to glossary.md#chain-τ",
        "docs/y.md:0: 'τ': used without a link to glossary.md#tau-τ",
    ]
    (page / "y.md").write_text("the [chain τ](glossary.md#chain-τ) of a [τ](glossary.md#tau-τ)\n", encoding="utf-8")
    assert insider_words_at(page / "y.md", tmp_path) == []


def test_the_insider_word_check_catches_the_lab_words(tmp_path):
    page = tmp_path / "docs"
    page.mkdir()
    (page / "x.md").write_text(
        "On this VM, a lent H200 for 15 device-minutes (Issue 34): eagle@candidate, head-major pools.\n"
        "<!-- results:begin card docs/results/x.json method=eagle@candidate -->\n",
        encoding="utf-8",
    )
    assert [f.split(": ")[1] for f in insider_words_at(page / "x.md", tmp_path)] == [
        "'this VM'", "'lent machine'", "'device-minutes'", "'issue number'", "'candidate method name'",
        "'head-major pools'",
    ]  # fmt: skip


def test_an_explicit_anchor_counts_as_a_heading(tmp_path):
    page = tmp_path / "p.md"
    page.write_text('# Title\n\n<a id="an-old-section"></a>\n**Text** the old links still reach.\n', encoding="utf-8")
    assert anchors(page) == {"title", "an-old-section"}


def insider_words_at(path: Path, root: Path) -> list[str]:
    global ROOT
    saved, ROOT = ROOT, root
    try:
        return insider_words(path)
    finally:
        ROOT = saved


@pytest.mark.parametrize("page", PAGES + CARDS + OTHER, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_insider_words(page):
    found = insider_words(page)
    assert not found, "words a reader cannot know (see docs/glossary.md for the plain terms):\n" + "\n".join(found)


@pytest.mark.parametrize("rel", sorted(KNOWN_ELSEWHERE))
def test_every_known_exception_is_still_needed(rel):
    still = {f.split(": ")[1].strip("'") for f in insider_words(ROOT / rel, ignore_known=False)}
    gone = KNOWN_ELSEWHERE[rel] - still
    assert not gone, f"{rel} no longer uses {sorted(gone)}: remove them from KNOWN_ELSEWHERE"


def test_the_glossary_defines_the_terms_the_pages_rely_on():
    terms = anchors(ROOT / "docs" / "glossary.md")
    for term in ("tau-τ", "acceptance", "per-depth-acceptance", "chain-τ", "tree-budget", "verify-forward",
                 "draft-vocabulary", "teacher-forced", "self-distilled", "the-loop-with-no-drafts"):  # fmt: skip
        assert term in terms, f"docs/glossary.md has no heading for {term}"
    for index in (ROOT / "README.md", ROOT / "docs" / "README.md"):
        assert "glossary.md" in index.read_text(encoding="utf-8"), (
            f"{index.relative_to(ROOT)} does not link the glossary"
        )


@pytest.mark.parametrize("card", CARDS, ids=lambda p: p.parent.name)
def test_model_cards_have_hub_metadata_and_no_local_paths(card):
    text = card.read_text(encoding="utf-8")
    front = re.match(r"^---\n(.*?)\n---\n", text, re.DOTALL)
    assert front, "no YAML front matter"
    meta = front.group(1)
    for key in ("license: apache-2.0", "base_model: HuggingFaceTB/SmolLM2-135M-Instruct", "library_name:", "tags:"):
        assert key in meta, f"front matter lacks {key!r}"
    assert "/root/" not in text and "/home/" not in text and ".cache" not in text, "a local path in the card"
    for repo in re.findall(r"from_pretrained\(\"([^\"]+)\"", text):
        assert re.fullmatch(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+", repo), f"{repo!r} is not a Hub repo id"


def test_the_custom_generate_readme_follows_the_hub_layout():
    """transformers' custom generation methods on the Hub: front matter tagged ``custom_generate`` and the sections
    its template asks for, with every argument hf-specdec adds to ``generate`` described."""
    import inspect

    import hf_specdec

    text = (ROOT / "custom_generate" / "README.md").read_text(encoding="utf-8")
    front = re.match(r"^---\n(.*?)\n---\n", text, re.DOTALL)
    assert front and re.search(r"^tags:\n(- .*\n)*- custom_generate$", front.group(1) + "\n", re.MULTILINE)
    for key in ("library_name: transformers", "license:", "base_model:"):
        assert key in front.group(1)
    sections = re.findall(r"^## (.+)$", text, re.MULTILINE)
    for name in ("Description", "Base model", "Model compatibility", "Additional Arguments", "Output Type changes",
                 "Example usage"):  # fmt: skip
        assert name in sections, f"custom_generate/README.md has no '## {name}' section"
    arguments = text.split("## Additional Arguments", 1)[1].split("\n## ", 1)[0]
    params = list(inspect.signature(hf_specdec.generate).parameters)
    ours = params[params.index("generation_config") + 1 :]
    internal = {"hf_specdec_streamer", "model_kwargs"}  # the hook's way to pass streamer=; generate's own kwargs
    missing = [p for p in ours if p not in internal and f"`{p}`" not in arguments]
    assert not missing, f"custom_generate/README.md does not describe {missing}"


# An address no one can open: the package has no public repository at it. Spelled in two pieces so that this file
# does not hold it either.
DEAD_ADDRESS = "github.com/" + "hf-specdec/hf-specdec"
# what is not the repository's own text: version control, environments, caches, build outputs
NOT_SOURCE = {".git", ".venv", "venv", "node_modules", "__pycache__", "build", "dist", ".ruff_cache", ".pytest_cache",
              ".mypy_cache", ".benchmarks"}  # fmt: skip
BINARY = {".safetensors", ".png", ".jpg", ".gguf", ".bin", ".pt", ".so", ".whl", ".gz", ".zip"}


def repository_files(root: Path) -> list[Path]:
    out = []
    for path in root.iterdir():
        if path.name in NOT_SOURCE or path.name.endswith(".egg-info"):
            continue
        if path.is_dir() and not path.is_symlink():
            out += repository_files(path)
        elif path.is_file() and path.suffix.lower() not in BINARY:
            out.append(path)
    return out


def test_no_file_names_the_dead_repository_address():
    """The package is installed from a checkout of its source (``pip install -e .``); no page, card, requirements
    file or package metadata points at a repository address that does not exist."""
    found = [
        str(path.relative_to(ROOT))
        for path in repository_files(ROOT)
        if DEAD_ADDRESS.encode() in path.read_bytes().lower()
    ]
    assert not found, f"{DEAD_ADDRESS} named in: {', '.join(sorted(found))}"


def test_the_dead_address_check_finds_it(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(f"see https://{DEAD_ADDRESS}/issues\n", encoding="utf-8")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text(DEAD_ADDRESS, encoding="utf-8")
    assert [p.relative_to(tmp_path).as_posix() for p in repository_files(tmp_path)] == ["docs/a.md"]


def python_code(path: Path) -> str:
    """The Python a page shows: its fenced ```python blocks, or a notebook's code cells."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".ipynb":
        cells = json.loads(text)["cells"]
        return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    return "\n".join(re.findall(r"^```python[ \t]*\n(.*?)^```[ \t]*$", text, flags=re.MULTILINE | re.DOTALL))


def calls(code: str, name: str) -> list[str]:
    """The text of every call ``name(...)`` in ``code``, parentheses balanced."""
    out = []
    for found in re.finditer(rf"\b{re.escape(name)}\(", code):
        depth, end = 0, found.end() - 1
        for end in range(found.end() - 1, len(code)):
            depth += {"(": 1, ")": -1}.get(code[end], 0)
            if depth == 0:
                break
        out.append(code[found.start() : end + 1])
    return out


def chat_template_tensor_calls(code: str) -> list[str]:
    """``apply_chat_template(..., return_tensors="pt")`` calls without ``return_dict=True``: in transformers 5 they
    return a BatchEncoding, which ``generate`` does not take as its ids."""
    return [
        " ".join(call.split())
        for call in calls(code, "apply_chat_template")
        if "return_tensors" in call and "return_dict=True" not in call and "tokenize=False" not in call
    ]


def test_the_chat_template_check_catches_a_batch_encoding_passed_as_ids():
    bad = 'ids = tok.apply_chat_template(m, add_generation_prompt=True,\n    return_tensors="pt").to("cuda")\n'
    good = 'x = tok.apply_chat_template(m, return_tensors="pt", return_dict=True)["input_ids"]\n'
    assert chat_template_tensor_calls(bad + good) == [
        'apply_chat_template(m, add_generation_prompt=True, return_tensors="pt")'
    ]


USER_PAGES = [*PAGES, *CARDS, *OTHER, ROOT / "demo" / "README.md"]


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_passes_a_chat_template_batch_encoding_as_ids(page):
    found = chat_template_tensor_calls(python_code(page))
    assert not found, (
        f"{page.relative_to(ROOT)}: apply_chat_template(..., return_tensors='pt') returns a BatchEncoding in "
        "transformers 5; add return_dict=True and pass **inputs (or ['input_ids']):\n" + "\n".join(found)
    )


# ------------------------------------------------------------------------------------------ a speedup above its τ
# τ is the tokens one speculative step emits; the speedup is τ over the step cost, a speculative step's time over
# vanilla's time per token (hf_specdec/demo/speed.py). A speedup above its own τ is real only where a step costs
# less than a decoding step (a verify forward on the few-rows GEMM, a batch that vanilla pads and the loop packs),
# and a reader who knows τ takes it for an error unless the page says so where the figure stands.
SPEEDUP_FIGURE = re.compile(r"(?<![\w.])(\d+\.\d+)\s?[x×](?!\w)")
TAU_FIGURE = re.compile(r"(?:τ|\btau\b)\s*(?:=|≈|of|is|:)?\s*(\d+\.\d+)(?![\w.]|\s?[x×])")
# the reason, in words: a step costs less than (or a fraction of) a decoding step, or a step cost below 1
STEP_REASON = re.compile(
    r"\bcosts?\s+(?:less\s+than|under|below|0\.\d+(?:\s*[-–]\s*0\.\d+)?\s?[x×])\s[^|]{0,80}?"
    r"\b(?:decod\w*|vanilla(?:'s)?)\s+(?:\w+\s+)?step"
    r"|\bstep\s+cost\s+(?:of\s+)?(?:0\.\d+|below\s+1|under\s+1|<\s*1)\b",
    re.IGNORECASE,
)
SENTENCE_END = re.compile(r"(?<=[.;!?])\s+(?=[A-Z`(*\[])")
TAU_PAGES = [
    ROOT / "README.md",
    # every page under docs/ but the maintainers' log and the runs' own reports (docs/results/*.md are what
    # `hf-specdec bench` wrote for each record, the data the pages cite, not a page quoting it)
    *sorted(p for p in (ROOT / "docs").rglob("*.md") if not {"lab", "results"} & set(p.relative_to(ROOT).parts)),
    *CARDS,
    ROOT / "custom_generate" / "README.md",
    ROOT / "demo" / "README.md",
]
GENERATED_BLOCK = re.compile(r"<!-- results:begin [^>]*-->\n.*?<!-- results:end -->", re.DOTALL)


def _speedup_columns(header: list[str]) -> list[tuple[int, int]]:
    """``(speedup column, its τ column)`` of a table: a column headed ``overall``, ``... overall`` or ``speedup
    ...`` (the total over the prompts the τ beside it counts, not a category's or a median), with the nearest τ column
    (headed ``τ`` or ``... τ``) not past another speedup column, to its right first."""
    is_tau = [h == "τ" or h.endswith(" τ") for h in header]
    is_speedup = [h == "overall" or h.endswith(" overall") or h.startswith("speedup") for h in header]
    pairs = []
    for col, speedup in enumerate(is_speedup):
        if not speedup:
            continue
        right = next((j for j in range(col + 1, len(header)) if is_speedup[j] or is_tau[j]), None)
        left = next((j for j in range(col - 1, -1, -1) if is_speedup[j] or is_tau[j]), None)
        for j in (right, left):
            if j is not None and is_tau[j]:
                pairs.append((col, j))
                break
    return pairs


def _number(cell: str, pattern: re.Pattern) -> float | None:
    found = pattern.fullmatch(cell.strip().strip("*").strip())
    return float(found.group(1)) if found else None


def speedups_above_tau(text: str) -> list[str]:
    """``line: figures`` of every speedup quoted above its own τ without the reason beside it (`STEP_REASON`).

    In prose, a τ goes with the speedup quoted closest before it in the same sentence (``1.59x, τ 2.65``,
    ``1.09x (τ 1.36)``), else the first after it. In a table, an overall speedup goes with its τ column
    (`_speedup_columns`) and the reason belongs in the row; a generated table's rows are the generator's
    (tools/render.py), so for them the reason stands in the paragraph that introduces the block (the lines
    right above its ``<!-- results:begin`` marker)."""
    found = []
    lines = text.splitlines()
    generated_rows: dict[int, str] = {}  # line index of a generated row -> the paragraph above its block
    for block in GENERATED_BLOCK.finditer(text):
        first = text.count("\n", 0, block.start())
        last = first + block.group(0).count("\n")
        above, i = [], first - 1
        while i >= 0 and not lines[i].strip():
            i -= 1
        while i >= 0 and lines[i].strip() and not lines[i].startswith(("#", "|", "```", "<!--")):
            above.insert(0, lines[i])
            i -= 1
        for j in range(first, last + 1):
            generated_rows[j] = " ".join(above)
    # tables
    header: list[str] | None = None
    for index, line in enumerate(lines):
        if not line.lstrip().startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = [c.strip("*").strip() for c in cells]
            continue
        for col, tau_col in _speedup_columns(header):
            if max(col, tau_col) >= len(cells):
                continue
            speedup, tau = _number(cells[col], SPEEDUP_FIGURE), _number(cells[tau_col], re.compile(r"(\d+\.\d+)"))
            if speedup is None or tau is None or speedup <= tau:
                continue
            if STEP_REASON.search(line) or STEP_REASON.search(generated_rows.get(index, "")):
                continue
            found.append(
                f"line {index + 1}: {cells[0]}: {header[col]} {cells[col].strip('*')} above τ {cells[tau_col]}"
            )
    # prose: paragraphs outside code and tables, one sentence at a time
    keep = dict(prose_lines(text))
    paragraph: list[tuple[int, str]] = []
    for number in range(1, len(lines) + 2):
        line = keep.get(number, "") if number <= len(lines) else ""
        if line.strip() and not line.lstrip().startswith(("|", "<!--")):
            paragraph.append((number, line))
            continue
        starts, parts, offset = [], [], 0  # where each line's text begins in the joined paragraph
        for at, part in paragraph:
            starts.append((offset, at))
            parts.append(part.strip())
            offset += len(parts[-1]) + 1
        joined = " ".join(parts)
        paragraph = []
        bounds = [0, *(m.end() for m in SENTENCE_END.finditer(joined)), len(joined)]
        for begin, end in zip(bounds, bounds[1:]):
            sentence = joined[begin:end]
            start = max((at for off, at in starts if off <= begin), default=0)
            speedups = [(m.start(), float(m.group(1)), m.group(0)) for m in SPEEDUP_FIGURE.finditer(sentence)]
            for tau_match in TAU_FIGURE.finditer(sentence):
                before = [s for s in speedups if s[0] < tau_match.start()]
                after = [s for s in speedups if s[0] > tau_match.start()]
                mine = before[-1] if before else after[0] if after else None
                if mine is None or mine[1] <= float(tau_match.group(1)) or STEP_REASON.search(sentence):
                    continue
                found.append(f"line {start}: {mine[2]} above {tau_match.group(0)}: {sentence.strip()[:160]}")
    return found


def test_the_speedup_check_catches_a_speedup_above_its_tau():
    assert speedups_above_tau("The heads: `medusa` 1.35x (τ 1.27), `eagle` 1.09x (τ 1.36).\n") == [
        "line 1: 1.35x above τ 1.27: The heads: `medusa` 1.35x (τ 1.27), `eagle` 1.09x (τ 1.36)."
    ]
    # each τ goes with its own speedup; a reason in the sentence makes it a measurement
    assert speedups_above_tau("A 1.20x at τ 1.30.\nThe\nother, 1.45x (tau\n1.40).\n") == [
        "line 2: 1.45x above tau 1.40: The other, 1.45x (tau 1.40)."
    ]
    reason = "`medusa` 1.47x (τ 1.39): with the kernel a verify step costs 0.72-0.87x a stock decoding step.\n"
    assert speedups_above_tau(reason) == []
    assert speedups_above_tau("`medusa` 1.47x (τ 1.39): a verify forward can cost less than a decode step.\n") == []
    # a table's overall column against its own τ column (two runs side by side), not a category's speedup
    table = (
        "| method | qa | fp32 overall | τ | bf16 overall | τ |\n|---|---:|---:|---:|---:|---:|\n"
        "| `a` | 1.90x | **1.05x** | 1.15 | 1.18x | 1.47 |\n| `b` | 1.00x | 1.10x | 1.20 | 1.50x | 1.40 |\n"
    )
    assert speedups_above_tau(table) == ["line 4: `b`: bf16 overall 1.50x above τ 1.40"]
    assert speedups_above_tau(table.replace("| 1.40 |", "| 1.40 (a step costs less than a decoding step) |")) == []
    # a model card's columns: τ first, then the speedup
    card = "| method | mean accepted length τ | speedup over vanilla `generate` |\n|---|---:|---:|\n| `m` | 1.27 | 1.35x |\n"
    assert speedups_above_tau(card) == ["line 3: `m`: speedup over vanilla `generate` 1.35x above τ 1.27"]
    # a generated table's reason stands in the paragraph right above it
    block = "<!-- results:begin runs x.json -->\n" + table + "<!-- results:end -->\n"
    assert len(speedups_above_tau("On this CPU:\n\n" + block)) == 1
    assert speedups_above_tau("Here a verify step costs less than a decoding step:\n\n" + block) == []


@pytest.mark.parametrize("page", TAU_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_speedup_above_its_tau_without_the_reason(page):
    found = speedups_above_tau(page_text(page))
    assert not found, (
        f"{page.relative_to(ROOT)} quotes speedups above their τ without saying why (τ is the tokens per step; a "
        "speedup above it means a step cost less than a decoding step: say so in the sentence or the row, or for a "
        "generated table in the paragraph above it):\n" + "\n".join(found)
    )
