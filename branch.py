"""Branch rollouts: at the decision points a group passed, play every legal action and train toward the best.

GRPO learns a decision only when its group happens to disagree there, and it learns it least where
the policy is confidently wrong: if all 8 members make the same wrong choice, the state gets
exactly nothing. Branching makes the comparison on purpose. After a step's groups are played:

    1. points    per group, up to K states (`branch_points_per_group`) where its members made a
                 choice that matters (Task.is_decision_point), or where a member ended the episode
                 unsolved (a premature stop). Those where the group disagreed or failed come first,
                 then the earlier ones. Each is taken from the member that reached it first.
    2. branches  from that member's exact prefix (its conversation up to the point, token for token,
                 and its task restored to that state: rollout.Episode.prefix, Task.restore), every
                 legal action (Task.legal_actions) is forced as the reply there, and the policy
                 finishes each branch at the training temperature with the same turn limit.
    3. returns   G(a) = gamma^k R: R the strict reward of branch a, k its turns after the point (the
                 discount of the step-level term, so a detour that still arrives is worth less).
    4. target    a* = argmax_a G(a), unless the best is tied (every branch failed, say): then none.
                 The point's state with a*'s reply is one extra training row whose only trained
                 tokens are that reply, with advantage w (`branch_weight`): grpo.branch_target_advantages
                 has the loss, L = -w log pi_T(a* | s), a cross-entropy toward the winning branch.

Why a cross-entropy and not an advantage per branch: its gradient, (e_a* - pi_T) dz / T, vanishes
once the policy agrees with the branches, so it spends the update on the states the policy gets
wrong; an advantage on every forced action keeps pushing actions the policy has already ruled out
(docs/experiments.md has the measurement). The branches continue with the policy, not a solver, so
G(a) is noisy where the policy errs later: the right action can lose to a wrong one that the policy
happens to recover from, and then no target or a wrong one.

Cost: each point plays one episode per legal action (2-4 in the main job), from the point to the end,
all batched into one play_turns loop; the forced reply is not an engine call. The step reports what
it played (branch_* metrics: points, targets, branches, extra engine turns and generated tokens);
bench/visit_cost.py counts it per visit.
"""

import time
from dataclasses import dataclass

import env
import grpo
import rollout

# Branches draw from their own seed stream (a run seed of seed + this), so that a branch's samples
# are never the parent group's own samples repeated.
BRANCH_SEED_OFFSET = 7_919


@dataclass
class BranchPoint:
    parent: int  # index of the episode whose prefix is replayed, among the step's episodes
    turn: int  # the point's turn in that episode: its reply `turn` is the one forced
    actions: list  # the forced actions (Task.legal_actions there), one per branch
    branches: list  # the played branch episodes, in the order of `actions`
    returns: list  # G(a) = gamma^k R of each branch
    best: int | None  # index into actions of a*; None where the best return is tied


def choose_points(episodes: list, per_group: int) -> list[tuple[int, int]]:
    """Up to `per_group` (episode index, turn) pairs per group: the decision points its members
    passed and the states where one ended the episode unsolved; those where they disagreed (gave
    different replies there) or where one of them failed first, then by the earliest turn any member
    reached them; each from the first member to get there."""
    groups = {}
    for i, e in enumerate(episodes):
        groups.setdefault(e.group_id, []).append(i)
    points = []
    for members in groups.values():
        states = {}  # state key -> [earliest (turn, episode), replies given there, did a visitor fail]
        for i in members:
            e = episodes[i]
            ended_unsolved = e.end_reason == "stop" and not e.solved
            probe = e.task.clone()
            for t, turn in enumerate(e.played):
                probe.restore(turn.snapshot)
                if not (probe.is_decision_point() or (ended_unsolved and t == e.num_turns - 1)):
                    continue
                visits = states.setdefault(turn.key, [(t, i), set(), False])
                visits[0] = min(visits[0], (t, i))
                visits[1].add(turn.reply)
                visits[2] |= not e.solved
        ranked = sorted(states.values(), key=lambda c: (not (len(c[1]) > 1 or c[2]), c[0]))
        points += [(i, t) for (t, i), _, _ in ranked[:per_group]]
    return points


def play_branches(cfg, engine, chat: rollout.ChatFormat, episodes: list, points: list, lora_request=None,
                  progress: bool = False) -> list[BranchPoint]:
    """Every branch of every point, played to the end in one batched turn loop (rollout.play_turns)."""
    found, branches, forced = [], [], []
    for i, t in points:
        parent = episodes[i]
        state = parent.task.clone()
        state.restore(parent.turns[t].snapshot)
        actions = state.legal_actions()
        for a, action in enumerate(actions):
            # a sample id of its own for every (episode, turn, action): its samples are its own
            branches.append(parent.prefix(t, (parent.sample_id * cfg.max_turns + t) * len(state.actions) + a))
            forced.append([chat.reply_ids(state, action)])
        found.append(BranchPoint(i, t, actions, [], [], None))
    rollout.play_turns(engine, chat, branches, forced, rollout.Sampling.of(cfg, seed=cfg.seed + BRANCH_SEED_OFFSET),
                       lora_request=lora_request, desc="branches", progress=progress)
    played = iter(branches)
    for point in found:
        point.branches = [next(played) for _ in point.actions]
        point.returns = [grpo.branch_return(b.num_turns - point.turn, b.reward, cfg.gamma) for b in point.branches]
        point.best = grpo.best_branch(point.returns)
    return found


def target_sequence(branch: rollout.Episode, turn: int, chat: rollout.ChatFormat,
                    max_images: int | None) -> rollout.Sequence:
    """The branch's training sequence through its forced reply (reply `turn`), with only that
    reply trained: the point's state as the parent saw it, and the best action as its answer."""
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
        # the share of targets the task's solver agrees with: a target comes from one continuation
        # per action, so the worse action can look better once; this says how often it did
        **optimal_share(episodes, targets),
        "branch_episodes": len(played),
        # the forced reply is not an engine turn; every later reply of a branch is
        "branch_engine_turns": sum(b.num_turns - p.turn - 1 for p in points for b in p.branches),
        "branch_generated_tokens": sum(len(turn.reply_ids) for p in points for b in p.branches
                                       for turn in b.played[p.turn + 1:]),
        "branch_solve_rate": sum(b.solved for b in played) / max(len(played), 1),
        "branch_s": time.time() - start,
        # how often the winning action is not the one the parent took there: a correction, not a repeat
        "branch_target_differs_frac": sum(p.actions[p.best] != episodes[p.parent].task.parse(
            episodes[p.parent].replies[p.turn]) for p in targets) / max(len(targets), 1),
    }


def optimal_share(episodes: list, targets: list) -> dict:
    """branch_targets_optimal_frac: the share of targets on a shortest way to success (env.is_optimal);
    nothing for a task without a solver."""
    verdicts = [env.is_optimal(episodes[p.parent].task, episodes[p.parent].turns[p.turn].snapshot, p.actions[p.best])
                for p in targets]
    if None in verdicts:
        return {}
    return {"branch_targets_optimal_frac": sum(verdicts) / len(verdicts) if verdicts else 1.0}
