#!/usr/bin/env bash
# Create .venv and install the right stack for this machine, then build the tiny model.
#
#   bash launch/setup.sh            # auto: GPU stack if nvidia-smi sees a GPU, else the CPU stack
#   GRPO_STACK=cpu bash launch/setup.sh   # force a variant (cpu | gpu)
#
# Idempotent: a stamp in .venv records what was installed; a second run with unchanged
# requirement files only checks the stamp and the tiny model (a second or two).
set -euo pipefail
cd "$(dirname "$0")/.."

stack="${GRPO_STACK:-auto}"
if [ "$stack" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && [ "$(nvidia-smi -L 2>/dev/null | grep -c GPU)" -gt 0 ]; then stack=gpu; else stack=cpu; fi
fi
if [ "$stack" = gpu ] && command -v nvidia-smi >/dev/null 2>&1; then
  # The pinned GPU wheels (vllm 0.33, torch 2.14) are CUDA 13 builds: they need driver 580 or newer.
  driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)"
  if [ -n "$driver" ] && [ "${driver%%.*}" -lt 580 ] 2>/dev/null; then
    echo "[setup] NVIDIA driver $driver is too old for the CUDA 13 wheels in requirements.txt (they need >= 580):" \
         "update the driver, or pin CUDA 12 builds of torch and vllm yourself" >&2
    exit 2
  fi
fi
case "$stack" in
  cpu) reqs=(-r requirements-cpu.txt --override requirements-cpu-override.txt) ;;
  gpu) reqs=(-r requirements.txt) ;;
  *) echo "GRPO_STACK must be cpu, gpu or auto (got '$stack')" >&2; exit 2 ;;
esac

python="${PYTHON:-python3}"
stamp_want="$stack $(cat requirements*.txt | sha256sum | cut -c1-16)"
if [ -x .venv/bin/python ] && [ "$(cat .venv/.grpo-stack 2>/dev/null)" = "$stamp_want" ]; then
  echo "[setup] .venv is up to date ($stack stack)"
else
  echo "[setup] installing the $stack stack into .venv (uv; a few minutes on a fresh machine)"
  command -v uv >/dev/null 2>&1 || "$python" -m pip install -q uv
  uv="$(command -v uv || echo "$python -m uv")"
  [ -x .venv/bin/python ] || $uv venv -q --python "$python" .venv
  # uv reads neither pip's config nor local wheel folders: it takes the registry's torch build.
  $uv pip install -q --python .venv/bin/python "${reqs[@]}"
  echo "$stamp_want" > .venv/.grpo-stack
fi

# Bytecode, compiled once. The wheels ship no .pyc files, and where PYTHONDONTWRITEBYTECODE is set
# (as on our machines) Python never writes them: every process, each trainer and engine the tests
# start, compiled vLLM, torch and transformers from source again. Compiled, an engine's process
# start went from 20 s to 11.5 s (bench/bench.py, "coldstart") and a one-engine test from 36 s to
# 19 s, for ~30 s once here. (One of torch's test helpers uses Python 3.12 syntax and does not
# compile: harmless, Python reads that file from source if anything imports it.)
if [ "$(cat .venv/.grpo-bytecode 2>/dev/null)" != "$stamp_want" ]; then
  echo "[setup] compiling the installed packages to bytecode (once, ~30 s)"
  .venv/bin/python -m compileall -q -j 0 .venv/lib/python*/site-packages > .venv/compileall.log 2>&1 || true
  echo "$stamp_want" > .venv/.grpo-bytecode
fi

.venv/bin/python tiny_model.py
