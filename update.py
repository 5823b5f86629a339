"""The update: one rollout batch's policy-gradient step on the LoRA, and the checks around it.

    optimizer, scheduler = make_optimizer(model, cfg.lr), make_scheduler(optimizer, cfg)
    metrics = grpo_update(cfg, model, optimizer, scheduler, batch, experiences, num_episodes, device,
                          reweight=tis.TruncatedIS(cfg.tis_cap))
    guard.check(step, metrics["mismatch_abs_mean"], metrics["mismatch_tokens"])   # StalePolicyGuard

Micro-batches of the batch's sequences (packed by count and tokens, the same number on every
rank: FSDP's forward and backward are collectives) go through policy.sequence_logprobs and
grpo.policy_loss; gradients accumulate over a mini-batch, then one optimizer step. The loss's
normaliser counts the whole mini-batch over all ranks, so the accumulated gradient is the
mini-batch's mean whatever the micro-batching (Lockstep holds this plumbing). The same forward
pass measures how far the trainer's log-probs are from the engine's (MismatchMeter), the proof
that the engine sampled from this policy, which StalePolicyGuard turns into a stop when it is not.
"""

import torch
import torch.distributed as dist

import distributed
import grpo
from policy import Batch, lora_parameters, sequence_logprobs


# ----------------------------------------------------------------------------- micro-batches and checks

def pad_rows(rows: list, device) -> torch.Tensor:
    out = torch.zeros((len(rows), max(len(r) for r in rows)), device=device)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def synced_micro_batches(indices: list[int], size: int, length=None, max_tokens: int = 0) -> list:
    """Micro-batches of `indices`, padded with None up to the largest count on any rank.

    With `length` (index -> token count) the sequences are sorted longest first, so each
    micro-batch holds sequences of similar length and little compute goes to padding. The
    gradient is a sum over sequences, so the order does not change it. A micro-batch holds at
    most `size` sequences and, with `max_tokens`, at most that many tokens once padded to its
    longest (count x longest): what the update's memory follows (bench/sizing.py); a sequence
    longer than the budget goes alone. FSDP's forward and backward are collectives, so every rank
    must run the same number of them; ranks with fewer sequences run a zero-weight filler (None)."""
    if length is not None:
        indices = sorted(indices, key=length, reverse=True)
    local = []
    for i in indices:
        current = local[-1] if local else None
        fits = current is not None and len(current) < size and (
            max_tokens <= 0 or length is None or (len(current) + 1) * length(current[0]) <= max_tokens)
        if fits:
            current.append(i)
        else:
            local.append([i])
    return local + [None] * (int(distributed.max_over_ranks(len(local))) - len(local))


class MismatchMeter:
    """Token-weighted logprob mismatch (trainer vs vLLM) over micro-batches and ranks."""

    def __init__(self):
        self.sums = [0.0, 0.0, 0.0]  # |diff| sum, k3 sum, tokens
        self.worst = 0.0

    def add(self, logprobs, rollout_logprobs, mask):
        m = grpo.logprob_mismatch(logprobs, rollout_logprobs, mask)
        tokens = grpo.sampled_mask(mask, rollout_logprobs).sum().item()  # forced tokens were not sampled
        self.sums = [self.sums[0] + m["mismatch_abs_mean"] * tokens, self.sums[1] + m["mismatch_k3"] * tokens,
                     self.sums[2] + tokens]
        self.worst = max(self.worst, m["mismatch_abs_max"])

    def result(self) -> dict:
        """Reduced over all ranks (a collective: every rank must call it). mismatch_tokens 0: nothing
        was measured (the step trained no sampled token), and the means say nothing."""
        abs_sum, k3_sum, tokens = distributed.sum_over_ranks(self.sums)
        return {"mismatch_abs_mean": abs_sum / max(tokens, 1.0), "mismatch_k3": k3_sum / max(tokens, 1.0),
                "mismatch_abs_max": distributed.max_over_ranks(self.worst), "mismatch_tokens": tokens}


