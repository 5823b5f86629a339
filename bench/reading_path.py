"""How much of the project's code a reader follows through one training step (issue 59).

    OMP_NUM_THREADS=1 .venv/bin/python bench/reading_path.py                      # both recipes
    OMP_NUM_THREADS=1 .venv/bin/python bench/reading_path.py --recipe qwen3-vl --json out.json
    .venv/bin/python bench/reading_path.py --model runs/main/sft/model --prompts-per-step 4

One real step of the tiny model is traced: train.py's `start_run`, step 1 untraced (it pays the
warm-up and calibrates the stale-policy guard on every sequence), then step 2 traced, with the
evaluation, checkpoint and export intervals beyond the run, so the traced step is the loop's
ordinary one. The model defaults to the main job's SFT warm start (bench.py's, the tests'
`warm_start`; built if missing, 3-5 min), so the groups have reward spread and the update trains.

Per project file (the repository's own .py files at the top level and in tasks/) it reports:

  functions   the functions (`def`s) whose code the step enters: sys.settrace's 'call' events,
              which for Python code are the events sys.setprofile sees
  lines       the source lines of those functions, each one's whole span from its first decorator
              to its last line; the union of the spans, so a nested function inside an entered
              one adds nothing, and an entered function inside one that was not counts its own
  code        of those lines, the ones that are not docstring, comment or blank (the prose a
              reader also reads, told apart from the code)
  statements  the distinct (file, line) pairs of the step's 'line' events

and the functions on the path longer than LONG_FUNCTION lines. Each recipe runs in a process of
its own (a process holds one process group and one engine): `tiny` (train.py's defaults, branch
rollouts on) and `qwen3-vl` (the published run's shape: no branches, 48 puzzles a step, 32-token
replies). The project runs its code on the main thread, which is the thread traced.
"""

import argparse
import ast
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ("tiny", "qwen3-vl")
LONG_FUNCTION = 60  # issue 59's bound: no function on the step's path longer than this
BEYOND_THE_RUN = str(10 ** 6)  # an interval no traced run reaches


# ----------------------------------------------------------------------------- the counting

def project_file(filename: str, root: Path) -> str | None:
    """`filename` relative to `root` if it is one of the project's own files (top level or
    tasks/), else None (the venv, bench/, tests/, <frozen ...>, <string>)."""
    path = Path(os.path.realpath(filename))
    if path.suffix != ".py" or path.parent not in (root, root / "tasks"):
        return None
    return path.relative_to(root).as_posix()


class StepTrace:
    """Within its `with` block, records the project code entered and the project lines run.

    `calls`: {(file, first line, name)} of every project code object entered (functions, and
    also lambdas, comprehensions and module bodies, which `summarise` sorts out); `lines`:
    {(file, line)}. Frames outside the project get no local tracer, so the rest of the process
    (torch, vLLM) pays one call into the global tracer per Python call and no line events."""

    def __init__(self, root: Path):
        self.root = Path(os.path.realpath(root))
        self.calls, self.lines = set(), set()
        self._files = {}  # co_filename -> its project-relative name or None, decided once per file

    def _file(self, filename: str) -> str | None:
        if filename not in self._files:
            self._files[filename] = project_file(filename, self.root)
        return self._files[filename]

    def _global(self, frame, event, arg):
        name = self._file(frame.f_code.co_filename)
        if name is None:
            return None
        self.calls.add((name, frame.f_code.co_firstlineno, frame.f_code.co_name))
        return self._local

    def _local(self, frame, event, arg):
        if event == "line":
            self.lines.add((self._file(frame.f_code.co_filename), frame.f_lineno))
        return self._local

    def __enter__(self):
        self._previous = sys.gettrace()  # a debugger's or coverage's, given back on exit
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(self._previous)
        return False


def function_spans(source: str) -> dict:
    """{(first line, name): (first line, last line)} of every def in `source`. The first line is
    the first decorator's, as a code object's co_firstlineno is, so that calls match them."""
    spans = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            spans[(first, node.name)] = (first, node.end_lineno)
    return spans


def prose_lines(source: str) -> set:
    """The line numbers of `source` that hold no code: blank lines, comment lines, and docstrings
    (the string a module, class or function body opens with). A line with code and a trailing
    comment is code, and so is every line of a string that is not a docstring."""
    layout = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
              tokenize.ENCODING, tokenize.ENDMARKER}
    code = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in layout:
            code.update(range(token.start[0], token.end[0] + 1))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                code.difference_update(range(first.lineno, first.end_lineno + 1))
    return set(range(1, len(source.splitlines()) + 1)) - code


