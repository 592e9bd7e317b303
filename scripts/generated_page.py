"""The command line shared by the scripts that write a generated docs page (write_cli_reference.py,
write_api_reference.py): write the page, or with ``--check`` only say whether the committed one is stale."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def write_or_check(
    out: Path, root: Path, render: Callable[[], str], script: str, about: str, argv: list[str] | None
) -> int:
    """Write ``render()`` to ``out`` (exit status 0), or with ``--check`` in ``argv`` compare it with the file there
    (1 when stale, naming ``script``, the one that rewrites it). ``about``: the script's one-line description."""
    rel = out.relative_to(root)
    ap = argparse.ArgumentParser(description=about)
    ap.add_argument("--check", action="store_true", help=f"only say whether {rel} is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        fresh = out.exists() and out.read_text(encoding="utf-8") == text
        print(f"{rel} is fresh" if fresh else f"{rel} is stale: python scripts/{script}")
        return 0 if fresh else 1
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(f"wrote {rel}")
    return 0
