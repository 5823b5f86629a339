"""Files that must survive a crash: atomic writes, checkpoints that verify themselves, pruning.

    <out>/checkpoints/step_<N>/   adapter_config.json, adapter_model.safetensors (LoRA),
                                  trainer_state.pt (optimizer, LR schedule, RNG states),
                                  meta.json (step, maze stream, config, size + sha256 of every file)
    <out>/checkpoints/latest      the name of the newest published checkpoint

Everything is written into a hidden temp dir, fsynced, and renamed into place in one step; meta.json
is written last, so a dir without it was cut short. `latest` moves only after the rename. A
`kill -9` at any moment therefore leaves the previous checkpoint or the new one, never half of one.
Bit rot or a damaged copy after publication is caught by the hashes: on resume the newest
checkpoint that verifies is used, and each one that does not is named in one line.

The run directory as a whole (the last section, `open_run`): one trainer at a time holds it
(`trainer.lock`), a fresh start never reuses another run's files by accident (it refuses, or
moves them into archive/ when asked), and every evaluation records the run, step, adapter and
base it played, so summaries and reports count only the current run's.
"""

import dataclasses
import hashlib
import json
import os
import random
import shutil
import socket
import time
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import distributed

# The adapter directory's record of the base it was trained on (serve.py refuses a mismatch).
BASE_MODEL_FILE = "base_model.json"


class WriteError(Exception):
    """A file that matters could not be written (disk full, read-only, ...); nothing was published."""


# ----------------------------------------------------------------------------- atomic files

def atomic_write_text(path: Path, text: str):
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def fsync_path(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path):
    for p in [*path.rglob("*"), path]:
        fsync_path(p)


