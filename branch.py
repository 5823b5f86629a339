"""Branch rollouts: at the decision points a group passed, play every legal action and train toward the best.

    targets, stats = branch_step(cfg, engine, chat, episodes, lora_request)   # extra Experiences

GRPO learns a decision only when its group happens to disagree there, and it learns it least where
the policy is confidently wrong: if all 8 members make the same wrong choice, the state gets
exactly nothing. Branching makes the comparison on purpose. After a step's groups are played:

    1. points    per group, up to K states (`branch_points_per_group`) where its members made a
                 choice that matters (Task.is_decision_point), or where a member ended the episode
                 unsolved (a premature stop). Those where the group disagreed or failed come first,
                 then the earlier ones. Each is taken from the member that reached it first.
                 With `branch_winnable_only` (off in the recipe), only states from which the
                 task's solver still reaches success in the turns left: a lost state has no target.
    2. branches  from that member's exact prefix (its conversation up to the point, token for token,
                 and its task restored to that state: rollout.Episode.prefix, Task.restore), every
                 legal action (Task.legal_actions) is forced as the reply there, and the policy
                 finishes each branch at the training temperature with the same turn limit
                 (`branch_continuations` times per action; once in the recipe).
    3. returns   G(a) = gamma^k R: R the strict reward of branch a, k its turns after the point (the
                 discount of the step-level term, so a detour that still arrives is worth less);
                 with several continuations, their mean (a Monte Carlo estimate, as VinePPO's).
    4. target    a* = argmax_a G(a), unless the best is tied (every branch failed, say): then none,
                 or, with `branch_tiebreak progress` (off in the recipe: the published reward is
                 strict), where every branch failed the one that ended nearest success by the
                 task's solver (nearest_branch; each action judged by its first continuation).
                 The point's state with a*'s reply is one extra training row whose only trained
                 tokens are that reply, with advantage w (`branch_weight`): target_advantages has
                 the loss, L = -w log pi_T(a* | s), a cross-entropy toward the winning branch.

Why a cross-entropy and not an advantage per branch: its gradient, (e_a* - pi_T) dz / T, vanishes
once the policy agrees with the branches, so it spends the update on the states the policy gets
wrong; an advantage on every forced action keeps pushing actions the policy has already ruled out.
The branches continue with the policy, not a solver, so
G(a) is noisy where the policy errs later: the right action can lose to a wrong one that the policy
happens to recover from, and then no target or a wrong one.

Cost: each point plays `branch_continuations` episodes per legal action (2-4 actions in the main
job), from the point to the end, all batched into one play_turns loop; the forced reply is not an
engine call.
The step reports what it played (branch_* metrics: points, targets, branches, extra engine turns
and generated tokens); bench/visit_cost.py counts it per visit.
"""

import time
from dataclasses import dataclass

from torch import Tensor

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
    actions: list  # the forced actions (Task.legal_actions there), each finished by `branch_continuations` branches
    branches: list  # the played branch episodes, `branch_continuations` per action, in the order of `actions`
    returns: list  # G(a) of each action: the mean of its continuations' gamma^k R
    best: int | None  # index into actions of a*; None where the best return is tied
    tie_broken: bool = False  # a* came from the progress tie-break (every branch failed)


def branch_return(turns_played: int, reward: float, gamma: float) -> float:
    """A branch's return from its point: G = gamma^(k - 1) * R for a branch that played k turns
    from the point on (the forced action included) and ended with the strict reward R, the same
    discount as the step-level term's G_t (gigpo.discounted_returns with r = R at the last turn)."""
    return gamma ** (turns_played - 1) * reward


def best_branch(returns: list[float]) -> int | None:
    """a* = argmax_a G_branch(a), the branch to train toward; None where the best is shared (every
    branch failed, or two arrived equally fast) or failed (a point with one open move, a dead end
    where a member stopped: its one branch is a target only if it succeeds, beating the stop's 0)."""
    best = max(returns, default=0.0)
    return returns.index(best) if best > 0 and returns.count(best) == 1 else None


def nearest_branch(branches: list) -> int | None:
    """The branch that ended nearest success, where every branch failed: the fewest actions the
    task's solver still needs from its last state (Task.solve; none there: never nearest), if one
    branch is strictly nearest of two or more. A shaped judgement, not the strict reward: it means
    to say that a wrong turn into a dead end is worse than a right one that ran out of turns, which
    the reward cannot (both score 0), and it is only as good as the policy's continuations: a branch
    that walks back out of the dead end can end nearer than one that wandered off the right way."""
    remaining = []
    for b in branches:
        solution = b.task.solve()
        remaining.append(float("inf") if solution is None else len(solution))
    nearest = min(remaining, default=float("inf"))
    if len(branches) < 2 or nearest == float("inf") or remaining.count(nearest) > 1:
        return None
    return remaining.index(nearest)


def pick_target(returns: list[float], branches: list, tiebreak: str) -> tuple[int | None, bool]:
    """(a*, whether the tie-break chose it): the best branch by return; where every branch failed
    and `tiebreak` is "progress", the nearest one (a tie between successes stays untargeted)."""
    best = best_branch(returns)
    if best is None and tiebreak == "progress" and max(returns, default=0.0) == 0:
        nearest = nearest_branch(branches)
        return nearest, nearest is not None
    return best, False


