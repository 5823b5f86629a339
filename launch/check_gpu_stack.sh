#!/usr/bin/env bash
# Check the pinned GPU stack (requirements.txt) on a machine without a GPU: install it into a venv
# of its own, then run launch/check_gpu_stack.py in it (what it checks, and what it cannot: there).
#
#   bash launch/check_gpu_stack.sh                  # builds .venv-gpu (about 9 GB; minutes on a cold cache)
#   VENV=/path/to/venv bash launch/check_gpu_stack.sh
#
# Not part of the test suite: it downloads several GB. The report goes to docs/results/gpu_stack_check.json.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv-gpu}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.grpo-reqs" 2>/dev/null)" != "$(sha256sum requirements.txt | cut -c1-16)" ]; then
  echo "[check_gpu_stack] installing requirements.txt into $venv"
  command -v uv >/dev/null 2>&1 || "$python" -m pip install -q uv
  uv venv -q --allow-existing --python "$python" "$venv"
  start=$(date +%s)
  uv pip install -q --python "$venv/bin/python" -r requirements.txt
  echo "[check_gpu_stack] installed in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)"
  sha256sum requirements.txt | cut -c1-16 > "$venv/.grpo-reqs"
fi
# vLLM must not be told it is a CPU build (rollout.py would say so on a machine without CUDA)
VLLM_TARGET_DEVICE="${VLLM_TARGET_DEVICE:-cuda}" exec "$venv/bin/python" launch/check_gpu_stack.py "$@"
