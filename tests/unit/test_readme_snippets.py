"""The README's and docs/usage.md's Python code blocks exist, and the README's test command is CI's. Running them (and
every other user page's ```python blocks) is tests/unit/test_doc_blocks.py, which reads the blocks with
`python_blocks` / `marked_blocks` here."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
USAGE = README.parent / "docs" / "usage.md"


def marked_blocks(text: str, language: str = "python") -> list[tuple[str | None, str]]:
    """``(reason, body)`` of each ```LANGUAGE fenced block of a Markdown text, in order: ``reason`` is the text of a
    ``<!-- not run in CI: REASON -->`` comment on the line before the fence (stripped; "" when empty), else None."""
    fence = re.compile(
        rf"^(?:<!-- not run in CI:(?P<reason>[^\n]*?)-->[ \t]*\n)?```{re.escape(language)}[ \t]*\n(?P<body>.*?)^```[ \t]*$",
        flags=re.MULTILINE | re.DOTALL,
    )
    return [(None if m["reason"] is None else m["reason"].strip(), m["body"]) for m in fence.finditer(text)]


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python fenced blocks of a Markdown text, in order."""
    return [body for _, body in marked_blocks(text)]


def test_the_extraction_finds_fenced_python_blocks_only():
    text = "x\n```python\na = 1\n```\n```bash\nls\n```\n```python\nb = a + 1\n```\n"
    assert python_blocks(text) == ["a = 1\n", "b = a + 1\n"]


def test_the_extraction_reads_the_not_run_comment_before_a_block():
    text = "<!-- not run in CI: needs a GPU -->\n```python\na = 1\n```\n\n<!-- x -->\n```python\nb = 2\n```\n"
    assert marked_blocks(text) == [("needs a GPU", "a = 1\n"), (None, "b = 2\n")]


def test_the_readme_has_python_snippets():
    assert python_blocks(README.read_text(encoding="utf-8")), "README.md has no ```python block"


def test_the_usage_page_has_python_snippets():
    assert python_blocks(USAGE.read_text(encoding="utf-8")), "docs/usage.md has no ```python block"


def test_the_readme_test_command_installs_what_ci_installs():
    """The README's test command is CI's: the same pinned set and extras for scripts/install.sh, then
    scripts/test.sh."""
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8")
    ci_extras = re.search(r"^HF_SPECDEC_CONSTRAINTS=\S+ bash scripts/install\.sh (\S+)", ci, re.MULTILINE)
    line = next(li for li in README.read_text(encoding="utf-8").splitlines() if li.startswith("Tests: "))
    readme_extras = re.search(r"bash scripts/install\.sh (\S+)", line)
    assert ci_extras and readme_extras, "no scripts/install.sh call found"
    assert set(readme_extras.group(1).split(",")) == set(ci_extras.group(1).split(",")), (
        f"README installs {readme_extras.group(1)}, CI {ci_extras.group(1)}"
    )
    assert "bash scripts/test.sh" in line and "bash scripts/test.sh" in ci
    assert "HF_SPECDEC_CONSTRAINTS=.ci/constraints.txt bash scripts/install.sh" in line, "the README installs unpinned"
