"""GRPO math: finished episodes -> per-token advantages, the PPO-clip policy loss, KL, log-probs.

    turn_advantages, stats = episode_advantages(episodes)        # A^E of each episode, per turn
    experiences = to_experiences(episodes, turn_advantages)       # per-token rows, one per sequence
    loss, metrics = policy_loss(logprobs, old_logprobs, advantages, response_mask, ...)

GRPO's own math. The additions live in their own modules: GiGPO's step-level term (gigpo.py),
truncated importance sampling (tis.py), branch rollouts' targets (branch.py).

Everything here is plain tensor math with no model or engine in sight (an episode is read only
for its rewards and its sequences' masks), so it can be read top to bottom
and unit-tested on CPU. Shapes: B sequences, T token positions.

References
  GRPO       Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), Sec. 4.1
  PPO-clip   Schulman et al. 2017, "Proximal Policy Optimization" (arXiv:1707.06347), Eq. 7
  Dr. GRPO   Liu et al. 2025, "Understanding R1-Zero-like Training" (arXiv:2503.20783), Sec. 3
  DAPO       Yu et al. 2025, "DAPO" (arXiv:2503.14476), Sec. 3.1 "Clip-Higher"
  k3 KL      Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


# ----------------------------------------------------------------------------- advantages

def group_advantages(rewards: Tensor, group_ids: Tensor, scale_by_std: bool = True,
                     eps: float = 1e-6) -> tuple[Tensor, dict]:
    """One advantage per episode, normalised within its group (the episodes sharing a group id),
    and the batch's reward statistics.

    rewards: float [N]; group_ids: long [N] (any ints, need not be contiguous or sorted).
    Returns [N] (float64 inside). Size-1 groups and groups with all-equal rewards get exactly 0.
    A group's episodes are all played on one rank, so no statistic needs another rank's episodes.
    """
    r = rewards.detach().to(torch.float64)
    _, g = torch.unique(group_ids, return_inverse=True)  # arbitrary ids -> 0..G-1
    G = int(g.max()) + 1 if g.numel() else 0
    zeros = r.new_zeros(G)

    # mean_g = (1/|g|) sum_{i in g} r_i
    count = zeros.index_add(0, g, torch.ones_like(r))
    mean = zeros.index_add(0, g, r) / count
    centered = r - mean[g]
    # std_g = sqrt( sum_{i in g} (r_i - mean_g)^2 / (|g| - 1) )  -- the *sample* (unbiased)
    # std, as torch.std's default and TRL's GRPOTrainer. A size-1 group has no std (0/0);
    # it is caught by the all-equal rule below.
    std = (zeros.index_add(0, g, centered**2) / (count - 1).clamp_min(1)).sqrt()

    if scale_by_std:
        # GRPO (Shao et al. 2024, Sec. 4.1.2 outcome supervision): A_i = (r_i - mean_g) / (std_g + eps)
        adv = centered / (std[g] + eps)
    else:
        # Dr. GRPO (Liu et al. 2025, Sec. 3.1): drop the std, which up-weights groups that are
        # nearly all-right or all-wrong: A_i = r_i - mean_g
        adv = centered

    # A group whose rewards are all equal carries no learning signal: A_i = 0 *exactly*
    # (r - mean can be ~1e-17 off after the float division, so set it explicitly).
    rmax = r.new_full((G,), -torch.inf).scatter_reduce(0, g, r, "amax")
    rmin = r.new_full((G,), torch.inf).scatter_reduce(0, g, r, "amin")
    constant = rmax == rmin  # includes size-1 groups
    adv = torch.where(constant[g], torch.zeros_like(adv), adv)

    stats = {
        "reward_mean": r.mean().item() if r.numel() else 0.0,
        "reward_std": r.std().item() if r.numel() > 1 else 0.0,  # unbiased, over this rank's episodes
        "zero_variance_group_frac": constant.double().mean().item() if G else 0.0,
        "num_groups": float(G),
    }
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return adv.to(out_dtype), stats


# ----------------------------------------------------------------------------- per-turn values on reply tokens

def reply_spans(response_mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each reply (run of 1s) in a response mask, in order."""
    spans, start = [], None
    for j, m in enumerate(list(response_mask) + [0]):
        if m and start is None:
            start = j
        elif not m and start is not None:
            spans.append((start, j))
            start = None
    return spans


def reply_count(response_mask: list[int]) -> int:
    return len(reply_spans(response_mask))