def target_advantages(response_mask: list[int], weight: float) -> Tensor:
    """The advantage row of a branch point's target row: `weight` on its one trained reply.

    The estimator is a cross-entropy toward the winning branch, at the sampling temperature T:
        L_branch = -w * log pi_T(a* | s),   a* = argmax_a G_branch(a)
        grad_z L_branch = -w * (e_a* - pi_T(. | s)) / T
    which vanishes once the policy agrees (pi_T(a*) -> 1): it saturates, so it spends the update
    on the states the policy gets wrong (an equal weight on every forced action does not).

    How it enters policy_loss, unchanged: the row's trained tokens are the reply of a* (forced,
    rollout log-prob NaN), each with A = w. In the single-pass update pi_old = pi.detach(), so the
    ratio is exp(lp - lp.detach()) = 1 and per token L_j = -w * ratio_j has the gradient
    -w * grad log pi_T(y_j | s, y_<j); summed over the reply's tokens y that is exactly
    -w * grad log pi_T(a* | s). The token-mean normaliser N counts these tokens with the GRPO
    rows' (the mini-batch's response tokens), so the mini-batch loss is
        (1/N) [ sum_GRPO tokens A_t L_t  +  sum_targets sum_{j in reply} -w log pi_T(y_j) ]:
    a target weighs as much as a sampled reply with advantage w. With mini-batches or epochs the
    ratio leaves 1 and the clip caps it as for any A > 0 token. TIS gives forced tokens weight 1
    and the mismatch meter skips them (sampled_mask): the engine never sampled them."""
    return grpo.spread_over_replies(response_mask, [weight] * grpo.reply_count(response_mask))


def can_still_win(episode, turn: int) -> bool:
    """Whether the task's solver still reaches success in the turns left from the state the
    episode faced at its reply `turn` (some move there can still win)."""
    state = episode.task.clone()
    state.restore(episode.turns[turn].snapshot)
    solution = state.solve()
    return solution is not None and len(solution) <= state.max_turns - turn


def choose_points(episodes: list, per_group: int, winnable_only: bool = False) -> list[tuple[int, int]]:
    """Up to `per_group` (episode index, turn) pairs per group: the decision points its members
    passed and the states where one ended the episode unsolved; those where they disagreed (gave
    different replies there) or where one of them failed first, then by the earliest turn any member
    reached them; each from the first member to get there. With `winnable_only`, only states
    from which some move can still succeed (can_still_win): no branch of a lost state can give a target."""
    groups = {}
    for i, e in enumerate(episodes):
        groups.setdefault(e.group_id, []).append(i)
    points = []
    for members in groups.values():
        states = {}  # state key -> [earliest (turn, episode), replies given there, did a visitor fail]
        for i in members:
            e = episodes[i]
            ended_unsolved = e.end_reason in ("stop", "invalid") and not e.solved
            probe = e.task.clone()
            for t, turn in enumerate(e.played):
                probe.restore(turn.snapshot)
                if not (probe.is_decision_point() or (ended_unsolved and t == e.num_turns - 1)):
                    continue
                visits = states.setdefault(turn.key, [(t, i), set(), False])
                visits[0] = min(visits[0], (t, i))
                visits[1].add(turn.reply)
                visits[2] |= not e.solved
        if winnable_only:  # judged at the earliest visit, the one a branch replays
            states = {key: c for key, c in states.items() if can_still_win(episodes[c[0][1]], c[0][0])}
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
            first = ((parent.sample_id * cfg.max_turns + t) * len(state.actions) + a) * cfg.branch_continuations
            for k in range(cfg.branch_continuations):
                # a sample id of its own for every (episode, turn, action, continuation): its samples are its own
                branches.append(parent.prefix(t, first + k))
                forced.append([chat.reply_ids(state, action)])
        found.append(BranchPoint(i, t, actions, [], [], None))
    rollout.play_turns(engine, chat, branches, forced, rollout.Sampling.of(cfg, seed=cfg.seed + BRANCH_SEED_OFFSET),
                       lora_request=lora_request, desc="branches", progress=progress)
    played, n = iter(branches), cfg.branch_continuations
    for point in found:
        point.branches = [next(played) for _ in range(len(point.actions) * n)]
        returns = [branch_return(b.num_turns - point.turn, b.reward, cfg.gamma) for b in point.branches]
        point.returns = [sum(returns[a * n:(a + 1) * n]) / n for a in range(len(point.actions))]
        # the progress tie-break judges each action by its first continuation
        point.best, point.tie_broken = pick_target(point.returns, point.branches[::n], cfg.branch_tiebreak)
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
    step's branch metrics. Called only with branch_points_per_group above 0."""
    start = time.time()
    points = play_branches(cfg, engine, chat, episodes,
                           choose_points(episodes, cfg.branch_points_per_group, cfg.branch_winnable_only),
                           lora_request, progress)
    max_images = cfg.max_images or None
    experiences = []
    for p in points:
        if p.best is None:
            continue
        # every continuation of a* shares its prefix through the forced reply, which is all the row holds
        seq = target_sequence(p.branches[p.best * cfg.branch_continuations], p.turn, chat, max_images)
        experiences.append(grpo.Experience(seq, target_advantages(seq.response_mask, cfg.branch_weight),
                                             p.parent))
    played = [b for p in points for b in p.branches]
    targets = [p for p in points if p.best is not None]
    return experiences, {
        "branch_points": len(points),
        "branch_targets": len(targets),
        "branch_tiebreak_targets": sum(p.tie_broken for p in targets),
        # the share of targets the task's solver agrees with: a target comes from a few continuations
        # per action (branch_continuations), so the worse action can look better; this says how often it did
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
