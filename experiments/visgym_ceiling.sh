#!/usr/bin/env bash
# How far supervised learning takes the tiny model on VisGym maze_2d easy: the two-stage warm start
# of `TASK=visgym-easy bash launch/run.sh` (1000 steps at 2e-3, then 500 at 1e-3), continued for
# EXTRA_STEPS more at 1e-3 with a snapshot every 250, each played greedily on VisGym's 64 easy
# evaluation seeds at 15 turns (strict; 50 of the 64 fit). A curve that keeps rising says the model
# has room and GRPO's signal is the limit; a flat one says the model at that depth (LAYERS) binds.
#
#   bash experiments/visgym_ceiling.sh                   # into runs/visgym-easy (shared with run.sh)
#   OUT=runs/vg EXTRA_STEPS=500 bash experiments/visgym_ceiling.sh
#   LAYERS=4 EXTRA_STEPS=0 bash experiments/visgym_ceiling.sh  # a deeper language model, same eyes
#
# Every stage is reused when its model is already there, so a killed run continues. One thread:
# ~2.1 s a full-history SFT step at 2 layers (3.75 s at 4), ~1 min an evaluation.
set -euo pipefail
cd "$(dirname "$0")/.."
layers="${LAYERS:-2}"
if [ "$layers" = 2 ]; then base=.cache/tiny-qwen3-vl-visgym; out="${OUT:-runs/visgym-easy}"
else base=".cache/tiny-qwen3-vl-visgym-${layers}l"; out="${OUT:-runs/visgym-easy-${layers}l}"; fi
extra="${EXTRA_STEPS:-1000}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
py=.venv/bin/python
task=(--task visgym-maze --difficulty easy --max-turns 15)
$py tiny_model.py --task visgym --text-layers "$layers" --out "$base"  # reused when already built
[ -f "$out/sft-stage1/model/config.json" ] || $py sft.py --model "$base" \
  --out "$out/sft-stage1" "${task[@]}" --steps 1000 --seed 0
[ -f "$out/sft/model/config.json" ] || $py sft.py --model "$out/sft-stage1/model" --out "$out/sft" \
  "${task[@]}" --steps 500 --lr 1e-3 --warmup 0 --seed 1
[ "$extra" = 0 ] || [ -f "$out/sft-stage3/model/config.json" ] || $py sft.py --model "$out/sft/model" --out "$out/sft-stage3" \
  "${task[@]}" --steps "$extra" --lr 1e-3 --warmup 0 --seed 2 --save-every 250
models=("$out/sft-stage1/model" "$out/sft/model")
for step in $(seq 250 250 "$extra"); do
  if [ -d "$out/sft-stage3/model_step_$step" ]; then models+=("$out/sft-stage3/model_step_$step"); fi
done
[ "$extra" = 0 ] || models+=("$out/sft-stage3/model")
for model in "${models[@]}"; do
  result="$out/ceiling/$(echo "${model#"$out"/}" | tr / -).json"
  [ -f "$result" ] || $py experiments/eval_policy.py --model "$model" --difficulty easy --task visgym-maze \
    --max-turns 15 --n 64 --out "$result"
  echo "[ceiling] $model: $($py -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['solved'], '/', r['total'], 'solved; of the', r['fitting'], 'that fit')" "$result" 2>/dev/null || echo '?')"
done
