"""GiGPO's step-level term: an advantage for each turn, from the turns that faced the same state.

    turn_advantages, stats = grpo.episode_advantages(episodes)          # A^E_i, once per turn
    stats |= add_step_term(turn_advantages, episodes, weight=1.0, gamma=0.95)   # += w A^S_t

GRPO gives every turn of an episode one number, the episode's advantage: a dozen moves share it.
The episodes of a group play the same puzzle, so they keep meeting the *same* states (the same
Task.state_key); turns taken from one state form an anchor group, and each turn's discounted
return is normalised within it exactly as rewards are within a GRPO group. That compares actions
taken in the very same situation, which the episode-level advantage cannot (Feng et al. 2025,
"Group-in-Group Policy Optimization for LLM Agent Training", arXiv:2505.10978, Sec. 3).

A group's episodes are all played on one rank, so anchor groups never span ranks.
"""

import torch
from torch import Tensor

import grpo


def discounted_returns(turn_rewards: list[float], gamma: float) -> list[float]:
    """Return of each turn of an episode: G_t = sum_{k >= t} gamma^(k-t) * r_k.

    With the strict reward alone (r_k = 0 except the last turn's R) this is G_t = gamma^(T-1-t) * R:
    the same success is worth less the more turns it still takes, so a wasted turn (an action that
    changes nothing) lowers every return before it."""
    returns, running = [0.0] * len(turn_rewards), 0.0
    for t in reversed(range(len(turn_rewards))):
        running = turn_rewards[t] + gamma * running
        returns[t] = running
    return returns


def step_advantages(returns: Tensor, anchor_ids: Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """A^S_t = (G_t - mean_anchor(G)) / (std_anchor(G) + eps), one per turn (Sec. 3.2): GRPO's
    group normalisation with the anchor groups as groups. Turns whose state no other turn shared,
    or whose anchor group's returns are all equal, get exactly 0.

    returns: float [N turns]; anchor_ids: long [N], equal for turns from the same state."""
    return grpo.group_advantages(returns, anchor_ids, scale_by_std, eps)[0]


def add_step_term(turn_advantages: list[list[float]], episodes: list, weight: float, gamma: float,
                  scale_by_std: bool = True) -> dict:
    """A_t = A^E + w A^S_t: adds `weight` times each turn's step-level advantage to
    `turn_advantages` (one list per episode, one value per turn played), in place. The anchor
    groups are the turns of one group with one state key; G_t is discounted_returns of the strict
    reward. Returns the step's metric, the share of turns with a step-level advantage. w = 0: plain
    GRPO, nothing added."""
    if weight == 0:
        return {"step_adv_nonzero_frac": 0.0}
    returns, anchors, anchor_ids = [], [], {}  # (group, state key) -> its anchor group's id
    for e in episodes:
        returns += discounted_returns([0.0] * (e.num_turns - 1) + [e.reward], gamma)
        anchors += [anchor_ids.setdefault((e.group_id, t.key), len(anchor_ids)) for t in e.played]
    if not returns:
        return {"step_adv_nonzero_frac": 0.0}
    step_adv = step_advantages(torch.tensor(returns, dtype=torch.float64), torch.tensor(anchors),
                               scale_by_std=scale_by_std)
    values = iter(step_adv.tolist())
    for advantages in turn_advantages:
        advantages[:] = [a + weight * next(values) for a in advantages]
    return {"step_adv_nonzero_frac": (step_adv != 0).double().mean().item()}
