#!/usr/bin/env bash
# The device check: the trainer's GPU code path on one GPU, then its speed (launch/gpu_check.py),
# on a bare machine that has torch but no vLLM and no network.
#
#   bash launch/gpu_check.sh --fetch-wheels      # here, with PyPI: the pinned transformers + peft into .whl/
#   bash launch/gpu_check.sh                     # there: both shapes and bench/gpu_mfu.py, one JSON report
#   bash launch/gpu_check.sh --dry-run           # anywhere: the small shape on the CPU
#
# That machine's transformers may be older than the pin (5.17 has no precomputed image features,
# so policy.Batch would fall back to pixels): wheels found in .whl/ go first on the path.
# OUT (default docs/results) is where gpu_check.json is written.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --fetch-wheels ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
    -d .whl transformers==5.19.0 peft==0.21.2
  ls -la .whl
  exit 0
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-check-site .whl/*.whl
  export PYTHONPATH="/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
py="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
exec "$py" launch/gpu_check.py --out "${OUT:-docs/results}/gpu_check.json" "$@"
