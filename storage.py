"""Files that survive a crash and a full disk: written whole or not at all, published by one
rename, pruned without a half-deleted directory ever showing under its name.

Everything that matters (checkpoints, adapters, the run's records, the adapter syncs) is written
through these: into a temp file or a hidden temp dir, fsynced, then renamed into place, so a
`kill -9` at any moment leaves the old version or the new one. A write the disk refuses becomes
one WriteError line that says what, where, why, the free space there and what was kept.
"""

import os
import re
import shutil
import uuid
from pathlib import Path


class WriteError(OSError):
    """A file that matters could not be written (disk full, a quota, read-only, ...); nothing was
    published. Its message is the one line a user sees (train.py stops with it): what, where,
    why, the free space there, and what was kept."""


def write_error(what: str, path: Path, error: Exception, kept: str) -> WriteError:
    reason = getattr(error, "strerror", None)
    # safetensors (Rust) names the OS error inside its own text: "... (os error 28)", "code: 28, ..."
    code = re.search(r"os error (\d+)|code: (\d+)", str(error))
    if not reason and code:
        reason = os.strerror(int(code.group(1) or code.group(2)))
    reason = reason or (str(error).strip().splitlines() or [type(error).__name__])[0]
    return WriteError(f"{what} {path} not written ({reason}; {free_space(path)}); {kept}")


def free_space(path: Path) -> str:
    """'N MB free there' for the filesystem that holds `path` (or its nearest existing parent)."""
    for place in (path, *path.parents):
        try:
            return f"{shutil.disk_usage(place).free / 2**20:.0f} MB free there"
        except OSError:
            continue
    return "free space unknown"


def atomic_write_text(path: Path, text: str):
    """Write `path` whole or not at all (temp file, fsync, rename); WriteError if the disk refuses."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, WriteError):
            raise
        raise write_error("file", path, e, "the previous version, if any, is untouched") from e


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
