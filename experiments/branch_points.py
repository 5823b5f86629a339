"""What the branch rollouts see in one group: the points chosen, every branch and its return.

    python experiments/branch_points.py --model <warm start> --adapter runs/overfit/branch2/adapters/step_60 \
        --train-pool 8 --maze-seed 1000004

One group (`--group-size` members of one training maze, at the run's temperature) played as
train.py plays it (rollout.play_episodes), then branch.choose_points and branch.play_branches as
the trainer calls them; the other settings are the Config's defaults (8 reply tokens, our maze
style, the full image history; this tool has no flags for them). Prints where each member went and how it ended, then, per point, the
moves tried, their returns, the target (if any) and what each branch did after its forced move.
It says whether a mistake the run does not fix has no target (every branch returns 0) or has one
that is too light to move the policy.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import rollout  # noqa: E402

import branch  # noqa: E402
import env  # noqa: E402
from tasks.maze import MazeTask, solve  # noqa: E402
from config import Config  # noqa: E402
from experiments.eval_policy import load_policy  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--adapter", default="", help="a PEFT adapter directory (none: the model itself)")
    parser.add_argument("--difficulty", default="small")
    parser.add_argument("--train-pool", type=int, default=0, help="the run's --train-pool (0: the open stream)")
    parser.add_argument("--maze-seed", type=int, required=True, help="the training maze, by its seed")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.5)
    parser.add_argument("--max-turns", type=int, default=15)
    parser.add_argument("--points", type=int, default=2, help="--branch-points-per-group")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    cfg = Config(model=args.model, difficulty=args.difficulty, train_pool=args.train_pool, max_turns=args.max_turns,
                 temperature=args.temperature, branch_points_per_group=args.points, max_new_tokens=8, seed=args.seed)
    stream = env.TrainingStream(MazeTask, args.difficulty, args.max_turns, eval_n=cfg.eval_puzzles,
                                pool=args.train_pool)
    tasks = stream.first(args.train_pool or 1000)
    task = next((t for t in tasks if t.seed == args.maze_seed), None)
    if task is None:
        raise SystemExit(f"no training maze with seed {args.maze_seed} among the first {len(tasks)}")
    maze = task.maze
    engine, lora_request, chat = load_policy(args.model, args.adapter, args.max_turns)
    episodes = rollout.play_episodes(engine, chat, [task], [0],
                                     rollout.Sampling.of(cfg, temperature=args.temperature, seed=args.seed),
                                     samples_per_task=args.group_size, lora_request=lora_request, progress=False)
    print(f"maze {maze.seed}: goal {maze.goal}, shortest path {len(solve(maze))} turns")
    for e in episodes:
        print(f"member {e.sample_id}: {e.end_reason}, solved {e.solved}, {e.num_turns} turns, "
              f"cells {[t.key for t in e.played]}")
    points = branch.choose_points(episodes, args.points)
    for p in branch.play_branches(cfg, engine, chat, episodes, points, lora_request):
        target = p.actions[p.best] if p.best is not None else "none"
        print(f"point: member {p.parent}, turn {p.turn}, cell {episodes[p.parent].turns[p.turn].key}: "
              f"returns {dict(zip(p.actions, (round(r, 3) for r in p.returns)))}, target {target}")
        for move, b in zip(p.actions, p.branches[::cfg.branch_continuations]):  # each move's first continuation
            print(f"    {move}: {b.end_reason}, solved {b.solved}, ends at {b.task.agent}, then "
                  f"{[t.reply for t in b.played[p.turn + 1:]]}")


if __name__ == "__main__":
    main()
