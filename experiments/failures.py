"""How did a greedy policy's failed evaluation episodes go wrong? Read from the logged replies.

    python experiments/failures.py runs/main/grpo/eval/step_0.json [runs/main/grpo/eval/step_100.json ...]

Each failed maze is replayed from its `replies` (an `eval/step_<N>.json` of train.py, or the
output of experiments/eval_policy.py or `serve.py eval`) and classified by two questions:

  first wrong move towards the goal   the first move off the shortest path brings the agent closer
                                      to the goal (Manhattan distance): a heuristic "head for the
                                      goal" choosing a branch that does not go through
  ends in a two-cell loop             the last 6 positions alternate between two cells: the agent
                                      bounces between a dead end and the cell before it

Also printed: how many of the mazes have a shortest path that only ever moves towards the goal,
and over the failed mazes the turns spent bumping into walls and the cells left between the agent
and the goal at the end (how lost a failure is, against how close). Both maze tasks (the result's
`task`: ours or VisGym's) are replayed by their own task. No model is loaded.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tasks.maze import ACTION_STRINGS, MOVE_DELTAS, goal_distances, solve  # noqa: E402
from experiments.eval_policy import mazes_played  # noqa: E402


def manhattan(a, b) -> int:
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


def replay(task, replies: list) -> tuple[list, tuple | None, int]:
    """The cells the agent stood on (start first), its first move off a shortest path, as (cell,
    action string or None for an invalid reply) or None if it never left one, and its wall bumps."""
    game = task.clone()
    game.max_turns = max(len(replies), 1)
    game.reset()
    maze = game.maze
    cells, first_wrong, bumps = [maze.start], None, 0
    for reply in replies:
        cell, action = game.agent, game.parse(reply)
        if first_wrong is None and cell != maze.goal and action != solve(maze, start=cell)[0]:
            first_wrong = (cell, action)
        bumps += game.step(reply).no_effect
        cells.append(game.agent)
        if game.done:
            break
    return cells, first_wrong, bumps


def classify(result: dict) -> dict:
    """Counts over the failed mazes of one evaluation result (the JSON's dict)."""
    # train.py's results are held-out puzzles; experiments/eval_policy.py says which it played
    played = mazes_played(result["difficulty"], result["total"], result.get("mazes_played", "evaluation"),
                          result.get("task", "maze"))
    mazes = [task.maze for task in played]
    for row in result["puzzles"]:
        if "seed" in row and row["seed"] != mazes[row["index"]].seed:
            raise SystemExit(f"maze {row['index']} has seed {row['seed']}, not the replayed maze's "
                             f"{mazes[row['index']].seed}: these are not the mazes this result was played on")
    counts = {"mazes": len(mazes), "failed": 0, "first_wrong_towards_goal": 0, "two_cell_loop": 0,
              "monotone_shortest_path": sum(len(solve(m)) - 1 == manhattan(m.start, m.goal) for m in mazes),
              "bumps": 0, "end_distances": []}
    for row in result["puzzles"]:
        if row["solved"]:
            continue
        maze = mazes[row["index"]]
        cells, first_wrong, bumps = replay(played[row["index"]], row["replies"])
        counts["failed"] += 1
        counts["bumps"] += bumps
        counts["end_distances"].append(goal_distances(maze)[cells[-1]])
        counts["two_cell_loop"] += len(cells) >= 6 and len(set(cells[-6:])) == 2
        if first_wrong is not None and first_wrong[1] in ACTION_STRINGS[:4]:
            cell, (dr, dc) = first_wrong[0], MOVE_DELTAS[ACTION_STRINGS.index(first_wrong[1])]
            counts["first_wrong_towards_goal"] += (
                manhattan((cell[0] + dr, cell[1] + dc), maze.goal) < manhattan(cell, maze.goal))
    return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("evals", nargs="+", type=Path, help="evaluation result JSON files")
    args = parser.parse_args()
    for path in args.evals:
        c = classify(json.loads(path.read_text()))
        print(f"{path}: failed {c['failed']}/{c['mazes']}; first wrong move towards the goal "
              f"{c['first_wrong_towards_goal']}, ends in a two-cell loop {c['two_cell_loop']}; "
              f"{c['monotone_shortest_path']} mazes have a shortest path that only moves towards the goal; "
              f"the failed ones bumped into walls {c['bumps']} times and ended a median "
              f"{statistics.median(c['end_distances'] or [0])} cells from the goal")


if __name__ == "__main__":
    main()
