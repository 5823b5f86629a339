"""Where does a greedy policy fail? Replay the held-out mazes with two rules bolted on.

    python experiments/diagnose.py --model runs/main/sft/model [--adapter DIR] [--difficulty small]

The policy's greedy choice is its highest-scoring action (vLLM log-probs of the action token).
Each variant then overrides it only where a rule says so, falling back to the policy's ranking:

  greedy     the policy alone (the number train.py's evaluation reports)
  no-repeat  never make a move the episode already made from the same cell (depth-first search
             with the policy's preferences: a loop becomes a new branch)
  no-wall    never push into a wall (perfect perception of the agent's four neighbours)
  both       both rules

If "no-repeat" solves many more mazes, the policy's failures are loops, which a learner can fix
with memory of the episode; if it does not, they are wrong turns that use up the 15 turns, i.e.
planning on layouts it has never seen. The rules are oracles for diagnosis, never used to train.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import evaluation  # noqa: E402

from tasks.maze import ACTION_STRINGS, INSTRUCTIONS, MOVE_DELTAS, STOP_ACTION, MazeTask, eval_mazes, parse_action  # noqa: E402
from experiments.eval_policy import load_policy, policy_arguments  # noqa: E402

VARIANTS = ("greedy", "no-repeat", "no-wall", "both")


def blocked(maze, cell, action: str) -> bool:
    parsed = parse_action(action)
    if parsed is None or parsed[0] != "move":
        return False
    dr, dc = MOVE_DELTAS[parsed[1]]
    return not maze.is_open((cell[0] + dr, cell[1] + dc))


def play(engine, lora_request, chat, mazes, variant: str, max_turns: int) -> list[bool]:
    from vllm import SamplingParams

    # two tokens: `<answer>`, then the action token, whose top log-probs rank the actions
    params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=20,
                            logit_bias={t: -100.0 for t in chat.banned_token_ids} or None)
    action_of = {chat.tokenizer.convert_tokens_to_ids(a): a for a in ACTION_STRINGS}
    games = [MazeTask.of(m, max_turns=max_turns) for m in mazes]
    first = [g.reset() for g in games]
    conversations = [[evaluation.chat_user_message(INSTRUCTIONS + "\n" + obs.text, obs.image)] for obs in first]
    made = [{} for _ in mazes]  # per episode: cell -> moves already made from it
    while active := [i for i, g in enumerate(games) if not g.done]:
        outputs = engine.chat([conversations[i] for i in active], params, lora_request=lora_request, use_tqdm=False)
        for i, out in zip(active, outputs):
            maze, cell = mazes[i], games[i].agent
            top = out.outputs[0].logprobs[1] if len(out.outputs[0].logprobs) > 1 else {}
            ranked = [action_of[t] for t, _ in sorted(top.items(), key=lambda kv: -kv[1].logprob) if t in action_of]
            choices = ranked or [STOP_ACTION]
            if variant in ("no-wall", "both"):
                choices = [a for a in choices if not blocked(maze, cell, a)] or choices
            if variant in ("no-repeat", "both"):
                choices = [a for a in choices if a not in made[i].get(cell, set())] or choices
            action = choices[0]
            made[i].setdefault(cell, set()).add(action)
            reply = f"<answer>{action}</answer>"
            obs = games[i].step(reply)  # moves games[i].agent
            conversations[i].append({"role": "assistant", "content": reply})
            if not games[i].done:
                conversations[i].append(evaluation.chat_user_message(obs.text, obs.image))
    return [g.solved for g in games]


def main():
    parser = policy_arguments(argparse.ArgumentParser(description=__doc__,
                                                      formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args()

    engine, lora_request, chat = load_policy(args.model, args.adapter, args.max_turns)
    mazes = eval_mazes(args.difficulty, args.n)
    for variant in VARIANTS:
        solved = play(engine, lora_request, chat, mazes, variant, args.max_turns)
        print(f"{variant:>9}: solved {sum(solved)}/{len(mazes)}", flush=True)


if __name__ == "__main__":
    main()
