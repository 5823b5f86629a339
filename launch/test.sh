#!/usr/bin/env bash
# Set up (idempotent) and run the test suite; extra arguments go to pytest.
#
#   bash launch/test.sh            # everything (the README's command and CI's)
#   bash launch/test.sh --fast     # the edit-loop tier: no end-to-end runs (tests marked slow)
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
args=()
for a in "$@"; do
  if [ "$a" = --fast ]; then args+=(-m "not slow"); else args+=("$a"); fi
done
set +e
.venv/bin/python -m pytest "${args[@]:--q}" tests
rc=$?
# pytest exits 5 when it collected no tests: that is a failure here, never a pass.
[ $rc -eq 5 ] && echo "[test] pytest collected no tests" >&2
exit $rc
