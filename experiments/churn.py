"""How much of a run's held-out count is coin flips: per maze, solved at every evaluation, at none,
or at some; how many mazes flip between consecutive evaluations; and the count's own spread.

    python experiments/churn.py runs/main/grpo [runs/main-seed1/grpo ...]

A count that moves by a few while a quarter of the mazes flip says the greedy policy sits on
near-ties that each update tips one way or the other: the final evaluation is then one draw from
a wide distribution, and the lift at the last step is partly luck (docs/experiments.md).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import rundir  # noqa: E402


def solved_table(run: Path) -> dict:
    """{step: {puzzle index: solved}} of the run's own held-out evaluations (rundir.run_evals)."""
    return {r["step"]: {row["index"]: bool(row["solved"]) for row in r["puzzles"]} for r in rundir.run_evals(run)}


def churn(run: Path, from_step: int = 0) -> dict:
    table = {step: solved for step, solved in solved_table(run).items() if step >= from_step}
    steps = sorted(table)
    mazes = sorted(set.intersection(*(set(table[s]) for s in steps))) if steps else []
    always = sum(all(table[s][m] for s in steps) for m in mazes)
    never = sum(not any(table[s][m] for s in steps) for m in mazes)
    flips = [sum(table[a][m] != table[b][m] for m in mazes) for a, b in zip(steps, steps[1:])]
    counts = [sum(table[s][m] for m in mazes) for s in steps]
    return {"run": str(run), "steps": steps, "mazes": len(mazes), "counts": counts, "always": always, "never": never,
            "sometimes": len(mazes) - always - never, "flips": flips,
            "count_sd": round(statistics.stdev(counts), 2) if len(counts) > 1 else 0.0}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", help="train.py run directories (their eval/)")
    parser.add_argument("--from-step", type=int, default=0, help="only the evaluations at or after this step")
    args = parser.parse_args()
    for run in args.runs:
        print(json.dumps(churn(run, args.from_step)))


if __name__ == "__main__":
    main()
