"""Shared fixtures: the tiny model and a short SFT of it (built once into .cache/), one in-process
vLLM engine."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import rollout  # noqa: E402  (sets the vLLM environment before vllm is imported anywhere)


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
    build = json.loads((tiny_model / "BUILD_INFO.json").read_text())["fingerprint"]
    recipe = hashlib.sha256((ROOT / "sft.py").read_bytes()).hexdigest()[:8]
    out = ROOT / ".cache" / f"warm-start-{WARM_START_STEPS}-{build}-{recipe}"
    if not (out / "model" / "config.json").exists():
        proc = subprocess.run([sys.executable, "sft.py", "--out", str(out), "--steps", str(WARM_START_STEPS),
                               "--seed", "0", "--log-every", "50"], cwd=ROOT, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "model"


@pytest.fixture(scope="session")
def engine(warm_start):
    """One vLLM engine for the whole session, on the warm start (start-up and warm-up cost ~20 s
    on 2 cores). One only: an engine torn down in a process takes vLLM's global state with it."""
    return rollout.build_engine(str(warm_start), max_model_len=4096, max_lora_rank=8, seed=0)


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
