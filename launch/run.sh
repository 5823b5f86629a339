#!/usr/bin/env bash
# The main job, end to end on one machine:
#   set up .venv -> build the tiny Qwen3-VL (its vision tower pretrained to see maze cells)
#   -> SFT warm start (sft.py) -> GRPO with step advantages and branch rollouts (train.py) -> final eval
#   -> report (solve-rate curve PNG, a replayed episode GIF, before/after table).
#
#   bash launch/run.sh                                  # 7x7 mazes, seed 0, into runs/main
#   OUT=runs/easy DIFFICULTY=easy SEED=1 bash launch/run.sh --steps 200
#   TASK=visgym-easy SEED=0 bash launch/run.sh          # the published run's task, into runs/visgym-easy
#   TASK=sokoban SEED=0 bash launch/run.sh              # a second task (tasks/sokoban.py), into runs/sokoban
#
# Extra arguments go to train.py (they override its defaults, which are the recipe). OUT holds everything; the
# SFT model is reused if it is already there, and train.py resumes from its latest checkpoint, so
# a killed job continues where it stopped. SFT_STEPS sets the warm start's length (sft.py's default,
# 250, stops it in the 30-60% band of held-out solve rate). SFT_NOISE is the share of its
# demonstrations' turns that start a detour (0: clean shortest paths).
#
# TASK=visgym-easy is VisGym's maze_2d easy as the published walkthrough trained it (9x9 mazes, 25 px
# cells, VisGym's drawing, texts and parser, 15 turns, 8 samples a maze): the tiny model's VisGym
# build (tiny_model.py --task visgym: one merged visual token per 25 px cell), a two-stage SFT that
# stops in the walkthrough's band (1000 steps at sft.py's 2e-3, then 500 at 1e-3: 25/64 held-out,
# docs/experiments.md 2026-12-06), then 100 GRPO steps of the recipe, evaluated every 20.
#
# TASK=sokoban is tasks/sokoban.py (6x6 rooms, one box, a picture each turn): the tiny model's Sokoban
# build (tiny_model.py --task sokoban: its eyes pretrained on the task's tiles), an SFT warm start
# of SOKOBAN_SFT_STEPS on the solver's pushes (docs/experiments.md: the steps that land in the
# 30-60% band), then GRPO with the recipe unchanged (train.py's defaults).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
SOKOBAN_SFT_STEPS=1500  # in the 30-60% band: docs/experiments.md, 2026-12-06 (#56), Sokoban
task="${TASK:-main}"
case "$task" in
  main|visgym-easy|sokoban) ;;
  *) echo "[run] TASK must be main, visgym-easy or sokoban, not '$task'" >&2; exit 2 ;;
esac
bash launch/setup.sh  # installs on a fresh machine, then builds the tiny model (~2-3 min on 2 cores)
seed="${SEED:-0}"
# every core for this one process (vLLM's CPU worker would otherwise pin torch to one thread)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
case "$task" in
  main)
    out="${OUT:-runs/main}"
    difficulty="${DIFFICULTY:-small}"
    task_flags=()
    if [ ! -f "$out/sft/model/config.json" ]; then
      .venv/bin/python sft.py --out "$out/sft" --difficulty "$difficulty" --seed "$seed" \
        ${SFT_STEPS:+--steps "$SFT_STEPS"} --noise "${SFT_NOISE:-0}"
    fi ;;
  visgym-easy)
    out="${OUT:-runs/visgym-easy}"
    difficulty=easy
    task_flags=(--task visgym-maze --steps 100 --eval-interval 20)
    .venv/bin/python tiny_model.py --task visgym  # reused when already built (~4 min on one core)
    sft_task=(--task visgym-maze --difficulty easy --max-turns 15)
    if [ ! -f "$out/sft-stage1/model/config.json" ] && [ ! -f "$out/sft/model/config.json" ]; then
      .venv/bin/python sft.py --model .cache/tiny-qwen3-vl-visgym --out "$out/sft-stage1" "${sft_task[@]}" \
        --steps 1000 --seed "$seed"
    fi
    if [ ! -f "$out/sft/model/config.json" ]; then
      .venv/bin/python sft.py --model "$out/sft-stage1/model" --out "$out/sft" "${sft_task[@]}" \
        --steps 500 --lr 1e-3 --warmup 0 --seed "$((seed + 1))"
    fi ;;
  sokoban)
    out="${OUT:-runs/sokoban}"
    difficulty=6x6
    task_flags=(--task sokoban)
    .venv/bin/python tiny_model.py --task sokoban  # reused when already built
    if [ ! -f "$out/sft/model/config.json" ]; then
      .venv/bin/python sft.py --model .cache/tiny-qwen3-vl-sokoban --out "$out/sft" --task sokoban --difficulty 6x6 \
        --steps "${SFT_STEPS:-$SOKOBAN_SFT_STEPS}" --seed "$seed"
    fi ;;
esac
# the GRPO recipe is train.py's defaults (config.py); only paths, the seed and the maze size here
.venv/bin/python train.py --model "$out/sft/model" --out-dir "$out/grpo" --difficulty "$difficulty" --seed "$seed" \
  ${task_flags[@]+"${task_flags[@]}"} "$@"
# RECORD=main (or visgym-easy) adds this run to docs/results/rl_lift.json (what the README's tables quote)
.venv/bin/python launch/report.py "$out/grpo" ${RECORD:+--record "$RECORD" --command "${TASK:+TASK=$TASK }${OUT:+OUT=$OUT }SEED=$seed RECORD=$RECORD bash launch/run.sh${*:+ $*}"}
echo "[run] $task job finished in $(( ($(date +%s) - start) / 60 )) min (setup and model build included)"