def summarise(calls: set, lines: set, root: Path) -> dict:
    """A StepTrace's records as the per-file table: {"files": {file: {functions, lines, code_lines,
    statements, code_objects}}, "total": {...}, "long_functions": [...], "outside": [...]}.

    Lambdas, comprehensions and module bodies are not functions a reader looks up: their
    statements count and their spans do not, since a lambda or comprehension lies inside some def
    whose span holds it when that def was entered. `code_objects` counts them with the defs (every
    code object sys.setprofile reports a 'call' for); `outside` lists any that lie in no entered
    def, whose lines the table would otherwise miss unseen."""
    entered, others = {}, {}  # file -> [(first, last, name)]; file -> [(first line, name)]
    sources = {file: (root / file).read_text() for file in {file for file, _, _ in calls}}
    spans_of = {file: function_spans(source) for file, source in sources.items()}
    for file, first, name in calls:
        span = spans_of[file].get((first, name))
        if span:
            entered.setdefault(file, []).append((*span, name))
        else:
            others.setdefault(file, []).append((first, name))
    files, long_functions, outside = {}, [], []
    for file in sorted(set(entered) | set(others) | {f for f, _ in lines}):
        spans = entered.get(file, [])
        covered = set()
        for first, last, _ in spans:
            covered.update(range(first, last + 1))
        files[file] = {"functions": len(spans), "lines": len(covered),
                       "code_lines": len(covered - prose_lines(sources[file])),
                       "statements": sum(1 for f, _ in lines if f == file),
                       "code_objects": len(spans) + len(others.get(file, []))}
        long_functions += [{"function": name, "file": file, "line": first, "lines": last - first + 1}
                           for first, last, name in spans if last - first + 1 > LONG_FUNCTION]
        outside += [f"{file}:{first} {name}" for first, name in sorted(others.get(file, []))
                    if name != "<module>" and first not in covered]
    total = {key: sum(row[key] for row in files.values()) for key in ("functions", "lines", "code_lines",
                                                                      "statements", "code_objects")}
    total["files"] = len(files)
    functions = sorted(({"function": name, "file": file, "line": first, "lines": last - first + 1}
                        for file, spans in entered.items() for first, last, name in spans),
                       key=lambda f: (f["file"], f["line"]))
    return {"files": files, "total": total, "functions": functions,
            "long_functions": sorted(long_functions, key=lambda f: (-f["lines"], f["file"], f["line"])),
            "outside": outside}


def table(recipe: str, result: dict) -> str:
    """One recipe's summary as a markdown table, then its long functions."""
    t = result["total"]
    rows = [f"### {recipe}: {t['functions']} functions, {t['lines']} lines, {t['statements']} statements in "
            f"{t['files']} files ({t['code_objects']} code objects entered with comprehensions and lambdas)",
            "", "| file | functions | lines | of them code | statements |", "| --- | --- | --- | --- | --- |"]
    by_lines = sorted(result["files"].items(), key=lambda kv: (-kv[1]["lines"], -kv[1]["statements"], kv[0]))
    rows += [f"| {f} | {r['functions']} | {r['lines']} | {r['code_lines']} | {r['statements']} |" for f, r in by_lines]
    rows += [f"| **total** | **{t['functions']}** | **{t['lines']}** | **{t['code_lines']}** | **{t['statements']}** |",
             "",
             f"over {LONG_FUNCTION} lines: " + (", ".join(f"{f['function']} {f['lines']} ({f['file']}:{f['line']})"
                                                         for f in result["long_functions"]) or "none")]
    if result["outside"]:
        rows.append("entered outside every entered function (their lines not counted): " + ", ".join(result["outside"]))
    return "\n".join(rows)


# ----------------------------------------------------------------------------- the traced step

def train_argv(recipe: str, model: str, out_dir: Path, prompts_per_step: int | None) -> list:
    """train.py's flags for the traced run: the recipe's settings, with evaluation, checkpoint and
    export beyond the run (the run's steps stay the recipe's, so step 2 is not its last either)
    and the start-up's sampled evaluation off (it runs before the traced step and only costs time)."""
    argv = ["--model", model, "--out-dir", str(out_dir), "--recipe", recipe, "--eval-interval", BEYOND_THE_RUN,
            "--ckpt-interval", BEYOND_THE_RUN, "--export-interval", BEYOND_THE_RUN, "--sampled-eval-samples", "0",
            "--progress", "false", "--resume", "none"]
    return argv + (["--prompts-per-step", str(prompts_per_step)] if prompts_per_step else [])


