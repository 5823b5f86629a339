"""The run directory: one run per directory, held by one trainer, with its logs and records.

    <out>/trainer.lock    the trainer that holds the directory (host, pid, start time, launcher)
    <out>/run.json        which run the directory holds: {run_id, started, host, launcher, base}
    <out>/config.json     the run's settings
    <out>/metrics.jsonl   one line per step (RunLog), and <out>/tb/ the same for TensorBoard
    <out>/eval/step_<N>.json   greedy evaluations, each naming its run, adapter and base
    <out>/summary.json    held-out solved at every evaluation, the run's time
    <out>/stopped.json    a run a signal stopped (preemption): which signal, its last checkpoint
    <out>/archive/<time>/ earlier runs, moved aside by --archive-old-run

`open_run` (rank 0, before anything is written there) takes the lock, picks the checkpoint to
resume from (checkpoint.find), and refuses to start a fresh run over another run's files unless
told to move them aside (the same command again, killed before its first checkpoint, starts its
own run over in place). `StopRequest` turns SIGTERM and the like into a checkpoint and an exit.
After a crash `RunLog` drops the metrics lines of the steps that will be
redone, so the log always reads as one uninterrupted run. Checkpoints themselves are checkpoint.py's.
"""

import dataclasses
import json
import os
import shutil
import signal
import socket
import time
import uuid
from pathlib import Path


import checkpoint
import storage
import distributed


# ----------------------------------------------------------------------------- writable and shared

def check_writable(directory: Path, min_free_mb: int = 64):
    """Create `directory` and make sure a file can be written there, with some room to spare."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-check-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise SystemExit(f"{directory}: cannot write there ({e.strerror or e})")
    free_mb = shutil.disk_usage(directory).free // 2**20
    if free_mb < min_free_mb:
        raise SystemExit(f"{directory}: only {free_mb} MB free; checkpoints and adapters need more")


def check_shared(shared: Path):
    """Rank 0 makes sure the LoRA sync's directory takes files; then every rank must read back what
    rank 0 wrote there (distributed.check_shared_dir). Collective; every rank stops alike."""
    distributed.on_rank0(lambda: check_writable(shared))
    distributed.check_shared_dir(shared, storage.atomic_write_text)


# ----------------------------------------------------------------------------- the run's own records

def metrics_step(line: str) -> int | None:
    """The step of a metrics.jsonl line; None for a blank line or one torn by a crash mid-write."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


def write_summary(steps: int, out: Path, elapsed_s: float, hours: float, on_gpu: bool, log=print):
    """summary.json: held-out solved at every evaluation of this run; steps_s covers every process that
    worked on this run (a resumed run's earlier ones too), elapsed_s this process's own time."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    evals = run_evals(out)
    summary = {"steps": steps, "steps_s": round(sum(json.loads(line)["step_s"] for line in lines), 1),
               "elapsed_s": round(elapsed_s, 1), ("gpu_hours" if on_gpu else "process_hours"): round(hours, 4),
               "eval": {r["step"]: f"{r['solved']}/{r['total']}" for r in evals}}
    storage.atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    log("run summary: " + json.dumps(summary))


def run_evals(out: Path) -> list[dict]:
    """The current run's evaluations (eval/step_<N>.json), by step; see `belongs_to_run`."""
    run = run_record(out)
    evals = []
    for path in (out / "eval").glob("step_*.json"):
        result = json.loads(path.read_text())
        if belongs_to_run(result, run):
            evals.append(result)
    return sorted(evals, key=lambda r: r["step"])


