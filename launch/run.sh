#!/usr/bin/env bash
# The main job, end to end on one machine:
#   set up .venv -> build the tiny Qwen3-VL -> SFT warm start (sft.py) -> GRPO (train.py)
#   -> final eval -> report (solve-rate curve PNG, a replayed episode GIF, before/after table).
# Extra arguments go to train.py. OUT (default runs/main) holds everything; the SFT model is
# reused if it is already there, and train.py resumes from its latest checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
out="${OUT:-runs/main}"
if [ ! -f "$out/sft/model/config.json" ]; then
  .venv/bin/python sft.py --out "$out/sft" --difficulty small ${SFT_ARGS:---steps 2000}
fi
.venv/bin/python train.py --model "$out/sft/model" --out-dir "$out/grpo" --difficulty small \
  --lora-rank 8 --steps 10 --prompts-per-step 4 --group-size 8 --max-new-tokens 8 \
  --lr 1e-3 --micro-batch-size 16 --eval-interval 5 --ckpt-interval 5 --export-interval 5 "$@"
.venv/bin/python launch/report.py "$out/grpo"
