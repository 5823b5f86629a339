"""Turn run directories into pictures and tables: everything comes from the logged files.

    python launch/report.py runs/default                    # one run
    python launch/report.py runs/seed0 runs/seed1 runs/seed2   # several seeds: a table with mean and spread

Writes <run>/solve_rate.png (the held-out greedy solve rate at each evaluation, and the training
solve rate as a rolling mean, labelled with the temperature the run sampled at) and
<run>/final_episode.gif (the final policy's greedy play of one held-out puzzle, replayed through
its task from the replies logged in eval/step_<N>.json), and prints the before/after table.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import env  # noqa: E402
import rundir  # noqa: E402
import tasks  # noqa: E402
from tasks.visgym_maze import VisGymMazeTask  # noqa: E402


def load_evals(run: Path) -> list[dict]:
    """The run's own evaluations (each file names its run; rundir.run_evals)."""
    return rundir.run_evals(run)


def rolling_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the window - 1 before it (of fewer at the start)."""
    import numpy as np

    sums = np.concatenate([[0.0], np.cumsum(values)])
    end = np.arange(1, len(values) + 1)
    start = np.maximum(end - window, 0)
    return ((sums[end] - sums[start]) / (end - start)).tolist()


def plot_curves(run: Path, evals: list[dict], window: int = 25) -> Path:
    """The held-out greedy curve, and the training solve rate: one step's few puzzles are mostly
    noise, so its `window`-step rolling mean, at the temperature the run sampled at."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config = json.loads((run / "config.json").read_text())
    metrics_file = run / "metrics.jsonl"
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in evals], [100 * r["solve_rate"] for r in evals], "o-",
            label=f"held-out solve rate ({evals[0]['total']} {evals[0]['difficulty']} puzzles, greedy)")
    current = [r for r in evals if "last_iterate" in r]
    if current:  # while the published policy is the tail average: the current policy beside it
        ax.plot([r["step"] for r in current], [100 * r["last_iterate"]["solve_rate"] for r in current], "x",
                color="tab:blue", label="held-out, the last step's own policy (the line: the tail average)")
    seen = [r for r in evals if "training_puzzles" in r]
    if seen:  # the puzzles it trains on first, greedy: above the held-out curve is memorising
        ax.plot([r["step"] for r in seen], [100 * r["training_puzzles"]["solve_rate"] for r in seen], "s--",
                color="tab:green", label=f"first {seen[0]['training_puzzles']['total']} training puzzles, greedy")
    if metrics:
        steps, rates = [m["step"] for m in metrics], [100 * m["solve_rate"] for m in metrics]
        episodes = config.get("prompts_per_step", 0) * config.get("group_size", 0)
        ax.plot(steps, rates, color="tab:orange", alpha=0.15, lw=0.8)
        ax.plot(steps, rolling_mean(rates, window), color="tab:orange",
                label=f"training solve rate (sampled at T {config.get('temperature', 1.0)}, "
                      + (f"{episodes} episodes a step; " if episodes else "") + f"{window}-step rolling mean)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("% solved")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"{run} (seed {config.get('seed')}, {config.get('task', 'maze')} {config.get('difficulty')})")
    fig.tight_layout()
    path = run / "solve_rate.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def replay_gif(run: Path, result: dict, config: dict) -> Path:
    """Replay the logged replies of one held-out puzzle (the first solved one, else the first)."""
    row = next((r for r in result["puzzles"] if r["solved"]), result["puzzles"][0])
    game = tasks.make(config["task"], result["difficulty"], row["seed"], config["max_turns"])
    frames = [game.reset().image]
    for reply in row["replies"]:
        if game.done:
            break
        frames.append(game.step(reply).image)
    path = run / "final_episode.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=400, loop=0)
    return path


def time_to(metrics: list[dict], evals: list[dict], rate: float):
    """(step, seconds of GRPO) at the first evaluation reaching `rate`, or (None, None)."""
    hit = next((r for r in evals if r["solve_rate"] >= rate), None)
    if hit is None:
        return None, None
    return hit["step"], sum(m["step_s"] for m in metrics if m["step"] <= hit["step"])


def solvable(task: str, difficulty: str, n: int, max_turns: int) -> int | None:
    """How many of the n held-out puzzles can be solved at all within max_turns (the ceiling,
    env.fits_turn_limit; None: the task has no solver). On 9x9 mazes with 15 turns, not all can."""
    fits = [env.fits_turn_limit(t) for t in env.held_out(tasks.task_class(task), difficulty, n, max_turns)]
    return None if None in fits else sum(fits)


def visgym_solved(model: str, adapter: str, n: int, max_turns: int, max_new_tokens: int) -> tuple[int, int]:
    """Greedy strict solves of VisGym's n easy evaluation seeds within max_turns by the warm start
    alone and with `adapter` (one engine for both). VisGym's own protocol allows 20 turns, the
    published run 15. SkyRL's pass metric (reward > 0) counts the same mazes for a policy that
    writes no SkyRL tags: its format share is 0, so its reward is 0.8 x solved."""
    import evaluation
    from experiments.eval_policy import load_policy

    engine, lora_request, chat = load_policy(model, adapter, max_turns)
    solved = []
    for request, name in ((None, "warm start"), (lora_request, "final")):
        replies = evaluation.engine_replies(engine, request, max_new_tokens, chat.banned_token_ids)
        episodes = evaluation.play_chat_episodes(env.held_out(VisGymMazeTask, "easy", n, max_turns), replies,
                                                 desc=f"{name}, {max_turns} turns")
        solved.append(sum(e.solved for e in episodes))
    return solved[0], solved[1]


def run_row(run: Path, target: float) -> dict:
    evals = load_evals(run)
    metrics_file = run / "metrics.jsonl"
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    config = json.loads((run / "config.json").read_text())
    best = max(evals, key=lambda r: r["solve_rate"])
    step, seconds = time_to(metrics, evals, target)
    mean = lambda k: sum(m.get(k, 0.0) for m in metrics) / max(len(metrics), 1)  # noqa: E731
    return {"run": str(run), "seed": config["seed"], "baseline": evals[0]["solve_rate"], "best": best["solve_rate"],
            "best_step": best["step"], "final": evals[-1]["solve_rate"], "final_step": evals[-1]["step"],
            "total": evals[0]["total"], "steps_to_target": step, "seconds_to_target": seconds,
            **{k: mean(k) for k in PHASES}}


def seeds_table(rows: list[dict], target: float) -> str:
    import statistics

    def pct(x):
        return f"{100 * x:.1f}%"

    def spread(key):
        values = [r[key] for r in rows]
        return f"{pct(statistics.mean(values))} ± {pct(statistics.stdev(values)) if len(values) > 1 else '-'}"

    lines = [f"| run | seed | baseline | best (step) | final (step) | steps to {pct(target)} | GRPO time to {pct(target)} |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        to = f"{r['steps_to_target']}" if r["steps_to_target"] is not None else "not reached"
        secs = f"{r['seconds_to_target'] / 60:.1f} min" if r["seconds_to_target"] is not None else "-"
        lines.append(f"| {r['run']} | {r['seed']} | {pct(r['baseline'])} | {pct(r['best'])} ({r['best_step']}) | "
                     f"{pct(r['final'])} ({r['final_step']}) | {to} | {secs} |")
    reached = sum(r["steps_to_target"] is not None for r in rows)
    lines.append(f"| mean ± std | | {spread('baseline')} | {spread('best')} | {spread('final')} | "
                 f"{reached}/{len(rows)} reached | |")
    lines += ["", "| mean seconds per step | " + " | ".join(k[:-2] for k in PHASES[:-1]) + " | total |",
              "|---" * (len(PHASES) + 1) + "|"]
    for r in rows:
        lines.append(f"| {r['run']} | " + " | ".join(f"{r[k]:.2f}" for k in PHASES) + " |")
    return "\n".join(lines)


RESULTS = ROOT / "docs" / "results" / "rl_lift.json"
# the step's phases train.py times (branch_s is inside rollout_s), the whole step last
PHASES = ("rollout_s", "advantages_s", "update_s", "sync_s", "eval_s", "checkpoint_s", "step_s")


def sampled_temperature(config: dict) -> float:
    """The temperature of a run's sampled evaluation: its own setting; runs from before that
    setting existed sampled at the training temperature."""
    return config.get("sampled_eval_temperature", config.get("temperature", 1.0))


def forks_right(model: str, difficulty: str, n: int, adapter: str = "") -> tuple[int, int]:
    """Forks of the n evaluation mazes' shortest paths the policy gets right teacher-forced
    (experiments/forks.py): the mechanism's own effect, beside the solve rate it feeds."""
    from experiments.eval_policy import mazes_played
    from experiments.forks import turn_accuracy

    right, total = turn_accuracy(model, [task.maze for task in mazes_played(difficulty, n)], adapter)
    forks = [kind for kind in total if kind.startswith("fork")]
    return sum(right[k] for k in forks), sum(total[k] for k in forks)


def lift_record(run: Path, kind: str, command: str) -> dict:
    """What docs/results/rl_lift.json keeps of a run: greedy held-out solved before GRPO, at its
    best and at the end, the same of the first training mazes, the sampled solve rate before and
    after, the held-out forks right before and after (teacher-forced), and what it took."""
    evals = load_evals(run)
    config = json.loads((run / "config.json").read_text())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    best = max(evals, key=lambda r: (r["solved"], -r["step"]))
    final_adapter = run / "adapters" / f"step_{evals[-1]['step']}"
    forks_before = forks_after = forks_total = None
    # experiments/forks.py scores our own mazes and drawing only
    if (Path(config.get("model", "")) / "config.json").exists() and final_adapter.is_dir() \
            and config.get("task") == "maze":
        difficulty, n = evals[0]["difficulty"], evals[0]["total"]
        forks_before, forks_total = forks_right(config["model"], difficulty, n)
        forks_after = forks_right(config["model"], difficulty, n, str(final_adapter))[0]
        print(f"{run}: held-out forks right (teacher-forced) {forks_before}/{forks_total} before GRPO, "
              f"{forks_after}/{forks_total} at the end")
    else:
        print(f"{run}: forks not scored (its model {config.get('model')!r} or {final_adapter} is not here, "
              f"or its task is not the maze)")
    visgym_fields = {}
    if config.get("task") == VisGymMazeTask.name and final_adapter.is_dir():
        n, turns = evals[0]["total"], config["max_turns"]
        before_20, after_20 = visgym_solved(config["model"], str(final_adapter), n, 20, config["max_new_tokens"])
        visgym_fields = {"env_style": "visgym", "max_turns": turns,
                         "solvable": solvable(config["task"], evals[0]["difficulty"], n, turns),
                         "solved_20_before": before_20, "solved_20_after": after_20,
                         "solvable_20": solvable(config["task"], evals[0]["difficulty"], n, 20)}
        print(f"{run}: VisGym's protocol (20 turns) {before_20}/{n} before GRPO, {after_20}/{n} at the end")
    return {**visgym_fields, "kind": kind, "run": str(run), "task": config["task"], "seed": config["seed"],
            "difficulty": evals[0]["difficulty"],
            "total": evals[0]["total"], "warm_start_solved": evals[0]["solved"], "best_solved": best["solved"],
            "best_step": best["step"], "final_solved": evals[-1]["solved"], "final_step": evals[-1]["step"],
            # the published policy is the tail average over the last average_frac of the steps
            # (average.py); the last step's own policy, evaluated beside it
            "average_frac": config.get("average_frac", 0),
            "final_last_iterate_solved": evals[-1].get("last_iterate", {}).get("solved"),
            # greedy play of the first training puzzles
            "train_solved_before": evals[0].get("training_puzzles", {}).get("solved"),
            "train_solved_after": evals[-1].get("training_puzzles", {}).get("solved"),
            "forks_before": forks_before, "forks_after": forks_after, "forks_total": forks_total,
            "sampled_before": evals[0].get("sampled_solve_rate"), "sampled_after": evals[-1].get("sampled_solve_rate"),
            "sampled_temperature": sampled_temperature(config),
            "train_temperature": config.get("temperature", 1.0),
            "branch_points_per_group": config.get("branch_points_per_group", 0),
            "branch_weight": config.get("branch_weight"),
            # a run still under way reads as such: grpo_steps short of planned_steps
            "grpo_steps": len(metrics), "planned_steps": config.get("steps"),
            "grpo_minutes": round(sum(m["step_s"] for m in metrics) / 60, 1),
            "command": command}


def records_table(records: list[dict]) -> str:
    """The README's table: one row a recorded run (seed order), then the mean lift in points. The
    forks column only for runs that scored them (the maze's)."""
    rows = sorted(records, key=lambda r: r["seed"])
    forked = any(r.get("forks_total") for r in rows)
    lines = ["| seed | warm start | GRPO best (step) | GRPO final (step) | lift, final | "
             + ("held-out forks right | " if forked else "") + "first training puzzles |",
             "| --- | --- | --- | --- | --- | " + ("--- | " if forked else "") + "--- |"]
    for r in rows:
        n = r["total"]
        forks = (f"{r['forks_before']} -> {r['forks_after']} of {r['forks_total']}"
                 if r.get("forks_total") else "not scored")
        train = (f"{r['train_solved_before']} -> {r['train_solved_after']}"
                 if r.get("train_solved_before") is not None else "-")
        lines.append(f"| {r['seed']} | {r['warm_start_solved']}/{n} | {r['best_solved']}/{n} ({r['best_step']}) | "
                     f"{r['final_solved']}/{n} ({r['final_step']}) | "
                     f"{100 * (r['final_solved'] - r['warm_start_solved']) / n:+.1f} points | "
                     + (f"{forks} | " if forked else "") + f"{train} |")
    lifts = [100 * (r["final_solved"] - r["warm_start_solved"]) / r["total"] for r in rows]
    gaps = [100 * (r["best_solved"] - r["final_solved"]) / r["total"] for r in rows]
    if rows:
        lines += ["", f"Final lift {sum(lifts) / len(lifts):+.1f} points mean (seeds {', '.join(f'{x:+.1f}' for x in lifts)}); "
                      f"final below best by {', '.join(f'{x:.1f}' for x in gaps)} points."]
    if rows and all(r.get("final_last_iterate_solved") is not None for r in rows):
        lines[-1] += (f" The final policy is the mean of the last {rows[0]['average_frac']:.0%} of the steps' "
                      f"(average.py); the last step's own solved "
                      f"{', '.join(str(r['final_last_iterate_solved']) for r in rows)}.")
    return "\n".join(lines)


def visgym_table(records: list[dict]) -> str:
    """The README's VisGym maze_2d easy table, beside the published walkthrough's: strict greedy
    solves at the published run's 15 turns (of those that fit) and at VisGym's 20, per seed."""
    rows = sorted(records, key=lambda r: r["seed"])
    lines = ["| seed | warm start, 15 turns | GRPO best (step) | GRPO final, 15 turns | of the solvable | lift, final | "
             "20 turns (VisGym's protocol): warm start -> final |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        n = r["total"]
        lines.append(f"| {r['seed']} | {r['warm_start_solved']}/{n} | {r['best_solved']}/{n} ({r['best_step']}) | "
                     f"{r['final_solved']}/{n} ({r['final_step']}) | {r['final_solved']}/{r['solvable']} "
                     f"({100 * r['final_solved'] / r['solvable']:.0f}%) | "
                     f"{100 * (r['final_solved'] - r['warm_start_solved']) / n:+.1f} points | "
                     f"{r['solved_20_before']}/{n} -> {r['solved_20_after']}/{n} |")
    if rows:
        lifts = [100 * (r["final_solved"] - r["warm_start_solved"]) / r["total"] for r in rows]
        lines += ["", f"Final lift {sum(lifts) / len(lifts):+.1f} points mean (seeds "
                      f"{', '.join(f'{x:+.1f}' for x in lifts)}). SkyRL's pass metric (reward > 0) counts the "
                      "same mazes as the strict one here: the policy writes no SkyRL tags."]
    return "\n".join(lines)


def record(records: list[dict], path: Path = RESULTS):
    """Add (or replace, by run dir) records in the results file, atomically."""
    old = json.loads(path.read_text()) if path.exists() else []
    runs = {r["run"] for r in records}
    merged = [r for r in old if r["run"] not in runs] + records
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(merged, indent=1))
    tmp.replace(path)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="*")
    parser.add_argument("--table", default="", help="print the README's table of the recorded runs whose run dir "
                        "contains this text (runs/mainb-seed: the three branch runs), from the results file, and stop")
    parser.add_argument("--target", type=float, default=0.9, help="solve rate for the time-to-target columns")
    parser.add_argument("--record", default="", choices=["", "main", "long", "control", "visgym-easy", "sokoban"],
                        help="also add each run to docs/results/rl_lift.json as this kind (control: a run "
                             "that isolates one change against main runs, not the recipe)")
    parser.add_argument("--command", default="", help="the command that made the runs (for --record)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the results file --record writes")
    args = parser.parse_args()
    if args.table:
        recorded = [r for r in (json.loads(args.results.read_text()) if args.results.exists() else [])
                    if args.table in r["run"]]
        visgym_runs = [r for r in recorded if r.get("env_style") == "visgym"]  # records keep the style's name
        print(visgym_table(visgym_runs) if visgym_runs else records_table(recorded))
        return
    if not args.runs:
        parser.error("give run directories (or --table)")
    loaded = {}  # run -> (its evaluations, its config), each file read once
    for run in args.runs:
        evals = load_evals(run)
        if not evals:
            raise SystemExit(f"{run} has no eval/step_*.json yet")
        config = json.loads((run / "config.json").read_text())
        loaded[run] = evals, config
        print(f"curve: {plot_curves(run, evals)}")
        print(f"episode: {replay_gif(run, evals[-1], config)}")
    evals, config = loaded[args.runs[0]]
    if len(args.runs) == 1:
        best = max(evals, key=lambda r: r["solve_rate"])
        print("\n| | step | solved |\n|---|---|---|")
        print(f"| before GRPO | {evals[0]['step']} | {evals[0]['solved']}/{evals[0]['total']} |")
        print(f"| best | {best['step']} | {best['solved']}/{best['total']} |")
        print(f"| final | {evals[-1]['step']} | {evals[-1]['solved']}/{evals[-1]['total']} |")
        if "training_puzzles" in evals[0] and "training_puzzles" in evals[-1]:
            before, after = evals[0]["training_puzzles"], evals[-1]["training_puzzles"]
            print(f"\nfirst {before['total']} training puzzles, greedy: {before['solved']} solved before GRPO, "
                  f"{after['solved']} at the end")
        if "sampled_solve_rate" in evals[0] and "sampled_solve_rate" in evals[-1]:
            print(f"\nsampled solve rate (temperature {sampled_temperature(config)}, held-out puzzles): "
                  f"{evals[0]['sampled_solve_rate']:.3f} before GRPO, {evals[-1]['sampled_solve_rate']:.3f} after")
    first, max_turns = evals[0], config["max_turns"]
    fits = solvable(config["task"], first["difficulty"], first["total"], max_turns)
    print(f"\n{'?' if fits is None else fits} of the {first['total']} {config['task']} {first['difficulty']} "
          f"held-out puzzles can be solved within {max_turns} turns (their shortest solution fits)")
    print()
    print(seeds_table([run_row(run, args.target) for run in args.runs], args.target))
    if args.record:
        record([lift_record(run, args.record, args.command) for run in args.runs], args.results)
        print(f"\nrecorded in {args.results}")
    # written by experiments/seeds.sh next to each run: the policies played on another maze size
    other = [(run, json.loads(p.read_text())) for run in args.runs
             for p in sorted((run.parent / "generalisation").glob("*.json"))]
    if other:
        print("\n| run | policy | played on | solved |\n|---|---|---|---|")
        for run, r in other:
            policy = "SFT + GRPO" if r["adapter"] else "SFT"
            print(f"| {run} | {policy} | {r['difficulty']} | {r['solved']}/{r['total']} |")


if __name__ == "__main__":
    main()
