"""The launchers and crash recovery, shown on the tiny model with launch/torchrun.sh:

- two "nodes" on one machine meet at a c10d rendezvous and train one run into one run dir, the
  engines of both sampling from exactly the trainer's policy after every sync;
- a worker killed in the middle of writing a checkpoint is restarted by torchrun and loads the
  previous one; killed again mid-step, it resumes from `latest`; no maze seed repeated or skipped
  and one metrics line per step (lost work printed: -s);
- launch/slurm.sbatch under stub srun/scontrol, and the Kubernetes manifests, give the
  torchrun command lines a cluster needs.
"""

import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from launch.restart_check import latest_step, metrics, uninterrupted_seeds, workers  # a run's lines, checkpoint, workers
from tasks.maze import eval_mazes, solve

ROOT = Path(__file__).resolve().parent.parent
# Smaller than test_train.py's runs: 2 evaluation mazes, evaluation only at the start and the end.
TINY = ["--prompts-per-step", "2", "--group-size", "4", "--max-turns", "3", "--eval-puzzles", "2",
        "--eval-interval", "100", "--sampled-eval-samples", "0", "--progress", "false"]
RUN_TIMEOUT = 480  # seconds for a whole run, restarts included (generous: the machine may be shared); every wait is bounded


# ----------------------------------------------------------------------------- helpers

@pytest.fixture
def launch(tmp_path):
    """Start `launch/torchrun.sh` in its own session; whatever is left is killed afterwards."""
    started = []

    def start(out: Path, *args: str, log: str = "log.txt", launcher: Path = ROOT / "launch" / "torchrun.sh",
              **env_vars: str) -> subprocess.Popen:
        environ = {**os.environ, "NPROC_PER_NODE": "1", **env_vars}  # one process even on a GPU machine
        with open(tmp_path / log, "w") as f:
            proc = subprocess.Popen(["bash", str(launcher), "--out-dir", str(out), *TINY, *args],
                                    cwd=ROOT, env=environ, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        proc.log = tmp_path / log
        started.append(proc)
        return proc

    yield start
    for proc in started:  # the session holds torchrun, its workers and anything they started
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def wait_for(condition, what: str, procs=(), timeout: float = RUN_TIMEOUT, poll: float = 0.1):
    """Poll until condition() is truthy; fail early if a launcher exits (and show its log)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        for proc in procs:
            if proc.poll() is not None:
                pytest.fail(f"launcher exited ({proc.returncode}) while waiting for {what}:\n{tail(proc)}")
        time.sleep(poll)
    pytest.fail(f"timed out after {timeout}s waiting for {what}:\n" + "\n".join(tail(p) for p in procs))


def tail(proc, n: int = 4000) -> str:
    return proc.log.read_text()[-n:]


def finish(proc, timeout: float = RUN_TIMEOUT) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"run did not finish in {timeout}s:\n{tail(proc)}")
    assert proc.returncode == 0, tail(proc)
    return proc.log.read_text()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_one_line_per_step_and_the_uninterrupted_maze_stream(out: Path, steps: int):
    lines = metrics(out)
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    # the seeds a run that never crashed would have drawn: none repeated, none skipped
    seeds, position = uninterrupted_seeds(out, steps)
    assert [m["seeds"] for m in lines] == seeds and len(seeds[0]) == 2
    assert lines[-1]["stream_position"] == position
    # the summary's time in steps counts the killed process's steps too, not just the last process's
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps and abs(summary["steps_s"] - sum(m["step_s"] for m in lines)) < 0.1


# ----------------------------------------------------------------------------- torchrun

KILLED_IN_CHECKPOINT = '''"""train.py, SIGKILLed while it writes step {step}'s checkpoint (its files written,
meta.json not yet), on torchrun's first attempt only (tests/test_launch.py)."""
import os, runpy, sys

sys.path.insert(0, {root!r})
import checkpoint

seal = checkpoint.seal


def seal_or_die(tmp, meta):
    if meta["step"] == {step} and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), 9)
    seal(tmp, meta)


checkpoint.seal = seal_or_die
sys.argv[0] = os.path.join({root!r}, "train.py")
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def killed_in_checkpoint(where: Path, step: int) -> Path:
    """A copy of launch/torchrun.sh whose train.py is the real one with checkpoint.seal replaced
    by one that kills the process first (at `step`, first attempt only); returns the launcher."""
    (where / "launch").mkdir(parents=True)
    for name in ("torchrun.sh", "torchrun_main.py"):
        shutil.copy(ROOT / "launch" / name, where / "launch" / name)
    (where / "train.py").write_text(KILLED_IN_CHECKPOINT.format(root=str(ROOT), step=step))
    return where / "launch" / "torchrun.sh"


