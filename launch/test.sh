#!/usr/bin/env bash
# Set up (idempotent) and run the test suite; extra arguments go to pytest.
#
#   bash launch/test.sh            # everything (the README's command and CI's)
#   bash launch/test.sh --fast     # the edit-loop tier: no end-to-end runs (tests marked slow)
#   TEST_WORKERS=1 bash launch/test.sh   # one pytest process instead of two (pytest-xdist)
#
# Two workers by default, one thread each: most of a test's time is one Python thread (imports,
# vLLM's engine start, the rollout loop), so two test files at once keep both cores busy, where
# one pytest keeps ~1.1 busy. One thread each: two workers of two OpenMP threads on two cores
# spin against each other (measured: every test ~2x slower, no gain). A file stays on one
# worker (--dist loadfile), so its module fixtures (the server, the bad-input cases) are built once.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
args=()
for a in "$@"; do
  if [ "$a" = --fast ]; then args+=(-m "not slow"); else args+=("$a"); fi
done
set +e
workers="${TEST_WORKERS:-2}"
xdist=()
if [ "$workers" -gt 1 ]; then
  xdist=(-n "$workers" --dist loadfile --no-loadscope-reorder)  # files in tests/conftest.py's order
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
.venv/bin/python -m pytest "${xdist[@]}" "${args[@]:--q}" tests
rc=$?
# pytest exits 5 when it collected no tests: that is a failure here, never a pass.
[ $rc -eq 5 ] && echo "[test] pytest collected no tests" >&2
exit $rc
