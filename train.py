"""GRPO post-training of a vision-language model on visual mazes: torchrun + FSDP2 + LoRA + vLLM.

    python train.py                                  # a world of one, the tiny model, CPU
    torchrun --nproc-per-node 8 train.py --model Qwen/Qwen3-VL-8B-Instruct --difficulty easy
    bash launch/run.sh                               # the main job: tiny model, SFT warm start, GRPO

Every process owns two things: an FSDP2 shard of the policy (HF Qwen3-VL + PEFT LoRA, policy.py)
and a whole in-process vLLM engine (rollout.py). One step:

    1. rollouts      every rank plays its share of the step's mazes, group_size episodes each
    2. advantages    rewards are normalised within each group over all ranks (grpo.py), plus
                     GiGPO's step-level term for moves made from the same cell
    3. update        the PPO-clip loss on the sampled tokens, one optimizer step per mini-batch
    4. sync          rank 0 writes the LoRA adapter to shared storage; every engine loads it
                     under a new id, and the next step's logprob mismatch proves it did
    5. eval / checkpoint / export on their intervals, one metrics line per step

On a GPU the engine sleeps while the trainer updates (--engine-sleep: by default its weights go
to host RAM and its KV cache is dropped; rollout.EngineSleep has the other choices) and wakes up
for the next rollouts; on a CPU sleep does not exist and both stay put.

What of GRPO this keeps (DeepSeekMath Sec. 4): group-relative advantages with the std division
(--scale-adv-by-std false gives Dr. GRPO), the clipped ratio, token-mean loss, an optional k3 KL
to the base model (off by default, as in DAPO and Dr. GRPO). What it adds: clip-higher, GiGPO's
step-level advantages for the multi-turn setting, truncated importance sampling against the
engine's own logprobs, and an optional dense reward for progress toward the goal (off by default:
it did not lift greedy play, docs/experiments.md). With one optimizer step per rollout batch (the
default) the old policy is the current one, so there is no separate old-logprob pass: the ratio is
1 with the gradient of log pi, which is exactly the policy gradient.
"""

import argparse
import dataclasses
import gc
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import rollout  # first: sets vLLM's environment before anything imports vllm

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tqdm import tqdm  # noqa: E402

import branch  # noqa: E402
import checkpoint  # noqa: E402
import distributed  # noqa: E402
import env  # noqa: E402
import grpo  # noqa: E402
import policy  # noqa: E402
from distributed import log0  # noqa: E402


# ----------------------------------------------------------------------------- configuration

