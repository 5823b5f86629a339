"""Kills a random worker of a torchrun run at a random moment, again and again, and checks that
torchrun's restart brings the run back every time (issue 58).

    .venv/bin/python launch/restart_check.py --runs 20                 # 20 runs of two processes, a kill each
    .venv/bin/python launch/restart_check.py --runs 10 --during steps  # ... each kill in the training steps
    .venv/bin/python launch/restart_check.py --kills 3 --during both   # one run, killed three times
    .venv/bin/python launch/restart_check.py --nproc 1 --runs 3        # a world of one

Each run is `launch/torchrun.sh` with NPROC_PER_NODE processes and MAX_RESTARTS equal to the
kills, so a restart that fails uses up one the run needs and the run fails. For each kill: a
worker of the current attempt drawn at random gets SIGKILL at a moment drawn uniformly from its
first --window seconds, start-up included (--during any), or from a step drawn at random among
those the attempt has left (--during steps); or as the run logs its next-to-last step, if that
comes first. Checked after each restart: it resumes from the checkpoint `latest` named when the
killed attempt was gone (or starts afresh if there was none); after the run: status 0, one
metrics line per step and the maze seeds of a run never killed. One line per kill and per
restart (kill -> resumed, kill -> its first step, the finished steps done again), one per run;
exit 1 at the first failure, naming it, with the end of the run's log.
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import env  # noqa: E402
import rundir  # noqa: E402
import tasks  # noqa: E402

# A short run of the tiny model: one maze per rank and step, 3 turns, 2 evaluation mazes at the
# start and the end only, a checkpoint after every step.
SHORT = ["--prompts-per-step", "2", "--group-size", "4", "--max-turns", "3", "--eval-puzzles", "2",
         "--eval-interval", "100", "--sampled-eval-samples", "0", "--progress", "false", "--ckpt-interval", "1"]
WAIT_S = 300  # the longest any one wait may take (a start-up on a loaded 2-core machine is ~45 s)


class RestartFailed(Exception):
    pass


def metrics(out: Path) -> list[dict]:
    """The run's metrics lines so far; a last line still being written (torn) is not one yet."""
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if rundir.metrics_step(line) is not None]


def latest_step(out: Path) -> int | None:
    pointer = out / "checkpoints" / "latest"
    return int(pointer.read_text().split("_")[1]) if pointer.exists() else None


def workers(launcher: subprocess.Popen) -> list[int]:
    """The train.py processes torchrun runs now (bash exec'd torchrun: the launcher's pid is its)."""
    alive = []
    try:
        children = psutil.Process(launcher.pid).children()
    except psutil.NoSuchProcess:
        return []
    for child in children:
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "train.py" in child.cmdline():
                alive.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def local_rank(pid: int) -> str:
    try:
        return psutil.Process(pid).environ().get("LOCAL_RANK", "?")
    except psutil.Error:
        return "?"


def wait_for(condition, what: str, launcher: subprocess.Popen, poll: float = 0.05):
    deadline = time.time() + WAIT_S
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        if launcher.poll() is not None:
            raise RestartFailed(f"the launcher exited ({launcher.returncode}) while waiting for {what}")
        time.sleep(poll)
    raise RestartFailed(f"no {what} after {WAIT_S} s")


def uninterrupted_seeds(out: Path, steps: int) -> tuple[list[list[int]], int]:
    """The puzzle seeds of each step of a run of this config that nothing interrupted, and where its
    stream ends."""
    cfg = json.loads((out / "config.json").read_text())
    stream = env.TrainingStream(tasks.task_class(cfg["task"]), cfg["difficulty"], cfg["max_turns"],
                                eval_n=cfg["eval_puzzles"], pool=cfg["train_pool"], seed=cfg["seed"])
    return [[stream.next().seed for _ in range(cfg["prompts_per_step"])] for _ in range(steps)], stream.position


