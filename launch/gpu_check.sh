#!/usr/bin/env bash
# The device check: the trainer's GPU code path on one GPU, then its speed (launch/gpu_check.py),
# on a bare machine that has torch but no vLLM and no network.
#
#   bash launch/gpu_check.sh --fetch-wheels      # here, with PyPI: what the device lacks, into .whl/
#   bash launch/gpu_check.sh                     # there, .whl/ carried: both shapes and bench/gpu_mfu.py
#   bash launch/gpu_check.sh --dry-run           # anywhere: the small shape on the CPU
#
# --fetch-wheels downloads the transformers and peft that requirements.txt pins (read from there),
# and a regex that satisfies what that transformers declares (it checks it at import; the device
# image's regex is of unknown age), all for the device's Python 3.12, into WHEELS (default .whl/,
# git-ignored: carry it). The rest of what transformers and peft declare is in the device image at
# versions that satisfy them (../.library/device/KINDS.md); gpu_check.py checks every one first
# and names what is missing. gpu_check.py refuses to start without the pinned transformers and peft.
# The wheels found in WHEELS are installed into a temporary folder that goes first on the path.
# OUT (default docs/results) is where gpu_check.json is written, after every check.
# Expected on an H100/H200: about 3-4 minutes (gpu_check.py --budget-s, default 270 s, bounds it).
set -euo pipefail
cd "$(dirname "$0")/.."
wheels="${WHEELS:-.whl}"
if [ "${1:-}" = --fetch-wheels ]; then
  read -ra pins <<< "$(sed -nE 's/^(transformers|peft)[[:space:]]*==[[:space:]]*([^[:space:];#]+).*/\1==\2/p' \
    requirements.txt | tr '\n' ' ')"
  if [ "${#pins[@]}" != 2 ]; then
    echo "gpu_check.sh: requirements.txt must pin transformers and peft with == (found: ${pins[*]:-nothing})" >&2
    exit 1
  fi
  rm -rf "$wheels" && mkdir -p "$wheels"  # no stale wheel of another version travels with them
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
    -d "$wheels" "${pins[@]}"
  regex=$(python3 - "$wheels" <<'EOF'
import re, sys, zipfile
from pathlib import Path
[wheel] = Path(sys.argv[1]).glob("transformers-*.whl")
with zipfile.ZipFile(wheel) as z:
    metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
need = re.findall(r"^Requires-Dist: *(regex *(?:[<>=!~][^;\n]*)?)(?:;|$)", metadata, re.M)
print(need[0].strip() if need else "regex")
EOF
)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$wheels" "$regex"
  ls -l "$wheels"
  mib=$(( ($(du -sb "$wheels" | cut -f1) + 1048575) / 1048576 ))
  if [ "$mib" -gt 56 ]; then  # a device call carries 64 MiB in all, the working tree included
    echo "gpu_check.sh: $wheels holds $mib MiB, too much to carry" >&2
    exit 1
  fi
  echo "gpu_check.sh: ${pins[*]} $regex in $wheels ($mib MiB): carry $wheels and run bash launch/gpu_check.sh"
  exit 0
fi
if ls "$wheels"/*.whl >/dev/null 2>&1; then
  site=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-site.XXXXXX")
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl; then
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  else  # go on: gpu_check.py then names what the machine lacks
    echo "gpu_check.sh: installing the wheels in $wheels failed; checking what the machine has" >&2
  fi
fi
export PYTHONUNBUFFERED=1
py="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
exec "$py" launch/gpu_check.py --out "${OUT:-docs/results}/gpu_check.json" "$@"
