"""torchrun restarts and stops of a run of two processes, under launch/torchrun.sh (issue 58):

- the process group forms again after a restart, whichever rank gets there first (in the store
  torchrun's agent shares across attempts, a restarted rank could read the dead attempt's gloo
  address: "Gloo connectFullMesh failed ... Connection refused"), for the CPU group and for the
  gloo half of the GPU group; a bare torchrun that would restart into that store is refused;
- a random worker of two, killed at a random moment, twice in one run: every restart resumes
  from the latest checkpoint, one metrics line per step, the maze stream of a run never killed
  (launch/restart_check.py, which does the same as many times as asked);
- a stop signal to the launcher ends with the run's one line and status 128 + signal.
"""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

GROUP_TWICE = '''"""Stands in for train.py under a copy of launch/torchrun.sh (tests/test_restart.py): the
project's process group (distributed.init_distributed), formed on torchrun's first attempt and
again on its restart. Rank 1 dies after the first; on the restart rank 0 comes late, so rank 1
looks up rank 0's address before rank 0 has written this attempt's."""
import os, sys, time
from datetime import timedelta
sys.path.insert(0, {root!r})
import torch, torch.distributed as dist
import distributed

distributed.backend = lambda on_gpu: {backend!r}
init = dist.init_process_group  # a wrong address then fails in 30 s, not the default 30 min
dist.init_process_group = lambda *args, **kwargs: init(*args, timeout=timedelta(seconds=30), **kwargs)
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 1 and rank == 0:
    time.sleep(3)
distributed.init_distributed()
sub = dist.new_group(backend="gloo")  # a second group's keys (wait_on_cpu's kind) in the same store
sums = []
for group in (None, sub):
    x = torch.ones(1)
    dist.all_reduce(x, group=group)
    sums.append(int(x.item()))
print(f"attempt {{attempt}} rank {{rank}}: sums {{sums}}", flush=True)
if attempt == 0:
    if rank == 1:
        os._exit(9)
    time.sleep(120)  # until torchrun stops it to restart the group
dist.destroy_process_group()
'''


def kill_session(proc: subprocess.Popen):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def launcher_running(where: Path, train_py: str) -> Path:
    """A copy of launch/torchrun.sh beside a stand-in train.py; returns the launcher."""
    (where / "launch").mkdir(parents=True)
    for name in ("torchrun.sh", "torchrun_main.py"):
        (where / "launch" / name).write_text((ROOT / "launch" / name).read_text())
    (where / "train.py").write_text(train_py)
    return where / "launch" / "torchrun.sh"


# "gloo": the CPU group; "cpu:gloo": the gloo half of the GPU group ("cpu:gloo,cuda:nccl", whose
# NCCL half needs GPUs), under the same keys (default_pg/0//cpu//...)
@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo"])
def test_the_group_forms_again_after_a_restart_when_the_peer_comes_late(tmp_path, backend):
    launcher = launcher_running(tmp_path, GROUP_TWICE.format(root=str(ROOT), backend=backend))
    environ = {**os.environ, "NPROC_PER_NODE": "2", "MAX_RESTARTS": "1", "OMP_NUM_THREADS": "1",
               "PYTHON": sys.executable}
    proc = subprocess.Popen(["bash", str(launcher)], cwd=tmp_path, env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=90)
    finally:  # torchrun and its workers, whatever state they are in
        kill_session(proc)
    assert "connectFullMesh" not in log, log[-3000:]
    assert proc.returncode == 0, log[-3000:]
    for attempt in (0, 1):
        for rank in (0, 1):
            assert f"attempt {attempt} rank {rank}: sums [2, 2]" in log


