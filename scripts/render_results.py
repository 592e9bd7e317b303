#!/usr/bin/env python
"""Regenerates every figure block of the README, docs/*.md, docs/lab/*.md and the model cards from the bench's results
files (docs/results/*.json): `python scripts/render_results.py`, or `--check` to list stale blocks without writing.
The blocks and their renderers: tools/render.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.render import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
