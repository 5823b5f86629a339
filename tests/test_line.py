"""Bring your own task: tasks/line.py (the README's example, under 100 lines) taken through the
whole pipeline a user's task takes: a short SFT from its solver (sft.py --task line), then GRPO
with real updates (train.py --task line), against the same run with every advantage's sign
flipped, as the maze's learning test does (tests/test_learning.py)."""

import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import env
from conftest import cached_build
from tasks.line import LineTask
from test_learning import _train_in_process
from test_train import read_metrics

ROOT = Path(__file__).resolve().parent.parent

# The corridor of 5 cells at 8 turns, four puzzles played over and over by groups of 8, from a
# 60-step SFT of the tiny model (15/32 held-out corridors solved greedily: reward spread), sampled
# at T 1, a constant rate.
SFT_STEPS = 60
RUN = ["--task", "line", "--difficulty", "short", "--max-turns", "8", "--train-pool", "4", "--group-size", "8",
       "--eval-puzzles", "4", "--temperature", "1", "--warmup-steps", "0", "--lr-schedule", "constant",
       "--lr", "4e-3", "--sampled-eval-samples", "0", "--progress", "false", "--lora-rank", "8",
       "--branch-points-per-group", "0", "--probe-states", "0", "--average-frac", "0", "--eval-interval", "1000",
       "--ckpt-interval", "1000", "--export-interval", "1000"]
STEPS, WINDOW = 8, 4


@pytest.fixture(scope="module")
def line_warm_start(tiny_model) -> Path:
    """The tiny model after SFT_STEPS of sft.py on the corridor (~30 s), cached like the maze's."""
    def build(out: Path):
        proc = subprocess.run([sys.executable, "sft.py", "--task", "line", "--difficulty", "short", "--max-turns", "8",
                               "--steps", str(SFT_STEPS), "--seed", "0", "--out", str(out)], cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]

    return cached_build(f"line-sft-{SFT_STEPS}", tiny_model, build, sources=("sft.py", "tasks/line.py")) / "model"


def test_the_toy_task_is_under_a_hundred_lines():
    assert len((ROOT / "tasks" / "line.py").read_text().splitlines()) <= 100


@pytest.mark.slow
def test_grpo_learns_the_toy_task(tmp_path, line_warm_start):
    """Its sampled solve rate over the last WINDOW steps beats the flipped twin's by 3 standard
    errors (the same seeds, the same four puzzles: a zero update or a stale sync would make the two
    runs identical)."""
    rates = {}
    for negate in (False, True):
        out = tmp_path / ("flipped" if negate else "learns")
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        argv = ["--model", str(line_warm_start), *RUN, "--steps", str(STEPS), "--out-dir", str(out)]
        proc = ctx.Process(target=_train_in_process, args=(argv, negate, results))
        proc.start()
        proc.join(timeout=1200)
        assert proc.exitcode == 0, f"training process exited with {proc.exitcode}"
        metrics = read_metrics(out)
        pool = [t.seed for t in env.TrainingStream(LineTask, "short", eval_n=4).first(4)]
        assert all(m["seeds"] == pool for m in metrics)
        rates[negate] = [m["solve_rate"] for m in metrics]
        if not negate:
            assert min(m["zero_variance_group_frac"] for m in metrics[:2]) < 1, "the warm start gave no spread"
            # --average-frac 0: what the run exports is the last step's own policy, as synced to the engine
            exported, synced = (load_file(out / where / f"step_{STEPS}" / "adapter_model.safetensors")
                                for where in ("adapters", "shared/sync"))
            assert exported.keys() == synced.keys() and all(torch.equal(exported[k], synced[k]) for k in exported)
    print("sampled solve rate per step: GRPO", rates[False], "| flipped", rates[True])
    assert rates[False][0] == pytest.approx(rates[True][0])  # the same start
    last, last_f = (sum(r[-WINDOW:]) / WINDOW for r in (rates[False], rates[True]))
    n = WINDOW * 4 * 8
    se = ((last * (1 - last) + last_f * (1 - last_f)) / n) ** 0.5
    print(f"last {WINDOW} steps: GRPO {last:.3f}, flipped {last_f:.3f}: {(last - last_f) / max(se, 1 / n):.1f} SE")
    assert last - last_f > 3.0 * max(se, 1 / n), (last, last_f, se)