STOPS_ON_A_SIGNAL = '''"""Stands in for train.py under a copy of launch/torchrun.sh (tests/test_restart.py): waits
for a stop signal, then says so in one line (rank 0) and exits as train.py does, 128 + signal."""
import os, signal, sys, time

def stop(signum, frame):
    time.sleep(1)  # a checkpoint's worth of work after the signal
    if os.environ["RANK"] == "0":
        print(f"stopped by {{signal.Signals(signum).name}}: the run's one line", flush=True)
    sys.exit(128 + signum)

for sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, stop)
print("ready", flush=True)
time.sleep(120)
'''


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_to_the_launcher_ends_with_the_runs_line_and_128_plus_the_signal(tmp_path, sig):
    """What Slurm (SIGUSR1 ahead of the time limit, SIGTERM on preemption) and Kubernetes (SIGTERM
    to the pod) send to torchrun: it forwards the signal, its workers stop with their line, and it
    exits 128 + signal after it, where torchrun alone raises SignalException (a traceback, status 1)."""
    launcher = launcher_running(tmp_path, STOPS_ON_A_SIGNAL.format())
    environ = {**os.environ, "NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", str(launcher)], cwd=tmp_path, env=environ, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 60
        while log.read_text().count("ready") < 2 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert log.read_text().count("ready") == 2, log.read_text()
        os.kill(proc.pid, sig)  # bash exec'd torchrun: the launcher's pid is torchrun's
        rc = proc.wait(timeout=30)
    finally:
        kill_session(proc)
    text = log.read_text()
    assert "Traceback" not in text and "SignalException" not in text, text
    assert text.rstrip().splitlines()[-1] == f"stopped by {sig.name}: the run's one line", text
    assert rc == 128 + sig


def test_a_bare_torchrun_that_would_restart_into_its_shared_store_is_refused_in_one_line(monkeypatch):
    """`torchrun --max-restarts N train.py` without launch/torchrun.sh: its agent's store is shared
    across attempts (TORCHELASTIC_USE_AGENT_STORE=True), so a restart could fail as in issue 58;
    the run says so and what to do before it forms a group. Without restarts, or alone, it starts."""
    import distributed

    torchrun_env = dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT="1", TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_MAX_RESTARTS="3")
    for name, value in torchrun_env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as refused:
        distributed.init_distributed()
    said = str(refused.value)
    assert "\n" not in said and "launch/torchrun.sh" in said and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in said
    for harmless in (dict(TORCHELASTIC_MAX_RESTARTS="0"), dict(WORLD_SIZE="1"),
                     dict(TORCHELASTIC_USE_AGENT_STORE="False")):  # the last: launch/torchrun.sh's
        with monkeypatch.context() as m:
            for name, value in harmless.items():
                m.setenv(name, value)
            distributed.check_restarts_can_meet()


@pytest.mark.slow
def test_a_random_worker_of_two_killed_at_random_moments_comes_back_every_time(tmp_path):
    """launch/restart_check.py's check, twice in one run of two processes (its command line does it
    20 times): a random worker SIGKILLed at a random moment, first of the training steps (so the
    restart has a checkpoint to resume from), then of the restarted attempt, its start-up included;
    MAX_RESTARTS=2 so a failed restart fails the run. Every restart that loads a checkpoint loads
    `latest` as the killed attempt left it, and the run ends with status 0, one metrics line per
    step and the maze stream of a run never killed. The draw's seed is printed (-s)."""
    from launch.restart_check import RestartFailed, run_with_kills

    seed = random.randrange(1 << 30)
    print(f"\n[restart] seed {seed}")
    try:
        records = run_with_kills(tmp_path / "run", kills=2, rng=random.Random(seed), nproc=2, steps=6,
                                 window_s=60, say=print, during=("steps", "any"))
    except RestartFailed as e:
        pytest.fail(f"seed {seed}: {e}")
    assert [r["kill"] for r in records] == [1, 2]
    print("[restart]", records)


def test_the_checks_reading_of_metrics_skips_a_line_still_being_written(tmp_path):
    """restart_check polls metrics.jsonl while the run writes it: a torn last line is not a step yet."""
    from launch.restart_check import metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "step_s": 2.0}\n{"step": 2, "step_s": 1.5}\n{"step": 3, "st')
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2]
    assert metrics(tmp_path / "nothing-yet") == []
