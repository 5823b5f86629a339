"""Evaluate a policy (a model, optionally with a LoRA adapter) on a task's held-out puzzles, any level.

    python experiments/eval_policy.py --model runs/main/sft/model --adapter runs/main/grpo/adapters/step_60 \
        --difficulty easy --out runs/main/generalisation_easy.json

Greedy play of the fixed held-out puzzles through the same chat path as train.py's evaluation
and `serve.py eval` (evaluation.play_chat_episodes), here with an in-process vLLM engine. Used for
the generalisation check: a policy trained on one maze size, played on another.

`--training-mazes` plays the first n puzzles of the training stream instead (the ones GRPO and SFT
drew from). Held-out and training solve rates side by side tell overfitting (better on the
training mazes) from not learning at all (no better there either).
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import evaluation  # noqa: E402
import rollout  # noqa: E402
import vllm_engine  # noqa: E402

import env  # noqa: E402
import tasks  # noqa: E402


def adapter_config(adapter: str) -> dict:
    """The adapter_config.json of a PEFT adapter directory; anything else is refused clearly."""
    config_file = Path(adapter) / "adapter_config.json"
    if not config_file.exists():
        raise SystemExit(f"{adapter} is not a PEFT adapter directory (no adapter_config.json)")
    return json.loads(config_file.read_text())


def load_policy(model: str, adapter: str, max_turns: int):
    """An in-process vLLM engine for `model`, the LoRARequest for `adapter` (None if empty) and the
    model's chat format. A path that is not a PEFT adapter is refused before anything loads."""
    rank = adapter_config(adapter)["r"] if adapter else 8
    engine = vllm_engine.build_engine(model, max_model_len=4096, max_lora_rank=rank, seed=0, max_images=max_turns + 1)
    lora_request = None
    if adapter:
        from vllm.lora.request import LoRARequest

        lora_request = LoRARequest("policy", 1, str(Path(adapter).resolve()))
    return engine, lora_request, rollout.ChatFormat.for_model(model)


def mazes_played(difficulty: str, n: int, which: str = "evaluation", task: str = "maze", max_turns: int = 15) -> list:
    """The puzzles a result's `mazes_played` names: the first n held-out or training ones, as tasks."""
    task_class = tasks.task_class(task)
    if which == "training":
        return env.TrainingStream(task_class, difficulty, max_turns).first(n)
    return env.held_out(task_class, difficulty, n, max_turns)


def policy_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The policy to play and the held-out mazes to play it on (shared with experiments/diagnose.py)."""
    parser.add_argument("--model", required=True, help="HF model directory or id")
    parser.add_argument("--adapter", default="", help="PEFT LoRA directory; empty: the model alone")
    parser.add_argument("--task", default="maze", help="the task (train.py's --task)")
    parser.add_argument("--difficulty", default="small", help="the task's level")
    parser.add_argument("--n", type=int, default=64, help="held-out puzzles (seeds 0..n-1)")
    parser.add_argument("--max-turns", type=int, default=15)
    return parser


def main():
    parser = policy_arguments(argparse.ArgumentParser(description=__doc__,
                                                      formatter_class=argparse.RawDescriptionHelpFormatter))
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--max-images", type=int, default=0, help="0: full image history")
    parser.add_argument("--out", default="", help="write the per-maze results here (JSON)")
    parser.add_argument("--training-mazes", action="store_true",
                        help="play the first n training mazes (never an evaluation layout) instead")
    args = parser.parse_args()

    engine, lora_request, chat = load_policy(args.model, args.adapter, args.max_turns)
    replies = evaluation.engine_replies(engine, lora_request, args.max_new_tokens, chat.banned_token_ids)
    which = "training" if args.training_mazes else "evaluation"
    mazes = mazes_played(args.difficulty, args.n, which, args.task, args.max_turns)
    episodes = evaluation.play_chat_episodes(
        mazes, replies, max_images=args.max_images or None, desc=f"{which} {args.difficulty}")
    solved = sum(e.solved for e in episodes)
    result = evaluation.eval_result(evaluation.eval_rows(episodes, list(range(len(episodes)))),
                                    args.max_turns, model=args.model, adapter=args.adapter, task=args.task,
                                    difficulty=args.difficulty, mazes_played=which)
    print(f"{args.difficulty} {which} mazes: solved {solved}/{len(episodes)}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, out)


if __name__ == "__main__":
    main()
