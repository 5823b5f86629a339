"""Shared fixtures: the tiny model (built once into .cache/) and one in-process vLLM engine."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "launch"))

import rollout  # noqa: E402  (sets the vLLM environment before vllm is imported anywhere)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from make_tiny_model import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def engine(tiny_model):
    """One vLLM engine for the whole session (start-up and warm-up cost ~20 s on 2 cores)."""
    return rollout.build_engine(str(tiny_model), max_model_len=4096, max_lora_rank=8, seed=0)


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
