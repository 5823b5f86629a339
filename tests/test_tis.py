"""Unit tests for tis.py, truncated importance sampling (CPU, a second)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo import policy_loss  # noqa: E402
from tis import TruncatedIS  # noqa: E402


def test_each_sampled_token_is_weighted_by_the_capped_ratio():
    # pi_old / pi_rollout per token: 1 (the engine agreed), 1.5, 3 (capped at 2), 0.5
    old = torch.log(torch.tensor([[0.5, 0.3, 0.6, 0.2]]))
    rollout = old - torch.log(torch.tensor([[1.0, 1.5, 3.0, 0.5]]))
    mask = torch.ones(1, 4)
    weights, m = TruncatedIS(2.0)(old, rollout, mask)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.5, 2.0, 0.5]]))
    assert m["tis_weight_mean"] == pytest.approx(5 / 4) and m["tis_capped_frac"] == pytest.approx(0.25)
    # the loss's gradient: each token's scaled by its weight
    logp = old.clone().requires_grad_(True)
    policy_loss(logp, old, torch.tensor([1.0]), mask, token_weights=weights)[0].backward()
    plain = old.clone().requires_grad_(True)
    policy_loss(plain, old, torch.tensor([1.0]), mask)[0].backward()
    torch.testing.assert_close(logp.grad, plain.grad * weights)
    # off (cap 0): no weights, every weight reported as 1
    assert TruncatedIS(0.0)(old, rollout, mask) == (None, TruncatedIS.IDLE_METRICS)
    assert TruncatedIS.IDLE_METRICS == {"tis_weight_mean": 1.0, "tis_capped_frac": 0.0}
    # masked positions: no weight, whatever the rollout said there
    _, m = TruncatedIS(2.0)(old, rollout, torch.tensor([[1.0, 1.0, 0.0, 0.0]]))
    assert m["tis_weight_mean"] == pytest.approx(1.25) and m["tis_capped_frac"] == 0.0


def test_a_forced_token_gets_weight_one():
    """A branch target's reply was forced, never sampled: rollout log-prob NaN, weight 1, and not in the metrics."""
    old = torch.log(torch.tensor([[0.5, 0.3]]))
    rollout = torch.tensor([[float("nan"), (old[0, 1] - torch.log(torch.tensor(1.5))).item()]])
    weights, m = TruncatedIS(2.0)(old, rollout, torch.ones(1, 2))
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.5]]))
    assert m["tis_weight_mean"] == pytest.approx(1.5)
