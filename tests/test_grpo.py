"""Unit tests for grpo.py (CPU, a few seconds)."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo import (  # noqa: E402
    IDLE_METRICS,
    chunked_token_logprobs,
    episode_advantages,
    group_advantages,
    kl_k3,
    logprob_mismatch,
    masked_mean,
    policy_loss,
    reply_count,
    spread_over_replies,
    to_experiences,
    token_logprobs,
)

# ----------------------------------------------------------------------------- advantages

# group 7: [1, 0, 0, 1] -> mean 0.5, sample std sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.5773503
#          A = +-0.5 / 0.5773503 = +-0.8660254
# group 3: [1, 1, 1, 1] -> all equal -> 0
# group 42: [0.3] -> size 1 -> 0
# group 5: [0.0, 2.0] -> mean 1, sample std sqrt(2) -> A = -+1/sqrt(2) = -+0.7071068
REWARDS = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.3, 1.0, 1.0, 2.0, 0.0])
GROUPS = torch.tensor([7, 7, 3, 7, 3, 3, 42, 7, 3, 5, 5])


def test_group_advantages_hand_computed():
    a = 0.8660254
    expected = torch.tensor([a, -a, 0, -a, 0, 0, 0, a, 0, 0.7071068, -0.7071068])
    adv, _ = group_advantages(REWARDS, GROUPS)
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    assert adv.dtype == torch.float32
    # all-equal and size-1 groups are exactly zero, not just close
    assert (adv[[2, 4, 5, 6, 8]] == 0).all()


def test_dr_grpo_advantages():
    adv, _ = group_advantages(REWARDS, GROUPS, scale_by_std=False)
    expected = torch.tensor([0.5, -0.5, 0, -0.5, 0, 0, 0, 0.5, 0, 1.0, -1.0])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)


def test_all_equal_non_representable_reward_is_exactly_zero():
    adv, _ = group_advantages(torch.tensor([0.1, 0.1, 0.1]), torch.tensor([0, 0, 0]))
    assert (adv == 0).all()


def test_episode_advantages_put_each_episodes_advantage_on_its_reply_tokens():
    """Two groups of two: A^E from the rewards within each group, once per turn played, on every
    token of that turn's reply and nowhere else (gigpo.py adds its step term to the same lists)."""
    from types import SimpleNamespace

    def episode(group, turns, reward):
        mask = [0, 0] + [m for _ in range(turns) for m in (1, 1, 0)]  # a 2-token prompt, then reply, observation
        return SimpleNamespace(group_id=group, reward=reward, num_turns=turns,
                               sequences=[SimpleNamespace(response_mask=mask)])

    episodes = [episode(0, 2, 1.0), episode(0, 2, 0.0), episode(1, 1, 0.0), episode(1, 1, 0.0)]
    advantages, stats = episode_advantages(episodes, scale_by_std=False)
    assert advantages == [[0.5, 0.5], [-0.5, -0.5], [0.0], [0.0]]
    assert stats["zero_variance_group_frac"] == 0.5 and stats["num_groups"] == 2 and "reward_mean" not in stats
    advantages[0][1] = 0.25  # a turn's own value (GiGPO's) goes on that turn's reply only
    experiences = to_experiences(episodes, advantages)
    assert [x.episode for x in experiences] == [0, 1, 2, 3]
    for x, values in zip(experiences, advantages):
        row, mask = x.advantages.tolist(), x.sequence.response_mask[1:]
        assert [row[j] for j in range(len(row)) if mask[j]] == pytest.approx([v for v in values for _ in range(2)])
        assert all(row[j] == 0 for j in range(len(row)) if not mask[j])


def test_per_token_advantages_equal_broadcast_ones_when_constant():
    torch.manual_seed(0)
    logp = torch.randn(2, 5)
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]], dtype=torch.float32)
    per_seq = torch.tensor([0.3, -1.2])
    a, _ = policy_loss(logp, logp.detach(), per_seq, mask)
    b, _ = policy_loss(logp, logp.detach(), per_seq.unsqueeze(-1).expand(2, 5), mask)
    torch.testing.assert_close(a, b)
    # and each token follows its own advantage: raising one token's raises only its weight
    lp = logp.clone().requires_grad_(True)
    per_token = torch.zeros(2, 5)
    per_token[0, 2] = 1.0
    loss, _ = policy_loss(lp, lp.detach(), per_token, mask)
    loss.backward()
    assert lp.grad[0, 2] < 0 and (lp.grad.flatten()[[i for i in range(10) if i != 2]] == 0).all()