@pytest.mark.slow
def test_a_worker_killed_in_a_checkpoint_write_and_then_mid_step_resumes_each_time(tmp_path, launch):
    """One run, two crashes, each restarted by torchrun (MAX_RESTARTS=2):
    1. train.py SIGKILLs itself in the middle of writing step 2's checkpoint (files half there, no
       meta.json; killed_in_checkpoint), on torchrun's first attempt only: the restart loads step
       1's checkpoint, taking over the lock the dead attempt left;
    2. the test SIGKILLs the restarted worker during step 4's rollouts: the next restart resumes
       from step 3's checkpoint (lost work printed: -s).
    After both: one metrics line per step and the maze stream of a run that never crashed."""
    out, ckpts, steps = tmp_path / "run", tmp_path / "run" / "checkpoints", 4
    # (--keep-syncs 1: the step-2 adapter the engines got before the first crash is then the only
    # one kept, and must not push out the step-1 adapter the resumed run writes)
    # (--resume none: a fresh run; torchrun's restarts of it still resume from its own checkpoint)
    proc = launch(out, "--steps", str(steps), "--ckpt-interval", "1", "--keep-syncs", "1", "--resume", "none",
                  launcher=killed_in_checkpoint(tmp_path / "killed", step=2), PYTHON=sys.executable,
                  MAX_RESTARTS="2")
    [first] = wait_for(lambda: workers(proc), "the worker", [proc])
    wait_for(lambda: not psutil.pid_exists(first) or psutil.Process(first).status() == psutil.STATUS_ZOMBIE,
             "the worker to die in its checkpoint write", [proc])
    # what the first crash left: a hidden temp dir with part of step 2, `latest` still on step 1
    [partial] = list(ckpts.glob(".step_2.tmp-*"))
    assert (partial / "trainer_state.pt").exists() and not (partial / "meta.json").exists()
    assert not (ckpts / "step_2").exists() and latest_step(out) == 1

    # `latest` names step k only after step k's metrics line is written: step k+1 is under way
    [second] = wait_for(lambda: [w for w in workers(proc) if w != first], "the restarted worker", [proc])
    wait_for(lambda: latest_step(out) == 3, "step 3's checkpoint", [proc], poll=0.05)
    time.sleep(0.3)  # into step 4's rollouts
    os.kill(second, signal.SIGKILL)
    killed_at = time.time()
    done_before, last_done_at = len(metrics(out)), (out / "metrics.jsonl").stat().st_mtime
    wait_for(lambda: "torchrun restart 2" in proc.log.read_text(), "the second restart", [proc])
    restarted_at = time.time()
    log = finish(proc)
    last_step_at = (out / "metrics.jsonl").stat().st_mtime

    assert f"resumed from {ckpts}/step_1 at step 1" in log and f"resumed from {ckpts}/step_3 at step 3" in log
    assert log.count(f"taking over {out}/trainer.lock from a trainer that is gone") == 2
    assert not (out / "trainer.lock").exists()  # released at the end
    assert_one_line_per_step_and_the_uninterrupted_maze_stream(out, steps)
    assert latest_step(out) == steps and (ckpts / "step_2" / "meta.json").exists()
    assert not list(ckpts.glob(".*")), "the next checkpoint clears what the crash left"
    step_s = sorted(m["step_s"] for m in metrics(out))[steps // 2]
    print(f"\n[recovery] SIGKILL to train.py (pid {second}) during step {done_before + 1} of {steps}; "
          f"resumed from step_3: {done_before - 3} finished steps redone, "
          f"{killed_at - last_done_at:.1f}s of the interrupted step lost (a step takes ~{step_s:.1f}s here); "
          f"kill -> restarted {restarted_at - killed_at:.1f}s, kill -> last step done {last_step_at - killed_at:.1f}s")


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_a_stop_signal_loses_at_most_the_step_in_hand_and_the_same_command_resumes(tmp_path, launch, launcher):
    """SIGTERM, as a scheduler preempts, at a random moment of a run (to `python train.py`, or to
    torchrun, which forwards it): the run checkpoints its last completed step, says so in one
    line, writes stopped.json and exits with 143 (python or torchrun, nothing after that line) well
    inside a 30 s grace period. The very
    same command then resumes it: one metrics line per step, the maze stream of a run never stopped."""
    out, steps = tmp_path / "run", 5
    args = ["--steps", str(steps), "--ckpt-interval", "50"]  # no checkpoint on the way: the stop writes it

    def start(log):
        if launcher == "torchrun":
            return launch(out, *args, log=log, PYTHON=sys.executable)
        with open(tmp_path / log, "w") as f:
            proc = subprocess.Popen([sys.executable, "train.py", "--out-dir", str(out), *TINY, *args], cwd=ROOT,
                                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        proc.log = tmp_path / log
        return proc

    proc = start("first.txt")
    wait_for(lambda: metrics(out), "the first step", [proc])
    time.sleep(random.uniform(0, 1.5))  # anywhere in a step (~1 s here)
    os.kill(proc.pid, signal.SIGTERM)
    signalled = time.time()
    try:
        rc = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running 30 s after SIGTERM:\n{tail(proc)}")
    stop_s, done = time.time() - signalled, len(metrics(out))
    log = proc.log.read_text()
    assert "Traceback" not in log and "SignalException" not in log, tail(proc)
    [said] = [line for line in log.splitlines() if "stopped by SIGTERM" in line]
    assert said == log.rstrip().splitlines()[-1], tail(proc)  # the run's line is the last one
    assert f"checkpoint step_{done} is the last completed step" in said and "the same command resumes" in said
    assert latest_step(out) == done and json.loads((out / "stopped.json").read_text())["checkpoint_step"] == done
    assert rc == 128 + signal.SIGTERM  # torchrun too (launch/torchrun_main.py), as a shell reports a kill

    again = start("again.txt")
    restarted = time.time()
    wait_for(lambda: len(metrics(out)) > done, "the first step after the restart", [again])
    back_s = time.time() - restarted
    log = finish(again)
    assert f"resumed from {out}/checkpoints/step_{done} at step {done}" in log
    assert not (out / "stopped.json").exists()
    assert_one_line_per_step_and_the_uninterrupted_maze_stream(out, steps)
    print(f"\n[preemption, {launcher}] SIGTERM during step {done + 1}: exit {stop_s:.1f}s later, "
          f"0 completed steps lost; restart -> step {done + 1} done again {back_s:.1f}s")


@pytest.mark.slow
def test_two_nodes_on_one_machine(tmp_path, launch, warm_start):
    """Two "nodes" (one process each) meet at a c10d rendezvous and train one run into one run
    dir, at the main job's temperature (0.5: the engines report the tempered log-probs,
    logprobs_mode="processed_logprobs"): both nodes' groups in the statistics, a real update, and
    after it and the sync the engines of both ranks sample from exactly the trainer's updated
    policy (the mismatch stays at fp32 rounding)."""
    out, shared, port = tmp_path / "run", tmp_path / "shared", free_port()
    # the warm start at 15 turns, so groups have reward spread; --train-pool 4 --group-size 8:
    # step 2 plays step 1's mazes again, 8 times each, so the maze whose group had spread at
    # step 1 has it again under the updated policy
    real = ["--model", str(warm_start), "--max-turns", "15", "--temperature", "0.5", "--prompts-per-step", "4",
            "--train-pool", "4", "--group-size", "8", "--eval-interval", "2", "--ckpt-interval", "2"]
    nodes = [launch(out, "--steps", "2", "--shared-dir", str(shared), *real, log=f"node{rank}.txt",
                    NNODES="2", NPROC_PER_NODE="1", NODE_RANK=str(rank), RDZV_ENDPOINT=f"127.0.0.1:{port}",
                    RDZV_ID="two-nodes", OMP_NUM_THREADS="1")  # two "nodes" share two cores
             for rank in (0, 1)]
    logs = [finish(node) for node in nodes]
    assert "is not shared" not in "".join(logs)
    assert (shared / "shared_dir_check.txt").exists()
    lines = metrics(out)
    assert [m["step"] for m in lines] == [1, 2]
    assert all(m["num_groups"] == 4 for m in lines)  # every group of the step, from both nodes
    print("per step (mismatch, trained fraction, grad norm):",
          [(m["mismatch_abs_mean"], m["trained_sequence_frac"], m["grad_norm"]) for m in lines])
    # step 2 samples from a policy that step 1 really changed, and trains on some of it (the
    # mismatch is measured on the sequences trained)
    assert lines[0]["grad_norm"] > 0 and lines[1]["trained_sequence_frac"] > 0
    assert all(m["mismatch_abs_mean"] < 1e-5 and abs(m["tis_weight_mean"] - 1) < 1e-4 for m in lines)
    assert (out / "checkpoints" / "latest").read_text() == "step_2"
    from test_train import lora_b_norm

    assert lora_b_norm(out / "checkpoints" / "step_2" / "adapter_model.safetensors") > 1e-3
    assert json.loads((out / "eval" / "step_2.json").read_text())["total"] == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and abs(summary["steps_s"] - sum(m["step_s"] for m in lines)) < 0.1


def test_torchrun_sh_command_lines():
    def dry(**env_vars):
        proc = subprocess.run(["bash", "launch/torchrun.sh", "--steps", "3"], cwd=ROOT, capture_output=True,
                              text=True, timeout=30, env={**os.environ, "DRY_RUN": "1", **env_vars})
        return proc

    single = dry().stdout
    assert "--standalone" in single and "--nnodes" not in single and single.rstrip().endswith("train.py --steps 3")
    if shutil.which("nvidia-smi") is None:
        assert "OMP_NUM_THREADS=" in single  # CPU: the cores are split between the local processes
    multi = dry(NNODES="2", RDZV_ENDPOINT="h0:29400", NODE_RANK="1", MAX_RESTARTS="2").stdout
    for flag in ("--nnodes 2", "--rdzv-backend c10d", "--rdzv-endpoint h0:29400", "--rdzv-conf is_host=0",
                 "--max-restarts 2"):
        assert flag in multi
    missing = dry(NNODES="2")
    assert missing.returncode == 2 and "RDZV_ENDPOINT" in missing.stderr


# ----------------------------------------------------------------------------- Slurm

STUB_SCONTROL = """#!/usr/bin/env bash
echo "$@" >> "$STUB_LOG/scontrol"
[ "$1 $2" = "show hostnames" ] && printf '%s\\n' $STUB_HOSTS
exit 0
"""
# srun: record the call, then run the task once per node with what srun would set in it
STUB_SRUN = """#!/usr/bin/env bash
echo "$@" >> "$STUB_LOG/srun"
while [[ "$1" == -* ]]; do shift; done
i=0
for host in $STUB_HOSTS; do SLURM_NODEID=$i SLURMD_NODENAME=$host "$@"; i=$((i + 1)); done
"""
STUB_NVIDIA_SMI = """#!/usr/bin/env bash
printf 'GPU 0: Stub (UUID: GPU-0)\\nGPU 1: Stub (UUID: GPU-1)\\n'
"""


def sbatch(tmp_path, with_nvidia_smi=False, **slurm_env) -> tuple[list[list[str]], str]:
    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    scripts = {"scontrol": STUB_SCONTROL, "srun": STUB_SRUN} | ({"nvidia-smi": STUB_NVIDIA_SMI} if with_nvidia_smi else {})
    for name, text in scripts.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    environ = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "STUB_LOG": str(tmp_path),
               "STUB_HOSTS": "gpu07 gpu08", "DRY_RUN": "1", "RUN_DIR": str(tmp_path / "run"),
               "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_NAME": "grpo-maze", "SLURM_JOB_ID": "4242",
               "SLURM_JOB_NODELIST": "gpu[07-08]", **slurm_env}
    for var in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        if var not in slurm_env:
            environ.pop(var, None)
    # Slurm runs a copy of the script from its spool dir, not from the repository
    copy = tmp_path / "slurm_script"
    copy.write_text((ROOT / "launch" / "slurm.sbatch").read_text())
    proc = subprocess.run(["bash", str(copy), "--steps", "5"], cwd=tmp_path, env=environ,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    commands = [shlex.split(line) for line in proc.stdout.splitlines() if "launch/torchrun_main.py" in line]
    return commands, (tmp_path / "srun").read_text()


def test_slurm_script_runs_torchrun_once_per_node(tmp_path):
    commands, srun_argv = sbatch(tmp_path, SLURM_GPUS_ON_NODE="4")
    assert "--ntasks-per-node=1" in srun_argv and "--kill-on-bad-exit=1" in srun_argv
    assert (tmp_path / "scontrol").read_text().split() == ["show", "hostnames", "gpu[07-08]"]
    run = str(tmp_path / "run")
    assert len(commands) == 2  # one torchrun per node
    for node, cmd in enumerate(commands):
        launcher = cmd[cmd.index("launch/torchrun_main.py") + 1:cmd.index("train.py")]
        assert launcher == ["--nproc-per-node", "4", "--max-restarts", "3",
                            "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--nnodes", "2",
                            "--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu07:29400", "--rdzv-id", "slurm-4242",
                            "--rdzv-conf", f"is_host={int(node == 0)}"]
        assert cmd[cmd.index("train.py") + 1:] == ["--out-dir", run, "--shared-dir", f"{run}/shared", "--steps", "5"]

    # GPUs per node from the other places Slurm (or the node) tells
    commands, _ = sbatch(tmp_path, SLURM_GPUS_PER_NODE="h100:8")
    assert all(cmd[cmd.index("--nproc-per-node") + 1] == "8" for cmd in commands)
    commands, _ = sbatch(tmp_path, with_nvidia_smi=True)
    assert all(cmd[cmd.index("--nproc-per-node") + 1] == "2" for cmd in commands)

    headers = [line.split()[1] for line in (ROOT / "launch" / "slurm.sbatch").read_text().splitlines()
               if line.startswith("#SBATCH")]
    for flag in ("--ntasks-per-node=1", "--requeue", "--nodes=2", "--gpus-per-node=8", "--signal=USR1@600"):
        assert flag in headers


def test_slurm_requeues_a_run_its_time_limit_warning_stopped(tmp_path):
    """--signal=USR1@600: train.py checkpoints, writes stopped.json and exits; the script then
    requeues its own job (a preemption's SIGTERM is requeued by Slurm itself: not again here)."""
    (tmp_path / "run").mkdir()
    for name, requeued in (("SIGTERM", False), ("SIGUSR1", True)):
        (tmp_path / "run" / "stopped.json").write_text(json.dumps({"signal": name, "checkpoint_step": 7}))
        (tmp_path / "scontrol").unlink(missing_ok=True)
        sbatch(tmp_path, SLURM_GPUS_ON_NODE="4")
        assert ("requeue 4242" in (tmp_path / "scontrol").read_text()) == requeued


# ----------------------------------------------------------------------------- Kubernetes

def test_kubernetes_manifests(tmp_path):
    docs = [d for f in ("job.yaml", "pvc.yaml")
            for d in yaml.safe_load_all((ROOT / "launch" / "k8s" / f).read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert sorted(by_kind) == ["Job", "PersistentVolumeClaim", "Service"]
    service, job, pvc = by_kind["Service"], by_kind["Job"], by_kind["PersistentVolumeClaim"]

    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert spec["backoffLimit"] >= 1 and pod["restartPolicy"] == "OnFailure"
    # the headless Service gives pod 0 the DNS name the rendezvous endpoint uses
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    [container] = pod["containers"]
    environ = {e["name"]: e["value"] for e in container["env"]}
    assert int(environ["NNODES"]) == spec["completions"]
    assert environ["RDZV_ENDPOINT"] == f"{job['metadata']['name']}-0.{service['metadata']['name']}:29400"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == int(environ["NPROC_PER_NODE"])
    [claim] = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claim["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == claim["name"]]
    script = " ".join(container["args"])
    assert f"--out-dir {mount['mountPath']}/" in script and f"--shared-dir {mount['mountPath']}/" in script

    # the container's command, run here: pod i hosts the rendezvous iff i == 0
    for index in (0, 1):
        proc = subprocess.run(container["command"] + container["args"], cwd=ROOT, capture_output=True, text=True,
                              timeout=30, env={**os.environ, **environ, "JOB_COMPLETION_INDEX": str(index),
                                               "DRY_RUN": "1"})
        assert proc.returncode == 0, proc.stderr
        cmd = shlex.split(proc.stdout.splitlines()[-1])
        assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--nproc-per-node") + 1] == "8"
        assert cmd[cmd.index("--rdzv-endpoint") + 1] == "grpo-maze-0.grpo-maze:29400"
        assert cmd[cmd.index("--rdzv-conf") + 1] == f"is_host={int(index == 0)}"


# ----------------------------------------------------------------------------- the report

def _fake_run(run: Path, seed: int, solved_by_step: dict, step_s: float, sampled: dict | None = None, **settings):
    """A run directory as train.py leaves it: config, metrics lines, evaluation files (with the
    sampled solve rate at the steps `sampled` names)."""
    (run / "eval").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"seed": seed, "task": "maze", "max_turns": 15, "temperature": 0.5,
                                                 "steps": 30, **settings}))
    maze = eval_mazes("small", 1)[0]
    for step, solved in solved_by_step.items():
        rows = [{"index": 0, "seed": 0, "solved": True, "replies": [f"<answer>{a}</answer>" for a in solve(maze)]}]
        extra = {"sampled_solve_rate": sampled[step]} if sampled and step in sampled else {}
        extra["training_puzzles"] = {"solved": solved + 1, "total": 64, "solve_rate": (solved + 1) / 64}
        (run / "eval" / f"step_{step}.json").write_text(json.dumps(
            {"step": step, "difficulty": "small", "solved": solved, "total": 64, "solve_rate": solved / 64,
             "puzzles": rows, "run_id": "this-run", **extra}))
    last = max(solved_by_step)
    (run / "run.json").write_text(json.dumps({"run_id": "this-run"}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": s, "step_s": step_s, "rollout_s": 1.0, "update_s": 2.0, "solve_rate": 0.5, "reward_mean": 0.5}) + "\n"
        for s in range(1, last + 1)))


def test_report_tables_come_from_the_logged_files(tmp_path):
    a, b = tmp_path / "a" / "grpo", tmp_path / "b" / "grpo"
    _fake_run(a, 0, {0: 32, 10: 50, 20: 60}, step_s=3.0)  # 93.75% at step 20
    _fake_run(b, 1, {0: 28, 10: 40, 20: 44}, step_s=4.0)  # never reaches 90%
    for step, solved in ((5, 64), (30, 64)):  # another run's evaluations left in b: not b's
        (b / "eval" / f"step_{step}.json").write_text(json.dumps(
            {"step": step, "difficulty": "small", "solved": solved, "total": 64, "solve_rate": 1.0,
             "puzzles": [], "run_id": "an-earlier-run"}))
    (tmp_path / "a" / "generalisation").mkdir()
    (tmp_path / "a" / "generalisation" / "easy-grpo.json").write_text(json.dumps(
        {"adapter": "x", "difficulty": "easy", "solved": 7, "total": 64}))
    results = tmp_path / "rl_lift.json"
    results.write_text(json.dumps([{"run": str(a), "kind": "main", "stale": True}, {"run": "other", "kind": "long"}]))
    proc = subprocess.run([sys.executable, "launch/report.py", str(a), str(b), "--record", "main", "--command",
                           "bash launch/run.sh", "--results", str(results)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    row_a = next(line for line in lines if line.startswith(f"| {a} | 0 |"))
    assert "| 50.0% | 93.8% (20) | 93.8% (20) | 20 | 1.0 min |" in row_a  # 20 steps x 3 s
    row_b = next(line for line in lines if line.startswith(f"| {b} | 1 |"))
    assert "| 43.8% | 68.8% (20) | 68.8% (20) | not reached | - |" in row_b
    mean = next(line for line in lines if line.startswith("| mean ± std |"))
    assert "46.9% ± 4.4%" in mean and "1/2 reached" in mean
    assert f"| {a} | SFT + GRPO | easy | 7/64 |" in lines
    # the ceiling, from the solver: every 7x7 maze fits in 15 turns, only some 9x9 ones do
    assert "64 of the 64 maze small held-out puzzles can be solved within 15 turns (their shortest solution fits)" in lines
    from launch.report import solvable
    assert solvable("maze", "easy", 64, 15) < 64 == solvable("maze", "easy", 64, 21)
    assert (a / "solve_rate.png").exists() and (a / "final_episode.gif").exists()
    # the records: one per run, from the logged evaluations; an older record of the same run replaced
    records = {r["run"]: r for r in json.loads(results.read_text())}
    assert sorted(records) == sorted([str(a), str(b), "other"]) and "stale" not in records[str(a)]
    assert {k: records[str(a)][k] for k in ("warm_start_solved", "best_solved", "final_solved", "grpo_steps",
                                             "seed", "kind", "command")} == \
        {"warm_start_solved": 32, "best_solved": 60, "final_solved": 60, "grpo_steps": 20, "seed": 0, "kind": "main",
         "command": "bash launch/run.sh"}
    assert records[str(a)]["grpo_minutes"] == 1.0  # 20 steps of 3 s
    assert records[str(a)]["planned_steps"] == 30  # of which 20 are done: a run under way
    assert records[str(a)]["train_temperature"] == 0.5
    # greedy on the first training mazes, beside the held-out ones; forks need the model, not here
    assert (records[str(a)]["train_solved_before"], records[str(a)]["train_solved_after"]) == (33, 61)
    assert records[str(a)]["forks_before"] is None and "forks not scored" in proc.stdout


def test_the_training_curve_is_a_rolling_mean():
    from launch.report import rolling_mean

    assert rolling_mean([0.0, 1.0, 2.0, 6.0], 2) == [0.0, 0.5, 1.5, 4.0]
    assert rolling_mean([4.0, 0.0, 2.0], 25) == [4.0, 2.0, 2.0]  # fewer than a window at the start


# ----------------------------------------------------------------------------- the device check

@pytest.mark.slow
def test_gpu_check_runs_the_trainer_path_in_its_dry_run(tmp_path):
    """launch/gpu_check.sh, the script for a one-GPU machine, in its CPU mode: the small shape
    through the trainer's code (build_policy from a saved model, equal to it; precomputed features;
    update with TIS; adapter and checkpoint round trip), every check passing, one JSON report that
    already holds each check when its line is printed (a run cut off keeps what it finished)."""
    out = tmp_path / "results"
    proc = subprocess.Popen(["bash", "launch/gpu_check.sh", "--dry-run"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True,  # (no wheels: what .venv has, whatever .whl/ holds)
                            env={**os.environ, "OUT": str(out), "WHEELS": str(tmp_path / "no-wheels")})
    seen_while_running = []
    for line in proc.stdout:
        if line.startswith("[ok]") or line.startswith("[FAIL]"):
            on_disk = json.loads((out / "gpu_check.json").read_text())
            seen_while_running.append((on_disk["status"], len(on_disk["checks"])))
    assert proc.wait(timeout=600) == 0
    # the report is written before its line is printed; a reader slowed by a busy machine may
    # already find the checks after it, or the finished report after the last line
    assert len(seen_while_running) == 6
    for n, (status, checks) in enumerate(seen_while_running, start=1):
        assert checks >= n and (status == "running" or checks == 6), seen_while_running
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["status"] == "done" and report["dry_run"] and not report["gpu"]
    assert (report["passed"], report["failed"], report["skipped"]) == (6, 0, 0)
    assert report["requirements"] and all(r["ok"] for r in report["requirements"])
    assert {"transformers", "peft", "regex", "tokenizers", "huggingface-hub"} <= {r["name"] for r in report["requirements"]}
    assert [c["check"].split(":")[0] for c in report["checks"]][1:] == ["small"] * 5
    assert "build_policy" in report["checks"][1]["check"]
    small = report["shapes"]["small"]
    compared = small["build_policy_compared"]
    assert compared["tensors"] > 100 and any("rotary_emb.inv_freq" in b for b in compared["buffers_outside_the_state_dict"])
    update = next(c for c in report["checks"] if "grpo_update" in c["check"])
    assert "LoRA moved" in update["detail"] and small["grad_norm"] > 0
    # the recipe's sampling, tied embeddings and a token budget that really packs
    assert small["tied_embeddings"] and small["temperature"] == 0.5 and small["processed_vs_full_logits_max_diff"] < 1e-4
    assert len(small["micro_batches"]) > 1 and max(small["micro_batches"]) > 1
    # it says what it ran on and what it leaves unproven
    assert {"torch", "transformers", "peft"} <= set(report["versions"]) and report["world_size"] == 1
    assert any("vLLM" in line for line in report["not_run"]) and any("a GPU" in line for line in report["not_run"])


def _fake_wheel(folder: Path, name: str, version: str, tag: str = "py3-none-any", requires=()) -> Path:
    """A wheel with metadata only (pip downloads and installs it like any other)."""
    import base64
    import hashlib
    import zipfile

    info = f"{name}-{version}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n"}
    digest = {p: base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b"=").decode()
              for p, t in files.items()}
    files[f"{info}/RECORD"] = "".join(f"{p},sha256={digest[p]},{len(t.encode())}\n" for p, t in files.items()) \
        + f"{info}/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / f"{name}-{version}-{tag}.whl", "w") as z:
        for p, t in files.items():
            z.writestr(p, t)
    return folder / f"{name}-{version}-{tag}.whl"


def _pinned() -> dict:
    """What requirements.txt pins for transformers and peft, read here on its own."""
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if line.startswith(("transformers==", "peft==")))


def test_gpu_check_fetch_wheels_takes_the_pins_from_requirements_txt(tmp_path):
    """--fetch-wheels downloads the transformers and peft that requirements.txt pins (not a newer
    one), a regex that satisfies that transformers, for the device's Python 3.12, into a folder
    emptied first. Offline: pip reads a local folder of stand-in wheels instead of PyPI."""
    pinned = _pinned()
    assert set(pinned) == {"transformers", "peft"}
    index = tmp_path / "index"
    _fake_wheel(index, "transformers", pinned["transformers"], requires=["regex>=2025.10.22", "tqdm>=4.60"])
    _fake_wheel(index, "transformers", "99.0.0")  # newer than the pin: must not be taken
    _fake_wheel(index, "peft", pinned["peft"])
    _fake_wheel(index, "regex", "2024.1.1", tag="cp312-cp312-manylinux_2_17_x86_64")  # too old for it
    _fake_wheel(index, "regex", "2026.1.1", tag="cp312-cp312-manylinux_2_17_x86_64")
    wheels = tmp_path / "whl"
    _fake_wheel(wheels, "transformers", "5.0.0")  # a stale one from an earlier fetch
    proc = subprocess.run(["bash", "launch/gpu_check.sh", "--fetch-wheels"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "WHEELS": str(wheels), "PIP_NO_INDEX": "1",
                                            "PIP_FIND_LINKS": str(index)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in wheels.iterdir()) == sorted([
        f"peft-{pinned['peft']}-py3-none-any.whl", "regex-2026.1.1-cp312-cp312-manylinux_2_17_x86_64.whl",
        f"transformers-{pinned['transformers']}-py3-none-any.whl"])
    assert "regex>=2025.10.22" in proc.stdout


def test_gpu_check_refuses_to_start_without_the_pinned_transformers_and_peft(tmp_path):
    """Carried wheels of other versions (here the device image's transformers 5.17 and an old peft)
    are installed, and gpu_check.py then refuses in one line naming both and the pins, before it
    imports either; the report says so. The pins are requirements.txt's."""
    from launch import gpu_check

    pinned = _pinned()
    assert gpu_check.pins() == pinned
    wheels, out = tmp_path / "whl", tmp_path / "out"
    _fake_wheel(wheels, "transformers", "5.17.0")
    _fake_wheel(wheels, "peft", "0.17.0")
    proc = subprocess.run(["bash", "launch/gpu_check.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "WHEELS": str(wheels), "OUT": str(out)})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    [line] = [line for line in proc.stderr.splitlines() if "refusing" in line]
    need = f"needs transformers=={pinned['transformers']} peft=={pinned['peft']} (requirements.txt)"
    assert line.startswith("gpu_check: refusing to start: " + need + ", found transformers 5.17.0, peft 0.17.0;")
    assert "--fetch-wheels" in line and "[ok]" not in proc.stdout
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["status"] == "refused" and report["checks"] == [] and report["refused"] == line


def _build_policy_check(results):
    """In a fresh process (a world of one): build_policy from a saved random model at the tiny
    shape equals it; then one buffer outside the state dict, one LoRA weight and one base weight
    of the built policy are changed, and the comparison names each."""
    import torch

    import distributed
    from config import Config
    from launch import gpu_check
    from gpu_mfu import TINY_TEXT, TINY_VISION  # (bench/, which gpu_check puts on the path) the tiny model's shape

    distributed.init_distributed()
    model, source = gpu_check.build_from_saved(Config(lora_rank=8, lora_alpha=16, seed=3), TINY_TEXT, TINY_VISION)
    found = {"clean": gpu_check.differences(model, source)}
    buffer = next(n for n in found["clean"][1]["buffers_outside_the_state_dict"] if "language_model" in n)
    lora = next(n for n, p in model.named_parameters() if "lora_A" in n and "layers.1." in n)
    base = next(n for n, p in model.named_parameters() if "lora_" not in n and "layers.0.mlp.up_proj" in n)
    with torch.no_grad():
        model.get_buffer(buffer).mul_(1.5)
        for name in (lora, base):
            param = model.get_parameter(name)
            (param.to_local() if hasattr(param, "to_local") else param).view(-1)[0] += 1.0
    found["broken"] = gpu_check.differences(model, source)[0]
    results.put({**found, "names": [buffer, lora, base]})


def test_gpu_check_build_policy_equals_its_saved_source_and_the_comparison_sees_a_change():
    from test_policy import in_fresh_process

    out = in_fresh_process(_build_policy_check)
    bad, compared = out["clean"]
    assert bad == [] and compared["tensors"] > 50
    outside = compared["buffers_outside_the_state_dict"]  # what a state-dict comparison alone would miss
    assert any(b.endswith("language_model.rotary_emb.inv_freq") for b in outside)
    assert any(b.endswith("visual.rotary_pos_emb.inv_freq") for b in outside)
    assert [name for name in out["names"] if not any(b.startswith(name + ":") for b in out["broken"])] == []
    assert len(out["broken"]) == 3, out["broken"]


def test_gpu_check_says_what_it_leaves_unproven():
    """The report's scope claims no more than the check runs: on a GPU too, vLLM, several processes
    and the sizing table stay unproven, and a torch other than the pinned one is named; its --help
    lists the same."""
    from launch import gpu_check

    scope = gpu_check.scope(on_gpu=True, world=1, shapes=["small", "8b"], bench=True)
    unproven, helped = " ".join(scope["not_run"]), " ".join(gpu_check.__doc__.split())
    for claim in ("vLLM", "bf16 trainer-vs-vLLM mismatch", "sleep modes", "more than one process", "HSDP",
                  "sizing.py"):
        assert claim in unproven and claim in helped, claim
    pinned = gpu_check.pins_of(["torch"])["torch"]
    assert (f"the pinned torch {pinned}" in unproven) == (not __import__("torch").__version__.startswith(pinned))
    assert "world size 1" in scope["ran"][0] and len(scope["ran"]) == 4
    assert "a GPU" in " ".join(gpu_check.scope(on_gpu=False, world=1, shapes=["small"], bench=False)["not_run"])


def test_gpu_check_skips_a_stage_it_has_no_time_for(tmp_path, monkeypatch):
    """A stage that would not fit in what is left of --budget-s is reported skipped, at once."""
    import time

    from launch import gpu_check

    monkeypatch.setattr(gpu_check, "REPORT", {"checks": [], "status": "running"})
    monkeypatch.setattr(gpu_check, "REPORT_PATH", tmp_path / "gpu_check.json")
    monkeypatch.setattr(gpu_check, "START", time.time() - 200)
    assert gpu_check.within_budget("bench", 300)  # 100 s left, it needs 75
    assert not gpu_check.within_budget("8b", 300)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["skipped"] == 1 and report["checks"][0]["check"] == "8b"
    assert report["checks"][0]["detail"].startswith("skipped: 100 s of the 300 s budget left")


def test_report_names_the_sampled_evaluations_own_temperature(tmp_path):
    """A run that trains at T 0.5 and evaluates sampled play at T 1: the table printed at the end and
    the record both say 1.0."""
    run = tmp_path / "grpo"
    _fake_run(run, 0, {0: 30, 30: 40}, step_s=2.0, sampled={0: 0.3, 30: 0.4}, sampled_eval_temperature=1.0)
    results = tmp_path / "rl_lift.json"
    proc = subprocess.run([sys.executable, "launch/report.py", str(run), "--record", "long", "--results", str(results)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "sampled solve rate (temperature 1.0, held-out puzzles): 0.300 before GRPO, 0.400 after" in proc.stdout
    [rec] = json.loads(results.read_text())
    assert (rec["sampled_temperature"], rec["train_temperature"], rec["sampled_after"]) == (1.0, 0.5, 0.4)


def test_gpu_check_names_what_is_missing_before_it_runs_anything(tmp_path):
    """A machine that lacks a requirement (or has one too old) gets a report naming it and one line,
    not a traceback from the first import that trips over it."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "launch/gpu_check.py", "--dry-run", "--out", str(out),
                           "--require", "no-such-package>=1", "--require", "numpy<1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "missing or too old: no-such-package >=1 (have none" in proc.stderr and "numpy <1 (have" in proc.stderr
    report = json.loads(out.read_text())
    assert report["checks"] == [] and len(report["missing"]) == 2
    assert {r["name"] for r in report["requirements"] if not r["ok"]} == {"no-such-package", "numpy"}


# ----------------------------------------------------------------------------- the README's commands

def test_the_readmes_test_commands_select_the_tests_they_name():
    """Every `pytest tests/<file> -k <expr>` in the README selects at least one test of that file,
    by pytest's own -k matching (test names, case-insensitive substrings)."""
    import ast
    import re

    from _pytest.mark.expression import Expression

    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"pytest\s+(tests/\w+\.py)\s+-k\s+(\w+|\"[^\"]+\")", readme)
    assert len(commands) >= 5, commands
    for path, expression in commands:
        tree = ast.parse((ROOT / path).read_text())
        names = [f.name for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test")]
        matcher = Expression.compile(expression.strip('"'))
        selected = [n for n in names if matcher.evaluate(lambda word, **kw: word.lower() in n.lower())]
        assert selected, f"pytest {path} -k {expression} selects nothing"


def test_the_readmes_table_comes_from_the_recorded_runs(tmp_path):
    """launch/report.py --table: the recorded runs whose dir matches, a row each by seed, and the
    mean final lift; another kind's runs stay out."""
    records = [{"kind": "main", "run": f"runs/x-seed{s}/grpo", "seed": s, "total": 64, "warm_start_solved": 30,
                "best_solved": 40, "best_step": 100, "final_solved": 30 + 4 * s, "final_step": 150,
                "forks_before": 70, "forks_after": 80, "forks_total": 108, "train_solved_before": 30,
                "train_solved_after": 31, "command": "c"} for s in (2, 0, 1)]
    records.append({**records[0], "run": "runs/other-seed0/grpo", "final_solved": 64})
    (tmp_path / "r.json").write_text(json.dumps(records))
    proc = subprocess.run([sys.executable, "launch/report.py", "--table", "runs/x-seed", "--results",
                           str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "seed" not in line
            and "---" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["0", "1", "2"]
    assert "| 38/64 (150) | +12.5 points | 70 -> 80 of 108 | 30 -> 31 |" in rows[2]
    assert "Final lift +6.2 points mean (seeds +0.0, +6.2, +12.5); final below best by 15.6, 9.4, 3.1" in proc.stdout


def test_the_visgym_table_counts_the_mazes_that_fit(tmp_path):
    """VisGym easy: the table's share is of the mazes that fit the turn limit (50 of VisGym's 64 seeds
    at 15 turns, all 64 at 20: experiments/count_fits.py), and run.sh refuses an unknown TASK."""
    from launch.report import solvable

    assert solvable("visgym-maze", "easy", 64, 15) == 50 and solvable("visgym-maze", "easy", 64, 20) == 64
    assert solvable("maze", "easy", 64, 15) == 45 and solvable("sokoban", "6x6", 8, 15) == 8
    records = [{"kind": "visgym-easy", "env_style": "visgym", "run": f"runs/v-seed{s}/grpo", "seed": s, "total": 64,
                "warm_start_solved": 25, "best_solved": 40, "best_step": 60, "final_solved": 35 + s,
                "final_step": 100, "solvable": 50, "solved_20_before": 27, "solved_20_after": 40 + s}
               for s in (1, 0)]
    (tmp_path / "r.json").write_text(json.dumps(records))
    proc = subprocess.run([sys.executable, "launch/report.py", "--table", "runs/v-seed", "--results",
                           str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "| 0 | 25/64 | 40/64 (60) | 35/64 (100) | 35/50 (70%) | +15.6 points | 27/64 -> 40/64 |" in proc.stdout
    assert "Final lift +16.4 points mean (seeds +15.6, +17.2)" in proc.stdout
    proc = subprocess.run(["bash", "launch/run.sh"], cwd=ROOT, env={**os.environ, "TASK": "visgym"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "TASK must be main, visgym-easy or sokoban, not 'visgym'" in proc.stderr
