"""bench/bench.py keeps running: every section at its smallest size (`--size tiny`), end to end,
so that a metric train.py renames or drops, or a flag bench passes that train.py no longer
takes, fails here instead of in the next person's benchmark (issue 45: `--quick` died on the
`logprobs_s` the single-pass update stopped writing). And its training steps train: a step
whose groups all scored alike runs no backward pass, and timing it times nothing (issue 60: the
untrained model's steps were timed as training steps). And bench/reading_path.py's counter counts
what issue 59 defines, on a fake project small enough to count by hand."""

import importlib.util
import json
import os
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


def metrics_row(step: int, trained: float, grad_norm: float) -> dict:
    """A train.py metrics line with what bench's summary reads."""
    return {"step": step, "step_s": 5.0, "eval_s": 0.0, "checkpoint_s": 0.0, "sync_s": 0.01, "update_s": 1.0,
            "rollout_s": 3.0, "sync_bytes": 1.0, "trained_sequence_frac": trained, "grad_norm": grad_norm}


CONFIG = {"prompts_per_step": 4, "group_size": 8, "lora_rank": 32}


def test_a_run_whose_timed_steps_trained_nothing_is_refused():
    """Idle steps (grad_norm 0: no rank trained a row) in half or more of the timed steps refuse the
    run; one idle step of four stays in, and shows as the rows-trained minimum. The first step
    (the calibration, which runs every sequence) is not timed, so its share does not count."""
    bench = load_bench()
    idle_after_the_first = [metrics_row(1, 1.0, 0.3)] + [metrics_row(s, 0.0, 0.0) for s in (2, 3, 4, 5)]
    res = bench.summarise_train(idle_after_the_first, CONFIG)
    assert res["idle_steps"] == [2, 3, 4, 5] and "trained no rows" in res["refused"]

    half = [metrics_row(1, 1.0, 0.3), metrics_row(2, 0.5, 0.2), metrics_row(3, 0.0, 0.0), metrics_row(4, 0.25, 0.1),
            metrics_row(5, 0.0, 0.0)]
    assert "refused" in bench.summarise_train(half, CONFIG)

    # rank 0 trained nothing at step 3, another rank did (the gradient, reduced over ranks, is not 0)
    one = [metrics_row(1, 1.0, 0.3), metrics_row(2, 0.5, 0.2), metrics_row(3, 0.0, 0.1), metrics_row(4, 0.25, 0.1),
           metrics_row(5, 0.0, 0.0)]
    res = bench.summarise_train(one, CONFIG)
    assert "refused" not in res and res["idle_steps"] == [5]
    assert res["trained_frac"]["min"] == 0.0 and res["trained_frac"]["max"] == 0.5
    assert [p["trained_frac"] for p in res["per_step"]] == [1.0, 0.5, 0.0, 0.25, 0.0]

    with pytest.raises(KeyError, match="trained_sequence_frac"):
        bench.summarise_train([{k: v for k, v in r.items() if k != "trained_sequence_frac"} for r in one], CONFIG)


def load_reading_path():
    spec = importlib.util.spec_from_file_location("bench_reading_path", ROOT / "bench" / "reading_path.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A fake project for bench/reading_path.py's counter: a top-level file, one in tasks/, one in
# bench/ (not the project's). Line numbers matter: the test names them.
READING_TOP = """\
def deco(f):
    return f


@deco
@deco
def outer(n):
    def inner(x):
        return x + 1
    return [inner(i) for i in range(n)]


def never_called():
    return 0
"""
READING_TASK = """\
def make():
    def made(x):
        # a comment: prose
        y = x * 2
        return y
    return made


def long_one():
    total = 0
""" + "    total += 1\n" * 60 + """\
    return total
"""
READING_OTHER = """\
def elsewhere(f):
    return f(1)
"""


def test_the_reading_path_counter_counts_spans_once_and_statements_once(tmp_path):
    """Functions entered, the union of their whole spans (decorators included; a nested function
    inside an entered one adds nothing, one inside a function not entered counts its own) and the
    distinct statements run, per project file; files outside the top level and tasks/ are not
    counted though their code runs and calls project code."""
    rp = load_reading_path()
    modules = {}
    for rel, text in (("top.py", READING_TOP), ("tasks/task.py", READING_TASK), ("bench/other.py", READING_OTHER)):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text(text)
        spec = importlib.util.spec_from_file_location(f"fake_{rel.replace('/', '_')[:-3]}", tmp_path / rel)
        modules[rel] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[rel])
    made = modules["tasks/task.py"].make()  # made before the trace: its parent is never entered in it
    with rp.StepTrace(tmp_path) as trace:
        modules["top.py"].outer(3)
        modules["bench/other.py"].elsewhere(made)
        modules["bench/other.py"].elsewhere(made)  # twice: the same function and lines, once
        modules["tasks/task.py"].long_one()
    res = rp.summarise(trace.calls, trace.lines, tmp_path)

    assert set(res["files"]) == {"top.py", "tasks/task.py"}
    # top.py: outer (lines 5-10, from its first decorator; inner inside it adds nothing); its
    # statements: def inner, return [...] (the comprehension's line too), inner's return; every line code
    assert res["files"]["top.py"] == {"functions": 2, "lines": 6, "code_lines": 6, "statements": 3,
                                      "code_objects": 3}
    # tasks/task.py: made's own span (2-5, its comment line 3 prose) and long_one's (9-71);
    # statements 4-5 and 10-71
    assert res["files"]["tasks/task.py"] == {"functions": 2, "lines": 4 + 63, "code_lines": 3 + 63,
                                            "statements": 2 + 62, "code_objects": 2}
    assert res["total"] == {"functions": 4, "lines": 73, "code_lines": 72, "statements": 67, "code_objects": 5,
                            "files": 2}
    assert res["long_functions"] == [{"function": "long_one", "file": "tasks/task.py", "line": 9, "lines": 63}]
    assert res["outside"] == []
    assert "| **total** | **4** | **73** | **72** | **67** |" in rp.table("fake", res)
    assert sys.gettrace() is None or sys.gettrace() is not trace._global  # the tracer is gone after the block


