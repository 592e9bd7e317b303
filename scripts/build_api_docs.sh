#!/usr/bin/env bash
# Builds the API reference from the docstrings with pdoc (pip install -e ".[docs]"): the public API of
# `import hf_specdec` (every name of hf_specdec.__all__, its module docstring as the front page) and
# hf_specdec.assistants (the ready-made assistants), as HTML in build/api/ (git-ignored; open build/api/index.html).
# Fails on anything pdoc cannot resolve, so a broken docstring reference or import stops CI (scripts/test.sh runs it).
# Usage: bash scripts/build_api_docs.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-build/api}"
python - "$out" <<'PY'
import sys
import warnings
from pathlib import Path

import pdoc
import pdoc.render

import hf_specdec

# The package loads most classes on first use (hf_specdec.__getattr__); pdoc reads a module's namespace, so resolve
# every public name into it first.
for name in hf_specdec.__all__:
    setattr(hf_specdec, name, getattr(hf_specdec, name))

pdoc.render.configure(docformat="google", footer_text=f"hf-specdec {hf_specdec.__version__}", search=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    pdoc.pdoc("hf_specdec", "hf_specdec.assistants", output_directory=Path(sys.argv[1]))
problems = [str(w.message) for w in caught if "pdoc" in (w.filename or "") or w.category.__module__.startswith("pdoc")]
for line in problems:
    print(f"pdoc: {line}", file=sys.stderr)
if problems:
    sys.exit(f"{len(problems)} pdoc warning(s): the API reference has unresolved names (above)")
print(f"API reference: {sys.argv[1]}/index.html")
PY
