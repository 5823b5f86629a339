"""Which decisions does a policy get wrong? Its accuracy on the shortest path, by kind of turn.

    python experiments/forks.py --model runs/main/sft/model [--adapter runs/main/grpo/adapters/step_100] [--n 64]
    python experiments/forks.py --model runs/main/sft/model --training-mazes --n 128
    python experiments/forks.py --census [--difficulty small]       # no model: how common each kind is

Every turn of a maze's shortest path is one of three kinds:

  corridor   no other way on than the right one (going back where it came from aside)
  fork dN    another branch is open too, and the deepest of those wrong branches runs N cells
             before it ends: to rule it out from the fork a policy must look N cells down it
  stop       the agent stands on the goal

The policy is scored teacher-forced, as sft.py scores its held-out accuracy: the conversation is
the shortest path's own (same chat format, images and history as a real episode), and its top
action at each turn is compared with the solver's. Held-out mazes against training mazes tells
overfitting (right on the training mazes only) from underfitting (wrong on both), and the fork
depths tell how far down a branch the policy has learned to see.
"""

import argparse
import collections
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import rollout  # noqa: E402

from tasks.maze import ACTION_STRINGS, DIFFICULTY_SIZES, MOVE_DELTAS, STOP_ACTION, MazeTask, solve  # noqa: E402
from experiments.eval_policy import adapter_config, mazes_played  # noqa: E402


def open_neighbours(maze, cell) -> list:
    return [(cell[0] + dr, cell[1] + dc) for dr, dc in MOVE_DELTAS.values()
            if maze.is_open((cell[0] + dr, cell[1] + dc))]


def branch_depth(maze, cell, came_from) -> int:
    """Cells in the longest walk that enters at `cell` from `came_from` and never turns back.
    A perfect maze is a tree, so every such walk ends in a dead end (or passes the goal)."""
    return 1 + max((branch_depth(maze, nxt, cell) for nxt in open_neighbours(maze, cell) if nxt != came_from),
                   default=0)


def turn_kinds(maze) -> list[str]:
    """The kind of each turn of the maze's shortest path (solve), in order."""
    kinds, cell, previous = [], maze.start, None
    for action in solve(maze):
        if action == STOP_ACTION:
            kinds.append("stop")
            continue
        dr, dc = MOVE_DELTAS[ACTION_STRINGS.index(action)]
        nxt = (cell[0] + dr, cell[1] + dc)
        wrong = [other for other in open_neighbours(maze, cell) if other not in (nxt, previous)]
        kinds.append(f"fork d{max(branch_depth(maze, w, cell) for w in wrong)}" if wrong else "corridor")
        previous, cell = cell, nxt
    return kinds


def kind_order(kind: str):
    return (kind != "corridor", kind == "stop", int(kind[6:]) if kind.startswith("fork d") else 0)


def turn_accuracy(model_path: str, mazes: list, adapter: str = "") -> tuple[collections.Counter, collections.Counter]:
    """(right, total) per kind of turn: the model's (with `adapter`, a PEFT LoRA on it, such as a
    GRPO export) top action token against the solver's."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    import policy
    import sft

    chat = rollout.ChatFormat.for_model(model_path)
    model = Qwen3VLForConditionalGeneration.from_pretrained(model_path, dtype=torch.float32).eval()
    if adapter:
        from peft import PeftModel

        adapter_config(adapter)  # refuses a directory that is not an adapter
        model = PeftModel.from_pretrained(model, adapter).eval()
    right, total = collections.Counter(), collections.Counter()
    for maze in mazes:
        kinds = turn_kinds(maze)
        # the whole shortest path as one conversation (full history), its replies masked in
        task = MazeTask.of(maze, max_turns=len(kinds))
        answer_id = chat.action_prefix(task)[-1]  # the token right before the action
        sequences = sft.demonstration(task, chat, random.Random(0), max_images=None, noise=0.0)
        inputs, mask, _ = policy.Batch(sequences, chat.processor).micro([0], torch.device("cpu"))
        with torch.no_grad():
            logits = model(**inputs).logits[0, :-1]
        targets = inputs["input_ids"][0, 1:]
        at_action = ((mask[0] > 0) & (inputs["input_ids"][0, :-1] == answer_id)).nonzero().flatten().tolist()
        assert len(at_action) == len(kinds), "one action token per turn of the shortest path"
        for kind, position in zip(kinds, at_action):
            total[kind] += 1
            right[kind] += int(logits[position].argmax() == targets[position])
    return right, total


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="HF model directory (an SFT model, or a base model)")
    parser.add_argument("--adapter", default="", help="PEFT LoRA directory on top of the model (a GRPO export)")
    parser.add_argument("--difficulty", default="small", choices=list(DIFFICULTY_SIZES))
    parser.add_argument("--n", type=int, default=64, help="mazes: evaluation seeds 0..n-1, or the first n training mazes")
    parser.add_argument("--training-mazes", action="store_true", help="score the first n training mazes instead")
    parser.add_argument("--census", action="store_true", help="no model: count the kinds of turn only")
    args = parser.parse_args()
    if not args.census and not args.model:
        parser.error("give --model, or --census for the counts alone")

    which = "training" if args.training_mazes else "evaluation"
    mazes = [task.maze for task in mazes_played(args.difficulty, args.n, which)]
    if args.census:
        total = collections.Counter(kind for maze in mazes for kind in turn_kinds(maze))
        right = total
    else:
        right, total = turn_accuracy(args.model, mazes, args.adapter)
    print(f"{args.difficulty} {which} mazes ({len(mazes)}), {sum(total.values())} turns of their shortest paths"
          + ("" if args.census else ", teacher-forced accuracy per kind of turn") + ":")
    for kind in sorted(total, key=kind_order):
        print(f"  {kind:>9}: {total[kind]}" if args.census else
              f"  {kind:>9}: {right[kind]}/{total[kind]} ({100 * right[kind] / total[kind]:.1f}%)")


if __name__ == "__main__":
    main()
