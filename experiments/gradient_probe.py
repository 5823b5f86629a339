"""What gradient does GRPO's signal give each decision, against what one demonstration gives?

    python experiments/gradient_probe.py --model runs/main/sft/model [--n 64] [--out docs/results/gradient_probe.json]

On the teacher-forced shortest path of each of the first n training mazes that fit the turn limit
(3 of the first 64 do not: their shortest path takes 17 turns), the conversation a demonstration
has (full history, as sft.py and experiments/forks.py build it), at every action
token (the one right after `<answer>`), with the gradient restricted to the LoRA parameters of
the main job's adapter (rank 8, alpha 16, the language model's projections; at PEFT's start, B = 0,
the adapter of a first GRPO step; or `--adapter`, a trained one):

  sft           grad log pi_1(a*)  : one demonstration's gradient (sft.py trains at T = 1)
  pg_exact      sum_a pi_T(a) A*(a) grad log pi_T(a),  A*(a) = Q*(a) - sum_b pi_T(b) Q*(b)
                the exact expected on-policy gradient at that state, with an oracle advantage
  grpo8_exact   E[ (1/G) sum_i A_i grad log pi_T(a_i) ] over groups of G = 8 moves a_i ~ pi_T,
                A_i = (Q*(a_i) - mean) / (std + eps) and 0 when all G are equal (grpo.group_advantages):
                the expectation of GRPO's own estimator, by enumerating the multinomial counts
  grpo8_a, _b   two independent draws of that estimator (what one GRPO step sees there)
  branch        sum over the open moves a (and the stop, on the goal) of A_u(a) grad log pi_T(a), A_u the oracle values
                centred and std-normalised over those moves with equal weight: every open move
                played from that very state (a branch rollout), no pi(a) factor
  branch_best   grad log pi_T(the branch that returned most): cross-entropy toward the winning
                branch, which saturates where the policy already agrees with it

Q*(s, a) is the maze's true value of playing a and then the shortest path within the turn limit:
gamma^(k) for a rewarded stop k turns after a (gamma the main job's 0.95), 0 for a stop off the
goal or when the goal can no longer be reached in time; a bump spends the turn in place. The
discount is what tells a detour from the shortest path: undiscounted, most wrong moves can still be
recovered within 15 turns, and their true advantage would be 0.

Every one of these is a combination of seven vectors per state, the gradients of the five action
logits and of the two softmax expectations E_pi_T[z] and E_pi_1[z] (grad log pi_T(a) =
(grad z_a - grad E_pi_T[z]) / T), so each state costs seven backward passes through one shared
forward. Reported over all turns, corridors, forks (another open way than the right one and back)
and the forks the greedy policy gets wrong: per-state median cosine and norm ratio against sft,
and for the set's summed gradient the cosine and norm ratio, and the "wrong-fork gain", the
first-order rise of sum log pi_1(a*) over the wrong forks for a unit step along the direction of
the update summed over ALL turns (what one update of a batch with every turn in it does for them;
Adam and clipping take most of the scale out, the direction stays).
"""

import argparse
import itertools
import json
import math
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import rollout  # noqa: E402
import vllm_engine  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import env  # noqa: E402
from tasks.maze import (ACTION_STRINGS, DIFFICULTY_SIZES, MOVE_DELTAS, STOP_ACTION, MazeTask, goal_distances,  # noqa: E402
                        solve)
from experiments.forks import turn_kinds  # noqa: E402

KINDS = ("sft", "pg_exact", "grpo8_exact", "grpo8_a", "grpo8_b", "branch", "branch_best")
SETS = ("all", "corridor", "fork", "wrong_fork")


# ----------------------------------------------------------------------------- the oracle