def spread_over_replies(response_mask: list[int], values: list[float]) -> Tensor:
    """A per-token advantage row for one sequence: every token of its k-th reply (the k-th run of
    1s in the mask) carries values[k]; prompt and observation tokens carry 0.

    The row is aligned with the trainer's shifted targets (entry j is about token j + 1), so it
    drops the first token, which nothing predicts. len(values) must equal the number of replies."""
    spans, row = reply_spans(response_mask), torch.zeros(len(response_mask) - 1)
    if len(spans) != len(values):
        raise ValueError(f"{len(spans)} replies in the mask, {len(values)} values")
    for (start, end), value in zip(spans, values):
        row[max(start - 1, 0):end - 1] = value
    return row


# ----------------------------------------------------------------------------- episodes -> experiences

@dataclass
class Experience:
    """One trained sequence and everything the loss needs of it (one record, as in tiny-grpo).

    Per-token rows are aligned with the trainer's shifted targets: entry j is about token j + 1,
    the token that position j predicts."""
    sequence: object  # rollout.Sequence: token ids, response mask, the engine's logprobs, images
    advantages: Tensor  # [len - 1]: the advantage of each target token (0 off the replies)
    episode: int  # index of its episode on this rank (mini-batches split episodes, not sequences)
    old_logprobs: Tensor | None = None  # [len - 1] log pi_old; None: the update is single-pass
    ref_logprobs: Tensor | None = None  # [len - 1] log pi_ref, for the KL term


def episode_advantages(episodes: list, scale_by_std: bool = True) -> tuple[list[list[float]], dict]:
    """A^E_i, each episode's strict reward R_i (1 for success, else 0) normalised within its group
    (a group's episodes are all on this rank), once for every turn it played: the advantage each
    token of that turn's reply carries (GiGPO adds its step-level term to these: gigpo.py). And the
    step's reward statistics."""
    rewards = torch.tensor([float(e.reward) for e in episodes])
    advantages, stats = group_advantages(rewards, torch.tensor([e.group_id for e in episodes]),
                                         scale_by_std=scale_by_std)
    stats.pop("reward_mean")  # the rollout's own metrics report it
    return [[float(a)] * e.num_turns for a, e in zip(advantages, episodes)], stats


def to_experiences(episodes: list, turn_advantages: list[list[float]]) -> list[Experience]:
    """One Experience per training sequence of this rank's episodes: every token of episode i's
    reply t carries turn_advantages[i][t] (spread_over_replies)."""
    experiences = []
    for i, (e, values) in enumerate(zip(episodes, turn_advantages)):
        for seq in e.sequences:  # an episode's sequences hold its replies in order
            n = reply_count(seq.response_mask)
            experiences.append(Experience(seq, spread_over_replies(seq.response_mask, values[:n]), i))
            values = values[n:]
    return experiences


# ----------------------------------------------------------------------------- per-token math

