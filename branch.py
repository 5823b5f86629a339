"""Branch rollouts: at the forks a group passed, play every open move and train toward the best.

GRPO learns a fork only when its group happens to disagree there, and it learns it least where the
policy is confidently wrong: if all 8 members take the same wrong way, the fork gets exactly
nothing (docs/experiments.md, "Step 1 of the fork-signal issue": 23-31% of the wrong forks).
Branching makes the comparison on purpose. After a step's groups are played:

    1. points    per group, up to K states (`branch_points_per_group`) where its members made a
                 decision: a fork (a cell with another open way than in and out; the start: more
                 than one), the goal (stop, or walk on), or a cell where a member stopped off the
                 goal (a premature stop: walk on). Those where the group disagreed or failed come
                 first, then the earlier ones. Each is taken from the member that reached it first.
    2. branches  from that member's exact prefix (its conversation up to the fork, token for token,
                 and its env restored to that state, rollout.Episode.prefix + env.MazeEnv.restore),
                 every open move (and stop on the goal) is forced as the fork's reply, and the
                 policy finishes each branch at the training temperature with the same turn limit.
    3. returns   G(a) = gamma^k R: R the strict reward of branch a, k its turns after the fork (the
                 discount of the step-level term, so a detour that still arrives is worth less).
    4. target    a* = argmax_a G(a), unless the best is tied (every branch failed, say): then none.
                 The fork state with a*'s reply is one extra training row whose only trained tokens
                 are that reply, with advantage w (`branch_weight`): grpo.branch_target_advantages
                 has the loss, L = -w log pi_T(a* | s), a cross-entropy toward the winning branch.

Why a cross-entropy and not an advantage per branch: its gradient, (e_a* - pi_T) dz / T, vanishes
once the policy agrees with the branches, so it spends the update on the forks the policy gets
wrong. The probe found weighting every forced move alike (sum_a A(a) grad log pi(a)) keeps
pushing moves the policy has already ruled out and, summed over a batch, lowers the right move at
the wrong forks (-0.37x SFT's gain there, against 1.36x for this form). The branches continue
with the policy, not the solver, so G(a) is noisy where the policy errs later: the right move can
lose to a wrong one that the policy happens to recover from, and then no target or a wrong one.

Cost: each point plays one episode per open move (2-4 on a 7x7 maze), from the fork to the end,
all batched into one play_turns loop; the forced reply is not an engine call. The step reports
what it played (branch_* metrics: points, targets, branches, extra engine turns and generated
tokens); bench/visit_cost.py counts it per visit.
"""

import time
from dataclasses import dataclass

import env
import grpo
import rollout
import visgym

# Branches draw from their own seed stream (a run seed of seed + this), so that a branch's samples
# are never the parent group's own samples repeated.
BRANCH_SEED_OFFSET = 7_919


@dataclass
class BranchPoint:
    parent: int  # index of the episode whose prefix is replayed, among the step's episodes
    turn: int  # the fork's turn in that episode: its reply `turn` is the one forced
    moves: list  # the forced actions (env.ACTION_STRINGS), one per branch
    branches: list  # the played branch episodes, in the order of `moves`
    returns: list  # G(a) = gamma^k R of each branch
    best: int | None  # index into moves of a*; None where the best return is tied


def branch_moves(maze, cell) -> list[str]:
    """The moves worth a branch from `cell`: every move into an open cell, and stop on the goal."""
    moves = [env.ACTION_STRINGS[m] for m, (dr, dc) in env.MOVE_DELTAS.items()
             if maze.is_open((cell[0] + dr, cell[1] + dc))]
    return moves + [env.STOP_ACTION] if tuple(cell) == tuple(maze.goal) else moves


def is_optimal(maze, cell, move: str) -> bool:
    """Whether `move` from `cell` is on a shortest way to the goal (stop: only on the goal)."""
    if move == env.STOP_ACTION:
        return tuple(cell) == tuple(maze.goal)
    dr, dc = env.MOVE_DELTAS[env.ACTION_STRINGS.index(move)]
    distance = env.goal_distances(maze)
    return distance.get((cell[0] + dr, cell[1] + dc), -1) == distance[tuple(cell)] - 1


def is_fork(maze, cell) -> bool:
    """Whether a decision is made at `cell`: another open way than the one in and the one out
    (at the start, which has no way in: more than one way out), or the goal (stop or walk on)."""
    ways = len(branch_moves(maze, cell))
    return tuple(cell) == tuple(maze.goal) or ways >= 3 or (tuple(cell) == tuple(maze.start) and ways >= 2)


