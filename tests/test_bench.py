"""bench/bench.py keeps running: every section at its smallest size (`--size tiny`), end to end,
so that a metric train.py renames or drops, or a flag bench passes that train.py no longer
takes, fails here instead of in the next person's benchmark (issue 45: `--quick` died on the
`logprobs_s` the single-pass update stopped writing)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_bench", ROOT / "bench" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("size", ["tiny", "quick", "full"])
def test_the_train_flags_of_every_size_are_train_pys(size, tmp_path):
    """The flags bench passes to train.py at each size parse and validate, with as many processes
    as bench starts (the tiny run below plays only the tiny ones)."""
    from config import parse_config

    bench = load_bench()
    cfg = parse_config(["--out-dir", str(tmp_path), *bench.train_args(size)])
    for world in (1,) if size == "tiny" else (1, 2):
        cfg.validate(world)


@pytest.mark.slow
def test_every_section_runs_at_its_smallest_size(tiny_model, tmp_path):
    """`bench.py --size tiny --profile`: the engine cold start (one fresh process), a 2-step
    train.py run summarised from its metrics.jsonl, the 8B-shaped LoRA sync at rank 1, the vLLM
    rollout against transformers with its profile, and the markdown table of all of it."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "bench/bench.py", "--size", "tiny", "--profile", "--threads", "1",
                           "--timeout", "600", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = json.loads(out.read_text())
    assert {"coldstart", "train", "sync_8b", "rollout"} <= set(results)

    # the child processes bench starts report failures instead of raising: none may have failed
    assert "failed" not in results["coldstart"]["default"], proc.stdout[-3000:]
    run = results["train"]["nproc_1"]
    assert "failed" not in run, run.get("stderr_tail")
    # the phases are what train.py wrote: each a timing of every step after the first
    phases = run["phases"]
    assert {"step_s", "eval_s", "checkpoint_s", "sync_s"} <= set(phases)
    assert not any(k.endswith("_per_s") for k in phases)
    assert run["steps"] == 2
    for k in phases:
        assert run[k]["n"] == 1 and run[k]["median"] >= 0, (k, run[k])
    assert 0 < run["core_step_s"]["median"] <= run["step_s"]["median"]
    assert run["eval_s_when_run"]["n"] == 1 and run["checkpoint_s_when_run"]["n"] == 1  # step 2 ran both

    assert results["sync_8b"]["rank"] == 1 and results["sync_8b"]["float32"]["write_s"]["n"] == 1
    rollout = results["rollout"]
    assert rollout["turns_2"]["same_work"]
    assert rollout["profile"]["profiled_s"] > 0

    # the table names every phase train.py wrote, and no other
    table = proc.stdout[proc.stdout.index("### Training step"):]
    header = next(line for line in table.splitlines() if line.startswith("| processes x threads |"))
    for k in phases:
        if k != "step_s":
            assert f"| {k[:-2].replace('_', ' ')}" in header, (k, header)
    for section in ("### Rollout", "### LoRA sync", "### Engine cold start"):
        assert section in proc.stdout