def test_stats():
    adv, stats = group_advantages(REWARDS, GROUPS)
    assert stats["num_groups"] == 4.0
    assert stats["zero_variance_group_frac"] == pytest.approx(0.5)  # groups 3 and 42
    assert stats["reward_mean"] == pytest.approx(REWARDS.mean().item())
    assert stats["reward_std"] == pytest.approx(REWARDS.std().item())
    assert all(isinstance(v, float) for v in stats.values())


def _grad(logp, **kw):
    logp = logp.clone().requires_grad_(True)
    loss, metrics = policy_loss(logp, **kw)
    loss.backward()
    return loss, metrics, logp.grad


def test_loss_sign_follows_advantage():
    old = torch.log(torch.full((2, 3), 0.5))
    mask = torch.ones(2, 3)
    _, m, g = _grad(old, old_logprobs=old, advantages=torch.tensor([1.0, -1.0]), response_mask=mask)
    # minimising the loss moves logp against the gradient: up for A>0, down for A<0
    assert (g[0] < 0).all() and (g[1] > 0).all()
    assert m["ratio_mean"] == pytest.approx(1.0) and m["clip_frac"] == 0.0


def test_clipping_zeroes_gradient_and_counts():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.1, 1.3, 1.3, 0.7]]))  # ratios
    mask = torch.ones(1, 4)
    _, m, g = _grad(logp, old_logprobs=old, advantages=torch.tensor([1.0]), response_mask=mask)
    # A>0: ratio 1.3 > 1.2 is clipped (no grad); ratio 0.7 < 0.8 is not (min keeps unclipped)
    assert g[0, 1] == 0 and g[0, 2] == 0
    assert g[0, 0] < 0 and g[0, 3] < 0
    assert m["clip_frac"] == pytest.approx(0.5)
    # clip-higher (DAPO): eps_high = 0.28 un-clips ratio 1.25 but still clips 1.3
    logp = torch.log(torch.tensor([[1.25, 1.3, 1.0, 1.0]]))
    _, m, g = _grad(logp, old_logprobs=old, advantages=torch.tensor([1.0]), response_mask=mask)
    assert g[0, 0] == 0 and g[0, 1] == 0 and m["clip_frac"] == pytest.approx(0.5)
    _, m, g = _grad(logp, old_logprobs=old, advantages=torch.tensor([1.0]), response_mask=mask,
                    clip_eps_high=0.28)
    assert g[0, 0] < 0 and g[0, 1] == 0
    assert m["clip_frac"] == pytest.approx(0.25)
    # eps_low is separate: A<0 with ratio 0.85 is clipped at eps_low=0.1 but not at 0.2
    logp = torch.log(torch.tensor([[0.85, 1.0, 1.0, 1.0]]))
    for eps_low, clipped in ((0.1, True), (0.2, False)):
        _, m, g = _grad(logp, old_logprobs=old, advantages=torch.tensor([-1.0]), response_mask=mask,
                        clip_eps_low=eps_low, clip_eps_high=0.5)
        assert (g[0, 0] == 0) == clipped
        assert m["clip_frac"] == pytest.approx(0.25 if clipped else 0.0)


def test_token_weights_scale_each_tokens_policy_gradient_term():
    old = torch.log(torch.tensor([[0.5, 0.3, 0.6, 0.2]]))
    weights = torch.tensor([[1.0, 1.5, 2.0, 0.5]])
    mask = torch.ones(1, 4)
    plain_loss, _, plain = _grad(old, old_logprobs=old, advantages=torch.tensor([1.0]), response_mask=mask)
    loss, m, g = _grad(old, old_logprobs=old, advantages=torch.tensor([1.0]), response_mask=mask,
                       token_weights=weights)
    torch.testing.assert_close(g, plain * weights)  # L_t <- w_t * L_t
    assert loss.item() == pytest.approx(plain_loss.item() * (1 + 1.5 + 2 + 0.5) / 4)
    assert m["pg_loss"] == pytest.approx(loss.item())
    assert set(m) == set(IDLE_METRICS)  # what a step that trains nothing reports has every metric


def test_each_reply_carries_its_turns_advantage():
    # prompt, reply 0 (2 tokens), observation, reply 1 (3 tokens): the row drops the first token
    mask = [0, 0, 1, 1, 0, 0, 0, 1, 1, 1]
    assert reply_count(mask) == 2 and reply_count([1, 1, 0, 1]) == 2 and reply_count([0, 0]) == 0
    row = spread_over_replies(mask, [0.6, 0.3])
    torch.testing.assert_close(row, torch.tensor([0, 0.6, 0.6, 0, 0, 0, 0.3, 0.3, 0.3]))
    with pytest.raises(ValueError, match="2 replies in the mask, 3 values"):
        spread_over_replies(mask, [1.0, 2.0, 3.0])