class StalePolicyGuard:
    """Stops the run when the engine is evidently not sampling from the policy being trained.

    The per-step mismatch (mean |log pi_trainer - log pi_engine| over the sampled tokens, reduced
    over ranks, so every rank decides alike) sits at the stack's own noise when the sync works:
    ~1e-7 on a CPU in fp32, ~1e-3..1e-2 on a GPU in bf16, which TIS absorbs. A stale adapter in
    the engine (a reused id, a sync that did not land, an adapter lost after sleep/wake: vLLM
    issue 53888) shows as a mismatch above that, growing step after step as the trained policy
    moves away from the one the engine still serves; training on such samples is training on
    another policy's data. After `steps` steps in a row above the bound, one line and exit.

    The bound is the stack's noise times NOISE_FACTOR, measured where nothing else can be in it:
    the first step of a fresh run, whose LoRA is PEFT's initial one (B = 0: the base model, with
    or without the adapter in the engine), every sampled sequence measured (`calibrating`). It is
    never below FLOOR (1e-3 on a CPU, ~1,000x its noise; a skipped sync of the tiny model measured
    ~0.2), and a checkpoint carries it (`bound`), so a resumed run keeps it. Given (--mismatch-bound)
    it is fixed; a run resumed from a checkpoint without one takes LEGACY_BOUND. A step that
    measured no token (every group without reward spread: the update ran no sequence) is no
    evidence either way: it neither counts nor breaks a streak. steps 0: off."""

    NOISE_FACTOR = 5.0
    FLOOR = {"cpu": 1e-3, "gpu": 2e-3}
    LEGACY_BOUND = {"cpu": 1e-3, "gpu": 0.1}  # the fixed bounds before calibration

    def __init__(self, bound: float = 0.0, steps: int = 3, on_gpu: bool = False, start_step: int = 0,
                 saved_bound: float | None = None):
        self.stack = "gpu" if on_gpu else "cpu"
        self.bound = bound or saved_bound or (None if start_step == 0 else self.LEGACY_BOUND[self.stack])
        self.steps = steps
        self.above = []  # the mismatches of the current run of steps above the bound

    @property
    def calibrating(self) -> bool:
        """The next step measures the noise: the update measures every sampled sequence."""
        return self.bound is None

    def check(self, step: int, mismatch: float, tokens: float = 1.0):
        if tokens == 0:
            return
        if self.bound is None:
            self.bound = max(self.FLOOR[self.stack], self.NOISE_FACTOR * mismatch)
            return
        self.above = self.above + [mismatch] if mismatch > self.bound else []
        if self.steps and len(self.above) >= self.steps:
            raise SystemExit(
                f"step {step}: the trainer's and the engine's log-probs of the sampled tokens differ by "
                f"{', '.join(f'{m:.3g}' for m in self.above[-self.steps:])} (mean |difference|) in {self.steps} "
                f"steps in a row, above the bound {self.bound:.3g}: the engine is not sampling from the policy "
                "being trained. Likely causes: the new adapter did not reach the engine (a reused LoRA id or "
                "path, a failed or skipped sync, an adapter lost in sleep/wake), a temperature or logprob mode "
                "that differs between engine and trainer, or another base model in the engine. Stopped before "
                "training on more of them; --mismatch-bound raises the bound, --mismatch-steps 0 turns this off.")


# ----------------------------------------------------------------------------- the update

def make_optimizer(model, lr: float, weight_decay: float = 0.0):
    """AdamW over the LoRA weights, one rate for A and B."""
    return torch.optim.AdamW([p for _, p in lora_parameters(model)], lr=lr, weight_decay=weight_decay)


def make_scheduler(optimizer, cfg):
    """transformers' schedules: a linear warm-up from 0, then warmup-stable-decay (constant, then a
    cosine decay to 0 over the last decay_frac of the run: the policy a run ends with is then the
    settled end of its trajectory, not one noisy step of it), a cosine decay over the whole run,
    or constant."""
    from transformers import get_scheduler

    total = cfg.steps * cfg.num_mini_batches * cfg.ppo_epochs
    if cfg.lr_schedule == "wsd":
        return get_scheduler("warmup_stable_decay", optimizer, num_warmup_steps=cfg.warmup_steps,
                             num_training_steps=total,
                             scheduler_specific_kwargs={"num_decay_steps": max(1, round(cfg.decay_frac * total))})
    return get_scheduler("cosine" if cfg.lr_schedule == "cosine" else "constant_with_warmup", optimizer,
                         num_warmup_steps=cfg.warmup_steps, num_training_steps=total)


