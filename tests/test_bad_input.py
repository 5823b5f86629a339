"""Bad input gets one clear line and a non-zero exit, not a traceback: the entry points' common
mistakes, each with the words it must be answered with."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import rundir

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
    # a run directory another run left (no checkpoint: a cleanup deleted them), one whose
    # `latest` names a checkpoint that is gone, and one a live trainer holds (this process)
    (root / "used" / "eval").mkdir(parents=True)
    (root / "used" / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (root / "used" / "eval" / "step_0.json").write_text('{"step": 0}')
    (root / "used" / "config.json").write_text("{}")
    (root / "gone" / "checkpoints").mkdir(parents=True)
    (root / "gone" / "checkpoints" / "latest").write_text("step_4")
    (root / "locked").mkdir()
    (root / "locked" / rundir.LOCK_FILE).write_text(json.dumps(
        {**rundir.process_identity(os.getpid()), "started": "2026-12-02T10:00:00Z"}))
    readonly = make_read_only(root / "readonly")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    yield {"root": root, "tiny": tiny_model, "busy_port": listener.getsockname()[1], "closed_port": closed_port,
           "pid": os.getpid(), "host": socket.gethostname(), "readonly": readonly}
    listener.close()
    subprocess.run(["chattr", "-i", str(root / "readonly")], capture_output=True)


def make_read_only(path: Path) -> str:
    """A directory nothing can be written into, also for root (which ignores permissions): the
    immutable attribute where the filesystem has one. Returns its path, or "" if neither works."""
    path.mkdir()
    path.chmod(0o555)
    if os.access(path, os.W_OK):  # root
        subprocess.run(["chattr", "+i", str(path)], capture_output=True)
    try:
        (path / "probe").write_text("x")
    except OSError:
        return str(path)
    (path / "probe").unlink()
    return ""


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
    ("out dir on a read-only path", ["train.py", "--model", "{tiny}", "--out-dir", "{readonly}/run"],
     "{readonly}/run: cannot write there"),
    ("fresh start into another run's dir", ["train.py", "--model", "{tiny}", "--out-dir", "{root}/used",
                                            "--resume", "none"],
     "{root}/used holds another run (metrics.jsonl (2 steps), eval/ (1 entry), config.json) and --resume none: "
     "--archive-old-run true moves it into {root}/used/archive/ first, or pick a new --out-dir"),
    ("`latest` naming a checkpoint that is gone", ["train.py", "--model", "{tiny}", "--out-dir", "{root}/gone"],
     "{root}/gone/checkpoints/latest names step_4, which is gone, and no other checkpoint is there"),
    ("a second trainer on a run dir", ["train.py", "--model", "{tiny}", "--out-dir", "{root}/locked"],
     "{root}/locked is in use by another trainer: pid {pid} on {host}, since 2026-12-02T10:00:00Z"),
    ("a LoRA rank vLLM does not take", ["train.py", "--lora-rank", "12"],
     "lora_rank 12: the engine (vLLM) takes only [1, 8, 16, 32, 64, 128, 256, 320, 512]"),
    ("config that makes no sense", ["train.py", "--group-size", "1"], "group_size must be >= 2"),
    ("unknown task", ["train.py", "--task", "gym"], "unknown task 'gym': one of ["),
    ("a level the task does not have", ["train.py", "--task", "sokoban", "--difficulty", "small"],
     "difficulty must be one of sokoban's levels ['6x6']"),
    ("a task module that is not there", ["train.py", "--task", "nowhere:Task"], "task 'nowhere:Task' cannot be loaded"),
    ("SFT of a task without a solver", ["sft.py", "--task", "tests.test_task_check:NoSolver", "--difficulty", "short"],
     "the task tests.test_task_check:NoSolver has no solver"),
    ("a tie broken by progress on a task without a solver",
     ["train.py", "--model", "{tiny}", "--out-dir", "{root}/tiebreak", "--task", "tests.test_task_check:NoSolver",
      "--difficulty", "short", "--branch-tiebreak", "progress"],
     "bad config: branch_tiebreak progress needs the task's solver (env.Task.solve); "
     "tests.test_task_check:NoSolver has none"),
    ("winnable-only branch points on a task without a solver",
     ["train.py", "--model", "{tiny}", "--out-dir", "{root}/winnable", "--task", "tests.test_task_check:NoSolver",
      "--difficulty", "short", "--branch-winnable-only", "true"],
     "bad config: branch_winnable_only needs the task's solver (env.Task.solve); "
     "tests.test_task_check:NoSolver has none"),
    ("misspelt boolean", ["train.py", "--progress", "ture"],
     "bad config: argument --progress: Truthy value expected: got ture"),
    ("a flag that is not there", ["train.py", "--progress-reward", "0.1"],
     "bad config: unrecognized arguments: --progress-reward 0.1"),
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


@pytest.fixture(scope="module")
def outcomes(places, tmp_path_factory, request) -> dict:
    """The selected cases' (exit status, stdout, stderr): each command line in a process of its
    own, forked from one that imported the scripts' libraries once (tests/forked_entry_points.py).
    (All of them when none is selected: the test after them checks what they all left.)"""
    selected = {item.callspec.params["what"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_a_mistake_is_one_clear_line"} or {c[0] for c in CASES}
    runnable = [c for c in CASES if c[0] in selected and (places["readonly"] or "{readonly}" not in " ".join(c[1]))]
    work = tmp_path_factory.mktemp("cases")
    (work / "cases.json").write_text(json.dumps([[a.format(**places) for a in argv] for _, argv, _ in runnable]))
    environ = {**os.environ, "HF_HUB_OFFLINE": "1"}  # as on an offline node: no minutes of retries
    proc = subprocess.run([PY, "tests/forked_entry_points.py", str(work / "cases.json"), str(work / "results.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, env=environ)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((work / "results.json").read_text())
    return {what: subprocess.CompletedProcess(argv, *result) for (what, argv, _), result in zip(runnable, results)}


@pytest.mark.slow
@pytest.mark.parametrize("what,argv,message", CASES, ids=[c[0] for c in CASES])
def test_a_mistake_is_one_clear_line(what, argv, message, places, outcomes):
    if "{readonly}" in " ".join(argv) and not places["readonly"]:
        pytest.skip("no way to make a read-only directory here")
    proc = outcomes[what]
    output = proc.stderr + proc.stdout
    assert proc.returncode != 0, f"{what}: exit 0\n{output[-2000:]}"
    assert message.format(**places) in output, f"{what}:\n{output[-2000:]}"
    assert "Traceback" not in output, f"{what}: a traceback\n{output[-3000:]}"
    # and the answer is one line: on stderr nothing else (but argparse's usage block before its
    # error line), or, where it goes to stdout, the last line there
    lines, in_usage = [], False
    for line in proc.stderr.splitlines():
        in_usage = line.startswith("usage: ") or (in_usage and line.startswith(" "))
        if line.strip() and not in_usage:
            lines.append(line)
    lines = lines or proc.stdout.splitlines()[-1:]
    assert len(lines) == 1 and message.format(**places) in lines[0], f"{what}: not one line\n{output[-2000:]}"


@pytest.mark.slow
def test_the_refused_run_dirs_are_left_as_they_were(places, outcomes):
    """Nothing lost: the refusals above wrote nothing into the directories they refused."""
    root = places["root"]
    assert sorted(p.name for p in (root / "used").iterdir()) == ["config.json", "eval", "metrics.jsonl"]
    assert (root / "used" / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert sorted(p.name for p in (root / "gone").rglob("*")) == ["checkpoints", "latest"]
    assert sorted(p.name for p in (root / "locked").iterdir()) == [rundir.LOCK_FILE]
