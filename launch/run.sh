#!/usr/bin/env bash
# Set up (idempotent) and run the main job; extra arguments go to train.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
exec .venv/bin/python train.py "$@"