def choose_points(episodes: list, per_group: int) -> list[tuple[int, int]]:
    """Up to `per_group` (episode index, turn) pairs per group: the fork cells its members passed
    and the cells where one stopped off the goal; those where they disagreed (took different
    replies there) or where one of them failed first, then by the earliest turn any member reached
    them; each from the first member to get there."""
    groups = {}
    for i, e in enumerate(episodes):
        groups.setdefault(e.group_id, []).append(i)
    points = []
    for members in groups.values():
        cells = {}  # cell -> [earliest (turn, episode), replies given there, did a visitor fail]
        for i in members:
            e = episodes[i]
            stopped_off_goal = e.end_reason == "stop" and not e.solved
            for t, turn in enumerate(e.played):
                if not (is_fork(e.maze, turn.cell) or (stopped_off_goal and t == e.num_turns - 1)):
                    continue
                visits = cells.setdefault(turn.cell, [(t, i), set(), False])
                visits[0] = min(visits[0], (t, i))
                visits[1].add(turn.reply)
                visits[2] |= not e.solved
        ranked = sorted(cells.values(), key=lambda c: (not (len(c[1]) > 1 or c[2]), c[0]))
        points += [(i, t) for (t, i), _, _ in ranked[:per_group]]
    return points


def play_branches(cfg, engine, chat: rollout.ChatFormat, episodes: list, points: list, lora_request=None,
                  progress: bool = False) -> list[BranchPoint]:
    """Every branch of every point, played to the end in one batched turn loop (rollout.play_turns)."""
    reply_ids, _ = chat.reply_tokens()
    max_turns, env_settings = cfg.max_turns, visgym.EnvSettings.of(cfg)
    found, branches, games, forced = [], [], [], []
    for i, t in points:
        parent = episodes[i]
        fork = parent.turns[t].cell
        moves = branch_moves(parent.maze, fork)
        for m, move in enumerate(moves):
            branch = parent.prefix(t, (parent.sample_id * max_turns + t) * len(env.ACTION_STRINGS) + m)
            game = env_settings.make(parent.maze)
            game.restore(fork, t, parent.cells_vacated(t))
            branches.append(branch)
            games.append(game)
            forced.append([reply_ids[move]])
        found.append(BranchPoint(i, t, moves, [], [], None))
    rollout.play_turns(engine, chat, branches, games, forced, rollout.Sampling.of(cfg, seed=cfg.seed + BRANCH_SEED_OFFSET),
                       lora_request=lora_request, desc="branches", progress=progress)
    played = iter(branches)
    for point in found:
        point.branches = [next(played) for _ in point.moves]
        point.returns = [grpo.branch_return(b.num_turns - point.turn, b.reward, cfg.gamma) for b in point.branches]
        point.best = grpo.best_branch(point.returns)
    return found


def target_sequence(branch: rollout.Episode, turn: int, chat: rollout.ChatFormat,
                    max_images: int | None) -> rollout.Sequence:
    """The branch's training sequence through its forced reply (reply `turn`), with only that
    reply trained: the fork state as the parent saw it, and the best move as its answer."""
    return rollout.training_sequences(branch, chat, max_images, trained={turn}, through=turn)[-1]


def branch_step(cfg, engine, chat: rollout.ChatFormat, episodes: list, lora_request=None,
                progress: bool = False) -> tuple[list, dict]:
    """The branch rollouts of one training step: the extra Experiences (one per point with a
    target, hung on its parent episode's index, so they go to that episode's mini-batch) and the
    step's branch metrics. Nothing (and no engine call) when branch_points_per_group is 0."""
    if not cfg.branch_points_per_group:
        return [], {}
    start = time.time()
    points = play_branches(cfg, engine, chat, episodes, choose_points(episodes, cfg.branch_points_per_group),
                           lora_request, progress)
    max_images = cfg.max_images or None
    experiences = []
    for p in points:
        if p.best is None:
            continue
        seq = target_sequence(p.branches[p.best], p.turn, chat, max_images)
        experiences.append(grpo.Experience(seq, grpo.branch_target_advantages(seq.response_mask, cfg.branch_weight),
                                             p.parent))
    played = [b for p in points for b in p.branches]
    targets = [p for p in points if p.best is not None]
    return experiences, {
        "branch_points": len(points),
        "branch_targets": len(targets),
        # the share of targets the maze's solver agrees with: a target comes from one continuation
        # per move, so the worse move can look better once; this says how often it did
        "branch_targets_optimal_frac": (sum(is_optimal(episodes[p.parent].maze, episodes[p.parent].turns[p.turn].cell,
                                                       p.moves[p.best]) for p in targets) / len(targets)
                                        if targets else 1.0),
        "branch_episodes": len(played),
        # the forced reply is not an engine turn; every later reply of a branch is
        "branch_engine_turns": sum(b.num_turns - p.turn - 1 for p in points for b in p.branches),
        "branch_generated_tokens": sum(len(turn.reply_ids) for p in points for b in p.branches
                                       for turn in b.played[p.turn + 1:]),
        "branch_solve_rate": sum(b.solved for b in played) / max(len(played), 1),
        "branch_s": time.time() - start,
        # how often the winning move is not the one the parent made there: a correction, not a repeat
        "branch_target_differs_frac": sum(env.parse_action(p.moves[p.best])
                                          != env.parse_action(episodes[p.parent].replies[p.turn]) for p in targets)
        / max(len(targets), 1),
    }
