"""The trainer end to end, from a warm start that solves some mazes, so every run really updates
the policy: it resumes exactly after a kill and skips a damaged checkpoint. (That it learns:
test_learning.py; two ranks: test_launch.py's two-node run.)"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import env
from tasks.maze import MazeTask
import evaluation
import update
import train
from conftest import SHORT_RUN

ROOT = Path(__file__).resolve().parent.parent


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def lora_b_norm(adapter_file: Path) -> float:
    return sum(v.norm().item() ** 2 for k, v in load_file(str(adapter_file)).items() if "lora_B" in k) ** 0.5


# ----------------------------------------------------------------------------- resume

@pytest.mark.slow
def test_resume_is_exact_with_real_updates(tmp_path, short_run, warm_start):
    """The short run's 4 steps straight == the same run SIGKILLed after its step-2 checkpoint and
    restarted: the same LoRA weights, Adam moments, LR schedule, step count and maze stream, and
    the same metrics, branch rollouts included. The straight run also shows what every run
    writes, and that its updates are real."""
    # LoRA dropout (SHORT_RUN): the update draws from torch's global generator, so the resumed run
    # matches only if the checkpoint's RNG state is restored, and restored after vLLM's engine
    # start (which re-seeds it). Nothing else in a step draws from it (checkpoint.rng_states).
    straight, split = short_run, tmp_path / "split"
    cmd = [sys.executable, "train.py", "--model", str(warm_start), "--out-dir", str(split), *SHORT_RUN]
    # the split run: killed once its step-2 checkpoint is published (step 3 is then under way)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 600
    while not ((split / "checkpoints" / "latest").exists()
               and (split / "checkpoints" / "latest").read_text() == "step_2"):
        assert proc.poll() is None and time.time() < deadline, "the run ended before its step-2 checkpoint"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    log = resumed.stdout + resumed.stderr
    assert "resumed from" in log and "at step 2" in log

    a, b = read_metrics(straight), read_metrics(split)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3, 4]
    # real updates: groups with reward spread, non-zero advantages, the LoRA moved (the engine
    # sampling from exactly the trainer's policy is test_launch.py's two-node test's: dropout blurs it here)
    assert any(m["zero_variance_group_frac"] < 1 for m in a) and any(m["grad_norm"] > 0 for m in a)
    assert all(m["probe_kl"] >= 0 for m in a) and any(m["probe_kl"] > 0 for m in a)  # how far each update moved
    final = straight / "checkpoints" / "step_4"
    assert lora_b_norm(final / "adapter_model.safetensors") > 1e-3  # PEFT starts B at exactly 0
    for x, y in zip(a, b):
        assert x["seeds"] == y["seeds"] and x["stream_position"] == y["stream_position"]
        for key in ("reward_mean", "generated_tokens", "episode_turns", "grad_norm", "lr", "pg_loss",
                    "branch_points", "branch_targets", "branch_generated_tokens"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), (x["step"], key)
    # the checkpoints: LoRA, Adam moments, schedule and stream. Not bitwise: the killed run's
    # engine restarts with an empty prefix cache, so its KV entries (and so the logprobs vLLM
    # reports, which TIS uses) are computed in other batch shapes; they agree to ~1e-7.
    # and the tail average of steps 2-4, carried over the kill by the step-2 checkpoint, exported
    for adapter in (final / "adapter_model.safetensors", straight / "adapters" / "step_4" / "adapter_model.safetensors"):
        la, lb = load_file(str(adapter)), load_file(str(split / adapter.relative_to(straight)))
        assert la.keys() == lb.keys() and all(torch.allclose(la[k], lb[k], rtol=1e-4, atol=1e-6) for k in la)
    sa, sb = (torch.load(r / "checkpoints" / "step_4" / "trainer_state.pt", weights_only=False) for r in (straight, split))
    for key in ("exp_avg", "exp_avg_sq", "step"):
        moments_a = {n: s[key] for n, s in sa["optimizer"]["state"].items()}
        moments_b = {n: s[key] for n, s in sb["optimizer"]["state"].items()}
        assert moments_a.keys() == moments_b.keys()
        assert all(torch.allclose(torch.as_tensor(moments_a[n]), torch.as_tensor(moments_b[n]), rtol=1e-4, atol=1e-9)
                   for n in moments_a), key
    assert sa["scheduler"]["last_epoch"] == sb["scheduler"]["last_epoch"] == 4
    ma, mb = (json.loads((r / "checkpoints" / "step_4" / "meta.json").read_text()) for r in (straight, split))
    assert ma["step"] == mb["step"] == 4 and ma["stream"] == mb["stream"] and ma["average_count"] == 3

    # the published policy is the tail average: its delta is the mean of the policies after steps
    # 2, 3 and 4 (the three syncs the shared dir keeps), up to what the truncation reported dropping
    published = load_file(str(straight / "adapters" / "step_4" / "adapter_model.safetensors"))
    syncs = [load_file(str(straight / "shared" / "sync" / f"step_{s}" / "adapter_model.safetensors")) for s in (2, 3, 4)]
    error = exact = 0.0
    for name_a in (n for n in published if "lora_A" in n):
        name_b = name_a.replace("lora_A", "lora_B")
        mean = sum(s[name_b] @ s[name_a] for s in syncs) / 3
        error += (published[name_b] @ published[name_a] - mean).pow(2).sum().item()
        exact += mean.pow(2).sum().item()
    assert (error / exact) ** 0.5 < 1.5 * sum(m.get("average_dropped", 0) for m in a) + 1e-5
    assert not torch.allclose(published[name_b] @ published[name_a], syncs[-1][name_b] @ syncs[-1][name_a])

    # what a run writes
    evals = json.loads((straight / "eval" / "step_4.json").read_text())
    assert evals["total"] == 8 == len(evals["puzzles"]) and evals["fitting"] == 8
    # what it played: this run's id, the adapter synced after step 4, the base
    run = json.loads((straight / "run.json").read_text())
    assert evals["run_id"] == run["run_id"] and evals["adapter"] == str(straight / "shared" / "average" / "step_4")
    assert evals["last_iterate"]["adapter"] == str(straight / "shared" / "sync" / "step_4")
    assert evals["last_iterate"]["total"] == 8  # the current policy, beside the average
    assert "last_iterate" not in json.loads((straight / "eval" / "step_0.json").read_text())  # none before step 2
    assert evals["base"]["path"] == str(warm_start.resolve()) and evals["base"]["fingerprint"]
    assert json.loads((split / "eval" / "step_4.json").read_text())["run_id"] == \
        json.loads((split / "run.json").read_text())["run_id"]  # a resumed run keeps its id
    assert (straight / "eval" / "step_0.json").exists() and list((straight / "tb").glob("events.out.tfevents.*"))
    assert (straight / "checkpoints" / "latest").read_text() == "step_4"
    from peft import PeftConfig

    assert PeftConfig.from_pretrained(str(straight / "adapters" / "step_4")).r == 8  # an ordinary PEFT adapter
    summary = json.loads((split / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["steps_s"] == pytest.approx(sum(m["step_s"] for m in b), abs=0.1)


@pytest.mark.slow
def test_a_damaged_checkpoint_and_changed_settings_on_resume(tmp_path, short_run, warm_start):
    """The newest checkpoint damaged after it was written: the restart says so in one line and
    resumes from the one before. A restart with another learning rate is refused, unless asked."""
    out = tmp_path / "run"
    shutil.copytree(short_run, out, symlinks=True)  # checkpoints at steps 2 and 4
    state = out / "checkpoints" / "step_4" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:1000])  # truncated by a bad copy or a failing disk
    cmd = [sys.executable, "train.py", "--model", str(warm_start), "--out-dir", str(out), *SHORT_RUN, "--lr", "5e-4"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert f"checkpoint {out}/checkpoints/step_4 skipped: trainer_state.pt has 1000 bytes" in proc.stdout + proc.stderr
    assert "step_2 was written with other settings (lr: 0.001 -> 0.0005)" in proc.stderr
    proc = subprocess.run(cmd + ["--resume-allow-changes", "true"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    log = proc.stdout + proc.stderr
    assert f"resumed from {out}/checkpoints/step_2 at step 2" in log
    assert "resuming with changed settings: lr: 0.001 -> 0.0005" in log
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]  # steps 3 and 4 redone, one line each
    assert metrics[-2]["lr"] == pytest.approx(5e-4)  # the new rate took effect (the last step's decayed to 0)


# ----------------------------------------------------------------------------- evaluation

def test_an_evaluation_plays_the_first_training_mazes_too_and_samples_at_its_own_temperature(
        tmp_path, engine, warm_start):
    """Greedy play of the held-out mazes and, beside them, of the first training mazes (the ones
    the trainer's stream starts with); --sampled-eval-temperature, not the training temperature,
    is what the engine samples the held-out mazes at, and the evaluation file says which one."""
    import torch.distributed as dist

    import rollout

    temperatures = []

    class RecordingEngine:  # the real engine, with the temperature of every sampled request noted
        def __getattr__(self, name):
            return getattr(engine, name)

        def generate(self, prompts, params, **kwargs):
            temperatures.extend(p.temperature for p in params)
            return engine.generate(prompts, params, **kwargs)

    ours = not dist.is_initialized()  # the in-process engine normally made a world of one already
    if ours:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        cfg = train.Config(eval_puzzles=2, sampled_eval_samples=2, temperature=0.5, sampled_eval_temperature=0.8,
                           max_turns=3, max_new_tokens=8, progress=False)
        result = evaluation.evaluate_run(cfg, RecordingEngine(), rollout.ChatFormat.for_model(str(warm_start)), None, 0,
                                         tmp_path, MazeTask)
    finally:
        if ours:
            dist.destroy_process_group()
    assert temperatures and set(temperatures) == {0.8}
    assert 0.0 <= result["sampled_solve_rate"] <= 1.0
    saved = json.loads((tmp_path / "eval" / "step_0.json").read_text())
    assert saved["sampled_temperature"] == 0.8 and saved["solved"] == result["solved"]
    assert [r["seed"] for r in saved["puzzles"]] == [0, 1]
    stream = env.TrainingStream(MazeTask, "small", eval_n=2)  # the trainer's, as train.main makes it
    assert [r["seed"] for r in saved["training_puzzles"]["puzzles"]] == [stream.next().seed, stream.next().seed]
    assert saved["training_puzzles"]["total"] == 2 and saved["training_puzzles"]["solved"] == sum(
        r["solved"] for r in saved["training_puzzles"]["puzzles"])


# ----------------------------------------------------------------------------- configuration

def test_the_lr_schedule_is_transformers_own():
    from transformers import get_scheduler

    for schedule, name in (("constant", "constant_with_warmup"), ("cosine", "cosine")):
        lrs = []
        for make in (update.make_scheduler, lambda o, c: get_scheduler(name, o, num_warmup_steps=2,
                                                                       num_training_steps=c.steps)):
            optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
            cfg = train.Config(lr_schedule=schedule, warmup_steps=2, steps=6)
            scheduler = make(optimizer, cfg)
            seen = []
            for _ in range(6):  # the rate each optimizer step uses
                seen.append(scheduler.get_last_lr()[0])
                optimizer.step()
                scheduler.step()
            lrs.append(seen)
        assert lrs[0] == lrs[1]
    assert lrs[0][:3] == [0.0, 0.5, 1.0] and lrs[0][-1] < 0.2  # warm-up from 0, then cosine towards 0
    # the recipe's: warm-up, constant, then the last 30% of the steps decay to 0 (warmup-stable-decay)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = update.make_scheduler(optimizer, train.Config(warmup_steps=2, steps=20))
    assert train.Config().lr_schedule == "wsd" and train.Config().decay_frac == 0.3
    seen = []
    for _ in range(20):
        seen.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert seen[:3] == [0.0, 0.5, 1.0] and set(seen[2:14]) == {1.0}  # 6 = 30% of 20 steps decay
    assert seen[14:] == sorted(seen[14:], reverse=True) and seen[-1] < 0.1 and scheduler.get_last_lr()[0] == 0.0
