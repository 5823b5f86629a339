"""Files that must survive a crash: checkpoints that verify themselves, pruning, atomic writes,
resume refusing a changed configuration."""

import json
import os
from pathlib import Path

import pytest

import checkpoint
import storage
import rundir
import train
from stand_ins import peft_model


def fake_checkpoint(root: Path, step: int, **files) -> Path:
    """A sealed checkpoint dir with the given files (name -> bytes)."""
    tmp = root / f".step_{step}.tmp-x"
    tmp.mkdir(parents=True)
    for name, data in (files or {"adapter_model.safetensors": b"lora" * 100, "trainer_state.pt": b"adam" * 300}).items():
        (tmp / name).write_bytes(data)
    checkpoint.seal(tmp, {"step": step})
    path = root / f"step_{step}"
    os.replace(tmp, path)
    return path


def test_sealed_checkpoints_verify_and_damage_is_named(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 1)
    meta = json.loads((ckpt / "meta.json").read_text())
    assert set(meta["files"]) == {"adapter_model.safetensors", "trainer_state.pt"}
    assert checkpoint.verify(ckpt) is None

    state = ckpt / "trainer_state.pt"
    data = state.read_bytes()
    state.write_bytes(data[: len(data) // 2])  # truncated
    assert "trainer_state.pt has 600 bytes, 1200 were written" in checkpoint.verify(ckpt)
    flipped = bytearray(data)
    flipped[700] ^= 0x01  # one bit, same size
    state.write_bytes(bytes(flipped))
    assert "trainer_state.pt does not match its sha256" in checkpoint.verify(ckpt)
    state.unlink()
    assert checkpoint.verify(ckpt) == "trainer_state.pt is missing"
    (ckpt / "meta.json").unlink()
    assert "no meta.json" in checkpoint.verify(ckpt)


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        fake_checkpoint(root, step)
    (root / "latest").write_text("step_6")
    (root / "step_6" / "trainer_state.pt").write_bytes(b"cut")  # damaged after publication
    (root / "step_8").mkdir()  # a dir without meta.json: a write cut short
    warnings = []
    assert checkpoint.find(tmp_path, "latest", warn=warnings.append) == root / "step_4"
    assert len(warnings) == 2 and all(w.startswith("checkpoint ") for w in warnings)
    assert "step_6 skipped: trainer_state.pt has 3 bytes" in warnings[0]  # `latest`'s choice first
    assert "step_8 skipped: no meta.json" in warnings[1]
    # no pointer: newest first; a pointer to a pruned dir is no help either
    (root / "latest").write_text("step_10")
    warnings = []
    assert checkpoint.find(tmp_path, "latest", warn=warnings.append) == root / "step_4"
    assert warnings[0] == f"{root / 'latest'} names step_10, which is gone; trying the newest checkpoint there instead"
    assert checkpoint.find(tmp_path, "none") is None
    # an explicit --resume dir must verify; nothing to resume from is a fresh start
    with pytest.raises(SystemExit, match=r"--resume .*step_6: not a usable checkpoint: trainer_state.pt has"):
        checkpoint.find(tmp_path, str(root / "step_6"))
    assert checkpoint.find(tmp_path, str(root / "step_2")) == root / "step_2"
    assert checkpoint.find(tmp_path / "fresh", "latest") is None
    # every one damaged: refuse, and say how to start over
    for step in (2, 4):
        (root / f"step_{step}" / "adapter_model.safetensors").unlink()
    with pytest.raises(SystemExit, match="no usable checkpoint .* --resume none --archive-old-run true starts over"):
        checkpoint.find(tmp_path, "latest", warn=lambda m: None)


def test_pruning_keeps_the_newest_and_clears_what_a_crash_left(tmp_path):
    for name in ("step_1", "step_2", "step_3", ".step_4.tmp-ab", ".step_1.trash-cd"):
        (tmp_path / name).mkdir()
    storage.prune(tmp_path, "step_", keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3"]
    # a run resumed at step 1 writes step_1 again: the abandoned run's later dirs go, not it
    storage.prune(tmp_path, "step_", keep=1, current=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    (tmp_path / "step_1").mkdir(), (tmp_path / "step_5").mkdir(), (tmp_path / "step_6").mkdir()
    storage.prune(tmp_path, "step_", keep=1, current=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


def test_torn_metrics_lines_are_recognised():
    assert rundir.metrics_step('{"step": 3, "reward_mean": 0.5}') == 3
    assert rundir.metrics_step('{"step": 4, "rew') is None and rundir.metrics_step("") is None
    assert rundir.metrics_step("[1, 2]") is None


def test_a_full_disk_leaves_the_previous_adapter_and_says_so(tmp_path, monkeypatch):
    """Disk full in the middle of writing an adapter: the error names it, the old one stays whole,
    and no temp dir is left behind."""
    import torch
    from peft import PeftConfig

    final = tmp_path / "adapters" / "step_2"
    checkpoint.write_adapter(peft_model(), {"w": torch.ones(2)}, final, {"path": "base", "fingerprint": None})
    assert PeftConfig.from_pretrained(str(final)).r == 8  # an adapter PEFT reads
    before = {p.name: p.read_bytes() for p in final.iterdir()}

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", no_space)
    with pytest.raises(storage.WriteError, match=r"adapter .*step_2 not written \(No space left on device; \d+ MB free there\); the previous "
                                                     "one is untouched$"):
        checkpoint.write_adapter(peft_model(), {"w": torch.zeros(2)}, final, {"path": "base", "fingerprint": None})
    assert {p.name: p.read_bytes() for p in final.iterdir()} == before
    assert sorted(p.name for p in final.parent.iterdir()) == ["step_2"]


def test_a_full_disk_during_a_checkpoint_leaves_the_previous_one_newest(tmp_path, monkeypatch):
    import torch

    previous = fake_checkpoint(tmp_path / "checkpoints", 2)
    storage.atomic_write_text(tmp_path / "checkpoints" / "latest", "step_2")

    def no_space(obj, path, *args, **kwargs):
        Path(path).write_bytes(b"partial")  # half written, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", no_space)
    with pytest.raises(storage.WriteError, match=r"checkpoint step_4 .*checkpoints not written \(No space left on device; \d+ MB free there\); "
                                                     "the previous one stays the newest"):
        checkpoint.write_checkpoint(tmp_path, 4, peft_model(), {"w": torch.ones(1)}, {"optimizer": {}}, {"step": 4},
                                    {"path": "base", "fingerprint": None})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_2"]  # no temp dir left
    assert checkpoint.find(tmp_path, "latest") == previous


def test_resume_with_meaningful_changes_is_refused_harmless_ones_are_taken():
    saved = train.Config(lr=1e-3, group_size=8, difficulty="small", steps=100, eval_interval=10,
                         lr_schedule="constant", average_frac=0).__dict__
    same = train.Config(lr=1e-3, group_size=8, difficulty="small", steps=400, eval_interval=20, progress=False,
                        lr_schedule="constant", average_frac=0)
    assert checkpoint.config_changes(saved, same.__dict__) == []  # longer run at a constant rate, other intervals
    for horizon in ({"lr_schedule": "cosine", "average_frac": 0}, {"lr_schedule": "constant", "average_frac": 0.3}):
        # steps is a decaying rate's horizon and sets the tail average's window: guarded
        assert checkpoint.config_changes(train.Config(**horizon, steps=100).__dict__,
                                         train.Config(**horizon, steps=400).__dict__) == ["steps: 100 -> 400"]
    other = train.Config(lr=5e-4, group_size=4, difficulty="easy", steps=100, lr_schedule="constant",
                         average_frac=0).__dict__
    assert checkpoint.config_changes(saved, other) == ["difficulty: 'small' -> 'easy'", "group_size: 8 -> 4",
                                                       "lr: 0.001 -> 0.0005"]


def test_model_fingerprint_tells_weights_apart(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, byte in ((a, 1), (b, 2)):
        d.mkdir()
        (d / "config.json").write_text('{"model_type": "qwen3_vl"}')
        (d / "model.safetensors").write_bytes(bytes([byte]) * 300_000)
    assert checkpoint.fingerprint_model(str(a)) != checkpoint.fingerprint_model(str(b))
    (b / "model.safetensors").write_bytes(bytes([1]) * 300_000)
    assert checkpoint.fingerprint_model(str(a)) == checkpoint.fingerprint_model(str(b))  # same content, other dir
    assert checkpoint.fingerprint_model(str(tmp_path / "none")) is None
    record = checkpoint.base_model_record("Qwen/Qwen3-VL-8B-Instruct")
    assert record == {"path": "Qwen/Qwen3-VL-8B-Instruct", "fingerprint": None}  # a hub id stays an id


# ----------------------------------------------------------------------------- the run directory

def used_run_dir(out: Path) -> dict:
    """A run directory another run left: its files, name -> content."""
    files = {"metrics.jsonl": '{"step": 1}\n{"step": 2}\n', "eval/step_0.json": '{"step": 0}',
             "adapters/step_2/adapter_config.json": "{}", "config.json": '{"seed": 3}'}
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    return files


def run_settings(**kwargs):
    from types import SimpleNamespace

    return SimpleNamespace(**{"resume": "latest", "archive_old_run": False, "take_over_lock": False, **kwargs})


def test_a_fresh_start_never_takes_over_another_runs_files_unasked(tmp_path):
    out = tmp_path / "run"
    files = used_run_dir(out)
    for resume in ("none", "latest"):  # asked to start over; or its checkpoints were deleted
        with pytest.raises(SystemExit, match=r"holds another run \(metrics.jsonl \(2 steps\), eval/ \(1 entry\), "
                                             r"adapters/ \(1 entry\), config.json\)") as refused:
            rundir._open_run(out, run_settings(resume=resume), {"path": "base"}, log=print)
        assert "\n" not in str(refused.value) and "--archive-old-run true" in str(refused.value)
        assert {n: (out / n).read_text() for n in files} == files  # nothing touched
    said = []
    ckpt, run = rundir._open_run(out, run_settings(resume="none", archive_old_run=True), {"path": "base"},
                                     log=said.append)
    [archive] = list((out / checkpoint.ARCHIVE_DIR).iterdir())
    assert ckpt == "" and said == [f"moved the earlier run's files (metrics.jsonl (2 steps), eval/ (1 entry), "
                                   f"adapters/ (1 entry), config.json) to {archive}"]
    assert {n: (archive / n).read_text() for n in files} == files  # moved, every byte
    assert not any((out / n).exists() for n in files) and rundir.run_record(out)["run_id"] == run["run_id"]


def test_a_torchrun_restart_of_a_fresh_run_resumes_its_own_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    _, run = rundir._open_run(out, run_settings(resume="none"), {"path": "base"}, log=print)
    used_run_dir(out)  # what the first attempt wrote before it died, no checkpoint yet
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert rundir._open_run(out, run_settings(resume="none"), {"path": "base"}, log=print) == \
        ("", {**run, "base": {"path": "base"}})  # starts over in its own files, the same run
    fake_checkpoint(out / "checkpoints", 2)
    ckpt, again = rundir._open_run(out, run_settings(resume="none"), {"path": "base"}, log=print)
    assert ckpt == str(out / "checkpoints" / "step_2") and again["run_id"] == run["run_id"]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")  # another torchrun's restart: not this run's
    with pytest.raises(SystemExit, match="holds another run"):
        rundir._open_run(out, run_settings(resume="none"), {"path": "base"}, log=print)


def test_one_trainer_per_run_dir_and_a_dead_ones_lock_is_taken_over(tmp_path, monkeypatch):
    import socket
    import subprocess

    lock = tmp_path / rundir.LOCK_FILE
    other = subprocess.Popen(["sleep", "60"])
    try:
        lock.write_text(json.dumps({**rundir.process_identity(other.pid), "started": "then"}))
        with pytest.raises(SystemExit, match=rf"in use by another trainer: pid {other.pid} on "
                                             rf"{socket.gethostname()}, since then"):
            rundir.take_lock(tmp_path)
    finally:
        other.kill()
        other.wait()
    warnings = []
    assert rundir.take_lock(tmp_path, warn=warnings.append) == lock  # its holder is gone now
    assert len(warnings) == 1 and f"taking over {lock} from a trainer that is gone: pid {other.pid}" in warnings[0]
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    rundir.release_lock(lock, os.getpid())
    assert not lock.exists()
    # a pid that lives again as another process (its start time differs) is no holder either
    lock.write_text(json.dumps({**rundir.process_identity(os.getppid()), "start_ticks": 1}))
    assert rundir.take_lock(tmp_path, warn=lambda m: None) == lock
    rundir.release_lock(lock, os.getpid())
    # on another host nothing can be checked: refuse, unless told to take it over
    lock.write_text(json.dumps({"host": "node-7", "pid": 4242, "started": "then"}))
    with pytest.raises(SystemExit, match="pid 4242 on node-7, since then .*on another host.*--take-over-lock true"):
        rundir.take_lock(tmp_path)
    assert rundir.take_lock(tmp_path, take_over=True, warn=warnings.append) == lock
    rundir.release_lock(lock, os.getpid())
    # ... but a Slurm job requeued (onto other nodes) after its first run took the lock: that run is over
    lock.write_text(json.dumps({"host": "node-7", "pid": 4242, "slurm_job": "77", "slurm_restart": 0}))
    with monkeypatch.context() as env:
        env.setenv("SLURM_JOB_ID", "77")
        env.setenv("SLURM_RESTART_COUNT", "0")  # the same run of the job, on another node: a live trainer
        with pytest.raises(SystemExit, match="on another host"):
            rundir.take_lock(tmp_path)
        env.setenv("SLURM_RESTART_COUNT", "1")
        assert rundir.take_lock(tmp_path, warn=lambda m: None) == lock
    rundir.release_lock(lock, os.getpid())


def test_only_the_current_runs_evaluations_count(tmp_path):
    """eval/ files name their run; the summary (and launch/report.py) count only this run's."""
    from types import SimpleNamespace

    out = tmp_path / "run"
    out.mkdir()
    _, run = rundir._open_run(out, run_settings(resume="none"), {"path": "base", "fingerprint": "f"}, log=print)
    result = {"step": 0, "solved": 3, "total": 8}
    written = rundir.eval_file(out, result, run, SimpleNamespace(lora_path="shared/sync/step_0"))
    assert written == {**result, "run_id": run["run_id"], "adapter": "shared/sync/step_0",
                       "base": {"path": "base", "fingerprint": "f"}}
    assert json.loads((out / "eval" / "step_0.json").read_text()) == written
    (out / "eval" / "step_4.json").write_text(json.dumps({"step": 4, "solved": 8, "total": 8, "run_id": "another"}))
    (out / "eval" / "step_6.json").write_text(json.dumps({"step": 6, "solved": 8, "total": 8}))  # no run named
    assert [r["step"] for r in rundir.run_evals(out)] == [0]
    assert rundir.has_eval(out, 0, run) and not rundir.has_eval(out, 4, run)
    (out / "metrics.jsonl").write_text('{"step": 1, "step_s": 2.0}\n')
    rundir.write_summary(1, out, 2.0, 0.1, False, log=lambda m: None)
    assert json.loads((out / "summary.json").read_text())["eval"] == {"0": "3/8"}
    # a directory from before runs had ids: every file counts
    (out / rundir.RUN_FILE).unlink()
    assert [r["step"] for r in rundir.run_evals(out)] == [0, 4, 6]


def test_the_same_command_again_continues_its_run_before_its_first_checkpoint(tmp_path):
    """A requeued job, a restarted pod or a plain rerun killed before its first checkpoint: the same
    settings and base start the run over in place, as the same run. Another run's command is
    refused, naming what differs, and the refusal never advises the command it refuses."""
    import dataclasses

    out, base = tmp_path / "run", {"path": "base", "fingerprint": "f"}
    out.mkdir()
    cfg = train.Config(out_dir=str(out))
    _, run = rundir._open_run(out, cfg, base, log=print)
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))  # what RunLog writes first
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')  # then SIGKILL, no checkpoint
    said = []
    assert rundir._open_run(out, train.Config(out_dir=str(out), eval_interval=999), base, log=said.append) == \
        ("", {**run, "base": base})  # an interval is not meaningful: still this run
    assert said == [f"{out} holds this run (the same settings and base) with no checkpoint yet: starting it over "
                    "in place"]
    for other, other_base, difference in ((train.Config(out_dir=str(out), lr=5e-4), base, "lr: 0.001 -> 0.0005"),
                                          (cfg, {"path": "other", "fingerprint": "g"}, "base: ")):
        with pytest.raises(SystemExit, match="holds another run") as refused:
            rundir._open_run(out, other, other_base, log=print)
        message = str(refused.value)
        assert difference in message and "--resume latest" not in message and "\n" not in message
    with pytest.raises(SystemExit) as refused:  # asked to start afresh: --resume latest would continue it
        rundir._open_run(out, train.Config(out_dir=str(out), resume="none"), base, log=print)
    assert "--resume none: --resume latest continues it" in str(refused.value)
    assert rundir.run_record(out)["run_id"] == run["run_id"]


@pytest.mark.parametrize("writer", ["sync", "checkpoint", "export", "metrics", "eval", "summary", "stopped"])
def test_every_write_of_a_run_fails_in_one_line_naming_the_path_and_the_free_space(tmp_path, monkeypatch, writer):
    """A full disk (or a quota) at any of the run's writes: a WriteError whose one line names what
    and where, the free space there and what was kept (train.py stops with it), and no temp file
    is left. The sync's adapter fails inside safetensors, which raises its own error type."""
    import builtins

    import torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    def safetensors_full(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                              "message: \"No space left on device\" })")

    real_open = builtins.open

    def open_full_for_writing(path, mode="r", *args, **kwargs):
        if any(m in mode for m in "wa"):
            raise OSError(28, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    out = tmp_path / "run"
    (out / "eval").mkdir(parents=True)
    if writer == "metrics":
        log = rundir.RunLog(out, train.Config(), 0)
        monkeypatch.setattr(builtins, "open", open_full_for_writing)
        write = lambda: log.step(3, {"reward_mean": 0.5})  # noqa: E731
    elif writer in ("sync", "export"):
        monkeypatch.setattr(checkpoint, "save_file", safetensors_full if writer == "sync" else full)
        write = lambda: checkpoint.write_adapter(peft_model(), {"w": torch.ones(2)}, out / "adapters" / "step_3",  # noqa
                                                 {"path": "base"})
    elif writer == "checkpoint":
        monkeypatch.setattr(torch, "save", full)
        write = lambda: checkpoint.write_checkpoint(out, 3, peft_model(), {"w": torch.ones(1)}, {}, {"step": 3},  # noqa
                                                    {"path": "base"})
    else:
        monkeypatch.setattr(builtins, "open", open_full_for_writing)
        write = {"eval": lambda: rundir.eval_file(out, {"step": 3}, {"run_id": "r", "base": None}, None),
                 "summary": lambda: storage.atomic_write_text(out / "summary.json", "{}"),
                 "stopped": lambda: rundir.write_stopped(out, 15, 3, True)}[writer]
    with pytest.raises(storage.WriteError) as failed:
        write()
    message = str(failed.value)
    assert "\n" not in message and " not written (No space left on device; " in message
    assert str(out) in message and "MB free there); " in message
    assert any(kept in message for kept in ("untouched", "stays the newest", "are kept"))
    monkeypatch.undo()
    leftovers = [p for p in out.rglob("*") if ".tmp-" in p.name]
    assert not leftovers