def oracle_values(maze, cell, turns_taken: int, max_turns: int, gamma: float) -> np.ndarray:
    """Q*(s, a) for the five actions (ACTION_STRINGS order) with the agent on `cell` after
    `turns_taken` turns: play a, then the shortest path and stop; gamma^(turns after a) if the stop
    lands within the turn limit, else 0."""
    distance = goal_distances(maze)
    left = max_turns - turns_taken - 1  # turns still to play once a is played
    q = np.zeros(len(ACTION_STRINGS))
    for move, (dr, dc) in MOVE_DELTAS.items():
        target = (cell[0] + dr, cell[1] + dc)
        after = target if maze.is_open(target) else cell  # a bump spends the turn in place
        needed = distance[after] + 1  # its moves, then the stop
        q[move] = gamma ** needed if needed <= left else 0.0
    q[ACTION_STRINGS.index(STOP_ACTION)] = 1.0 if tuple(cell) == tuple(maze.goal) else 0.0
    return q


def path_states(maze) -> list[dict]:
    """Each turn of the shortest path: the cell, turns taken, kind (experiments/forks.py), right action."""
    states, cell = [], tuple(maze.start)
    for t, (action, kind) in enumerate(zip(solve(maze), turn_kinds(maze))):
        right = ACTION_STRINGS.index(action)
        open_moves = [m for m, (dr, dc) in MOVE_DELTAS.items() if maze.is_open((cell[0] + dr, cell[1] + dc))]
        states.append({"cell": cell, "turn": t, "kind": kind, "right": right, "open_moves": open_moves})
        if action != STOP_ACTION:
            dr, dc = MOVE_DELTAS[right]
            cell = (cell[0] + dr, cell[1] + dc)
    return states


# ----------------------------------------------------------------------------- estimators as coefficients

# A state's gradients live in the span of seven vectors: grad z_a for the five actions (rows 0-4),
# grad E_pi_T[z] (row 5) and grad E_pi_1[z] (row 6). Each estimator is a coefficient vector over them.

def grad_log_pi(action: int, temperature: float) -> np.ndarray:
    """Coefficients of grad log pi_T(action) = (grad z_a - grad E_pi_T[z]) / T (T = 1 uses row 6)."""
    c = np.zeros(7)
    c[action] = 1.0 / temperature
    c[5 if temperature != 1.0 else 6] = -1.0 / temperature
    return c


def group_advantage(rewards: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """grpo.group_advantages for one group: (r - mean) / (sample std + eps); 0 if all are equal."""
    if rewards.max() == rewards.min():
        return np.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std(ddof=1) + eps)


def grpo_coefficients(counts: np.ndarray, q: np.ndarray, temperature: float) -> np.ndarray:
    """(1/G) sum_i A_i grad log pi_T(a_i) for a group holding counts[a] draws of each action a."""
    moves = np.repeat(np.arange(len(counts)), counts)
    adv = group_advantage(q[moves])
    return sum(a * grad_log_pi(int(m), temperature) for a, m in zip(adv, moves)) / len(moves)


def compositions(total: int, parts: int):
    """Every way of putting `total` draws into `parts` bins (stars and bars)."""
    for bars in itertools.combinations(range(total + parts - 1), parts - 1):
        edges = (-1, *bars, total + parts - 1)
        yield np.array([edges[i + 1] - edges[i] - 1 for i in range(parts)])