def single_pass(cfg) -> bool:
    """One optimizer step per rollout batch and no KL term: the policy being updated IS the one
    that sampled, so pi_old = pi_theta.detach() and the separate old-logprob pass is skipped."""
    return cfg.num_mini_batches == 1 and cfg.ppo_epochs == 1 and cfg.kl_coef == 0


def grpo_update(cfg, model, optimizer, scheduler, batch: Batch, experiences: list, num_episodes: int,
                device, measure_every_sequence: bool = False, reweight=None) -> dict:
    """Mini-batches of episodes (one optimizer step each) of micro-batches of their sequences.

    Without old logprobs (single pass) the ratio is exp(logp - logp.detach()) = 1 with the
    gradient of logp, and the rollout mismatch is measured on this very forward pass. Otherwise
    (mini-batches, epochs or a KL term) pi_old, and pi_ref for the KL, are computed first, before
    the first optimizer step moves the policy (fill_old_logprobs).

    Sequences whose advantages are all 0 (every member of their group scored the same) are not
    run when there is no KL term: their loss and gradient are exactly zero, and they still count
    in the normaliser (Lockstep.mini_batches). measure_every_sequence runs them too, so that the
    mismatch covers every sampled token: StalePolicyGuard's calibration step. `reweight`
    (tis.TruncatedIS) gives each micro-batch's token weights; None: none."""
    lockstep = Lockstep(cfg, batch, device)
    if not single_pass(cfg):
        fill_old_logprobs(model, lockstep, experiences, with_ref=cfg.kl_coef > 0)
    old_known = bool(experiences) and experiences[0].old_logprobs is not None  # else pi_old = pi, detached
    model.train()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for rows, normalizer in lockstep.mini_batches(experiences, num_episodes, every_sequence=measure_every_sequence):
        optimizer.zero_grad(set_to_none=True)
        for idx, _, mask, rollout_logprobs, logprobs in lockstep.forward(model, rows, measure=not old_known):
            chosen = [experiences[i] for i in ([0] if idx is None else idx)]
            old_logprobs = pad_rows([x.old_logprobs for x in chosen], device) if old_known else logprobs.detach()
            weights, weight_metrics = reweight(old_logprobs, rollout_logprobs, mask) if reweight else (None, {})
            loss, loss_metrics = grpo.policy_loss(
                logprobs, old_logprobs, pad_rows([x.advantages for x in chosen], device), mask,
                clip_eps_low=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high,
                aggregation=cfg.loss_aggregation, loss_normalizer=normalizer,
                ref_logprobs=pad_rows([x.ref_logprobs for x in chosen], device) if cfg.kl_coef > 0 else None,
                kl_coef=cfg.kl_coef, token_weights=weights)
            (loss * (0.0 if idx is None else 1.0)).backward()  # a filler's gradient is exactly zero
            if idx is not None:
                lockstep.record({**loss_metrics, **weight_metrics})
        lockstep.clip_gradients(params, cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
    out = lockstep.result(idle={**grpo.IDLE_METRICS, **(reweight.IDLE_METRICS if reweight else {})})
    out.update(lr=scheduler.get_last_lr()[0], trained_sequence_frac=lockstep.trained / max(len(experiences), 1))
    if torch.cuda.is_available():
        optimizer.zero_grad(set_to_none=True)  # the gradients are spent: free them for the engine
        torch.cuda.empty_cache()  # and the trainer's cached blocks (vLLM's wake_up does it too)
    return out


@torch.no_grad()
def fill_old_logprobs(model, lockstep: "Lockstep", experiences: list, with_ref: bool):
    """pi_old (and pi_ref for the KL) of every sampled token, when the update is not single-pass;
    also the proof that the engine sampled from this same policy (the mismatch, in `lockstep`)."""
    model.eval()
    for idx, inputs, mask, _, logprobs in lockstep.forward(model, list(range(len(experiences))), measure=True):
        ref = None
        if with_ref:
            with model.disable_adapter():  # the reference policy is the base model
                ref = sequence_logprobs(model, inputs, lockstep.cfg.temperature, lockstep.batch.banned_token_ids)
        if idx is None:  # a filler: FSDP needs every rank in every forward
            continue
        for row, i in enumerate(idx):  # unpadded rows: the update may group them differently
            n = len(experiences[i].sequence.token_ids) - 1
            experiences[i].old_logprobs = logprobs[row, :n].cpu()
            experiences[i].ref_logprobs = None if ref is None else ref[row, :n].cpu()


class Lockstep:
    """An update's plumbing: what keeps every rank in step, and what it measures on the way.

    FSDP's forward and backward are collectives, so every rank runs as many micro-batches: a rank
    with fewer runs fillers (any one sequence, with weight 0). A mini-batch's loss normaliser counts
    it over all ranks. The forward passes over the sampled sequences measure the trainer-vs-engine
    mismatch (MismatchMeter); the micro-batches' metrics are averaged, whatever the loss reports."""

    def __init__(self, cfg, batch: Batch, device):
        self.cfg, self.batch, self.device = cfg, batch, device
        self.mismatch = MismatchMeter()
        self.metrics = {}  # name -> its value in each micro-batch that trained (grad_norm: each optimizer step)
        self.trained = 0  # sequences run, over the mini-batches and epochs

    def mini_batches(self, experiences: list, num_episodes: int, every_sequence: bool):
        """Yields each mini-batch's rows (the experiences of its episodes) and loss normaliser, epoch
        after epoch. Token-mean divides by the mini-batch's response tokens over ALL ranks (seq-mean
        by its sequences), then by world size since FSDP averages gradients. Rows whose advantages
        are all 0 are then left out when there is no KL term, unless `every_sequence`: the update
        is the same as if they had been run, only cheaper."""
        cfg, per_mini = self.cfg, num_episodes // self.cfg.num_mini_batches
        for mb in [m for _ in range(cfg.ppo_epochs) for m in range(cfg.num_mini_batches)]:
            rows = [i for i, x in enumerate(experiences) if mb * per_mini <= x.episode < (mb + 1) * per_mini]
            count = sum(sum(experiences[i].sequence.response_mask) if cfg.loss_aggregation == "token-mean" else 1
                        for i in rows)
            normalizer = distributed.sum_over_ranks([count])[0] / dist.get_world_size()
            if cfg.kl_coef == 0 and not every_sequence:
                rows = [i for i in rows if bool(experiences[i].advantages.any())]
            self.trained += len(rows)
            yield rows, normalizer

    def forward(self, model, rows: list[int], measure: bool):
        """Yields, for each micro-batch of `rows` (synced_micro_batches, as many on every rank), its
        rows (None: a filler, which runs row 0), model inputs, response mask, rollout log-probs and
        the policy's log-probs. With `measure`, the mismatch is measured on it."""
        cfg, batch = self.cfg, self.batch
        for idx in synced_micro_batches(rows, cfg.micro_batch_size, batch.length, cfg.micro_batch_tokens):
            inputs, mask, rollout_logprobs = batch.micro([0] if idx is None else idx, self.device)
            logprobs = sequence_logprobs(model, inputs, cfg.temperature, batch.banned_token_ids)
            if measure and idx is not None:
                self.mismatch.add(logprobs.detach(), rollout_logprobs, mask)
            yield idx, inputs, mask, rollout_logprobs, logprobs

    def record(self, metrics: dict):
        for name, value in metrics.items():
            self.metrics.setdefault(name, []).append(value)

    def clip_gradients(self, params: list, max_norm: float):
        """Clip the gradients to a total norm of `max_norm` over all ranks, and record the norm."""
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)  # under FSDP a DTensor: made whole to be read
        self.record({"grad_norm": (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()})

    def result(self, idle: dict) -> dict:
        """The metrics' means (`idle`'s value for one no micro-batch measured) and the mismatch,
        reduced over ranks (a collective)."""
        return {**idle, **{name: sum(v) / len(v) for name, v in self.metrics.items()}, **self.mismatch.result()}
