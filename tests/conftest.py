"""Shared fixtures: the tiny model and a short SFT of it (built once into .cache/), one in-process
vLLM engine."""

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import vllm_engine  # noqa: E402


# The slowest files first: pytest-xdist (launch/test.sh, --no-loadscope-reorder) gives each of
# its two workers two files to start with, in this order, then the next file to whichever is
# free: the learning test and the trainer's runs on one, the launchers and the server on the
# other, and no long file left to start when the other worker is nearly done.
SLOW_FILES_FIRST = ("test_learning.py", "test_launch.py", "test_line.py", "test_train.py", "test_serve.py", "test_bad_input.py",
                    "test_experiments.py", "test_sft.py", "test_policy.py", "test_branch.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file keeps its order


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from tiny_model import ensure_tiny_model

    return ensure_tiny_model()


WARM_START_STEPS = 250


@pytest.fixture(scope="session")
def warm_start(tiny_model) -> Path:
    """The tiny model after a short SFT (sft.py, about a minute on 2 cores): a policy that solves
    some of the mazes some of the time, so GRPO groups have reward spread and updates are real.
    Built once, cached beside the tiny model under a name that changes with it and with sft.py.
    GRPO_TEST_WARM_START=<sft.py --out dir> uses another one instead (one built with other
    threads, say: another floating-point path, so another policy for the tests to hold on)."""
    if os.environ.get("GRPO_TEST_WARM_START"):
        other = Path(os.environ["GRPO_TEST_WARM_START"]) / "model"
        assert (other / "config.json").exists(), f"GRPO_TEST_WARM_START: no {other}/config.json"
        return other
    return cached_build(f"warm-start-{WARM_START_STEPS}", tiny_model, build_warm_start) / "model"


def cached_build(name: str, tiny_model: Path, build, sources=("sft.py",)) -> Path:
    """`build(out)` once into .cache/<name>-<tiny model's fingerprint>-<the sources' hash> (sft.py's,
    and any other file the build depends on), a name that changes with the model and the recipe;
    under pytest-xdist every worker may ask at once: the first builds it, the others wait."""
    fingerprint = json.loads((tiny_model / "BUILD_INFO.json").read_text())["fingerprint"]
    recipe = hashlib.sha256(b"".join((ROOT / source).read_bytes() for source in sources)).hexdigest()[:8]
    out = ROOT / ".cache" / f"{name}-{fingerprint}-{recipe}"
    with open(ROOT / ".cache" / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "model" / "config.json").exists():
            build(out)
    return out


def build_warm_start(out: Path):
    proc = subprocess.run([sys.executable, "sft.py", "--out", str(out), "--steps", str(WARM_START_STEPS),
                           "--seed", "0", "--log-every", "50"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


# The short GRPO run that the resume, damaged-checkpoint, branch and serve tests read: 4 steps
# from the warm start at T 1, with checkpoints, evaluations and adapter exports at steps 2 and
# 4, LoRA dropout (so a resume must restore torch's RNG) and branch rollouts (so the resume
# covers them too), and a tail average over steps 2-4 (so the step-2 checkpoint holds one to
# resume); the recipe otherwise, without its warm-up and its sampled evaluation, and at LoRA rank 8
# (the session's engine fixture takes rank 8; the tests were sized at it).
SHORT_RUN = ["--steps", "4", "--group-size", "4", "--eval-puzzles", "8", "--temperature", "1", "--warmup-steps", "0",
             "--sampled-eval-samples", "0", "--progress", "false", "--ckpt-interval", "2", "--eval-interval", "2",
             "--export-interval", "2", "--lora-dropout", "0.1", "--branch-points-per-group", "2", "--lora-rank", "8",
             "--average-frac", "0.75"]


def shared_tmp(tmp_path_factory) -> Path:
    """This session's temporary root, the same for every pytest-xdist worker."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def short_run(tmp_path_factory, warm_start) -> Path:
    """The run directory of SHORT_RUN, made once per session (whichever worker asks first runs it;
    the others wait for it). Tests read it; one that changes it works on a copy."""
    out = shared_tmp(tmp_path_factory) / "short-run"
    with open(f"{out}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "summary.json").exists():
            shutil.rmtree(out, ignore_errors=True)  # a worker that failed half-way
            proc = subprocess.run([sys.executable, "train.py", "--model", str(warm_start), "--out-dir", str(out),
                                   *SHORT_RUN], cwd=ROOT, capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


@pytest.fixture(scope="session")
def engine(warm_start):
    """One vLLM engine for the whole session, on the warm start (start-up and warm-up cost ~20 s
    on 2 cores). One only: an engine torn down in a process takes vLLM's global state with it."""
    return vllm_engine.build_engine(str(warm_start), max_model_len=4096, max_lora_rank=8, seed=0)


def masked_segments(seq) -> list[list[int]]:
    """The runs of tokens a sequence trains on (response_mask 1), in order."""
    segments, current = [], []
    for token, m in zip(seq.token_ids, seq.response_mask):
        if m:
            current.append(token)
        elif current:
            segments.append(current)
            current = []
    return segments + ([current] if current else [])
