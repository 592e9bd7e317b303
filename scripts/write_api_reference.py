#!/usr/bin/env python
"""Writes docs/api/README.md, the API reference in brief: every public name of ``hf_specdec`` (``__all__``, then the
other names ``import hf_specdec`` loads on first use, and `hf_specdec.assistants.available_assistants`) with its
signature and the first paragraph of its docstring; for a class, its public methods and properties the same way.

    python scripts/write_api_reference.py            # rewrite docs/api/README.md
    python scripts/write_api_reference.py --check    # exit 1 if docs/api/README.md is stale

The full reference (every docstring in full, as HTML) is what `bash scripts/build_api_docs.sh` builds with pdoc into
build/api/. tests/unit/test_api_docs.py fails when docs/api/README.md is stale."""

from __future__ import annotations

import enum
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from scripts.generated_page import write_or_check  # noqa: E402

OUT = ROOT / "docs" / "api" / "README.md"

HEADER = """\
# API reference (in brief)

Every public name of `hf_specdec` with its signature and the first paragraph of its docstring. Generated from the
docstrings by `python scripts/write_api_reference.py`; a test fails when it is stale. The full text of every
docstring, as HTML: `pip install -e ".[docs]"`, then `bash scripts/build_api_docs.sh` writes `build/api/index.html`.
How to call it: [usage.md](../usage.md); the terms: [glossary.md](../glossary.md).
"""


def summary(obj) -> str:
    """The first paragraph of ``obj``'s docstring on one line, RST literals as Markdown code."""
    doc = inspect.getdoc(obj) or ""
    first = doc.split("\n\n", 1)[0]
    text = " ".join(first.split())
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    return text.replace("|", "\\|")


def default_text(value) -> str:
    text = repr(value)
    return "..." if " at 0x" in text or len(text) > 40 else text


def signature(obj) -> str:
    """``(a, b=1, *, c=None)``: parameter names and defaults, without annotations (they read as strings here)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    parts, star_done = [], False
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    for p in params:
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star_done = True
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.default is not p.empty:
            parts.append(f"{p.name}={default_text(p.default)}")
        else:
            parts.append(p.name)
    return "(" + ", ".join(parts) + ")"


def members(cls) -> list[tuple[str, object, str]]:
    """``(name, object, kind)`` of the public methods and properties ``cls`` defines itself, in definition order."""
    out = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            out.append((name, value, "property"))
        elif isinstance(value, (classmethod, staticmethod)):
            out.append((name, value.__func__, "classmethod" if isinstance(value, classmethod) else "staticmethod"))
        elif inspect.isfunction(value):
            out.append((name, value, "method"))
    return out


def entry(name: str, obj) -> list[str]:
    module = getattr(obj, "__module__", "")
    if inspect.isclass(obj) and issubclass(obj, enum.Enum):
        values = ", ".join(f"`{m.name}`" for m in obj)
        return [f"### `{name}`", "", f"enum `{name}` (defined in `{module}`): {values}", "", summary(obj), ""]
    if inspect.isclass(obj):
        lines = [f"### `{name}`", "", f"class `{name}{signature(obj)}` (defined in `{module}`)", "", summary(obj), ""]
        rows = []
        for member, value, kind in members(obj):
            shown = member if kind == "property" else f"{member}{signature(value)}"
            label = "" if kind == "method" else f" ({kind})"
            rows.append(f"| `{shown}`{label} | {summary(value)} |")
        if rows:
            lines += ["| member | what it does |", "|---|---|", *rows, ""]
        return lines
    return [f"### `{name}`", "", f"`{name}{signature(obj)}` (defined in `{module}`)", "", summary(obj), ""]


def render() -> str:
    import hf_specdec
    from hf_specdec import assistants

    lines = [HEADER, "## `hf_specdec`", "", summary(hf_specdec), ""]
    lines += ["| name | what it is |", "|---|---|"]
    lines += [f"| [`{n}`](#{n.lower()}) | {summary(getattr(hf_specdec, n))} |" for n in hf_specdec.__all__]
    others = [n for n in hf_specdec._LAZY if n not in hf_specdec.__all__]
    lines += ["", f"Also loaded on first use, outside `__all__`: {', '.join(f'`{n}`' for n in others)}; and the "
              "module `hf_specdec.assistants` (the ready-made assistants).", "", "## Public names", ""]  # fmt: skip
    for name in hf_specdec.__all__:
        lines += entry(name, getattr(hf_specdec, name))
    lines += ["## Outside `__all__`", ""]
    for name in others:
        lines += entry(name, getattr(hf_specdec, name))
    lines += entry("assistants.available_assistants", assistants.available_assistants)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    return write_or_check(OUT, ROOT, render, "write_api_reference.py", __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
