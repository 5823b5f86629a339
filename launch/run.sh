#!/usr/bin/env bash
# The main job, end to end on one machine:
#   set up .venv -> build the tiny Qwen3-VL (its vision tower pretrained to see maze cells)
#   -> SFT warm start (sft.py) -> GRPO with step advantages and branch rollouts (train.py) -> final eval
#   -> report (solve-rate curve PNG, a replayed episode GIF, before/after table).
#
#   bash launch/run.sh                                  # 7x7 mazes, seed 0, into runs/main
#   OUT=runs/easy DIFFICULTY=easy SEED=1 bash launch/run.sh --steps 200
#
# Extra arguments go to train.py (they override its defaults, which are the recipe). OUT holds everything; the
# SFT model is reused if it is already there, and train.py resumes from its latest checkpoint, so
# a killed job continues where it stopped. SFT_STEPS sets the warm start's length (sft.py's default,
# 250, stops it in the 30-60% band of held-out solve rate). SFT_NOISE is the share of its
# demonstrations' turns that start a detour (0: clean shortest paths).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash launch/setup.sh  # installs on a fresh machine, then builds the tiny model (~2-3 min on 2 cores)
out="${OUT:-runs/main}"
difficulty="${DIFFICULTY:-small}"
seed="${SEED:-0}"
# every core for this one process (vLLM's CPU worker would otherwise pin torch to one thread)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
if [ ! -f "$out/sft/model/config.json" ]; then
  .venv/bin/python sft.py --out "$out/sft" --difficulty "$difficulty" --seed "$seed" \
    ${SFT_STEPS:+--steps "$SFT_STEPS"} --noise "${SFT_NOISE:-0}"
fi
# the GRPO recipe is train.py's defaults (config.py); only paths, the seed and the maze size here
.venv/bin/python train.py --model "$out/sft/model" --out-dir "$out/grpo" --difficulty "$difficulty" --seed "$seed" "$@"
# RECORD=main adds this run to docs/results/rl_lift.json (what the README's table quotes)
.venv/bin/python launch/report.py "$out/grpo" ${RECORD:+--record "$RECORD" --command "${OUT:+OUT=$OUT }SEED=$seed RECORD=$RECORD bash launch/run.sh${*:+ $*}"}
echo "[run] main job finished in $(( ($(date +%s) - start) / 60 )) min (setup and model build included)"
