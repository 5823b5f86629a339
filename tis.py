"""Truncated importance sampling (TIS): the loss reweighted for the engine that really sampled.

    reweight = TruncatedIS(cap=2.0)                  # train.py passes it to update.grpo_update
    weights, metrics = reweight(old_logprobs, rollout_logprobs, response_mask)
    loss, _ = grpo.policy_loss(..., token_weights=weights)

The tokens were sampled by the engine, pi_rollout, not by the trainer's pi_old: their numerics
differ (on a GPU, bf16 with other kernels: |log pi_old - log pi_rollout| ~ 1e-3..1e-2). Each
token's policy-gradient term is reweighted by

    w_t = min( pi_old(o_t) / pi_rollout(o_t) , C ),   L_t <- w_t * L_t

w is a constant (no gradient); the cap C bounds the variance a few outlier tokens could add. On a
CPU in fp32 the two agree to ~1e-7, so w = 1 to about 1e-6. (Yao et al. 2025, "Your Efficient RL
Framework Secretly Brings You Off-Policy RL Training"; verl's and SkyRL's TIS.)
"""

import torch
from torch import Tensor

import grpo


def tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, sampled: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """The capped weights w_t and the raw ratios, [B, T]. A token outside `sampled` (rollout
    log-prob NaN: a branch's forced reply, never sampled) gets w = 1."""
    rollout = torch.where(sampled, rollout_logprobs.detach().to(old_logprobs.dtype), old_logprobs)
    raw = torch.exp(old_logprobs - rollout)
    return torch.clamp(raw, max=cap), raw


class TruncatedIS:
    """The reweighting the update applies to each micro-batch's loss; cap 0: off (no weights)."""

    # what its metrics read where no token was sampled, and with TIS off: every weight 1
    IDLE_METRICS = {"tis_weight_mean": 1.0, "tis_capped_frac": 0.0}

    def __init__(self, cap: float):
        self.cap = cap

    def __call__(self, old_logprobs: Tensor, rollout_logprobs: Tensor,
                 response_mask: Tensor) -> tuple[Tensor | None, dict]:
        """The weights of a micro-batch's tokens ([B, T], or None when off) and its metrics: the mean
        weight over the sampled tokens and the share of them the cap cut."""
        if self.cap <= 0:
            return None, dict(self.IDLE_METRICS)
        mask = response_mask.bool()
        # pi_old as policy_loss reads it: masked positions scrubbed to 0
        old = torch.where(mask, old_logprobs.detach(), torch.zeros_like(old_logprobs))
        sampled = grpo.sampled_mask(mask, rollout_logprobs)
        weights, raw = tis_weights(old, rollout_logprobs, sampled, self.cap)
        with torch.no_grad():
            return weights, {
                "tis_weight_mean": grpo.masked_mean(weights, sampled).item() if sampled.any() else 1.0,
                "tis_capped_frac": ((raw > self.cap) & sampled).sum().item() / max(sampled.sum().item(), 1)}
