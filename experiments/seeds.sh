#!/usr/bin/env bash
# The seed experiment: the main job at one maze size for several seeds, each final policy (and its
# SFT warm start) also played on the other size (generalisation), then one table over the seeds.
#
#   bash experiments/seeds.sh                                         # 7x7, seeds 0 1 2 -> runs/small-seed<N>
#   DIFFICULTY=easy SFT_STEPS=1000 GRPO_STEPS=100 bash experiments/seeds.sh   # VisGym's easy (9x9), longer
#
# Each seed is a whole main job (launch/run.sh), so a killed experiment resumes where it stopped.
# RUNS_DIR (default runs) holds the seeds' directories; EVAL_MAZES (default 64) sets how many
# held-out mazes every evaluation plays, the generalisation ones included.
set -euo pipefail
cd "$(dirname "$0")/.."
difficulty="${DIFFICULTY:-small}"
other="${OTHER:-$([ "$difficulty" = small ] && echo easy || echo small)}"
eval_mazes="${EVAL_MAZES:-64}"
runs=()
for seed in ${SEEDS:-0 1 2}; do
  out="${RUNS_DIR:-runs}/$difficulty-seed$seed"
  OUT="$out" DIFFICULTY="$difficulty" SEED="$seed" bash launch/run.sh --eval-puzzles "$eval_mazes" \
    ${GRPO_STEPS:+--steps "$GRPO_STEPS"}
  final=$(ls -d "$out"/grpo/adapters/step_* | sort -t_ -k2 -n | tail -1)
  for policy in sft grpo; do
    adapter=$([ $policy = grpo ] && echo "--adapter $final" || true)
    [ -f "$out/generalisation/$other-$policy.json" ] || .venv/bin/python experiments/eval_policy.py \
      --model "$out/sft/model" $adapter --difficulty "$other" --n "$eval_mazes" \
      --out "$out/generalisation/$other-$policy.json"
  done
  runs+=("$out/grpo")
done
.venv/bin/python launch/report.py "${runs[@]}"
