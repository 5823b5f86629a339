"""Bad input gets one clear line and a non-zero exit, not a traceback: the entry points' common
mistakes, each with the words it must be answered with."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


@pytest.fixture(scope="module")
def places(tmp_path_factory, tiny_model):
    """Directories that are wrong in different ways."""
    root = tmp_path_factory.mktemp("bad")
    (root / "empty").mkdir()
    (root / "llama").mkdir()
    (root / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "a_file").write_text("not a directory")
    (root / "not_a_checkpoint").mkdir()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    yield {"root": root, "tiny": tiny_model, "busy_port": listener.getsockname()[1], "closed_port": closed_port}
    listener.close()


# (what is wrong, command, what the one line must say)
CASES = [
    ("model dir that does not exist", ["train.py", "--model", "{root}/missing/model"],
     "--model {root}/missing/model: no such directory (and not a hub id"),
    ("dir that is not a model", ["train.py", "--model", "{root}/empty"], "not a model directory (no config.json)"),
    ("model that is not a Qwen3-VL", ["train.py", "--model", "{root}/llama"],
     "a 'llama' model; this trainer needs a Qwen3-VL one"),
    ("hub id with no network", ["train.py", "--model", "nobody/no-such-model"],
     "not a local directory, and the hub copy could not be had"),
    ("out dir that cannot be written", ["train.py", "--model", "{tiny}", "--out-dir", "{root}/a_file/run"],
     "{root}/a_file/run: cannot write there"),
    ("resume from a dir that is no checkpoint", ["train.py", "--model", "{tiny}", "--out-dir", "{root}/run",
                                                 "--resume", "{root}/not_a_checkpoint"],
     "--resume {root}/not_a_checkpoint: not a usable checkpoint: no meta.json"),
    ("config that makes no sense", ["train.py", "--group-size", "1"], "group_size must be >= 2"),
    ("unknown env style", ["train.py", "--env-style", "gym"], "env_style must be one of"),
    ("misspelt boolean", ["train.py", "--progress", "ture"], "expected true/false/1/0/yes/no, got 'ture'"),
    ("SFT from a model dir that does not exist", ["sft.py", "--model", "{root}/missing"], "no such directory"),
    ("SFT into an out dir that cannot be written", ["sft.py", "--out", "{root}/a_file/sft"], "cannot write there"),
    ("server with no adapter root", ["serve.py", "--adapters", "{root}/missing"], "not a directory"),
    ("server on a port in use", ["serve.py", "--adapters", "{root}/empty", "--port", "{busy_port}"],
     "--port {busy_port}: cannot listen there"),
    ("server with a model dir that is not a model", ["serve.py", "--model", "{root}/empty", "--adapters", "{root}/empty"],
     "not a model directory"),
    ("eval client with no server there", ["serve.py", "eval", "--url", "http://127.0.0.1:{closed_port}",
                                          "--model", "tiny:x"], "http://127.0.0.1:{closed_port}: Connection error"),
    ("eval of an adapter path that is no adapter", ["experiments/eval_policy.py", "--model", "{tiny}", "--adapter",
                                                    "{root}/empty"], "is not a PEFT adapter directory"),
]


@pytest.mark.parametrize("what,argv,message", CASES, ids=[c[0] for c in CASES])
def test_a_mistake_is_one_clear_line(what, argv, message, places):
    argv = [a.format(**places) for a in argv]
    environ = {**os.environ, "HF_HUB_OFFLINE": "1"}  # as on an offline node: no minutes of retries
    proc = subprocess.run([PY, *argv], cwd=ROOT, capture_output=True, text=True, timeout=180, env=environ)
    output = proc.stderr + proc.stdout
    assert proc.returncode != 0, f"{what}: exit 0\n{output[-2000:]}"
    assert message.format(**places) in output, f"{what}:\n{output[-2000:]}"
    assert "Traceback" not in output, f"{what}: a traceback\n{output[-3000:]}"