def test_masked_positions_contribute_nothing():
    torch.manual_seed(0)
    logp = -torch.rand(2, 5)
    old = logp + 0.05 * torch.randn(2, 5)
    ref = logp + 0.05 * torch.randn(2, 5)
    mask = torch.tensor([[1, 1, 0, 0, 1], [0, 1, 1, 1, 0]])  # 0 = observation / padding
    kw = dict(advantages=torch.tensor([0.7, -1.2]), response_mask=mask, ref_logprobs=ref, kl_coef=0.1)
    for agg in ("token-mean", "seq-mean"):
        loss, m, g = _grad(logp, old_logprobs=old, aggregation=agg, **kw)
        for garbage in (float("inf"), float("-inf"), float("nan"), 123.0):
            bad = torch.where(mask.bool(), logp, torch.tensor(garbage))
            bad_old = torch.where(mask.bool(), old, torch.tensor(garbage))
            loss2, m2, g2 = _grad(bad, old_logprobs=bad_old, aggregation=agg, **kw)
            assert torch.equal(loss, loss2)
            assert torch.equal(g, g2)  # unmasked grads identical, masked grads exactly 0
            assert (g2[~mask.bool()] == 0).all()
            assert m == m2


def test_token_mean_normalizer_makes_micro_batches_add_up():
    torch.manual_seed(1)
    logp, old, ref = -torch.rand(4, 6), -torch.rand(4, 6), -torch.rand(4, 6)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [0, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]])
    adv = torch.tensor([1.0, -0.5, 0.3, 2.0])
    kw = dict(ref_logprobs=ref, kl_coef=0.05)
    full, _, g_full = _grad(logp, old_logprobs=old, advantages=adv, response_mask=mask, **kw)
    n = mask.sum()
    parts, grads = [], []
    for sl in (slice(0, 1), slice(1, 4)):
        kw_sl = dict(ref_logprobs=ref[sl], kl_coef=0.05)
        l, _, g = _grad(logp[sl], old_logprobs=old[sl], advantages=adv[sl], response_mask=mask[sl],
                        loss_normalizer=n, **kw_sl)
        parts.append(l)
        grads.append(g)
    torch.testing.assert_close(parts[0] + parts[1], full)
    torch.testing.assert_close(torch.cat(grads), g_full)
    # seq-mean weights each sequence equally instead of each token
    seq, _ = policy_loss(logp, old, adv, mask, aggregation="seq-mean")
    tok, _ = policy_loss(logp, old, adv, mask, aggregation="token-mean")
    assert not torch.allclose(seq, tok)
    with pytest.raises(ValueError):
        policy_loss(logp, old, adv, mask, aggregation="nope")


def test_seq_mean_hand_computed():
    # at ratio 1 the per-token loss is -A; seq-mean = (1/B) sum_i (-A_i)
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, m = policy_loss(logp, logp, torch.tensor([1.0, 3.0]), mask, aggregation="seq-mean")
    assert loss.item() == pytest.approx(-2.0)
    loss, m = policy_loss(logp, logp, torch.tensor([1.0, 3.0]), mask, aggregation="token-mean")
    assert loss.item() == pytest.approx(-(3 * 1.0 + 3.0) / 4)
    assert m["pg_loss"] == pytest.approx(loss.item()) and m["kl"] == 0.0


# ----------------------------------------------------------------------------- kl / logprobs

def test_kl_k3():
    torch.manual_seed(2)
    a, b = torch.randn(1000), torch.randn(1000)
    assert (kl_k3(a, b) >= 0).all()
    assert (kl_k3(a, a) == 0).all()
    # hand: logp = 0, ref = log 2 -> 2 - log 2 - 1
    assert kl_k3(torch.tensor(0.0), torch.tensor(math.log(2))).item() == pytest.approx(1 - math.log(2))
    # the kl metric equals the masked mean of k3
    mask = torch.tensor([[1, 1, 0]])
    logp, ref = torch.tensor([[0.0, -1.0, 5.0]]), torch.tensor([[math.log(2), -1.0, -9.0]])
    _, m = policy_loss(logp, logp, torch.tensor([1.0]), mask, ref_logprobs=ref, kl_coef=0.1)
    assert m["kl"] == pytest.approx((1 - math.log(2)) / 2)


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert masked_mean(x, mask).item() == pytest.approx(13 / 4)
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([1.5, 5.0]))


