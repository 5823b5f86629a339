"""Checkpoints that survive a crash and verify themselves, and the adapters a run exports.

    <out>/checkpoints/step_<N>/   adapter_config.json, adapter_model.safetensors (LoRA),
                                  trainer_state.pt (optimizer, LR schedule, RNG states),
                                  meta.json (step, training stream, config, size + sha256 of every file)
    <out>/checkpoints/latest      the name of the newest published checkpoint

Everything is written into a hidden temp dir, fsynced, and renamed into place in one step; meta.json
is written last, so a dir without it was cut short. `latest` moves only after the rename. A
`kill -9` at any moment therefore leaves the previous checkpoint or the new one, never half of one.
Bit rot or a damaged copy after publication is caught by the hashes: on resume the newest
checkpoint that verifies is used, and each one that does not is named in one line.

The atomic writes themselves are storage.py's; the run directory around the checkpoints (its lock,
its logs, which files belong to which run) is rundir.py's.
"""

import dataclasses
import hashlib
import json
import os
import random
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import config
import distributed
import storage

# The adapter directory's record of the base it was trained on (serve.py refuses a mismatch).
BASE_MODEL_FILE = "base_model.json"
AVERAGE_FILE = "average_model.safetensors"  # a checkpoint's tail average (average.py), beside the LoRA


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
        storage.publish_dir(tmp, final_dir)
    except (OSError, SafetensorError) as e:  # safetensors reports a full disk as its own error
        storage.remove_tmp(tmp)
        raise storage.write_error("adapter", final_dir, e, "the previous one is untouched") from e


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

def save(cfg, model, optimizer, scheduler, lora_state, step, stream, hours, out: Path, base,
         mismatch_bound: float | None = None, average=None) -> Path | None:
    """Rank 0 writes the checkpoint into a hidden temp dir and returns it; `publish` makes it
    step_<N> once the step's metrics line is written (a crash before that redoes the step).
    Collective. A failed write (disk full, ...) stops every rank and leaves the previous one."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    optim_state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                      cpu_offload=True))
    rngs = distributed.all_gather_objects(rng_states())
    meta = {"step": step, "stream": stream.state_dict(), "process_hours": hours,
            "world_size": dist.get_world_size(), "config": dataclasses.asdict(cfg),
            "mismatch_bound": mismatch_bound,  # the stale-policy guard's, calibrated (update.StalePolicyGuard)
            "average_count": average.count if average else 0}  # the tail average's steps (average.py)
    trainer_state = {"optimizer": optim_state, "scheduler": scheduler.state_dict(), "rng": rngs}
    return distributed.on_rank0(lambda: write_checkpoint(out, step, model, lora_state, trainer_state, meta, base,
                                                         average.state if average and average.count else None),
                                storage.WriteError)


def write_checkpoint(out: Path, step: int, model, lora_state: dict, trainer_state: dict, meta: dict, base,
                     average_state: dict | None = None) -> Path:
    """The checkpoint's files in a hidden temp dir, sealed (meta.json last); returns the dir. If
    the disk refuses (full, read-only), the temp dir goes and storage.WriteError says so."""
    tmp = out / "checkpoints" / f".step_{step}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir(parents=True)
        write_adapter_files(model, lora_state, tmp, base)
        if average_state is not None:
            save_file(average_state, str(tmp / AVERAGE_FILE))
        torch.save(trainer_state, tmp / "trainer_state.pt")
        seal(tmp, meta)
        return tmp
    except (OSError, RuntimeError, SafetensorError) as e:  # torch.save reports a failed write as a RuntimeError
        storage.remove_tmp(tmp)
        raise storage.write_error(f"checkpoint step_{step}", out / "checkpoints", e,
                          "the previous one stays the newest") from e


def load(path: Path, cfg, model, optimizer, scheduler, stream, log=print) -> dict:
    """Restore LoRA, optimizer, schedule, RNG states and training stream; returns the checkpoint's
    meta.json (its step, process_hours, mismatch_bound and average_count among them).

    A checkpoint written with other meaningful settings (config.meaningful_fields) is refused
    unless cfg.resume_allow_changes; then the new learning rate and schedule take effect from here.
    One that used a setting since removed from the Config is refused whatever the flags."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    meta = json.loads((path / "meta.json").read_text())
    removed = config.removed_settings(meta.get("config", {}))
    if removed:
        raise SystemExit(f"{path} was written with a setting this version no longer has ({'; '.join(removed)}); "
                         "resume it with the code that wrote it (git history), or start a new --out-dir.")
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
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    log(f"resumed from {path} at step {meta['step']} (training stream at {stream.position}"
        + (f", torchrun restart {restart})" if restart != "0" else ")"))
    return meta


def load_average(path: Path, meta: dict) -> dict:
    """The tail average the checkpoint at `path` (its meta.json: `meta`) holds, as
    average.TailAverage's state and count; none if it holds none."""
    count = meta.get("average_count", 0)
    return {"state": load_file(str(path / AVERAGE_FILE)), "count": count} if count else {}


def rng_states() -> dict:
    """This process's global random generators. What draws from them in a step: LoRA dropout
    (--lora-dropout > 0) in the update. vLLM seeds each request itself, the training stream and the
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
    storage.fsync_dir(tmp)


def publish(out: Path, tmp: Path, step: int, keep: int):
    """Rename the sealed temp dir to step_<N>, then point `latest` at it (last: it only ever
    names a complete dir), then drop old ones."""
    root = out / "checkpoints"
    try:
        storage.publish_dir(tmp, root / f"step_{step}")
        storage.atomic_write_text(root / "latest", f"step_{step}")
    except OSError as e:
        storage.remove_tmp(tmp)
        raise storage.write_error(f"checkpoint step_{step}", root, e, "`latest` still names the previous one") from e
    storage.prune(root, "step_", keep, current=step)


ARCHIVE_DIR = "archive"  # earlier runs moved aside by --archive-old-run (rundir.archive_run)


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


def config_changes(saved: dict, current: dict) -> list[str]:
    """'name: saved -> current' for each meaningful field (config.py declares which) that differs:
    resuming with another value would silently mix two runs (the optimizer and schedule are the
    checkpoint's). Everything else (intervals, paths, memory settings) can change on resume, and
    `steps` too under a constant learning rate and no tail average; a decaying rate's horizon and
    the average's window are set by it."""
    fields = config.meaningful_fields()
    if saved.get("lr_schedule", "constant") != "constant" or saved.get("average_frac", 0):
        fields.append("steps")  # another step count is another schedule, another window
    return [f"{k}: {saved[k]!r} -> {current[k]!r}" for k in fields
            if k in saved and k in current and saved[k] != current[k]]