PROSE = '''\
"""A module docstring,
on two lines."""


def f(x):
    """A one-line docstring."""
    # a comment line
    y = x  # code with a trailing comment
    text = """a string that is no docstring
# even where a line of it starts like a comment
"""
    return y, text


class C:
    """A class docstring."""
    z = 1
'''


def test_the_reading_path_counter_tells_prose_from_code():
    """Docstrings (module, class, function), comment lines and blank lines are prose; a line with a
    trailing comment and every line of a string that is not a docstring are code."""
    rp = load_reading_path()
    assert rp.prose_lines(PROSE) == {1, 2, 3, 4, 6, 7, 13, 14, 16}


@pytest.mark.parametrize("recipe", ["tiny", "qwen3-vl"])
def test_the_reading_path_flags_are_train_pys(recipe, tmp_path):
    """The flags reading_path.py gives train.py parse, validate, and keep the traced step 2 an
    ordinary one: no evaluation, checkpoint or export on it, and not the run's last step."""
    from config import parse_config

    rp = load_reading_path()
    cfg = parse_config(rp.train_argv(recipe, "", tmp_path, None))
    cfg.apply_recipe(recipe)
    cfg.validate(1)
    assert min(cfg.eval_interval, cfg.ckpt_interval, cfg.export_interval) > 2 and cfg.steps > 2
    # the published recipe is plain GRPO (with TIS): its traced step enters none of the other additions
    additions = (cfg.branch_points_per_group, cfg.step_adv_weight, cfg.average_frac, cfg.probe_states)
    assert additions == ((0, 0, 0, 0) if recipe == "qwen3-vl" else (2, 1.0, 0.3, 32)) and cfg.tis_cap == 2


@pytest.mark.slow
def test_every_section_runs_at_its_smallest_size(warm_start, tmp_path):
    """`bench.py --size tiny --profile`: the engine cold start (one fresh process), a 2-step
    train.py run from the warm start summarised from its metrics.jsonl, whose timed step trained
    rows, the 8B-shaped LoRA sync at rank 1, the vLLM rollout against transformers with its
    profile, and the markdown table of all of it. GRPO_TEST_WARM_START=<dir whose model/ is the
    untrained tiny model> makes it fail: bench refuses the idle run and exits 3."""
    bench = load_bench()
    if not os.environ.get("GRPO_TEST_WARM_START"):  # bench's own warm start is this session's: one build
        assert bench.warm_start_dir() / "model" == warm_start
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "bench/bench.py", "--size", "tiny", "--profile", "--threads", "1",
                           "--timeout", "600", "--model", str(warm_start), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
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
    # the timed step trained: rows, and their sampled tokens, went through the update
    assert "refused" not in run and run["idle_steps"] == [], run["per_step"]
    assert run["per_step"][1]["trained_frac"] > 0 and run["per_step"][1]["trained_sampled_tokens"] > 0, run["per_step"]

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
    assert "| rows trained (rank 0) |" in header
    for section in ("### Rollout", "### LoRA sync", "### Engine cold start"):
        assert section in proc.stdout
