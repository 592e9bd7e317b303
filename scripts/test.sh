#!/usr/bin/env bash
# Runs the test suite: tests/unit, tests/integration and tests/training (real default model included), then the
# Triton kernels of tests/kernels in interpreter mode, then builds the API reference (pdoc, the docs extra) so a
# docstring or import that breaks it fails here.
#
# The tests run in parallel processes (pytest-xdist, the test extra): one per core up to four, each file on one
# process (its module fixtures built once), the cores shared out between them in OMP_NUM_THREADS. On the 2-core CI
# machine that is two processes of one thread each. TEST_WORKERS=1 runs them in this one process.
set -uo pipefail
cd "$(dirname "$0")/.."
cores="$(python -c 'import os; print(len(os.sched_getaffinity(0)))')"
workers="${TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores / workers > 0 ? cores / workers : 1 ))}"
parallel=()
if [ "$workers" -gt 1 ]; then parallel=(-n "$workers" --dist loadfile); fi
status=0
run() {
  "$@"
  rc=$?
  if [ "$rc" -eq 5 ]; then echo "no tests collected by: $*"; rc=1; fi  # an empty run is a failure here
  if [ "$rc" -ne 0 ]; then status=$rc; fi
}
run python -m pytest -q -p no:cacheprovider "${parallel[@]}" tests --ignore=tests/kernels "$@"
run env TRITON_INTERPRET=1 python -m pytest -q -p no:cacheprovider "${parallel[@]}" tests/kernels
run bash scripts/build_api_docs.sh
exit $status