@dataclass
class Config:
    # model and task
    model: str = ""  # any HF Qwen3-VL directory or hub id; empty: the tiny model, built on first use
    difficulty: str = "small"  # tiny 5x5 | small 7x7 | easy 9x9 (VisGym) | hard 11x11 (VisGym)
    env_style: str = "ours"  # or visgym: VisGym's maze for a seed, drawing, texts and parser (env.py)
    cell_px: int = 0  # 0: the style's own (32 px ours: one cell per merged visual token; 25 visgym)
    max_turns: int = 15
    # the training rollouts' turn limit (0: max_turns). More turns than evaluation gives room to
    # recover from a wrong branch; the discount (gamma) still prices every wasted turn
    train_max_turns: int = 0
    max_new_tokens: int = 32  # per turn
    max_model_len: int = 4096
    max_images: int = 0  # keep only the last k images in the conversation; 0: full history
    train_pool: int = 0  # 0: an endless stream of new training mazes; N: the first N over and over
    # GRPO
    steps: int = 20
    prompts_per_step: int = 8  # mazes per step over all ranks; each is played group_size times
    group_size: int = 8
    temperature: float = 1.0  # rollout sampling; the loss uses the same tempered policy
    scale_adv_by_std: bool = True  # False: Dr. GRPO
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2  # > clip_eps_low: DAPO's clip-higher
    loss_aggregation: str = "token-mean"  # or seq-mean
    kl_coef: float = 0.0  # KL to the base model (LoRA disabled); 0 skips the reference pass
    step_adv_weight: float = 0.0  # GiGPO: A_t = A_episode + w * A_step_t; 0 = plain GRPO
    gamma: float = 0.95  # discount of the per-turn returns G_t = sum_k gamma^(k-t) * r_k
    # shaping: +c for each step closer to the goal, -c for each step away (grpo.progress_rewards);
    # training only, evaluation stays strict. 0: the strict reward alone
    progress_reward: float = 0.0
    tis_cap: float = 2.0  # truncated importance sampling against the engine's logprobs; 0: off
    # branch rollouts (branch.py): per group, up to this many forks its members passed are replayed
    # with every open move forced and the policy finishing each; the best branch's move becomes a
    # target, L = -w log pi_T(a* | s) (grpo.branch_target_advantages). 0: off
    branch_points_per_group: int = 0
    branch_weight: float = 1.0  # w, the advantage on a target's reply tokens
    # optimisation
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0  # optimizer steps
    lr_schedule: str = "constant"  # or cosine (transformers.get_scheduler)
    max_grad_norm: float = 1.0
    num_mini_batches: int = 1  # optimizer steps per pass over the rollout batch
    ppo_epochs: int = 1  # passes over each rollout batch (PPO's sample reuse; the clip bounds the drift)
    micro_batch_size: int = 4  # sequences per forward/backward
    # LoRA and sharding
    lora_rank: int = 0  # 0: 32 (the published recipe) for real models, 8 for the tiny one
    lora_alpha: int = 0  # 0: 2 * rank
    lora_dropout: float = 0.0
    lora_plus_ratio: float = 0.0  # LoRA+: B learns this many times faster than A (lr); 0: the same rate
    lora_targets: str = rollout.LORA_TARGET_REGEX
    shard_group_size: int = 0  # processes that shard one copy of the policy; 0: one node (HSDP)
    # engine
    gpu_memory_utilization: float = 0.45
    # how the engine frees the GPU for the update: offload (weights to host RAM) | kv (drop only the
    # KV cache) | none | auto (decides after the first step; rollout.EngineSleep). CPU: always none
    engine_sleep: str = "offload"
    # stop when the trainer-vs-engine logprob mismatch stays above this bound for mismatch_steps
    # steps in a row (a stale adapter in the engine); 0: the stack's own (policy.StalePolicyGuard)
    mismatch_bound: float = 0.0
    mismatch_steps: int = 3  # 0: never stop
    # evaluation, checkpoints, exports
    eval_interval: int = 10
    eval_mazes: int = 64
    sampled_eval_samples: int = 0  # >0: also the sampled solve rate at the start and end
    sampled_eval_temperature: float = 1.0  # its sampling temperature (1: the policy itself)
    ckpt_interval: int = 20
    export_interval: int = 20
    keep_checkpoints: int = 3
    keep_syncs: int = 3
    resume: str = "latest"  # latest | none | <checkpoint dir>
    resume_allow_changes: bool = False  # resume although meaningful settings differ (they take effect)
    archive_old_run: bool = False  # a fresh start into a used --out-dir moves the old run into <out>/archive/
    take_over_lock: bool = False  # take the run lock although its holder (on another host) may still run
    # paths and misc
    out_dir: str = "runs/default"
    shared_dir: str = ""  # visible to every node; empty: <out_dir>/shared
    seed: int = 0
    progress: bool = True

    def validate(self, world_size: int):
        problems = []
        if self.difficulty not in env.DIFFICULTY_SIZES:
            problems.append(f"difficulty must be one of {list(env.DIFFICULTY_SIZES)}")
        if self.env_style not in env.MAZE_STYLES:
            problems.append(f"env_style must be one of {list(env.MAZE_STYLES)}")
        if self.prompts_per_step % world_size:
            problems.append(f"prompts_per_step ({self.prompts_per_step}) must be a multiple of the "
                            f"number of processes ({world_size}) so every rank does the same work")
        if self.group_size < 2:
            problems.append("group_size must be >= 2: a group of one has no baseline")
        if (self.prompts_per_step // world_size * self.group_size) % self.num_mini_batches:
            problems.append("episodes per rank must divide into num_mini_batches")
        if not (self.temperature > 0 and self.sampled_eval_temperature > 0):
            problems.append("temperature and sampled_eval_temperature must be > 0 (greedy evaluation is separate)")
        if self.step_adv_weight < 0 or not 0 < self.gamma <= 1 or self.progress_reward < 0:
            problems.append("step_adv_weight and progress_reward must be >= 0 and gamma in (0, 1]")
        if self.loss_aggregation not in ("token-mean", "seq-mean"):
            problems.append("loss_aggregation must be token-mean or seq-mean")
        if self.lr_schedule not in ("constant", "cosine"):
            problems.append("lr_schedule must be constant or cosine")
        if self.tis_cap < 0 or self.train_pool < 0 or self.sampled_eval_samples < 0:
            problems.append("tis_cap, train_pool and sampled_eval_samples must be >= 0")
        if self.branch_points_per_group < 0 or self.branch_weight <= 0:
            problems.append("branch_points_per_group must be >= 0 and branch_weight > 0")
        for name in ("steps", "ppo_epochs", "max_turns", "max_new_tokens", "micro_batch_size", "eval_interval",
                     "ckpt_interval", "export_interval", "keep_checkpoints", "keep_syncs"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if self.engine_sleep not in rollout.ENGINE_SLEEP_MODES:
            problems.append(f"engine_sleep must be one of {list(rollout.ENGINE_SLEEP_MODES)}")
        if self.mismatch_bound < 0 or self.mismatch_steps < 0:
            problems.append("mismatch_bound and mismatch_steps must be >= 0")
        if self.train_max_turns < 0:
            problems.append("train_max_turns must be >= 0 (0: max_turns)")
        if self.lora_rank and self.lora_rank not in rollout.VLLM_LORA_RANKS:
            problems.append(f"lora_rank {self.lora_rank}: the engine (vLLM) takes only {list(rollout.VLLM_LORA_RANKS)}")
        if problems:
            raise SystemExit("bad config: " + "; ".join(problems))


def parse_bool(text: str) -> bool:
    value = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true/false/1/0/yes/no, got {text!r}")
    return value


def parse_config(argv=None) -> Config:
    """One flag per Config field: --prompts-per-step 8, --scale-adv-by-std false, ..."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    types = {"int": int, "float": float, "str": str, "bool": parse_bool}
    for f in dataclasses.fields(Config):
        kind = types[f.type] if isinstance(f.type, str) else {bool: parse_bool}.get(f.type, f.type)
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)
    return Config(**vars(parser.parse_args(argv)))


# ----------------------------------------------------------------------------- experiences

def turn_rewards(cfg: Config, e) -> list[float]:
    """The reward of each turn of an episode: the strict reward R at its last turn, plus the
    progress shaping term of every turn when --progress-reward is set."""
    rewards = [0.0] * e.num_turns
    if cfg.progress_reward > 0:
        distance = env.goal_distances(e.maze)
        rewards = grpo.progress_rewards([distance[c] for c in e.states + [e.end_cell]], cfg.progress_reward)
    rewards[-1] += e.reward
    return rewards


def make_experiences(cfg: Config, episodes: list, advantages: torch.Tensor, rewards: list) -> tuple[list, dict]:
    """One Experience per training sequence, its per-token advantages filled in.

    Every turn t of an episode gets A_t = A_episode + w * A_step_t (grpo.turn_values). The
    step-level anchors are (group, agent cell): the same maze, the agent on the same cell; a
    group's episodes are all played on one rank, so anchor groups never span ranks. rewards[i]
    holds episode i's turn rewards (turn_rewards)."""
    step_adv = torch.zeros(sum(e.num_turns for e in episodes), dtype=torch.float64)
    if cfg.step_adv_weight > 0:
        returns, anchors = [], []
        for e, episode_rewards in zip(episodes, rewards):
            returns += grpo.discounted_returns(episode_rewards, cfg.gamma)
            anchors += [(e.group_id * e.maze.size + r) * e.maze.size + c for r, c in e.states]
        step_adv = grpo.step_advantages(torch.tensor(returns, dtype=torch.float64), torch.tensor(anchors),
                                        scale_by_std=cfg.scale_adv_by_std)
    experiences, first_turn = [], 0
    for i, e in enumerate(episodes):
        values = grpo.turn_values(float(advantages[i]), step_adv[first_turn:first_turn + e.num_turns].tolist(),
                                  cfg.step_adv_weight)
        first_turn += e.num_turns
        for seq in e.sequences:  # an episode's sequences hold its replies in order
            n = grpo.reply_count(seq.response_mask)
            experiences.append(policy.Experience(seq, grpo.spread_over_replies(seq.response_mask, values[:n]), i))
            values = values[n:]
    nonzero = (step_adv != 0).double().mean().item() if step_adv.numel() else 0.0
    return experiences, {"step_adv_nonzero_frac": nonzero}


def single_pass(cfg) -> bool:
    """One optimizer step per rollout batch and no KL term: the policy being updated IS the one
    that sampled, so pi_old = pi_theta.detach() and the separate old-logprob pass is skipped."""
    return cfg.num_mini_batches == 1 and cfg.ppo_epochs == 1 and cfg.kl_coef == 0


def grpo_update(cfg, model, optimizer, scheduler, batch: policy.Batch, experiences: list, num_episodes: int,
                device) -> dict:
    """Mini-batches of episodes (one optimizer step each) of micro-batches of their sequences.

    Without old logprobs (single pass) the ratio is exp(logp - logp.detach()) = 1 with the
    gradient of logp, and the rollout mismatch is measured on this very forward pass. Sequences
    whose advantages are all 0 (every member of their group scored the same) are not run when
    there is no KL term: their loss and gradient are exactly zero. They still count in the
    normaliser, so the update is the same as if they had been run, only cheaper."""
    model.train()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    per_mini = num_episodes // cfg.num_mini_batches
    stats = {k: [] for k in ("clip_frac", "ratio_mean", "kl", "pg_loss", "tis_weight_mean", "tis_capped_frac",
                             "grad_norm")}
    mismatch, trained = policy.MismatchMeter(), 0
    for mb in [m for _ in range(cfg.ppo_epochs) for m in range(cfg.num_mini_batches)]:
        in_mini = [i for i, x in enumerate(experiences) if mb * per_mini <= x.episode < (mb + 1) * per_mini]
        # Normaliser: token-mean divides by the mini-batch's response tokens over ALL ranks
        # (seq-mean by its sequences), then by world size since FSDP averages gradients.
        count = sum(sum(experiences[i].sequence.response_mask) if cfg.loss_aggregation == "token-mean" else 1
                    for i in in_mini)
        normalizer = distributed.sum_over_ranks([count])[0] / dist.get_world_size()
        if cfg.kl_coef == 0:
            in_mini = [i for i in in_mini if bool(experiences[i].advantages.any())]
        trained += len(in_mini)
        optimizer.zero_grad(set_to_none=True)
        for idx in policy.synced_micro_batches(in_mini, cfg.micro_batch_size, batch.length):
            rows = [0] if idx is None else idx  # a filler runs any one sequence, with weight 0
            inputs, mask, rollout_lp = batch.micro(rows, device)
            lp = policy.sequence_logprobs(model, inputs, cfg.temperature, batch.banned_token_ids)
            xs = [experiences[i] for i in rows]
            old_lp = lp.detach() if xs[0].old_logprobs is None else policy.pad_rows([x.old_logprobs for x in xs], device)
            loss, m = grpo.policy_loss(
                lp, old_lp, policy.pad_rows([x.advantages for x in xs], device), mask,
                clip_eps_low=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high,
                aggregation=cfg.loss_aggregation, loss_normalizer=normalizer,
                ref_logprobs=policy.pad_rows([x.ref_logprobs for x in xs], device) if cfg.kl_coef > 0 else None,
                kl_coef=cfg.kl_coef, rollout_logprobs=rollout_lp, tis_cap=cfg.tis_cap)
            (loss * (0.0 if idx is None else 1.0)).backward()
            if idx is None:
                continue
            for k in m:
                stats[k].append(m[k])
            if xs[0].old_logprobs is None:
                mismatch.add(lp.detach(), rollout_lp, mask)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        stats["grad_norm"].append((grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item())
        optimizer.step()
        scheduler.step()
    neutral = {"ratio_mean": 1.0, "tis_weight_mean": 1.0}  # what a step that trained nothing reports
    out = {k: sum(v) / len(v) if v else neutral.get(k, 0.0) for k, v in stats.items()}
    out.update(lr=scheduler.get_last_lr()[0], trained_sequence_frac=trained / max(len(experiences), 1))
    if single_pass(cfg):
        out.update(mismatch.result())
    return out


# ----------------------------------------------------------------------------- evaluation

def evaluate(cfg, engine, chat, lora_request, step: int, out: Path, run: dict | None = None) -> dict:
    """Greedy play of the fixed evaluation mazes, split over ranks, through the chat API exactly as
    `serve.py eval` plays them over HTTP (rollout.play_chat_episodes); rank 0 writes the JSON.
    With sampled_eval_samples, also the mean solve rate of that many sampled episodes per maze.
    The file also names the run, adapter and base it played (checkpoint.eval_file)."""
    mazes = env.eval_mazes(cfg.difficulty, cfg.eval_mazes, cfg.env_style)
    mine = list(range(dist.get_rank(), len(mazes), dist.get_world_size()))
    episodes = rollout.play_chat_episodes(
        [mazes[i] for i in mine], rollout.engine_replies(engine, lora_request, cfg.max_new_tokens, chat.banned_token_ids),
        max_turns=cfg.max_turns, cell_px=cfg.cell_px, style=cfg.env_style, max_images=cfg.max_images or None,
        desc=f"eval@{step}",
        progress=cfg.progress and dist.get_rank() == 0)
    rows = [row for part in distributed.all_gather_objects(rollout.eval_rows(episodes, mine, cfg.max_turns))
            for row in part]
    result = rollout.eval_result(rows, cfg.max_turns, step=step, difficulty=cfg.difficulty, env_style=cfg.env_style)
    if cfg.sampled_eval_samples and (step == 0 or step == cfg.steps):
        sampled = rollout.play_episodes(
            engine, chat, [mazes[i] for i in mine], mine, samples_per_maze=cfg.sampled_eval_samples,
            max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens, max_model_len=cfg.max_model_len,
            temperature=cfg.sampled_eval_temperature, seed=cfg.seed + 1, lora_request=lora_request, cell_px=cfg.cell_px,
            style=cfg.env_style, max_images=cfg.max_images or None, desc=f"sampled eval@{step}", progress=False)
        solved, total = distributed.sum_over_ranks([sum(e.solved for e in sampled), len(sampled)])
        result["sampled_solve_rate"] = solved / total
        result["sampled_temperature"] = cfg.sampled_eval_temperature
    if dist.get_rank() == 0:
        checkpoint.eval_file(out, result, run or {"run_id": None, "base": None}, lora_request)
    return result


# ----------------------------------------------------------------------------- the loop

def make_scheduler(optimizer, cfg: Config):
    """transformers' schedules: a linear warm-up from 0, then constant or a cosine decay to 0."""
    from transformers import get_scheduler

    return get_scheduler("cosine" if cfg.lr_schedule == "cosine" else "constant_with_warmup", optimizer,
                         num_warmup_steps=cfg.warmup_steps,
                         num_training_steps=cfg.steps * cfg.num_mini_batches * cfg.ppo_epochs)


def main(cfg: Config):
    rank, world, local_rank = distributed.init_distributed()
    cfg.validate(world)
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    model_path = policy.resolve_model(cfg.model)  # downloads once per node, then every rank loads it
    cfg.lora_rank = cfg.lora_rank or (32 if cfg.model else 8)
    cfg.lora_alpha = cfg.lora_alpha or 2 * cfg.lora_rank
    base = checkpoint.base_model_record(model_path)

    out = Path(cfg.out_dir)
    shared = Path(cfg.shared_dir or out / "shared")
    if rank == 0:
        policy.check_writable(out)
    dist.barrier()
    # the run lock, the checkpoint to resume from, and no fresh start over another run's files
    # (before anything is written into the directory)
    ckpt, run = checkpoint.open_run(out, cfg, base, log=log0)
    if rank == 0:
        policy.check_writable(shared)
    dist.barrier()
    distributed.check_shared_dir(shared, checkpoint.atomic_write_text)

    chat = rollout.ChatFormat.for_model(model_path)
    # The policy first (identical seed on every rank), then this rank's engine (its own seed).
    model = policy.build_policy(cfg, model_path)
    optimizer = policy.make_optimizer(model, cfg.lr, cfg.weight_decay, cfg.lora_plus_ratio)
    scheduler = make_scheduler(optimizer, cfg)
    stream = env.TrainMazeStream(cfg.difficulty, eval_n=cfg.eval_mazes, pool=cfg.train_pool, style=cfg.env_style)

    start_step, hours = 0, 0.0
    if ckpt:
        start_step, hours = checkpoint.load(Path(ckpt), cfg, model, optimizer, scheduler, stream, log=log0)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        log0(f"resumed from {ckpt} at step {start_step} (training maze stream at {stream.position}"
             + (f", torchrun restart {restart})" if restart != "0" else ")"))
    if rank == 0:
        # one metrics line per step: drop lines of steps that will be redone after a crash, and a
        # last line that a crash cut short
        metrics_file = out / "metrics.jsonl"
        lines = metrics_file.read_text().splitlines() if metrics_file.exists() else []
        kept = [line for line in lines if (n := checkpoint.metrics_step(line)) is not None and n <= start_step]
        checkpoint.atomic_write_text(metrics_file, "".join(line + "\n" for line in kept))
        checkpoint.atomic_write_text(out / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(str(out / "tb"), purge_step=start_step + 1)

    t = time.time()
    rng = checkpoint.rng_states()  # the checkpoint's (or this fresh run's): vLLM re-seeds them on start
    engine = rollout.build_engine(model_path, max_model_len=cfg.max_model_len, max_lora_rank=cfg.lora_rank,
                                  seed=cfg.seed + rank, gpu_memory_utilization=cfg.gpu_memory_utilization,
                                  max_images=max(cfg.max_turns, cfg.train_max_turns) + 1, external_launcher=True,
                                  sleep_mode=cfg.engine_sleep != "none",
                                  max_image_px=env.DIFFICULTY_SIZES[cfg.difficulty]
                                  * env.cell_px_of(cfg.env_style, cfg.cell_px),
                                  # at T = 1 the raw model's log-probs (vLLM's default); at another
                                  # temperature, those of the distribution it sampled from
                                  logprobs_mode=rollout.logprobs_mode(cfg.temperature))
    checkpoint.set_rng_states(rng)
    log0(f"vLLM engine ready in {time.time() - t:.1f}s" + ("" if on_gpu else
         "; CPU: vLLM has no sleep mode here, so the engine and the trainer both stay resident"))

    sleeper = rollout.EngineSleep(cfg.engine_sleep, on_gpu, weights_bytes=policy.base_weight_bytes(model), log=log0,
                                  worst_over_ranks=distributed.max_over_ranks)
    guard = policy.StalePolicyGuard(cfg.mismatch_bound, cfg.mismatch_steps, on_gpu)
    lora_request, lora_state, _ = policy.sync_adapter(model, engine, shared, start_step, cfg.keep_syncs, base)
    if (start_step == 0 or start_step % cfg.eval_interval == 0) and not checkpoint.has_eval(out, start_step, run):
        result = evaluate(cfg, engine, chat, lora_request, start_step, out, run)
        log0(f"eval step {start_step}: solved {result['solved']}/{result['total']}")

    per_rank = cfg.prompts_per_step // world
    run_start = time.time()
    bar = tqdm(range(start_step, cfg.steps), desc="train", unit="step", initial=start_step, total=cfg.steps,
               disable=not (cfg.progress and rank == 0))
    for step in bar:
        step_start, timing, metrics = time.time(), {}, {}

        # 1. rollouts: every rank draws the same mazes from the stream and plays its share
        t0 = time.time()
        mazes = [stream.next() for _ in range(cfg.prompts_per_step)]
        mine = list(range(rank * per_rank, (rank + 1) * per_rank))
        episodes = rollout.play_episodes(
            engine, chat, [mazes[i] for i in mine], [step * cfg.prompts_per_step + i for i in mine],
            samples_per_maze=cfg.group_size, max_turns=cfg.train_max_turns or cfg.max_turns,
            max_new_tokens=cfg.max_new_tokens, max_model_len=cfg.max_model_len, temperature=cfg.temperature,
            seed=cfg.seed, lora_request=lora_request, cell_px=cfg.cell_px, style=cfg.env_style,
            max_images=cfg.max_images or None, desc=f"rollout@{step + 1}", progress=cfg.progress and rank == 0)
        branch_experiences, branch_stats = branch.branch_step(cfg, engine, chat, episodes, lora_request)
        sleeper.sleep(engine)  # time-slicing: the engine gives the GPU to the trainer (--engine-sleep)
        timing["rollout_s"] = time.time() - t0
        metrics.update(rollout.rollout_metrics(episodes))

        # 2. group advantages over all ranks, per-token rows, old (and reference) logprobs
        t0 = time.time()
        rewards = [turn_rewards(cfg, e) for e in episodes]
        advantages, adv_stats = grpo.gather_group_advantages(
            torch.tensor([sum(r) for r in rewards]), torch.tensor([e.group_id for e in episodes]),
            scale_by_std=cfg.scale_adv_by_std)
        experiences, step_stats = make_experiences(cfg, episodes, advantages, rewards)
        experiences += branch_experiences  # the forks' targets, each in its parent episode's mini-batch
        metrics.update(branch_stats)
        # reward_mean stays the strict reward (the training solve rate); the shaped one is logged apart
        adv_stats["shaped_reward_mean"] = adv_stats.pop("reward_mean")
        adv_stats["shaped_reward_std"] = adv_stats.pop("reward_std")
        metrics.update(adv_stats, **step_stats)
        batch = policy.Batch([x.sequence for x in experiences], chat.processor, model)
        if not single_pass(cfg):
            metrics.update(policy.fill_old_logprobs(model, batch, experiences, cfg.micro_batch_size, device,
                                                    cfg.temperature, with_ref=cfg.kl_coef > 0))
        timing["logprobs_s"] = time.time() - t0

        # 3. the GRPO update
        t0 = time.time()
        metrics.update(grpo_update(cfg, model, optimizer, scheduler, batch, experiences, len(episodes), device))
        timing["update_s"] = time.time() - t0
        del batch  # its cached image features

        # 4. LoRA sync through shared storage (the engine is awake again from here to the next update)
        if on_gpu:
            optimizer.zero_grad(set_to_none=True)  # the gradients are spent: free them for the engine
            torch.cuda.empty_cache()  # and the trainer's cached blocks (vLLM's wake_up does it too)
        sleeper.wake(engine)
        lora_request, lora_state, sync_stats = policy.sync_adapter(model, engine, shared, step + 1, cfg.keep_syncs, base)
        timing["sync_s"], metrics["sync_bytes"] = sync_stats["sync_s"], sync_stats["sync_bytes"]

        # 5. eval, checkpoint, export on their intervals
        done = step + 1
        t0 = time.time()
        if done % cfg.eval_interval == 0 or done == cfg.steps:
            result = evaluate(cfg, engine, chat, lora_request, done, out, run)
            metrics["eval_solve_rate"] = result["solve_rate"]
            log0(f"eval step {done}: solved {result['solved']}/{result['total']}")
        timing["eval_s"] = time.time() - t0
        t0 = time.time()
        hours += (time.time() - step_start) * world / 3600
        ckpt_tmp = None
        if done % cfg.ckpt_interval == 0 or done == cfg.steps:
            ckpt_tmp = checkpoint.save(cfg, model, optimizer, scheduler, lora_state, done, stream, hours, out, base)
        if rank == 0 and (done % cfg.export_interval == 0 or done == cfg.steps):
            checkpoint.write_adapter(model, lora_state, out / "adapters" / f"step_{done}", base)
        timing["checkpoint_s"] = time.time() - t0

        # 6. logs: one metrics line per step, TensorBoard, the bar
        timing["step_s"] = time.time() - step_start
        metrics.update(timing, tokens_per_s=metrics["generated_tokens"] / max(timing["rollout_s"], 1e-9))
        metrics["gpu_hours" if on_gpu else "process_hours"] = hours
        metrics = distributed.mean_over_ranks(metrics)
        metrics["generated_tokens"] *= world  # totals, not means, for these two
        metrics["tokens_per_s"] *= world
        if rank == 0:
            line = {"step": done, **{k: float(f"{v:.6g}") for k, v in metrics.items()},
                    "maze_seeds": [m.seed for m in mazes], "stream_position": stream.position}
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
                f.flush()
                os.fsync(f.fileno())  # on disk before `latest` can name this step
            if ckpt_tmp:
                checkpoint.publish(out, ckpt_tmp, done, cfg.keep_checkpoints)
            for k, v in metrics.items():
                writer.add_scalar(k, v, done)
            writer.flush()
            bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", mismatch=f"{metrics['mismatch_abs_mean']:.1e}",
                            step_s=f"{timing['step_s']:.1f}")
        guard.check(done, metrics["mismatch_abs_mean"])  # the same reduced figure on every rank

    bar.close()
    if rank == 0:
        writer.close()
        checkpoint.write_summary(cfg.steps, out, time.time() - run_start, hours, on_gpu, log=log0)
    # Shut down in order: all ranks done, then the engine (whose teardown may already take the
    # process group down with it), then the group if it is still there.
    dist.barrier()
    del engine
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_config())
