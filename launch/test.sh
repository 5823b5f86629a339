#!/usr/bin/env bash
# Set up (idempotent) and run the test suite; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
set +e
.venv/bin/python -m pytest "${@:--q}" tests
rc=$?
# pytest exits 5 when it collected no tests: that is a failure here, never a pass.
[ $rc -eq 5 ] && echo "[test] pytest collected no tests" >&2
exit $rc