def remove_dir(path: Path):
    """Delete a dir without ever showing a half-deleted one under its name: hide it, then delete."""
    trash = path.with_name(f".{path.name}.trash-{uuid.uuid4().hex[:8]}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def remove_tmp(tmp: Path):
    shutil.rmtree(tmp, ignore_errors=True)


def publish_dir(tmp: Path, final: Path):
    """Make a fully written temp dir visible under its final name in one rename."""
    fsync_dir(tmp)
    if final.exists():
        remove_dir(final)
    os.replace(tmp, final)
    fsync_path(final.parent)  # the rename itself is on disk before anything (`latest`) names it


def prune(parent: Path, prefix: str, keep: int, current: int | None = None):
    """Keep the newest `keep` <prefix><N> dirs. Call only from the one process that writes `parent`:
    it also deletes the hidden temp dirs of writes that a crash cut short. (Another trainer's
    temp dir mid-write would look the same; the run lock, `open_run`, keeps a second trainer out
    of the run dir, so there is none.)

    With `current` (the step just written), dirs numbered above it are deleted first: they are
    left over from a run that got further than the checkpoint this one resumed from, and would
    otherwise count as the newest and push out the dir just written."""
    for stale in parent.glob(f".{prefix}*"):
        shutil.rmtree(stale, ignore_errors=True)
    numbered = sorted((int(p.name[len(prefix):]), p) for p in parent.glob(prefix + "*")
                      if p.name[len(prefix):].isdigit())
    done = []
    for number, path in numbered:
        if current is not None and number > current:
            remove_dir(path)  # abandoned
        else:
            done.append(path)
    for old in done[:-keep]:
        remove_dir(old)


# ----------------------------------------------------------------------------- content hashes

def file_digest(path: Path) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def verify(ckpt: Path) -> str | None:
    """None if `ckpt` is a complete checkpoint whose every file matches meta.json; else what is wrong."""
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
    except FileNotFoundError:
        return "no meta.json (the write was cut short)"
    except (OSError, ValueError) as e:
        return f"meta.json unreadable ({e})"
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        return "meta.json lists no files"
    for name, want in files.items():
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, {want['bytes']} were written"
        if file_digest(path)["sha256"] != want["sha256"]:
            return f"{name} does not match its sha256 (damaged after it was written)"
    return None


def fingerprint_model(model_dir: str) -> str | None:
    """A fingerprint of a model directory's config and weights, without reading all of them:
    sha256 over config.json, each weight file's name and size, and 64 KiB at 16 places spread
    through each file. Two checkpoints of one architecture differ in it (their weights differ
    everywhere); a hub id (no local dir) has none."""
    root = Path(model_dir)
    if not (root / "config.json").is_file():
        return None
    h = hashlib.sha256((root / "config.json").read_bytes())
    for path in sorted(root.glob("*.safetensors")) + sorted(root.glob("*.bin")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            for i in range(16):
                f.seek(size * i // 16)
                h.update(f.read(1 << 16))
    return h.hexdigest()[:32]


def base_model_record(model_path: str) -> dict:
    """What an adapter records of its base: the resolved path (or hub id) and the fingerprint."""
    local = Path(model_path).is_dir()
    return {"path": str(Path(model_path).resolve()) if local else model_path,
            "fingerprint": fingerprint_model(model_path) if local else None}


# ----------------------------------------------------------------------------- adapters

def write_adapter_files(model, state: dict, directory: Path, base_model: dict):
    """adapter_config.json + adapter_model.safetensors (a PEFT adapter, loadable by PEFT and
    vLLM) + base_model.json, the base it belongs to (resolved path and content fingerprint)."""
    model.peft_config["default"].save_pretrained(str(directory))
    save_file(state, str(directory / "adapter_model.safetensors"))
    (directory / BASE_MODEL_FILE).write_text(json.dumps(base_model, indent=1))


def write_adapter(model, state: dict, final_dir: Path, base_model: dict):
    """An adapter directory, atomically: written whole into a hidden temp dir, then renamed."""
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = final_dir.with_name(f".{final_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir()
        write_adapter_files(model, state, tmp, base_model)
        publish_dir(tmp, final_dir)
    except OSError as e:
        remove_tmp(tmp)
        raise WriteError(f"adapter {final_dir} not written ({e.strerror or e}); the previous one is untouched") from e


def load_lora_state(model, adapter_file: Path):
    """Load PEFT-format LoRA weights into the sharded model (every rank reads the file)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # PEFT saves `...q_proj.lora_A.weight` for the parameter `...q_proj.lora_A.default.weight`
    by_saved_name = {n.replace(".default.", "."): n for n, p in model.named_parameters() if p.requires_grad}
    state = load_file(str(adapter_file))
    if set(state) != set(by_saved_name):
        raise SystemExit(f"{adapter_file} does not fit this model's LoRA (rank, targets or model differ)")
    full = {by_saved_name[k]: v for k, v in state.items()}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))


# ----------------------------------------------------------------------------- checkpoints

def save(cfg, model, optimizer, scheduler, lora_state, step, stream, hours, out: Path, base) -> Path | None:
    """Rank 0 writes the checkpoint into a hidden temp dir and returns it; `publish` makes it
    step_<N> once the step's metrics line is written (a crash before that redoes the step).
    Collective. A failed write (disk full, ...) stops every rank and leaves the previous one."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    optim_state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                      cpu_offload=True))
    rngs = distributed.all_gather_objects(rng_states())
    tmp, error = None, None
    if dist.get_rank() == 0:
        meta = {"step": step, "stream": stream.state_dict(), "process_hours": hours,
                "world_size": dist.get_world_size(), "config": dataclasses.asdict(cfg)}
        trainer_state = {"optimizer": optim_state, "scheduler": scheduler.state_dict(), "rng": rngs}
        try:
            tmp = write_checkpoint(out, step, model, lora_state, trainer_state, meta, base)
        except WriteError as e:
            error = str(e)
    error = distributed.broadcast_object(error)
    if error:
        raise SystemExit(error)
    return tmp


def write_checkpoint(out: Path, step: int, model, lora_state: dict, trainer_state: dict, meta: dict, base) -> Path:
    """The checkpoint's files in a hidden temp dir, sealed (meta.json last); returns the dir. If
    the disk refuses (full, read-only), the temp dir goes and WriteError says so."""
    tmp = out / "checkpoints" / f".step_{step}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir(parents=True)
        write_adapter_files(model, lora_state, tmp, base)
        torch.save(trainer_state, tmp / "trainer_state.pt")
        if os.environ.get("GRPO_TEST_KILL_IN_CHECKPOINT") == str(step) and \
                os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), 9)  # tests/test_launch.py: die mid-write (first attempt only)
        seal(tmp, meta)
        return tmp
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError
        remove_tmp(tmp)
        reason = getattr(e, "strerror", None) or str(e).splitlines()[0]
        raise WriteError(f"checkpoint step_{step} not written ({reason}); the previous one stays the newest") from e


def load(path: Path, cfg, model, optimizer, scheduler, stream, log=print) -> tuple[int, float]:
    """Restore LoRA, optimizer, schedule, RNG states and maze stream; returns (step, hours).

    A checkpoint written with other meaningful settings (MEANINGFUL) is refused unless
    cfg.resume_allow_changes; then the new learning rate and schedule take effect from here."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    meta = json.loads((path / "meta.json").read_text())
    changes = config_changes(meta.get("config", {}), dataclasses.asdict(cfg))
    if changes and not cfg.resume_allow_changes:
        raise SystemExit(f"{path} was written with other settings ({'; '.join(changes)}). Resume with the "
                         "same ones, start a new --out-dir, or pass --resume-allow-changes true to apply the new ones.")
    load_lora_state(model, path / "adapter_model.safetensors")
    state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
    fresh = list(scheduler.base_lrs)  # this run's rates (per group), before the saved ones replace them
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state["optimizer"],
                             options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(state["scheduler"])
    if changes:  # the saved optimizer and schedule carry the old values: put the new ones in
        scheduler.base_lrs = fresh
        for group, base, factor in zip(optimizer.param_groups, fresh, scheduler.lr_lambdas):
            group.update(lr=base * factor(scheduler.last_epoch), weight_decay=cfg.weight_decay)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
        log(f"resuming with changed settings: {'; '.join(changes)}")
    set_rng_states(state["rng"][dist.get_rank() % len(state["rng"])])
    stream.load_state_dict(meta["stream"])
    return meta["step"], meta["process_hours"]


def rng_states() -> dict:
    """This process's global random generators. What draws from them in a step: LoRA dropout
    (--lora-dropout > 0) in the update. vLLM seeds each request itself, the maze stream and the
    environment have generators of their own."""
    states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict):
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def seal(tmp: Path, meta: dict):
    """Record every file's size and hash in meta.json, written last, then fsync the dir."""
    meta = {**meta, "files": {p.name: file_digest(p) for p in sorted(tmp.iterdir()) if p.is_file()}}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    fsync_dir(tmp)


def publish(out: Path, tmp: Path, step: int, keep: int):
    """Rename the sealed temp dir to step_<N>, then point `latest` at it (last: it only ever
    names a complete dir), then drop old ones."""
    root = out / "checkpoints"
    publish_dir(tmp, root / f"step_{step}")
    atomic_write_text(root / "latest", f"step_{step}")
    prune(root, "step_", keep, current=step)


def find(out: Path, resume: str, warn=print) -> Path | None:
    """The checkpoint to resume from: `resume` = none, latest or a checkpoint dir.

    latest: the one `latest` names if it verifies, else the newest that does; each one passed over
    is named with what is wrong with it. An explicit dir must verify, or the run stops."""
    if resume == "none":
        return None
    if resume != "latest":
        path = Path(resume)
        problem = verify(path)
        if problem:
            raise SystemExit(f"--resume {path}: not a usable checkpoint: {problem}")
        return path
    root = out / "checkpoints"
    candidates = sorted((p for p in root.glob("step_*") if p.name[5:].isdigit()),
                        key=lambda p: int(p.name[5:]), reverse=True)
    pointer = root / "latest"
    named = pointer.read_text().strip() if pointer.exists() else None
    start_over = ("--resume none --archive-old-run true starts over (the old run's files moved into "
                  f"{out / ARCHIVE_DIR}/), or --resume <checkpoint dir> picks one")
    if named and not (root / named).is_dir():  # deleted by hand, a quota purge, a bad copy
        if not candidates:
            raise SystemExit(f"{pointer} names {named}, which is gone, and no other checkpoint is there; "
                             + start_over)
        warn(f"{pointer} names {named}, which is gone; trying the newest checkpoint there instead")
    elif named:  # the pointer's choice first, then newest first
        candidates.sort(key=lambda p: p.name != named)
    for path in candidates:
        problem = verify(path)
        if problem is None:
            return path
        warn(f"checkpoint {path} skipped: {problem}")
    if candidates:
        raise SystemExit(f"no usable checkpoint in {root} (all {len(candidates)} failed verification); "
                         + start_over)
    return None


# Config fields that change what a run means: resuming with another value would silently mix two
# runs (the optimizer and schedule are the checkpoint's). Everything else (steps, intervals,
# paths, progress, micro-batch size, memory settings) can change on resume.
MEANINGFUL = ("model", "difficulty", "env_style", "cell_px", "max_turns", "train_max_turns", "max_new_tokens",
              "max_images", "train_pool", "eval_mazes", "prompts_per_step", "group_size", "temperature",
              "scale_adv_by_std", "clip_eps_low", "clip_eps_high", "loss_aggregation", "kl_coef",
              "step_adv_weight", "gamma", "tis_cap", "lr", "weight_decay", "warmup_steps", "lr_schedule",
              "max_grad_norm", "num_mini_batches", "ppo_epochs", "lora_rank", "lora_alpha", "lora_dropout", "lora_plus_ratio",
              "lora_targets", "seed", "progress_reward", "branch_points_per_group", "branch_weight")


def config_changes(saved: dict, current: dict) -> list[str]:
    """'name: saved -> current' for each meaningful field that differs."""
    return [f"{k}: {saved[k]!r} -> {current[k]!r}" for k in MEANINGFUL
            if k in saved and k in current and saved[k] != current[k]]


# ----------------------------------------------------------------------------- the run's own records

def metrics_step(line: str) -> int | None:
    """The step of a metrics.jsonl line; None for a blank line or one torn by a crash mid-write."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


def write_summary(steps: int, out: Path, wall_s: float, hours: float, on_gpu: bool, log=print):
    """summary.json: held-out solved at every evaluation of this run; steps_s covers every process that
    worked on this run (a resumed run's earlier ones too), wall_s this process's own time."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    evals = run_evals(out)
    summary = {"steps": steps, "steps_s": round(sum(json.loads(line)["step_s"] for line in lines), 1),
               "wall_s": round(wall_s, 1), ("gpu_hours" if on_gpu else "process_hours"): round(hours, 4),
               "eval": {r["step"]: f"{r['solved']}/{r['total']}" for r in evals}}
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
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


# ----------------------------------------------------------------------------- the run directory
#
# A run directory holds one run. `open_run` (rank 0, before anything is written there) takes the
# run lock, picks the checkpoint to resume from, and refuses to start a fresh run over another
# run's files unless told to move them aside; run.json names the run, and every evaluation file
# names the run it belongs to.

RUN_FILE = "run.json"  # which run this directory holds: {run_id, started, host, launcher}
LOCK_FILE = "trainer.lock"  # the trainer that holds the directory: {host, pid, ...}
ARCHIVE_DIR = "archive"  # earlier runs moved aside by --archive-old-run, one timestamped dir each
# What a run leaves in its directory (shared/ is the LoRA sync's scratch space, not history).
RUN_FILES = ("metrics.jsonl", "eval", "checkpoints", "adapters", "config.json", "summary.json", "tb", RUN_FILE)


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
    atomic_write_text(out / "eval" / f"step_{result['step']}.json", json.dumps(record, indent=1))
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
    dest = out / ARCHIVE_DIR / stamp
    n = 1
    while dest.exists():
        n += 1
        dest = out / ARCHIVE_DIR / f"{stamp}-{n}"
    dest.mkdir(parents=True)
    for name in RUN_FILES:
        if (out / name).exists():
            os.replace(out / name, dest / name)
    fsync_path(dest)
    fsync_path(out)
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
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = _open_run(out, cfg, base, log)
        except SystemExit as e:
            error = str(e)
    error, result = distributed.broadcast_object((error, result))
    if error:
        raise SystemExit(error)
    return result


def _open_run(out: Path, cfg, base: dict, log) -> tuple[str, dict]:
    take_lock(out, cfg.take_over_lock, log)
    run = run_record(out)
    restart = is_restart_of(run)
    ckpt = find(out, "latest" if restart and cfg.resume == "none" else cfg.resume, warn=log)
    if ckpt is not None and run is not None:
        return str(ckpt), {**run, "base": base}
    if ckpt is None and not restart:
        used = used_run_files(out)
        if used and not cfg.archive_old_run:
            why = "--resume none" if cfg.resume == "none" else "there is no checkpoint to resume from"
            raise SystemExit(f"{out} holds another run ({', '.join(used)}) and {why}: --resume latest continues "
                             "it, --archive-old-run true moves it into "
                             f"{out / ARCHIVE_DIR}/ first, or pick a new --out-dir")
        if used:
            log(f"moved the earlier run's files ({', '.join(used)}) to {archive_run(out)}")
        run = None
    if run is None:  # a new run, or one resumed from a directory older than run.json (adopted)
        run = {"run_id": uuid.uuid4().hex[:12], "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "host": socket.gethostname(), "launcher": launcher_id(), "base": base,
               **({"adopted": True} if ckpt is not None else {})}
        atomic_write_text(out / RUN_FILE, json.dumps(run, indent=1))
    return str(ckpt or ""), {**run, "base": base}  # the base this process plays (resume may change it)


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
