"""Unit tests for gigpo.py, GiGPO's step-level term (CPU, a second)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gigpo import add_step_term, discounted_returns, step_advantages  # noqa: E402
from grpo import episode_advantages  # noqa: E402


def test_discounted_returns():
    assert discounted_returns([0.0, 0.0, 1.0], 0.5) == [0.25, 0.5, 1.0]
    assert discounted_returns([0.0, 0.0], 0.9) == [0.0, 0.0]
    assert discounted_returns([0.0, 1.0], 1.0) == [1.0, 1.0]
    # shaping terms along the way: G_1 = 0.1 + 0.5 * 1.0, G_0 = -0.1 + 0.5 * G_1
    assert discounted_returns([-0.1, 0.1, 1.0], 0.5) == pytest.approx([0.2, 0.6, 1.0])


def test_step_advantages_compare_turns_from_the_same_state():
    # anchor 0: returns 0.5, 0.25, 0.5 -> mean 5/12, sample std sqrt((1/144 + 4/144 + 1/144) * 3 / 2)...
    returns = torch.tensor([0.5, 0.25, 0.5, 1.0, 1.0, 0.3], dtype=torch.float64)
    anchors = torch.tensor([0, 0, 0, 1, 1, 2])
    centred = torch.tensor([1 / 12, -2 / 12, 1 / 12], dtype=torch.float64)
    std = (centred.pow(2).sum() / 2).sqrt()
    adv = step_advantages(returns, anchors)
    torch.testing.assert_close(adv[:3], centred / (std + 1e-6))
    assert (adv[3:] == 0).all()  # all-equal anchor group, and a state no other turn visited


def episodes():
    """Two groups of two; the turns' state keys are a and b."""
    def episode(group, keys, reward):
        return SimpleNamespace(group_id=group, played=[SimpleNamespace(key=k) for k in keys], reward=reward,
                               num_turns=len(keys))

    a, b = (0, 0), (0, 1)
    return [episode(0, [a, b], 1.0), episode(0, [a, a], 0.0),  # the same first state, different outcomes
            episode(1, [a], 0.0), episode(1, [b], 0.0)]  # a group without spread


def test_the_step_term_is_added_to_each_turn_from_the_turns_that_shared_its_state():
    """A_t = A^E + w * A^S_t: anchor (group 0, state a) holds three turns with returns G = 0.5
    (episode 0, turn 0), 0 and 0 (episode 1): mean 1/6. State b's one turn has no partner."""
    played = episodes()
    advantages, _ = episode_advantages(played, scale_by_std=False)  # +-0.5 in group 0, 0 in group 1
    stats = add_step_term(advantages, played, weight=1.0, gamma=0.5, scale_by_std=False)
    expected = [[0.5 + (0.5 - 1 / 6), 0.5], [-0.5 - 1 / 6, -0.5 - 1 / 6], [0.0], [0.0]]
    assert all(a == pytest.approx(e) for a, e in zip(advantages, expected))
    assert stats["step_adv_nonzero_frac"] == pytest.approx(3 / 6)
    doubled, _ = episode_advantages(played, scale_by_std=False)
    add_step_term(doubled, played, weight=2.0, gamma=0.5, scale_by_std=False)
    assert doubled[1] == pytest.approx([-0.5 - 2 / 6, -0.5 - 2 / 6])
    plain, _ = episode_advantages(played, scale_by_std=False)  # w = 0: plain GRPO, nothing added
    assert add_step_term(plain, played, weight=0.0, gamma=0.5) == {"step_adv_nonzero_frac": 0.0}
    assert plain == [[0.5, 0.5], [-0.5, -0.5], [0.0], [0.0]]
