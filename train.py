"""GRPO post-training of a vision-language model on visual mazes: torchrun + FSDP2 + LoRA + vLLM.

    python train.py                                  # a world of one, the tiny model, CPU
    torchrun --nproc-per-node 8 train.py --model Qwen/Qwen3-VL-8B-Instruct --difficulty easy
    bash launch/run.sh                               # the main job: tiny model, SFT warm start, GRPO

Every process owns two things: an FSDP2 shard of the policy (HF Qwen3-VL + PEFT LoRA, policy.py)
and a whole in-process vLLM engine (rollout.py). One step:

    1. rollouts      every rank plays its share of the step's mazes, group_size episodes each
    2. advantages    rewards are normalised within each group over all ranks (grpo.py), plus
                     GiGPO's step-level term for moves made from the same cell
    3. update        the policy-gradient loss on the sampled tokens (policy.py): by default one
                     pass and one optimizer step, so the ratio is 1 and the clip never acts; it
                     does with --num-mini-batches or --ppo-epochs above 1
    4. sync          rank 0 writes the LoRA adapter to shared storage (policy.py); every engine
                     loads it under a new id (rollout.py), and the next step's logprob mismatch
                     proves it did
    5. eval / checkpoint / export on their intervals (checkpoint.py), one metrics line per step
       (rundir.py)

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
import time
from dataclasses import dataclass
from pathlib import Path

import rollout  # first: sets vLLM's environment before anything imports vllm

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tqdm import tqdm  # noqa: E402

import checkpoint  # noqa: E402
import distributed  # noqa: E402
import env  # noqa: E402
import grpo  # noqa: E402
import policy  # noqa: E402
import rundir  # noqa: E402
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
    tis_cap: float = 2.0  # truncated importance sampling against the engine's logprobs; 0: off
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
        if self.step_adv_weight < 0 or not 0 < self.gamma <= 1:
            problems.append("step_adv_weight must be >= 0 and gamma in (0, 1]")
        if self.loss_aggregation not in ("token-mean", "seq-mean"):
            problems.append("loss_aggregation must be token-mean or seq-mean")
        if self.lr_schedule not in ("constant", "cosine"):
            problems.append("lr_schedule must be constant or cosine")
        if self.tis_cap < 0 or self.train_pool < 0 or self.sampled_eval_samples < 0:
            problems.append("tis_cap, train_pool and sampled_eval_samples must be >= 0")
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


# ----------------------------------------------------------------------------- evaluation

def evaluate(cfg, engine, chat, lora_request, step: int, out: Path, run: dict | None = None) -> dict:
    """Greedy play of the fixed evaluation mazes, split over ranks, through the chat API exactly as
    `serve.py eval` plays them over HTTP (rollout.play_chat_episodes); rank 0 writes the JSON.
    With sampled_eval_samples, also the mean solve rate of that many sampled episodes per maze.
    The file also names the run, adapter and base it played (rundir.eval_file)."""
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
        rundir.eval_file(out, result, run or {"run_id": None, "base": None}, lora_request)
    log0(f"eval step {step}: solved {result['solved']}/{result['total']}")
    return result


# ----------------------------------------------------------------------------- the loop

def build_rank_engine(cfg: Config, model_path: str, rank: int):
    """This rank's vLLM engine, seeded by rank, sized for the run's mazes and turns. vLLM re-seeds
    the global generators when it starts, so they are put back to what they were (a fresh run's,
    or the checkpoint's) afterwards."""
    rng, t0 = checkpoint.rng_states(), time.time()
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
    log0(f"vLLM engine ready in {time.time() - t0:.1f}s" + ("" if torch.cuda.is_available() else
         "; CPU: vLLM has no sleep mode here, so the engine and the trainer both stay resident"))
    return engine


def sync(model, engine, shared: Path, step: int, cfg: Config, base: dict):
    """The LoRA after `step` updates: to shared storage (policy), then into this rank's engine
    (rollout), under a new id. Returns the engine's LoRARequest, the full LoRA state, the stats."""
    t0 = time.time()
    path, lora_state, nbytes = policy.publish_adapter(model, shared, step, cfg.keep_syncs, base)
    lora_request = rollout.load_adapter(engine, path, step)
    return lora_request, lora_state, {"sync_s": time.time() - t0, "sync_bytes": nbytes}


def step_metrics(metrics: dict, timing: dict, hours: float, on_gpu: bool) -> dict:
    """The step's line: means over ranks, except the generated tokens and their rate (totals)."""
    metrics = {**metrics, **timing, "tokens_per_s": metrics["generated_tokens"] / max(timing["rollout_s"], 1e-9),
               ("gpu_hours" if on_gpu else "process_hours"): hours}
    metrics = distributed.mean_over_ranks(metrics)
    world = dist.get_world_size()
    return {**metrics, "generated_tokens": metrics["generated_tokens"] * world,
            "tokens_per_s": metrics["tokens_per_s"] * world}


def main(cfg: Config):
    rank, world, local_rank = distributed.init_distributed()
    cfg.validate(world)
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    model_path = policy.resolve_model(cfg.model)  # downloads once per node, then every rank loads it
    cfg.lora_rank = cfg.lora_rank or (32 if cfg.model else 8)
    cfg.lora_alpha = cfg.lora_alpha or 2 * cfg.lora_rank
    base = checkpoint.base_model_record(model_path)
    out, shared = Path(cfg.out_dir), Path(cfg.shared_dir or Path(cfg.out_dir) / "shared")
    # the run lock, the checkpoint to resume from, and no fresh start over another run's files
    # (all before anything is written into the directory)
    ckpt, run = rundir.open_run(out, cfg, base, log=log0)
    rundir.check_shared(shared)

    # The policy first (identical seed on every rank), then this rank's engine (its own seed).
    chat = rollout.ChatFormat.for_model(model_path)
    model = policy.build_policy(cfg, model_path)
    optimizer = policy.make_optimizer(model, cfg.lr, cfg.weight_decay, cfg.lora_plus_ratio)
    scheduler = policy.make_scheduler(optimizer, cfg)
    stream = env.TrainMazeStream(cfg.difficulty, eval_n=cfg.eval_mazes, pool=cfg.train_pool, style=cfg.env_style)
    start_step, hours = checkpoint.load(Path(ckpt), cfg, model, optimizer, scheduler, stream, log=log0) \
        if ckpt else (0, 0.0)
    log = rundir.RunLog(out, cfg, start_step) if rank == 0 else None
    engine = build_rank_engine(cfg, model_path, rank)
    sleeper = rollout.EngineSleep(cfg.engine_sleep, on_gpu, weights_bytes=policy.base_weight_bytes(model), log=log0,
                                  worst_over_ranks=distributed.max_over_ranks)
    guard = policy.StalePolicyGuard(cfg.mismatch_bound, cfg.mismatch_steps, on_gpu)
    lora_request, lora_state, _ = sync(model, engine, shared, start_step, cfg, base)
    if (start_step == 0 or start_step % cfg.eval_interval == 0) and not rundir.has_eval(out, start_step, run):
        evaluate(cfg, engine, chat, lora_request, start_step, out, run)

    per_rank, run_start = cfg.prompts_per_step // world, time.time()
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
        sleeper.sleep(engine)  # time-slicing: the engine gives the GPU to the trainer (--engine-sleep)
        timing["rollout_s"] = time.time() - t0
        metrics.update(rollout.rollout_metrics(episodes))

        # 2. advantages: group-normalised over all ranks, plus GiGPO's step-level term, per token
        t0 = time.time()
        experiences, stats = grpo.episode_experiences(episodes, gamma=cfg.gamma, step_adv_weight=cfg.step_adv_weight,
                                                      scale_by_std=cfg.scale_adv_by_std)
        metrics.update(stats)
        timing["advantages_s"] = time.time() - t0

        # 3. the update: the policy-gradient loss on the sampled tokens (policy.grpo_update)
        t0 = time.time()
        batch = policy.Batch([x.sequence for x in experiences], chat.processor, model)
        metrics.update(policy.grpo_update(cfg, model, optimizer, scheduler, batch, experiences, len(episodes), device))
        del batch  # its cached image features
        timing["update_s"] = time.time() - t0

        # 4. sync: the new LoRA through shared storage into every engine (awake again from here)
        sleeper.wake(engine)
        lora_request, lora_state, sync_stats = sync(model, engine, shared, step + 1, cfg, base)
        timing["sync_s"], metrics["sync_bytes"] = sync_stats["sync_s"], sync_stats["sync_bytes"]

        # 5. eval, checkpoint, export on their intervals; one metrics line per step
        done, t0 = step + 1, time.time()
        if done % cfg.eval_interval == 0 or done == cfg.steps:
            metrics["eval_solve_rate"] = evaluate(cfg, engine, chat, lora_request, done, out, run)["solve_rate"]
        timing["eval_s"], t0 = time.time() - t0, time.time()
        hours += (time.time() - step_start) * world / 3600
        ckpt_tmp = None
        if done % cfg.ckpt_interval == 0 or done == cfg.steps:
            ckpt_tmp = checkpoint.save(cfg, model, optimizer, scheduler, lora_state, done, stream, hours, out, base)
        if rank == 0 and (done % cfg.export_interval == 0 or done == cfg.steps):
            checkpoint.write_adapter(model, lora_state, out / "adapters" / f"step_{done}", base)
        timing["checkpoint_s"], timing["step_s"] = time.time() - t0, time.time() - step_start
        metrics = step_metrics(metrics, timing, hours, on_gpu)
        if rank == 0:
            log.step(done, metrics, maze_seeds=[m.seed for m in mazes], stream_position=stream.position)
            if ckpt_tmp:  # after the step's line is on disk, so that `latest` never names a step it lacks
                checkpoint.publish(out, ckpt_tmp, done, cfg.keep_checkpoints)
            bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", mismatch=f"{metrics['mismatch_abs_mean']:.1e}",
                            step_s=f"{timing['step_s']:.1f}")
        guard.check(done, metrics["mismatch_abs_mean"])  # the same reduced figure on every rank

    bar.close()
    if rank == 0:
        log.finish(cfg.steps, time.time() - run_start, hours, on_gpu, log=log0)
    # Shut down in order: all ranks done, then the engine (whose teardown may already take the
    # process group down with it), then the group if it is still there.
    dist.barrier()
    del engine
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_config())
