"""Files that must survive a crash: checkpoints that verify themselves, pruning, atomic writes,
resume refusing a changed configuration."""

import json
import os
from pathlib import Path

import pytest

import checkpoint
import train


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
    assert checkpoint.find(tmp_path, "latest", warn=lambda m: None) == root / "step_4"
    assert checkpoint.find(tmp_path, "none") is None
    # an explicit --resume dir must verify; nothing to resume from is a fresh start
    with pytest.raises(SystemExit, match=r"--resume .*step_6: not a usable checkpoint: trainer_state.pt has"):
        checkpoint.find(tmp_path, str(root / "step_6"))
    assert checkpoint.find(tmp_path, str(root / "step_2")) == root / "step_2"
    assert checkpoint.find(tmp_path / "fresh", "latest") is None
    # every one damaged: refuse, and say how to start over
    for step in (2, 4):
        (root / f"step_{step}" / "adapter_model.safetensors").unlink()
    with pytest.raises(SystemExit, match="no usable checkpoint .* --resume none starts over"):
        checkpoint.find(tmp_path, "latest", warn=lambda m: None)


def test_pruning_keeps_the_newest_and_clears_what_a_crash_left(tmp_path):
    for name in ("step_1", "step_2", "step_3", ".step_4.tmp-ab", ".step_1.trash-cd"):
        (tmp_path / name).mkdir()
    checkpoint.prune(tmp_path, "step_", keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3"]
    # a run resumed at step 1 writes step_1 again: the abandoned run's later dirs go, not it
    checkpoint.prune(tmp_path, "step_", keep=1, current=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    (tmp_path / "step_1").mkdir(), (tmp_path / "step_5").mkdir(), (tmp_path / "step_6").mkdir()
    checkpoint.prune(tmp_path, "step_", keep=1, current=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


def test_torn_metrics_lines_are_recognised():
    assert checkpoint.metrics_step('{"step": 3, "reward_mean": 0.5}') == 3
    assert checkpoint.metrics_step('{"step": 4, "rew') is None and checkpoint.metrics_step("") is None
    assert checkpoint.metrics_step("[1, 2]") is None


def test_a_full_disk_leaves_the_previous_adapter_and_says_so(tmp_path, monkeypatch):
    """Disk full in the middle of writing an adapter: the error names it, the old one stays whole,
    and no temp dir is left behind."""

    class Peft:  # what write_adapter needs of a PEFT model
        class Config:
            def save_pretrained(self, directory):
                Path(directory, "adapter_config.json").write_text("{}")
        peft_config = {"default": Config()}

    import torch

    final = tmp_path / "adapters" / "step_2"
    checkpoint.write_adapter(Peft(), {"w": torch.ones(2)}, final, {"path": "base", "fingerprint": None})
    before = {p.name: p.read_bytes() for p in final.iterdir()}

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", no_space)
    with pytest.raises(checkpoint.WriteError, match=r"adapter .*step_2 not written \(No space left on device\)"):
        checkpoint.write_adapter(Peft(), {"w": torch.zeros(2)}, final, {"path": "base", "fingerprint": None})
    assert {p.name: p.read_bytes() for p in final.iterdir()} == before
    assert sorted(p.name for p in final.parent.iterdir()) == ["step_2"]


def test_a_full_disk_during_a_checkpoint_leaves_the_previous_one_newest(tmp_path, monkeypatch):
    import torch

    previous = fake_checkpoint(tmp_path / "checkpoints", 2)
    checkpoint.atomic_write_text(tmp_path / "checkpoints" / "latest", "step_2")

    class Peft:
        class Config:
            def save_pretrained(self, directory):
                Path(directory, "adapter_config.json").write_text("{}")
        peft_config = {"default": Config()}

    def no_space(obj, path, *args, **kwargs):
        Path(path).write_bytes(b"partial")  # half written, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", no_space)
    with pytest.raises(checkpoint.WriteError, match=r"checkpoint step_4 not written \(No space left on device\); "
                                                     "the previous one stays the newest"):
        checkpoint.write_checkpoint(tmp_path, 4, Peft(), {"w": torch.ones(1)}, {"optimizer": {}}, {"step": 4},
                                    {"path": "base", "fingerprint": None})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_2"]  # no temp dir left
    assert checkpoint.find(tmp_path, "latest") == previous


def test_resume_with_meaningful_changes_is_refused_harmless_ones_are_taken():
    saved = train.Config(lr=1e-3, group_size=8, difficulty="small", steps=100, eval_interval=10).__dict__
    same = train.Config(lr=1e-3, group_size=8, difficulty="small", steps=400, eval_interval=20, progress=False)
    assert checkpoint.config_changes(saved, same.__dict__) == []  # longer run, other intervals: fine
    other = train.Config(lr=5e-4, group_size=4, difficulty="easy", steps=100).__dict__
    assert checkpoint.config_changes(saved, other) == ["difficulty: 'small' -> 'easy'", "group_size: 8 -> 4",
                                                       "lr: 0.001 -> 0.0005"]
    for name in checkpoint.MEANINGFUL:  # every listed field is a real setting
        assert name in saved or name == "env_style", name


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
