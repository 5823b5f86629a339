"""Which branch points can still be won: of the points a training step branches at, how many have a
move from which the task's solver still reaches success in the turns left, and which get a target.

    python experiments/point_reach.py --task visgym-maze --difficulty easy --model <warm start> \
        --puzzles 32 [--branch-continuations 3]

Plays `--puzzles` training puzzles (the run's stream, seed 0) `--group-size` times each as train.py
plays them, picks points with branch.choose_points and plays their branches with
branch.play_branches, as the trainer does. A point no move can still win (every move leaves more
actions to the goal than turns remain) can never give a target, however many continuations it
gets: what branch rollouts spend on it is spent for nothing. Needs a task with a solver.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import branch  # noqa: E402
import env  # noqa: E402
import rollout  # noqa: E402
import tasks  # noqa: E402
from config import Config  # noqa: E402
from experiments.eval_policy import load_policy  # noqa: E402


def winnable_moves(state, actions: list, turns_left: int) -> list[bool]:
    """For each action at `state`: does it win at once, or leave a state the solver still finishes
    in the turns left after it (the solver's actions end with the one that wins; None: a state
    with no way to success, a Sokoban box pushed into a corner)?"""
    verdicts = []
    for action in actions:
        after = state.clone()
        after.step(after.reply(action))
        solution = None if after.done else after.solve()
        verdicts.append(after.solved or (solution is not None and len(solution) <= turns_left - 1))
    return verdicts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--task", default="maze", choices=sorted(tasks.TASKS))
    parser.add_argument("--difficulty", default="small")
    parser.add_argument("--puzzles", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--branch-continuations", type=int, default=1)
    args = parser.parse_args()

    task_class = tasks.TASKS[args.task]
    if not env.features(task_class)["solver"]:
        raise SystemExit(f"{args.task}: no solver (env.Task.solve), so no point can be judged")
    cfg = Config(model=args.model, task=args.task, difficulty=args.difficulty, max_new_tokens=8, seed=0,
                 branch_continuations=args.branch_continuations)
    stream = env.TrainingStream(task_class, args.difficulty, cfg.max_turns, eval_n=cfg.eval_puzzles, seed=cfg.seed)
    puzzles = [stream.next() for _ in range(args.puzzles)]
    engine, lora_request, chat = load_policy(args.model, "", cfg.max_turns)
    episodes = rollout.play_episodes(engine, chat, puzzles, list(range(len(puzzles))), rollout.Sampling.of(cfg),
                                     samples_per_task=args.group_size, progress=False)
    points = branch.play_branches(cfg, engine, chat, episodes,
                                  branch.choose_points(episodes, cfg.branch_points_per_group))
    tally = {True: [0, 0, 0], False: [0, 0, 0]}  # some move can still win -> points, with a won branch, with a target
    for p in points:
        parent = episodes[p.parent]
        state = parent.task.clone()
        state.restore(parent.turns[p.turn].snapshot)
        row = tally[any(winnable_moves(state, p.actions, cfg.max_turns - p.turn))]
        row[0] += 1
        row[1] += any(r > 0 for r in p.returns)
        row[2] += p.best is not None
    print(f"{args.task} {args.difficulty}: {len(puzzles)} puzzles x {args.group_size}, {len(points)} points, "
          f"{cfg.branch_continuations} continuation(s) a move")
    for winnable, (count, won, targets) in tally.items():
        kind = "some move can still win" if winnable else "no move can still win"
        print(f"{kind}: {count} points, {won} with a winning branch, {targets} with a target")


if __name__ == "__main__":
    main()
