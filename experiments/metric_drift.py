"""How far a strict solve rate and SkyRL's pass metric can drift apart, on VisGym's own mazes.

    python experiments/metric_drift.py                                  # two reference policies
    python experiments/metric_drift.py --played runs/x/visgym-easy.json  # and a policy's logged play

Each policy plays VisGym `maze_2d/easy` seeds 0..63 in the VisGym-compatible style (its mazes,
texts and parser; tasks/visgym_maze.py) and is scored two ways:

  strict   reward 1 only for stopping on the goal within the turn limit (ours, the default)
  SkyRL    its SFT recipe's reward, 0.8 x task + 0.2 x the share of turns with well-formed
           <observation>, <justification> and <action> blocks (skyrl_shaped_reward), and
           its pass metric, reward > 0

The reference policies need no model: "shortest path" follows the BFS solution in SkyRL's tag
format (the best any policy can do: it solves exactly the mazes whose path fits the limit), and
"format only" makes random moves in that format and never reaches the goal on purpose. A played
file is what experiments/eval_policy.py --task visgym-maze writes (its replies are replayed here).
"""

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import env  # noqa: E402
from tasks.maze import ACTION_STRINGS, eval_mazes, solve  # noqa: E402
from tasks.visgym_maze import VisGymMazeTask, skyrl_shaped_reward  # noqa: E402


def tagged(action: str) -> str:
    return (f"<observation>the maze</observation><justification>towards the goal</justification>"
            f"<action>{action}</action>")


def shortest_path(maze, max_turns: int, rng) -> list[str]:
    return [tagged(a) for a in solve(maze)][:max_turns]


def format_only(maze, max_turns: int, rng) -> list[str]:
    return [tagged(ACTION_STRINGS[rng.randrange(4)]) for _ in range(max_turns)]


def score(mazes, replies_of, max_turns: int) -> dict:
    """Replay each maze's replies through the env: strict solved, SkyRL's reward and pass."""
    solved = passed = 0
    for i, maze in enumerate(mazes):
        game = VisGymMazeTask.of(maze, max_turns=max_turns)
        game.reset()
        used = []
        for reply in replies_of(i, maze):
            if game.done:
                break
            game.step(reply)
            used.append(reply)
        solved += game.solved
        passed += skyrl_shaped_reward(used, game.solved) > 0
    return {"solved": solved, "passed": passed}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--played", nargs="*", default=[], help="eval JSONs with replies (experiments/eval_policy.py)")
    parser.add_argument("--out", default="", help="write the table's numbers here (JSON)")
    args = parser.parse_args()
    mazes = eval_mazes("easy", args.n, VisGymMazeTask)
    rows = []
    for max_turns in (15, 20):
        fit = sum(len(solve(m)) <= max_turns for m in mazes)
        for name, policy in (("shortest path (BFS, SkyRL's tags)", shortest_path), ("format only", format_only)):
            rng = random.Random(0)
            rows.append({"policy": name, "max_turns": max_turns, "fit": fit,
                         **score(mazes, lambda i, m: policy(m, max_turns, rng), max_turns)})
        for path in args.played:
            played = json.loads(Path(path).read_text())
            if played.get("task") != VisGymMazeTask.name or played["difficulty"] != "easy":
                raise SystemExit(f"{path}: not a play of VisGym's easy mazes")
            by_index = {r["index"]: r["replies"] for r in played["puzzles"]}
            rows.append({"policy": path, "max_turns": max_turns, "fit": fit,
                         **score(mazes, lambda i, m: by_index[i], max_turns)})
    print(f"VisGym maze_2d/easy, seeds 0..{args.n - 1}, VisGym-style play")
    print("| policy | turn limit | mazes that fit | strict solved | SkyRL reward > 0 |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['policy']} | {r['max_turns']} | {r['fit']}/{args.n} | {r['solved']}/{args.n} | {r['passed']}/{args.n} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