def estimator_coefficients(q: np.ndarray, pi_t: np.ndarray, right: int, open_moves: list, temperature: float,
                           group: int, rng: np.random.Generator) -> dict:
    """Every estimator of the module docstring, as coefficients over the seven vectors. pi_t: the
    five actions' probabilities at T, renormalised over them (the rest of the vocabulary holds
    ~0 of the mass after SFT; its share is reported)."""
    out = {"sft": grad_log_pi(right, 1.0)}
    advantage = q - pi_t @ q  # A*, centred under pi_T
    out["pg_exact"] = sum(pi_t[a] * advantage[a] * grad_log_pi(a, temperature) for a in range(len(q)))
    expected = np.zeros(7)
    log_pi = np.log(np.clip(pi_t, 1e-300, None))
    for counts in compositions(group, len(q)):
        log_prob = (math.lgamma(group + 1) - sum(math.lgamma(c + 1) for c in counts)
                    + sum(c * lp for c, lp in zip(counts, log_pi) if c))
        if log_prob > -60:  # beyond that the term is below 1e-26 of the mass
            expected += math.exp(log_prob) * grpo_coefficients(counts, q, temperature)
    out["grpo8_exact"] = expected
    for name in ("grpo8_a", "grpo8_b"):
        out[name] = grpo_coefficients(rng.multinomial(group, pi_t), q, temperature)
    stop = len(q) - 1
    branches = open_moves + ([stop] if q[stop] > 0 else [])  # the stop too where it is the answer
    branch_adv = group_advantage(q[branches]) if len(branches) > 1 else np.zeros(len(branches))
    out["branch"] = sum(a * grad_log_pi(m, temperature) for a, m in zip(branch_adv, branches))
    out["branch_best"] = grad_log_pi(max(branches, key=lambda m: q[m]), temperature)
    return out


# ----------------------------------------------------------------------------- the model side

def lora_policy(model_path: str, adapter: str = "", rank: int = 8, seed: int = 0):
    """The warm start with the main job's LoRA (train.py's wrap_policy, without FSDP): fp32, eval
    mode (no dropout anyway), only the adapter trainable."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(model_path, dtype=torch.float32)
    if adapter:
        model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
    else:
        torch.manual_seed(seed)  # PEFT draws A at random, as train.py does with --seed
        model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=vllm_engine.LORA_TARGET_REGEX))
    return model.eval()


def state_vectors(model, chat, maze, temperature: float, max_turns: int):
    """Per action token of the maze's shortest path: the [7, P] gradient basis (module docstring),
    the five actions' probabilities at T and at 1, and their share of the vocabulary at T."""
    import policy
    import sft

    task = MazeTask.of(maze, max_turns=max_turns)
    reply_ids = {a: chat.reply_ids(task, a) for a in ACTION_STRINGS}
    answer_id = chat.action_prefix(task)[-1]
    action_ids = [reply_ids[a][reply_ids[a].index(answer_id) + 1] for a in ACTION_STRINGS]
    sequences = sft.demonstration(task, chat, random.Random(0), max_images=None, noise=0.0)
    inputs, mask, _ = policy.Batch(sequences, chat.processor, model).micro([0], torch.device("cpu"))
    params = [p for p in model.parameters() if p.requires_grad]
    logits = model(**inputs).logits[0, :-1]
    positions = ((mask[0] > 0) & (inputs["input_ids"][0, :-1] == answer_id)).nonzero().flatten().tolist()
    assert all(int(inputs["input_ids"][0, p + 1]) in action_ids for p in positions), "action tokens"
    out = []
    for position in positions:
        z = logits[position]
        pi_t_full = torch.softmax(z.detach() / temperature, -1)
        pi_1_full = torch.softmax(z.detach(), -1)
        scalars = [z[i] for i in action_ids] + [(pi_t_full * z).sum(), (pi_1_full * z).sum()]
        rows = []
        for s in scalars:
            grads = torch.autograd.grad(s, params, retain_graph=True)
            rows.append(torch.cat([g.reshape(-1) for g in grads]).double().numpy())
        pi_t = pi_t_full[action_ids].double().numpy()
        pi_1 = pi_1_full[action_ids].double().numpy()
        out.append({"basis": np.stack(rows), "pi_t": pi_t / pi_t.sum(), "pi_1": pi_1 / pi_1.sum(),
                    "action_mass_t": float(pi_t.sum())})
    return out


# ----------------------------------------------------------------------------- the probe