def run_with_kills(out: Path, kills: int, rng: random.Random, nproc: int = 2, steps: int = 6,
                   window_s: float = 60.0, args: tuple[str, ...] = (), log: Path | None = None,
                   say=print, during: tuple[str, ...] = ("any",)) -> list[dict]:
    """One run under launch/torchrun.sh, `kills` workers killed on the way; raises RestartFailed
    unless every restart resumes from `latest` and the run ends as one never killed. Returns a
    record per kill (a restart that the next kill cut short has no times). `during`, cycled over
    the kills: "any" draws the moment from the attempt's first `window_s` seconds, start-up
    included; "steps" from its training, after it has logged a step (and so has a checkpoint to
    be restarted from at --ckpt-interval 1)."""
    log = log or out.with_name(out.name + ".log")
    environ = {**os.environ, "NPROC_PER_NODE": str(nproc), "MAX_RESTARTS": str(kills), "PYTHON": sys.executable}
    environ.setdefault("OMP_NUM_THREADS", "1")  # the processes share the machine's cores
    ckpts, records = out / "checkpoints", []
    with open(log, "w") as f:
        launcher = subprocess.Popen(["bash", "launch/torchrun.sh", "--out-dir", str(out), "--steps", str(steps),
                                     *SHORT, *args], cwd=ROOT, env=environ, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def resume_lines(k: int) -> list[str]:
        return [x for x in log.read_text().splitlines() if "resumed from" in x and f"torchrun restart {k})" in x]

    def observe():
        """Times the last restart's way back: its resume line, then its first step's metrics line
        (written after the line and after it truncated whatever the killed attempt had logged)."""
        if not records:
            return
        r, now = records[-1], time.time()
        if r["latest"] is not None and r["resumed_s"] is None and resume_lines(r["kill"]):
            r["resumed_s"] = round(now - r["killed"], 1)
        since = r["killed"] + (r["resumed_s"] or 0)
        path = out / "metrics.jsonl"
        if (r["first_step_s"] is None and (r["latest"] is None or r["resumed_s"] is not None) and path.exists()
                and path.stat().st_mtime > since and len(metrics(out)) > r["start"]):
            r["first_step_s"] = round(now - r["killed"], 1)

    try:
        attempt = set(wait_for(lambda: (w := workers(launcher)) and len(w) == nproc and w,
                               "the first attempt's workers", launcher))
        started = time.time()
        for k in range(1, kills + 1):
            near_end = lambda: len(metrics(out)) >= steps - 1  # noqa: E731  (the kill must not miss the run)
            base = records[-1]["start"] if records else 0  # the step this attempt started from
            if during[(k - 1) % len(during)] == "any" or base + 1 > steps - 1:
                at = rng.uniform(0, window_s)  # into this attempt, start-up included
                wait_for(lambda: observe() or time.time() - started >= at or near_end(),
                         f"the moment of kill {k}", launcher)
            else:  # "steps": in the step after one of this attempt's steps, drawn at random
                after = rng.randint(base + 1, steps - 1)
                wait_for(lambda: observe() or ((not records or records[-1]["first_step_s"] is not None)
                                              and len(metrics(out)) >= after),
                         f"step {after} of attempt {k - 1}", launcher)
                at = rng.uniform(0, metrics(out)[-1]["step_s"])
                pause = time.time()
                wait_for(lambda: observe() or time.time() - pause >= at or near_end(),
                         f"the moment of kill {k}", launcher)
                at = time.time() - started
            victim = rng.choice(sorted(attempt))
            rank = local_rank(victim)
            os.kill(victim, signal.SIGKILL)
            killed = time.time()
            # the killed attempt is gone once the next one's workers run: `latest` is final then, and
            # the metrics file still holds every line the killed attempt wrote
            attempt = set(wait_for(lambda: (w := workers(launcher)) and len(w) == nproc and not set(w) & attempt
                                   and w, f"restart {k}'s workers", launcher))
            started, latest, done = time.time(), latest_step(out), len(metrics(out))
            records.append(dict(kill=k, local_rank=rank, killed=killed, into_attempt_s=round(at, 1), steps_done=done, latest=latest,
                                start=latest or 0, redone=done - (latest or 0), restarted_s=round(started - killed, 1),
                                resumed_s=None, first_step_s=None))
            say(f"  kill {k}/{kills}: local rank {rank}, {at:.1f} s into attempt {k - 1}, {done} of {steps} steps "
                f"done, latest " + (f"step_{latest}" if latest is not None else "none")
                + f"; restart {k} up {started - killed:.1f} s later")
        deadline = time.time() + WAIT_S
        while launcher.poll() is None and time.time() < deadline:
            observe()
            time.sleep(0.05)
        if launcher.poll() is None:
            raise RestartFailed(f"the run did not finish {WAIT_S} s after the last restart")
        if launcher.returncode != 0:
            raise RestartFailed(f"the launcher exited {launcher.returncode}")
        # every restart that got as far as loading a checkpoint loaded `latest` as the killed attempt left it
        for r in records:
            said = f"resumed from {ckpts}/step_{r['latest']} at step {r['latest']} "
            wrong = [x for x in resume_lines(r["kill"]) if r["latest"] is None or said not in x]
            if wrong:
                raise RestartFailed(f"restart {r['kill']} should have resumed from "
                                    + (f"step_{r['latest']}" if r["latest"] is not None else "nothing")
                                    + f", and logged {wrong[0]!r}")
        last = records[-1]
        if last["latest"] is not None and not resume_lines(last["kill"]):
            raise RestartFailed(f"the last restart never said it resumed from step_{last['latest']}")
        lines = metrics(out)
        if [m["step"] for m in lines] != list(range(1, steps + 1)):
            raise RestartFailed(f"metrics lines for steps {[m['step'] for m in lines]}, not 1..{steps} once each")
        seeds, position = uninterrupted_seeds(out, steps)
        if [m["seeds"] for m in lines] != seeds or lines[-1]["stream_position"] != position:
            raise RestartFailed("the puzzle seeds differ from those of a run never killed")
        for r in records:
            del r["killed"], r["start"]
        return records
    except RestartFailed as e:
        raise RestartFailed(f"{e}\n--- the end of {log}:\n{log.read_text()[-4000:]}") from None
    finally:  # torchrun and its workers, whatever state they are in
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        launcher.wait(timeout=30)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1, help="runs, one after another")
    parser.add_argument("--kills", type=int, default=1, help="kills per run")
    parser.add_argument("--nproc", type=int, default=2, help="processes per run (NPROC_PER_NODE)")
    parser.add_argument("--steps", type=int, default=6, help="steps per run")
    parser.add_argument("--window", type=float, default=60.0,
                        help="seconds into an attempt that its kill may come (start-up ~45 s here)")
    parser.add_argument("--during", choices=["any", "steps", "both"], default="any",
                        help="when a kill may come: any moment of an attempt (start-up included), during its "
                             "training steps, or each in turn")
    parser.add_argument("--seed", type=int, default=0, help="draws which worker and when")
    parser.add_argument("--work-dir", default="runs/restart-check", help="run directories and logs (emptied)")
    parser.add_argument("--model", default="", help="the model (default: the tiny model)")
    a = parser.parse_args()
    if min(a.runs, a.kills, a.nproc) < 1 or a.steps < 2:
        parser.error("--runs, --kills and --nproc must be at least 1, --steps at least 2")
    work, rng = Path(a.work_dir).resolve(), random.Random(a.seed)
    work.mkdir(parents=True, exist_ok=True)
    records, begun = [], time.time()
    for run in range(1, a.runs + 1):
        out = work / f"run{run}"
        shutil.rmtree(out, ignore_errors=True)
        print(f"run {run}/{a.runs}: {a.nproc} process(es), {a.steps} steps, {a.kills} kill(s) during {a.during}",
              flush=True)
        t = time.time()
        try:
            got = run_with_kills(out, a.kills, rng, a.nproc, a.steps, a.window,
                                 ("--model", a.model) if a.model else (),
                                 say=lambda s: print(s, flush=True),
                                 during=("any", "steps") if a.during == "both" else (a.during,))
        except RestartFailed as e:
            raise SystemExit(f"run {run} FAILED after {len(records)} good kill(s): {e}")
        records += got
        for r in got:
            print(f"  restart {r['kill']}: " + (f"resumed {r['resumed_s']} s after the kill, " if r["resumed_s"] else "")
                  + (f"its first step done {r['first_step_s']} s after it; " if r["first_step_s"]
                     else "cut short by the next kill; " if r["kill"] < a.kills else "")
                  + f"{r['redone']} finished step(s) done again", flush=True)
        print(f"run {run}/{a.runs}: finished, every restart from `latest`, one metrics line per step, the maze "
              f"stream of a run never killed ({time.time() - t:.0f} s)", flush=True)

    def median(key):
        values = sorted(r[key] for r in records if r[key] is not None)
        return f"{values[len(values) // 2]} s (of {len(values)})" if values else "-"

    print(f"all {len(records)} kills recovered ({a.runs} runs, {time.time() - begun:.0f} s): median kill -> resumed "
          f"{median('resumed_s')}, kill -> first step after it {median('first_step_s')}; finished steps done "
          f"again: {sum(r['redone'] for r in records)} in all, at most {max(r['redone'] for r in records)}")


if __name__ == "__main__":
    main()
