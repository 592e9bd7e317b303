#!/usr/bin/env bash
# Checks the newest transformers release against what CI pins (.ci/constraints.txt) and prints what changed:
# the version, the causal LM types it maps that the table of docs/architectures.md does not (and the reverse), every
# type whose sweep outcome differs from the table, and the unit tests. Not part of .ci/run: a new release is news,
# not a reason for an unrelated change to fail. Run it from an environment made by scripts/install.sh; it works in a
# throwaway venv that sees that environment's packages (--system-site-packages) with only transformers upgraded.
# Usage: bash scripts/check_newest_transformers.sh [VERSION]   (default: the newest on the package index)
set -uo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
venv="$(mktemp -d)/newest"
trap 'rm -rf "$(dirname "$venv")"' EXIT
python -m venv --system-site-packages "$venv"
spec="transformers${1:+==$1}"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade "$spec" || exit 1
pinned="$(sed -n 's/^transformers==//p' .ci/constraints.txt)"
newest="$("$venv/bin/python" -c 'import transformers; print(transformers.__version__)')"
echo "transformers: pinned $pinned, checking $newest"
"$venv/bin/python" - "$repo/docs/architectures.md" <<'EOF'
import sys
from pathlib import Path

import torch

from tools.architectures import causal_lm_types, read_table, sweep_type  # tools/ of this checkout (the working folder)

documented = read_table(Path(sys.argv[1]))
types = causal_lm_types()
print(f"new types: {sorted(set(types) - set(documented)) or 'none'}")
print(f"types gone: {sorted(set(documented) - set(types)) or 'none'}")
changed, failures = [], []
for model_type in types:
    with torch.no_grad():
        o = sweep_type(model_type, full=False)
    if o.verdict in ("silent difference", "crash", "vanilla fails"):
        failures.append(f"{model_type}: {o.verdict}: {o.detail[:200]}")
    if o.verdict != documented.get(model_type):
        changed.append(f"{model_type}: {documented.get(model_type)} -> {o.verdict} {o.detail[:120]}")
print("outcomes changed:", *(changed or ["none"]), sep="\n  ")
print("failures (neither exact nor refused by name):", *(failures or ["none"]), sep="\n  ")
sys.exit(1 if failures else 0)
EOF
sweep=$?
"$venv/bin/python" -m pytest -q -p no:cacheprovider -x -n 2 tests/unit 2>&1 | tail -3
units=${PIPESTATUS[0]}
echo "transformers $newest: architecture sweep rc $sweep, unit tests rc $units"
[ "$sweep" -eq 0 ] && [ "$units" -eq 0 ]