class RunLog:
    """Rank 0's record of the run as it goes: config.json, metrics.jsonl and TensorBoard, and at the
    end summary.json.

    Opened for a run that (re)starts at `start_step`, it keeps only the metrics lines of steps up
    to there: the lines of steps a crash will make the run redo go, and so does a last line the
    crash cut short. Each step's line is on disk (fsync) before the step's checkpoint is published
    (checkpoint.publish), so `latest` never names a step the log does not have."""

    def __init__(self, out: Path, cfg, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.out, self.path = out, out / "metrics.jsonl"
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        kept = [line for line in lines if (n := metrics_step(line)) is not None and n <= start_step]
        storage.atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        storage.atomic_write_text(out / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
        self.tensorboard = SummaryWriter(str(out / "tb"), purge_step=start_step + 1)

    def step(self, step: int, metrics: dict, **extra):
        """One step's line (metrics to 6 significant digits, then `extra` as is) and its scalars."""
        line = {"step": step, **{k: float(f"{v:.6g}") for k, v in metrics.items()}, **extra}
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:  # a torn last line is dropped on resume (metrics_step)
            raise storage.write_error(f"the metrics line of step {step} in", self.path, e,
                                         "the lines before it are kept; the step is redone on resume") from e
        for k, v in metrics.items():
            self.tensorboard.add_scalar(k, v, step)
        self.tensorboard.flush()

    def finish(self, steps: int, elapsed_s: float, hours: float, on_gpu: bool, log=print):
        self.tensorboard.close()
        write_summary(steps, self.out, elapsed_s, hours, on_gpu, log)


# ----------------------------------------------------------------------------- the run directory
#
# A run directory holds one run. `open_run` (rank 0, before anything is written there) takes the
# run lock, picks the checkpoint to resume from, and refuses to start a fresh run over another
# run's files unless told to move them aside; run.json names the run, and every evaluation file
# names the run it belongs to.

RUN_FILE = "run.json"  # which run this directory holds: {run_id, started, host, launcher}
LOCK_FILE = "trainer.lock"  # the trainer that holds the directory: {host, pid, ...}
# What a run leaves in its directory (shared/ is the LoRA sync's scratch space, not history).
STOPPED_FILE = "stopped.json"  # a run stopped by a signal: which one, at which step (launch/slurm.sbatch requeues)
RUN_FILES = ("metrics.jsonl", "eval", "checkpoints", "adapters", "config.json", "summary.json", "tb", RUN_FILE,
             STOPPED_FILE)


def run_record(out: Path) -> dict | None:
    try:
        return json.loads((out / RUN_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None


def belongs_to_run(result: dict, run: dict | None) -> bool:
    """Whether an evaluation file is the current run's: it names the run's id. A directory from
    before runs had ids (no run.json, or one adopted on resume) counts the files without one."""
    if run is None:
        return True
    if result.get("run_id") is None:
        return bool(run.get("adopted"))
    return result["run_id"] == run["run_id"]


def eval_file(out: Path, result: dict, run: dict, adapter) -> dict:
    """Write eval/step_<N>.json with what it played: the run, the step, the adapter (the sync
    dir the engine loaded; None: the bare base) and the base model record."""
    record = {**result, "run_id": run["run_id"], "adapter": getattr(adapter, "lora_path", None),
              "base": run["base"]}
    (out / "eval").mkdir(exist_ok=True)
    storage.atomic_write_text(out / "eval" / f"step_{result['step']}.json", json.dumps(record, indent=1))
    return record


def has_eval(out: Path, step: int, run: dict) -> bool:
    """This run already evaluated `step` (a restart after the evaluation, before a checkpoint)."""
    try:
        return belongs_to_run(json.loads((out / "eval" / f"step_{step}.json").read_text()), run)
    except (FileNotFoundError, ValueError):
        return False


def used_run_files(out: Path) -> list[str]:
    """What of another run is in `out`, in words ("metrics.jsonl (4 steps)", "eval/ (3 files)")."""
    found = []
    for name in RUN_FILES:
        path = out / name
        if path.is_dir():
            entries = [p for p in path.iterdir() if not p.name.startswith(".")]
            if entries:
                found.append(f"{name}/ ({len(entries)} {'entry' if len(entries) == 1 else 'entries'})")
        elif path.is_file() and path.stat().st_size:
            if name == "metrics.jsonl":
                steps = sum(metrics_step(line) is not None for line in path.read_text().splitlines())
                found.append(f"{name} ({steps} steps)")
            else:
                found.append(name)
    return found


def archive_run(out: Path) -> Path:
    """Move every run file in `out` into <out>/archive/<UTC time>/ (renames: nothing is copied
    or deleted) and return that dir."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest = out / checkpoint.ARCHIVE_DIR / stamp
    n = 1
    while dest.exists():
        n += 1
        dest = out / checkpoint.ARCHIVE_DIR / f"{stamp}-{n}"
    dest.mkdir(parents=True)
    for name in RUN_FILES:
        if (out / name).exists():
            os.replace(out / name, dest / name)
    storage.fsync_path(dest)
    storage.fsync_path(out)
    return dest


def launcher_id() -> str | None:
    """Which torchrun launched this process: its run id, this host and the agent's pid. Every
    restart of a worker by that torchrun has the same one; another torchrun (a new job, a
    requeue) has another."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return f"{run_id}@{socket.gethostname()}:{os.getppid()}" if run_id else None


def is_restart_of(run: dict | None) -> bool:
    """A torchrun restart (TORCHELASTIC_RESTART_COUNT > 0) of the run that `run` records."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    return bool(restarts > 0 and run and run.get("launcher") and run["launcher"] == launcher_id())


def open_run(out: Path, cfg, base: dict, log=print) -> tuple[str, dict]:
    """Rank 0 takes the run dir (the lock), then decides where the run starts. Collective:
    returns (the checkpoint to resume from or "", the run record) on every rank, or every rank
    stops with rank 0's one line.

    - `--resume latest` with a checkpoint, or `--resume <dir>`: resume; the run keeps its id.
    - A torchrun restart of this very run resumes from its own latest checkpoint even under
      `--resume none`, and with none written yet starts over in place (the files are its own).
    - Otherwise this is a fresh start: into a directory that holds another run's files it
      refuses, naming them, unless `--archive-old-run true` moves them aside first."""
    def open_on_rank0():
        result = _open_run(out, cfg, base, log)
        (out / STOPPED_FILE).unlink(missing_ok=True)  # this attempt goes on from where a stopped one left off
        return result

    return distributed.on_rank0(open_on_rank0)


def _open_run(out: Path, cfg, base: dict, log) -> tuple[str, dict]:
    check_writable(out)
    take_lock(out, cfg.take_over_lock, log)
    run = run_record(out)
    restart = is_restart_of(run)
    ckpt = checkpoint.find(out, "latest" if restart and cfg.resume == "none" else cfg.resume, warn=log)
    if ckpt is not None and run is not None:
        return str(ckpt), {**run, "base": base}
    if ckpt is None and not restart:
        used = used_run_files(out)
        differences = run_differences(out, cfg, base, run) if used and run is not None else None
        if used and cfg.resume == "latest" and differences == []:
            # the same command again (a requeued job, a restarted pod, a rerun) before its first
            # checkpoint: it starts over in place, as the same run
            log(f"{out} holds this run (the same settings and base) with no checkpoint yet: starting it over in place")
            return "", {**run, "base": base}
        if used and not cfg.archive_old_run:
            if cfg.resume == "none":
                why = "--resume none"
                # advise --resume latest only where it would not be refused in turn
                resumable = any(checkpoint.verify(p) is None for p in (out / "checkpoints").glob("step_*")) or \
                    differences == []
                why += ": --resume latest continues it," if resumable else ":"
            else:
                why = "there is no checkpoint to resume from" + (
                    f" and its settings or base differ from these ({'; '.join(differences)}):" if differences else ":")
            raise SystemExit(f"{out} holds another run ({', '.join(used)}) and {why} --archive-old-run true moves "
                             f"it into {out / checkpoint.ARCHIVE_DIR}/ first, or pick a new --out-dir")
        if used:
            log(f"moved the earlier run's files ({', '.join(used)}) to {archive_run(out)}")
        run = None
    if run is None:  # a new run, or one resumed from a directory older than run.json (adopted)
        run = {"run_id": uuid.uuid4().hex[:12], "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "host": socket.gethostname(), "launcher": launcher_id(), "base": base,
               **({"adopted": True} if ckpt is not None else {})}
        storage.atomic_write_text(out / RUN_FILE, json.dumps(run, indent=1))
    return str(ckpt or ""), {**run, "base": base}  # the base this process plays (resume may change it)


def run_differences(out: Path, cfg, base: dict, run: dict) -> list[str]:
    """What makes this command another run than the one `out` holds: its meaningful settings
    (config.json, checkpoint.config_changes) and its base model (path and fingerprint)."""
    try:
        saved = json.loads((out / "config.json").read_text())
    except (FileNotFoundError, ValueError):
        return ["no readable config.json"]
    current = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else vars(cfg)
    differences = checkpoint.config_changes(saved, current)
    if run.get("base") != base:
        differences.append(f"base: {run.get('base')} -> {base}")
    return differences


# The lock: a file created with O_EXCL, which is atomic on local disks, NFS (v3 and later) and
# Lustre alike; no flock, whose meaning differs between them. A lock file outlives a killed
# holder, so its content says who held it: on the same host a dead holder is recognised (its
# pid gone or reused: the process start time differs; the machine rebooted: the boot id
# differs) and the lock is taken over with one warning. From another host nothing can be
# checked: the run refuses and names the holder (except a Slurm job requeued since it took the
# lock: Slurm ended that run first); --take-over-lock true (or deleting the file) is for when
# you know that trainer is gone.

def process_identity(pid: int) -> dict:
    """What tells a live process from a dead one with the same pid on this host."""
    identity = {"host": socket.gethostname(), "pid": pid}
    try:
        identity["boot_id"] = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        # field 22 of /proc/<pid>/stat: the start time in clock ticks since boot (after the
        # parenthesised name, which may itself hold spaces)
        identity["start_ticks"] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        pass
    return identity


def holder_alive(holder: dict) -> bool | None:
    """True/False for a holder on this host; None when it cannot be known (another host)."""
    if holder.get("host") != socket.gethostname():
        return None
    pid = int(holder.get("pid", -1))
    if pid <= 0:
        return False
    now = process_identity(pid)
    if "boot_id" in holder and "boot_id" in now and holder["boot_id"] != now["boot_id"]:
        return False  # the machine rebooted since
    if "start_ticks" in holder:
        return now.get("start_ticks") == holder["start_ticks"]  # missing: no such process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def slurm_attempt() -> dict:
    """The Slurm job and which run of it this is (a requeue counts up SLURM_RESTART_COUNT)."""
    job = os.environ.get("SLURM_JOB_ID")
    return {"slurm_job": job, "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)} if job else {}


def earlier_attempt_of_this_job(holder: dict) -> bool:
    """The holder was an earlier run of this same Slurm job (requeued since, maybe onto other nodes)."""
    ours = slurm_attempt()
    return bool(ours and holder.get("slurm_job") == ours["slurm_job"]
                and int(holder.get("slurm_restart", 0)) < ours["slurm_restart"])


def describe_holder(holder: dict) -> str:
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {holder.get('started', '?')}"
            + (f", torchrun {holder['launcher']}" if holder.get("launcher") else ""))


def take_lock(out: Path, take_over: bool = False, warn=print) -> Path:
    """Create <out>/trainer.lock for this process, or stop if a live trainer holds it. Released
    when the process exits (atexit; a killed process leaves it, for the next one to take over)."""
    import atexit

    path = out / LOCK_FILE
    me = {**process_identity(os.getpid()), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
          "launcher": launcher_id(), **slurm_attempt()}
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                text = path.read_text()
                holder = json.loads(text)
            except FileNotFoundError:
                continue  # released while we looked
            except (OSError, ValueError):
                holder = {}  # written only in part: its holder died at once, or is still writing it
            if holder.get("pid") == os.getpid() and holder.get("host") == me["host"]:
                return path  # this process holds it already
            alive = holder_alive(holder) if holder else None
            if alive is None and earlier_attempt_of_this_job(holder):
                alive = False  # Slurm ends a job's allocation before it runs the requeued job
            if alive or (alive is None and not take_over):
                unknown = "" if alive else (" (on another host: whether it still runs cannot be checked from "
                                            "here; if it is gone, pass --take-over-lock true or delete the lock)")
                raise SystemExit(f"{out} is in use by another trainer: {describe_holder(holder)}{unknown}. "
                                 f"Stop it, or use another --out-dir (lock: {path})")
            warn(f"taking over {path} from a trainer that is gone: {describe_holder(holder)}")
            stale = path.with_name(f".{LOCK_FILE}.stale-{uuid.uuid4().hex[:8]}")
            try:
                os.replace(path, stale)
            except FileNotFoundError:
                continue
            if stale.read_text() != text:  # another trainer took it over first: give it back
                try:
                    os.link(stale, path)
                except FileExistsError:
                    pass
                stale.unlink()
                continue
            stale.unlink()
            continue
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(me))
            f.flush()
            os.fsync(f.fileno())
        atexit.register(release_lock, path, os.getpid())
        return path
    raise SystemExit(f"{path}: could not take the run lock (other trainers are taking it at the same time)")


def release_lock(path: Path, pid: int):
    """Delete the lock if this process holds it."""
    try:
        if json.loads(path.read_text()).get("pid") == pid and os.getpid() == pid:
            path.unlink()
    except (OSError, ValueError):
        pass


# ----------------------------------------------------------------------------- preemption
#
# Slurm, Kubernetes and the like take a node away the same way: SIGTERM, a grace period (30 s by
# default on both), then SIGKILL; then the requeued job or restarted pod runs the same command.
# So a signal is a request to stop at the next safe point, not death: the handler only notes it,
# and the loop asks between steps, and once more after the rollouts, where the step in hand has
# changed nothing yet and is given up. The run then checkpoints its last completed step, writes
# <out>/stopped.json and exits with 128 + the signal's number, the status of a process the signal
# killed, which a scheduler reads as "terminated", not "failed".

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)  # SIGUSR1: Slurm's --signal=USR1@<s>


class StopRequest:
    """Turns SIGTERM, SIGINT and SIGUSR1 into a request that the training loop polls. A second
    Ctrl-C (SIGINT) stops at once, as Ctrl-C does elsewhere; repeats of the others (Slurm signals
    every process of the step, torchrun then forwards the same signal) change nothing."""

    def __init__(self):
        self.signum, self.received_at = 0, None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._note)

    def _note(self, signum, frame):
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not self.signum:
            self.signum, self.received_at = signum, time.time()

    def pending(self) -> int:
        """The signal any rank received (0: none). Collective: every rank must ask at the same point,
        so that all of them stop at the same step."""
        return int(distributed.max_over_ranks(self.signum))


def write_stopped(out: Path, signum: int, step: int, abandoned: bool):
    storage.atomic_write_text(out / STOPPED_FILE, json.dumps(
        {"signal": signal.Signals(signum).name, "checkpoint_step": step, "step_in_hand_abandoned": abandoned,
         "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
