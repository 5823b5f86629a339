"""The tail average (average.py): the mean of LoRA deltas kept at the adapters' rank. The trainer's
use of it (evaluated, exported, checkpointed, resumed) is test_train.py's resume test."""

import pytest
import torch

import average


def delta(state: dict, name: str) -> torch.Tensor:
    return state[f"{name}.lora_B.weight"] @ state[f"{name}.lora_A.weight"]


def lora(b: torch.Tensor, a: torch.Tensor) -> dict:
    return {"m.lora_A.weight": a, "m.lora_B.weight": b}


def test_truncate_is_the_best_low_rank_approximation():
    """Its product is the SVD's rank-r truncation of b @ a (Eckart-Young), computed without it."""
    torch.manual_seed(0)
    b, a = torch.randn(40, 12, dtype=torch.float64), torch.randn(12, 30, dtype=torch.float64)
    b2, a2, dropped, total = average.truncate(b, a, 5)
    u, s, vh = torch.linalg.svd(b @ a)
    best = (u[:, :5] * s[:5]) @ vh[:5]
    assert b2.shape == (40, 5) and a2.shape == (5, 30)
    assert torch.allclose(b2 @ a2, best, atol=1e-9)
    assert dropped == pytest.approx(s[5:].pow(2).sum().item()) and total == pytest.approx(s.pow(2).sum().item())
    b3, a3, _, _ = average.truncate(b[:3], a, 5)  # a module narrower than the rank: padded with zeros
    assert b3.shape == (3, 5) and a3.shape == (5, 30) and torch.allclose(b3 @ a3, b[:3] @ a, atol=1e-9)


def test_the_tail_average_is_the_mean_of_the_deltas():
    """Policies along a training path (each step a small change of both factors): the running
    average's delta is the exact mean of the deltas, up to the little its truncation reports
    dropping (as near as the one-shot truncation of the exact mean), and nearer to it than the
    mean of the factors, which holds cross terms."""
    torch.manual_seed(1)
    rank, b, a = 4, torch.randn(32, 4, dtype=torch.float64), torch.randn(4, 24, dtype=torch.float64)
    tail, states = average.TailAverage(first_step=3, rank=rank), []
    assert not tail.active(3)  # nothing added yet
    for step in range(12):
        b, a = b + 0.15 * torch.randn_like(b), a + 0.15 * torch.randn_like(a)
        states.append(lora(b.clone(), a.clone()))
        tail.add(states[-1])
        assert tail.state["m.lora_A.weight"].shape == (rank, 24)  # the rank stays the adapters'
    exact = sum(delta(s, "m") for s in states) / len(states)
    error = ((delta(tail.state, "m") - exact).norm() / exact.norm()).item()
    factorwise = sum(s["m.lora_B.weight"] for s in states) @ sum(s["m.lora_A.weight"] for s in states) / len(states) ** 2
    assert tail.count == 12 and tail.active(3) and not tail.active(2)
    u, s, vh = torch.linalg.svd(exact)
    best = ((u[:, :rank] * s[:rank]) @ vh[:rank] - exact).norm() / exact.norm()
    assert error < 0.05 and error < 1.01 * best.item() < ((factorwise - exact).norm() / exact.norm()).item()
    assert 0 < tail.dropped < 0.05
    # deltas within one rank-r subspace (the same A): the mean is exact
    tail = average.TailAverage(first_step=1, rank=rank)
    states = [lora(torch.randn(32, 4, dtype=torch.float64), a) for _ in range(5)]
    for state in states:
        tail.add(state)
    exact = sum(delta(s, "m") for s in states) / 5
    assert torch.allclose(delta(tail.state, "m"), exact, atol=1e-10) and tail.dropped < 1e-7


def test_after_each_step_the_published_policy_is_the_current_one_until_the_tail_begins():
    tail = average.TailAverage(first_step=3, rank=2)
    states = [lora(torch.full((4, 2), float(k)), torch.ones(2, 5)) for k in range(1, 5)]
    for step, state in zip((1, 2), states):
        assert tail.after_step(step, state) == (state, {})  # before the tail: the current policy, nothing added
    assert tail.count == 0
    published, metrics = tail.after_step(3, states[2])
    assert published is tail.state and tail.count == 1 and metrics == {"average_dropped": tail.dropped}
    published, _ = tail.after_step(4, states[3])
    assert torch.allclose(delta(published, "m"), (delta(states[2], "m") + delta(states[3], "m")) / 2)