def cosine(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return float(a @ b / (na * nb)) if na > 0 and nb > 0 else 0.0


def probe(model, chat, mazes: list, *, temperature: float = 0.5, gamma: float = 0.95, max_turns: int = 15,
          group: int = 8, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    rows = []  # per state: its set memberships, p(right), and the estimators' gradient vectors
    for maze in mazes:
        states = path_states(maze)
        vectors = state_vectors(model, chat, maze, temperature, max_turns)
        assert len(states) == len(vectors), "one action token per turn of the shortest path"
        for s, v in zip(states, vectors):
            q = oracle_values(maze, s["cell"], s["turn"], max_turns, gamma)
            coefficients = estimator_coefficients(q, v["pi_t"], s["right"], s["open_moves"], temperature, group, rng)
            greedy_right = int(np.argmax(v["pi_1"])) == s["right"]
            sets = ["all", "corridor" if s["kind"] == "corridor" else "fork" if s["kind"].startswith("fork") else "stop"]
            if sets[1] == "fork" and not greedy_right:
                sets.append("wrong_fork")
            rows.append({"sets": sets, "p_right_t": float(v["pi_t"][s["right"]]), "greedy_right": greedy_right,
                         "action_mass_t": v["action_mass_t"], "q_spread": float(q.max() - q.min()),
                         "grads": {k: c @ v["basis"] for k, c in coefficients.items()}})
    summed_all = {k: sum(r["grads"][k] for r in rows if "all" in r["sets"]) for k in KINDS}
    wrong = [r for r in rows if "wrong_fork" in r["sets"]]
    report = {"temperature": temperature, "gamma": gamma, "max_turns": max_turns, "group_size": group,
              "mazes": len(mazes), "lora_parameters": int(rows[0]["grads"]["sft"].size) if rows else 0,
              "min_action_mass_t": min((r["action_mass_t"] for r in rows), default=1.0), "sets": {}}
    for name in SETS:
        members = [r for r in rows if name in r["sets"]]
        if not members:
            report["sets"][name] = {"states": 0}
            continue
        sft_sum = sum(r["grads"]["sft"] for r in members)
        entry = {"states": len(members), "mean_p_right_t": float(np.mean([r["p_right_t"] for r in members])),
                 "greedy_right": sum(r["greedy_right"] for r in members), "kinds": {}}
        for k in KINDS:
            summed = sum(r["grads"][k] for r in members)
            per_cos = [cosine(r["grads"][k], r["grads"]["sft"]) for r in members]
            per_ratio = [np.linalg.norm(r["grads"][k]) / max(np.linalg.norm(r["grads"]["sft"]), 1e-30) for r in members]
            direction = summed_all[k] / max(np.linalg.norm(summed_all[k]), 1e-30)
            entry["kinds"][k] = {
                "per_state_median_cos_to_sft": float(np.median(per_cos)),
                "per_state_median_norm_ratio_to_sft": float(np.median(per_ratio)),
                "per_state_mean_norm_ratio_to_sft": float(np.mean(per_ratio)),
                "zero_frac": float(np.mean([not r["grads"][k].any() for r in members])),
                "summed_cos_to_sft": cosine(summed, sft_sum),
                "summed_norm_ratio_to_sft": float(np.linalg.norm(summed) / max(np.linalg.norm(sft_sum), 1e-30)),
                # first-order rise of sum log pi_1(a*) over this set for a unit step along the update
                # summed over all turns
                "gain_per_unit_step": float(sum(r["grads"]["sft"] @ direction for r in members)),
            }
        for k in ("grpo8_a",):
            entry["kinds"][k]["per_state_median_cos_a_b"] = float(np.median(
                [cosine(r["grads"]["grpo8_a"], r["grads"]["grpo8_b"]) for r in members]))
            entry["kinds"][k]["per_state_median_cos_to_exact"] = float(np.median(
                [cosine(r["grads"]["grpo8_a"], r["grads"]["grpo8_exact"]) for r in members]))
            entry["kinds"][k]["summed_cos_a_b"] = cosine(sum(r["grads"]["grpo8_a"] for r in members),
                                                         sum(r["grads"]["grpo8_b"] for r in members))
        sft_gain = entry["kinds"]["sft"]["gain_per_unit_step"]
        for k in KINDS:
            entry["kinds"][k]["gain_relative_to_sft"] = (entry["kinds"][k]["gain_per_unit_step"] / sft_gain
                                                         if sft_gain else 0.0)
        report["sets"][name] = entry
    report["wrong_fork_p_right_t"] = sorted(round(r["p_right_t"], 4) for r in wrong)
    return report


def print_report(report: dict):
    print(f"{report['mazes']} mazes, T {report['temperature']}, gamma {report['gamma']}, groups of "
          f"{report['group_size']}, {report['lora_parameters']} LoRA parameters "
          f"(least action mass at T: {report['min_action_mass_t']:.6f})")
    for name, entry in report["sets"].items():
        if not entry["states"]:
            print(f"{name}: no states")
            continue
        print(f"{name}: {entry['states']} states, greedy right {entry['greedy_right']}, "
              f"mean p(right) at T {entry['mean_p_right_t']:.3f}")
        print(f"  {'estimator':>12} {'cos/state':>9} {'ratio/state':>11} {'zero':>5} {'cos sum':>8} {'ratio sum':>9} "
              f"{'gain vs sft':>11}")
        for k, m in entry["kinds"].items():
            print(f"  {k:>12} {m['per_state_median_cos_to_sft']:9.3f} {m['per_state_median_norm_ratio_to_sft']:11.4f} "
                  f"{m['zero_frac']:5.2f} {m['summed_cos_to_sft']:8.3f} {m['summed_norm_ratio_to_sft']:9.4f} "
                  f"{m['gain_relative_to_sft']:11.4f}")
        g = entry["kinds"]["grpo8_a"]
        print(f"  two 8-sample draws: median cos(a, b) per state {g['per_state_median_cos_a_b']:.3f}, summed "
              f"{g['summed_cos_a_b']:.3f}; median cos(a, exact) {g['per_state_median_cos_to_exact']:.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the warm start (HF model directory)")
    parser.add_argument("--adapter", default="", help="a trained PEFT LoRA to probe at; empty: a fresh one (B = 0)")
    parser.add_argument("--n", type=int, default=64,
                        help="the first n training mazes whose shortest path (stop included) fits --max-turns")
    parser.add_argument("--difficulty", default="small", choices=list(DIFFICULTY_SIZES))
    parser.add_argument("--temperature", type=float, default=0.5, help="the training temperature")
    parser.add_argument("--gamma", type=float, default=0.95)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="write the report here (JSON)")
    args = parser.parse_args()
    if not (args.temperature > 0 and 0 < args.gamma <= 1 and args.group_size >= 2 and args.n >= 1):
        parser.error("need --temperature > 0, --gamma in (0, 1], --group-size >= 2, --n >= 1")

    import policy

    model_path = policy.resolve_model(args.model, collective=False)
    chat = rollout.ChatFormat.for_model(model_path)
    model = lora_policy(model_path, args.adapter, seed=args.seed)
    mazes, skipped, stream = [], 0, env.TrainingStream(MazeTask, args.difficulty)
    while len(mazes) < args.n:  # the first n training mazes whose shortest path fits the turn limit
        maze = stream.next().maze
        if len(solve(maze)) <= args.max_turns:
            mazes.append(maze)
        else:
            skipped += 1
    report = probe(model, chat, mazes, temperature=args.temperature, gamma=args.gamma, max_turns=args.max_turns,
                   group=args.group_size, seed=args.seed)
    report.update(model=args.model, adapter=args.adapter, difficulty=args.difficulty, mazes_played="training",
                  skipped_too_long=skipped)
    print_report(report)
    if args.out:
        import storage

        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        storage.atomic_write_text(out, json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