def test_token_logprobs_matches_log_softmax():
    torch.manual_seed(3)
    logits = torch.randn(3, 5, 11)
    ids = torch.randint(0, 11, (3, 6))
    # alignment: logits at t predict token t+1
    out = token_logprobs(logits, ids[:, 1:], temperature=0.7)
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(out, ref)
    # bf16 logits still give float32 log-probs; gradients flow
    lg = logits.to(torch.bfloat16).requires_grad_(True)
    out = token_logprobs(lg, ids[:, 1:])
    assert out.dtype == torch.float32
    out.sum().backward()
    assert lg.grad is not None and lg.grad.shape == lg.shape


def test_token_logprobs_with_the_engines_logit_bias():
    """The bias is added to the logits before the temperature divides them (vLLM's order); the
    logits themselves are left alone, and no bias is the plain computation, bit for bit."""
    torch.manual_seed(4)
    logits = torch.randn(2, 4, 9)
    ids = torch.randint(0, 9, (2, 5))
    kept = logits.clone()
    biased = token_logprobs(logits, ids[:, 1:], temperature=0.5, logit_bias={2: -100.0, 7: -3.0})
    shifted = logits.clone()
    shifted[..., 2] -= 100.0
    shifted[..., 7] -= 3.0
    ref = torch.log_softmax(shifted / 0.5, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(biased, ref)
    assert torch.equal(logits, kept)
    assert not torch.allclose(biased, token_logprobs(logits, ids[:, 1:], temperature=0.5))
    assert torch.equal(token_logprobs(logits, ids[:, 1:], 0.5, {}), token_logprobs(logits, ids[:, 1:], 0.5))


def saved_for_backward_bytes(fn) -> tuple[object, int]:
    """fn()'s result and the bytes autograd keeps for its backward (distinct storages, parameters
    and other leaves given to fn excluded: they exist anyway)."""
    storages = {}

    def pack(t):
        if not (t.requires_grad and t.grad_fn is None):  # not a leaf the caller owns
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def test_chunked_logprobs_equal_the_full_logits_path_and_keep_no_logits_for_backward():
    """grpo.chunked_token_logprobs (the trainer's path: hidden states -> the head, a chunk at a
    time) gives token_logprobs' values and gradients, with the engine's bias and temperature; what
    autograd keeps for backward grows with the tokens, never with the vocabulary."""
    torch.manual_seed(5)
    B, T, H = 3, 10, 16

    def both(V: int, chunk: int):
        weight = torch.randn(V, H, requires_grad=True)
        base = torch.randn(B, T, H, requires_grad=True)
        ids = torch.randint(0, V, (B, T))
        results = []
        for path in ("full", "chunked"):
            hidden = base * 1.0  # a non-leaf, as the model's hidden states are
            if path == "full":
                run = lambda: token_logprobs(hidden @ weight.T, ids, 0.7, {1: -100.0})  # noqa: E731
            else:
                run = lambda: chunked_token_logprobs(hidden, weight, ids, 0.7, {1: -100.0}, chunk=chunk)  # noqa: E731
            out, saved = saved_for_backward_bytes(run)
            (out * torch.linspace(-1, 1, B * T).view(B, T)).sum().backward()
            results.append((out.detach(), base.grad.clone(), weight.grad.clone(), saved))
            base.grad, weight.grad = None, None
        return results

    (full, full_gh, full_gw, full_saved), (chunked, gh, gw, saved) = both(V=4000, chunk=7)
    torch.testing.assert_close(chunked, full)
    torch.testing.assert_close(gh, full_gh)
    torch.testing.assert_close(gw, full_gw)
    assert full_saved >= B * T * 4000 * 4  # the fp32 logits, kept for backward
    # the hidden states and targets, a few times over, and the bias: one row of V, not one a token
    assert saved < B * T * H * 4 * 3 + 4000 * 4
    *_, saved_big_vocab = both(V=16000, chunk=7)[1]
    assert saved_big_vocab - saved == (16000 - 4000) * 4  # a 4x vocabulary adds only the bias row


def test_logprob_mismatch_hand_example():
    trainer = torch.tensor([[-1.0, -2.0, -0.5, 9.0]])
    rollout = torch.tensor([[-1.1, -2.0, -0.2, float("nan")]])
    mask = torch.tensor([[1, 1, 1, 0]])
    m = logprob_mismatch(trainer, rollout, mask)
    assert m["mismatch_abs_mean"] == pytest.approx((0.1 + 0.0 + 0.3) / 3)
    assert m["mismatch_abs_max"] == pytest.approx(0.3)
    # k3 with d = rollout - trainer: exp(d) - d - 1, for d = -0.1, 0, 0.3
    k3 = [math.exp(d) - d - 1 for d in (-0.1, 0.0, 0.3)]
    assert m["mismatch_k3"] == pytest.approx(sum(k3) / 3)
    assert all(isinstance(v, float) for v in m.values())