def default_model() -> str:
    """The main job's warm start, as bench.py finds (or builds) it."""
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("bench_bench", ROOT / "bench" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.warm_start(SimpleNamespace(threads=1, timeout=1800))["model"]


def trace_one_recipe(recipe: str, model: str, prompts_per_step: int | None, result_file: Path):
    """In this process: start a run, play step 1, trace step 2; its summary into `result_file`."""
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    import gc

    import torch.distributed as dist

    import rundir
    import train
    from config import parse_config

    model = model or default_model()
    with tempfile.TemporaryDirectory(prefix="reading_path-") as out_dir:
        cfg = parse_config(train_argv(recipe, model, Path(out_dir), prompts_per_step))
        r = train.start_run(cfg)
        stop = rundir.StopRequest()
        first = train.train_step(r, 0, stop)
        t = time.time()
        with StepTrace(ROOT) as trace:
            metrics = train.train_step(r, 1, stop)
        traced_s = time.time() - t
        result = summarise(trace.calls, trace.lines, ROOT)
        result["run"] = {
            "model": model, "recipe": cfg.recipe, "prompts_per_step": cfg.prompts_per_step,
            "group_size": cfg.group_size, "branch_points_per_group": cfg.branch_points_per_group,
            "max_new_tokens": cfg.max_new_tokens, "traced_step": 2, "traced_s": round(traced_s, 1),
            "first_step_s": round(first["step_s"], 1),
            # that the traced step trained, and ran no evaluation or checkpoint
            **{k: metrics.get(k) for k in ("grad_norm", "trained_sequence_frac", "reward_mean", "eval_s",
                                           "checkpoint_s", "step_s")},
            "evaluated": "eval_solve_rate" in metrics}
        result_file.write_text(json.dumps(result))
        dist.barrier()
        del r
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="an HF model folder (default: the main job's warm start)")
    parser.add_argument("--recipe", choices=[*RECIPES, "both"], default="both")
    parser.add_argument("--prompts-per-step", type=int, default=None,
                        help="puzzles a step for every recipe (default: each recipe's own: tiny 4, qwen3-vl 48)")
    parser.add_argument("--json", type=Path, default=None, help="write the tables' figures here")
    parser.add_argument("--child", choices=RECIPES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        trace_one_recipe(args.child, args.model, args.prompts_per_step, args.result)
        return

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    out = {"head": head.strip() + ("+dirty" if dirty else ""), "prompts_per_step": args.prompts_per_step,
           "recipes": {}}
    environ = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with tempfile.TemporaryDirectory(prefix="reading_path-") as tmp:
        for recipe in RECIPES if args.recipe == "both" else (args.recipe,):
            result, log = Path(tmp) / f"{recipe}.json", Path(tmp) / f"{recipe}.log"
            cmd = [sys.executable, __file__, "--child", recipe, "--result", str(result), "--model", args.model]
            cmd += ["--prompts-per-step", str(args.prompts_per_step)] if args.prompts_per_step else []
            print(f"[reading_path] {recipe}: tracing step 2 ...", file=sys.stderr, flush=True)
            with open(log, "w") as f:
                proc = subprocess.run(cmd, cwd=ROOT, env=environ, stdout=f, stderr=subprocess.STDOUT)
            if proc.returncode != 0 or not result.exists():
                sys.stderr.write(log.read_text()[-4000:])
                raise SystemExit(f"reading_path: the {recipe} run failed ({proc.returncode})")
            out["recipes"][recipe] = json.loads(result.read_text())
            run = out["recipes"][recipe]["run"]
            print(table(recipe, out["recipes"][recipe]))
            print(f"(step 2 of {run['prompts_per_step']} puzzles x {run['group_size']}, branch points "
                  f"{run['branch_points_per_group']}, {run['max_new_tokens']}-token replies; traced in "
                  f"{run['traced_s']} s; grad norm {run['grad_norm']:.3g}, rows trained "
                  f"{run['trained_sequence_frac']:.2f}; evaluated {run['evaluated']}; head {out['head']})\n",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
