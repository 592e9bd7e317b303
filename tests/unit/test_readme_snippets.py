"""The README's Python code blocks run as written (each ```python block in order, in one namespace), so they cannot
rot: every name they use is defined in them or imported. docs/usage.md (every way to call it, moved out of the
README) is held to the same rule."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
USAGE = README.parent / "docs" / "usage.md"


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python fenced blocks of a Markdown text, in order."""
    return re.findall(r"^```python[ \t]*\n(.*?)^```[ \t]*$", text, flags=re.MULTILINE | re.DOTALL)


def test_the_extraction_finds_fenced_python_blocks_only():
    text = "x\n```python\na = 1\n```\n```bash\nls\n```\n```python\nb = a + 1\n```\n"
    assert python_blocks(text) == ["a = 1\n", "b = a + 1\n"]


def test_the_readme_has_python_snippets():
    assert python_blocks(README.read_text(encoding="utf-8")), "README.md has no ```python block"


def test_the_usage_page_has_python_snippets():
    assert python_blocks(USAGE.read_text(encoding="utf-8")), "docs/usage.md has no ```python block"


@pytest.mark.slow
@pytest.mark.parametrize("page", [README, USAGE], ids=["README.md", "docs/usage.md"])
def test_readme_python_snippets_run_as_written(page, monkeypatch):
    monkeypatch.chdir(README.parent)  # custom_generate="." (docs/usage.md) is the repository root
    namespace: dict = {"__name__": "__readme__"}
    for i, code in enumerate(python_blocks(page.read_text(encoding="utf-8"))):
        exec(compile(code, f"{page.name} python block {i + 1}", "exec"), namespace)  # noqa: S102 - the page's own code


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
