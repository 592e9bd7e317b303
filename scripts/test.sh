#!/usr/bin/env bash
# Runs the test suite: tests/unit, tests/integration and tests/training (real default model included), then the
# Triton kernels of tests/kernels in interpreter mode, then builds the API reference (pdoc, the docs extra) so a
# docstring or import that breaks it fails here.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
status=0
run() {
  "$@"
  rc=$?
  if [ "$rc" -eq 5 ]; then echo "no tests collected by: $*"; rc=1; fi  # an empty run is a failure here
  if [ "$rc" -ne 0 ]; then status=$rc; fi
}
run python -m pytest -q -p no:cacheprovider tests --ignore=tests/kernels "$@"
run env TRITON_INTERPRET=1 python -m pytest -q -p no:cacheprovider tests/kernels
run bash scripts/build_api_docs.sh
exit $status
