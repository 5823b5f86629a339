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
  # transformers 5.19 needs regex >= 2025.10.22 (checked at import); the device image's regex is
  # of unknown age, so a compiled one for its Python 3.12 travels too. The rest of what transformers
  # and peft declare is in the image at versions that satisfy them (../.library/device/KINDS.md);
  # gpu_check.py checks every one first and names what is missing.
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
    -d .whl transformers==5.19.0 peft==0.21.2
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl regex==2026.11.19
  ls -la .whl
  exit 0
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-check-site .whl/*.whl; then
    export PYTHONPATH="/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}"
  else  # go on: the report then names what the machine lacks
    echo "gpu_check.sh: installing the wheels in .whl/ failed; checking what the machine has" >&2
  fi
fi
export PYTHONUNBUFFERED=1
py="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
exec "$py" launch/gpu_check.py --out "${OUT:-docs/results}/gpu_check.json" "$@"