def masked_mean(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    """sum(x * m) / sum(m) over `dim` (all if None); masked entries may hold nan/inf."""
    m = mask.bool()
    x = torch.where(m, x, torch.zeros_like(x))
    if dim is None:
        return x.sum() / m.sum().clamp_min(1)
    return x.sum(dim) / m.sum(dim).clamp_min(1)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref) for tokens sampled from pi (Schulman 2020):
    k3 = r - log r - 1 with r = pi_ref / pi = exp(ref - logp). Unbiased and always >= 0."""
    log_r = ref_logprobs - logprobs
    return torch.exp(log_r) - log_r - 1


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor,
                clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, aggregation: str = "token-mean",
                loss_normalizer: float | Tensor | None = None, ref_logprobs: Tensor | None = None,
                kl_coef: float = 0.0, token_weights: Tensor | None = None) -> tuple[Tensor, dict]:
    """GRPO's clipped surrogate loss (to minimise) and detached float metrics (IDLE_METRICS's keys).

    logprobs (with grad), old_logprobs, response_mask, ref_logprobs: [B, T];
    advantages: [B], one per sequence, broadcast over its tokens, or [B, T], one per token
    (per-turn advantages: each reply's tokens carry that turn's value). response_mask is 1 on
    tokens the policy generated, 0 on prompt / tool-observation / padding positions; those
    contribute exactly nothing, even if their log-probs are nan or inf. `aggregation` and
    `loss_normalizer`: aggregate_loss. `token_weights` [B, T] (no gradient) multiply each token's
    policy-gradient term: truncated importance sampling's (tis.py).
    """
    mask = response_mask.bool()
    zero = torch.zeros_like(logprobs)
    # Scrub masked positions *before* any exp/log: torch.where in the backward pass sends
    # 0 to the unselected branch, so nan/inf there can neither reach the loss nor the grads.
    logp = torch.where(mask, logprobs, zero)
    old = torch.where(mask, old_logprobs.detach().to(logp.dtype), zero)
    A = advantages.detach().to(logp.dtype)
    A = A.unsqueeze(-1) if A.dim() == 1 else torch.where(mask, A, zero)  # [B, 1] or [B, T]

    # PPO-clip (Schulman et al. 2017, Eq. 7), per token t of sequence i, as in GRPO Eq. 3:
    #   ratio = pi_theta(o_t) / pi_old(o_t) = exp(logp - old_logp)
    #   L_t = -min( ratio * A_i , clip(ratio, 1 - eps_low, 1 + eps_high) * A_i )
    # (A_it in place of A_i with per-token advantages.)
    # eps_high > eps_low is DAPO's "clip-higher" (Yu et al. 2025, Sec. 3.1, eps_high = 0.28).
    ratio = torch.exp(logp - old)
    surr_unclipped = ratio * A
    surr_clipped = torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * A
    per_token = -torch.minimum(surr_unclipped, surr_clipped)
    if token_weights is not None:
        per_token = token_weights * per_token  # L_t <- w_t * L_t
    pg_per_token = per_token

    kl = None
    if ref_logprobs is not None:
        ref = torch.where(mask, ref_logprobs.detach().to(logp.dtype), zero)
        kl = kl_k3(logp, ref)
        if kl_coef > 0:
            # GRPO Eq. 3: L_t += beta * D_KL[pi_theta || pi_ref], estimated per token by k3.
            per_token = per_token + kl_coef * kl

    loss = aggregate_loss(per_token, mask, aggregation, loss_normalizer)

    with torch.no_grad():
        # Clipping "changed the objective" where the clipped surrogate is strictly the min;
        # there its gradient w.r.t. logp is zero.
        clipped = (surr_clipped < surr_unclipped) & mask
        metrics = {
            "clip_frac": (clipped.sum() / mask.sum().clamp_min(1)).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "kl": masked_mean(kl, mask).item() if kl is not None else 0.0,
            "pg_loss": aggregate_loss(pg_per_token, mask, aggregation, loss_normalizer).item(),
        }
    return loss, metrics


# What policy_loss's metrics read in a step that trains no token: the ratio at 1, the rest at 0.
IDLE_METRICS = {"clip_frac": 0.0, "ratio_mean": 1.0, "kl": 0.0, "pg_loss": 0.0}


def aggregate_loss(per_token: Tensor, mask: Tensor, aggregation: str,
                   loss_normalizer: float | Tensor | None = None) -> Tensor:
    """The loss from its per-token terms L_it; masked tokens count 0.

    "token-mean": sum over all masked tokens / loss_normalizer. The default normaliser is this
        call's masked-token count. For gradient accumulation pass the masked-token count of the
        whole mini-batch (all micro-batches, all ranks): the micro-batch losses then *sum* to
        exactly the mini-batch token mean (DAPO Sec. 3.3). DDP/FSDP *average* gradients over
        ranks, so there pass count / world_size. A constant normaliser (e.g. B * max_len) gives
        Dr. GRPO's length-unbiased sum (Liu et al. 2025, Sec. 3.1).
    "seq-mean": mean over each sequence's masked tokens, then sum over sequences / loss_normalizer
        (default B): the original GRPO objective (Shao et al. Eq. 3)."""
    x = torch.where(mask, per_token, torch.zeros_like(per_token))
    if aggregation == "token-mean":
        # L = sum_{i,t} m_it L_it / N_tokens
        norm = mask.sum().clamp_min(1) if loss_normalizer is None else loss_normalizer
        return x.sum() / norm
    if aggregation == "seq-mean":
        # L = (1/B) sum_i (1/|o_i|) sum_t m_it L_it
        seq = x.sum(-1) / mask.sum(-1).clamp_min(1)
        norm = x.shape[0] if loss_normalizer is None else loss_normalizer
        return seq.sum() / norm
    raise ValueError(f"unknown aggregation {aggregation!r}")


# ----------------------------------------------------------------------------- log-probs

def token_logprobs(logits: Tensor, target_ids: Tensor, temperature: float = 1.0,
                   logit_bias: dict[int, float] | None = None) -> Tensor:
    """log softmax((logits + bias) / temperature)[target] per position: [B, T, V], [B, T] -> float32 [B, T].

    Alignment: logits at position t predict token t+1, so the caller passes
    logits[:, :-1] and input_ids[:, 1:]. temperature must match the one the rollout engine
    sampled with (and whose log-probs it reported), else the ratio is off from step one.
    logit_bias ({token id: added logit}) is the engine's, where its log-probs include it (vLLM adds
    it to the fp32 logits, then divides by the temperature: policy.sequence_logprobs says when).

    log p(y) = z_y - logsumexp(z), z = (logits + bias) / temperature. Done one sequence at a time in
    float32 (bf16 logsumexp loses ~0.1 nats) so only one [T, V] float copy is live at once.
    """
    bias = bias_row(logit_bias, logits.shape[-1], logits.device)
    out = []
    for row_logits, row_targets in zip(logits, target_ids):
        z = row_logits.float() if bias is None else row_logits.float() + bias
        z = z / temperature
        picked = z.gather(-1, row_targets.long().unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(z, dim=-1))
    return torch.stack(out) if out else logits.new_zeros(target_ids.shape, dtype=torch.float32)


def bias_row(logit_bias: dict[int, float] | None, vocab: int, device) -> Tensor | None:
    """A logit bias ({token id: added logit}) as one float32 row over the vocabulary; None for none."""
    if not logit_bias:
        return None
    row = torch.zeros(vocab, dtype=torch.float32, device=device)
    row[list(logit_bias)] = torch.tensor(list(logit_bias.values()), dtype=torch.float32, device=device)
    return row


LOGITS_CHUNK = 1024  # positions whose logits exist at once in chunked_token_logprobs (bench/sizing.py counts it)


def chunked_token_logprobs(hidden: Tensor, head_weight: Tensor, target_ids: Tensor, temperature: float = 1.0,
                           logit_bias: dict[int, float] | None = None, chunk: int = LOGITS_CHUNK) -> Tensor:
    """token_logprobs from the final hidden states, without [B, T, V] logits: [B, T, H], [V, H], [B, T] -> [B, T].

    The same numbers as token_logprobs(hidden @ head_weight^T, ...): logits in the model's dtype,
    then float32. But a real vocabulary is large (Qwen3-VL: V = 151,936; 4k tokens of fp32 logits
    are 2.5 GB, and autograd would keep them all, with the model's bf16 logits, until backward).
    Here positions go through `chunk` at a time under activation checkpointing: autograd keeps only
    the hidden states (H numbers a token), and one chunk's logits exist at a time, in the forward
    pass and again when backward recomputes them. Memory then follows a micro-batch's tokens, not
    tokens x vocabulary (bench/sizing.py counts it that way)."""
    from torch.utils.checkpoint import checkpoint

    B, T, H = hidden.shape
    bias = bias_row(logit_bias, head_weight.shape[0], hidden.device)
    flat_hidden, flat_targets = hidden.reshape(B * T, H), target_ids.reshape(B * T)
    parts = [checkpoint(_chunk_logprobs, flat_hidden[i:i + chunk], head_weight, flat_targets[i:i + chunk],
                        temperature, bias, use_reentrant=False)
             for i in range(0, B * T, chunk)]
    return torch.cat(parts).view(B, T) if parts else hidden.new_zeros((B, T), dtype=torch.float32)


def _chunk_logprobs(hidden: Tensor, head_weight: Tensor, targets: Tensor, temperature: float,
                    bias: Tensor | None) -> Tensor:
    # log p(y) = z_y - logsumexp(z),  z = (h W^T + bias) / T, in float32 as token_logprobs
    z = torch.nn.functional.linear(hidden, head_weight).float()
    z = (z if bias is None else z + bias) / temperature
    return z.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def sampled_mask(response_mask: Tensor, rollout_logprobs: Tensor) -> Tensor:
    """The trained tokens the engine sampled: response tokens whose rollout log-prob is not NaN
    (rollout.NO_LOGPROB marks a forced reply, which the engine never sampled)."""
    return response_mask.bool() & ~rollout_logprobs.isnan()


@torch.no_grad()
def logprob_mismatch(trainer_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor) -> dict:
    """How far the trainer's log-probs are from the inference engine's on the sampled tokens.

    Near-zero values are the per-step evidence that the engine samples from the current
    policy (weights synced, same temperature, same tokens). Python floats:
      mismatch_abs_mean = mean |logp_trainer - logp_rollout|  over masked tokens
      mismatch_abs_max  = max  |logp_trainer - logp_rollout|
      mismatch_k3       = mean k3(logp_trainer, logp_rollout)
    Forced tokens (rollout log-prob NaN, sampled_mask) are not counted: the engine sampled none.
    """
    mask = sampled_mask(response_mask, rollout_logprobs)
    t = torch.where(mask, trainer_logprobs.double(), 0.0)
    r = torch.where(mask, rollout_logprobs.double(), 0.0)
    diff = (t - r).abs()
    return {
        "mismatch_abs_mean": masked_mean(diff, mask).item(),
        "mismatch_abs_max": diff.max().item() if diff.numel() else 0.0,  # masked entries are 0
        "mismatch_k3": masked_mean(kl_k3(t, r), mask).item(),
    }
