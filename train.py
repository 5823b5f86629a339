"""GRPO post-training of a vision-language model on visual mazes: torchrun + FSDP2 + LoRA + vLLM.

    python train.py --model runs/main/sft/model      # the main job's GRPO (its defaults are the recipe)
    torchrun --nproc-per-node 8 train.py --model Qwen/Qwen3-VL-8B-Instruct --difficulty easy
    bash launch/run.sh                               # the main job end to end: tiny model, SFT, GRPO

Every flag, its default and its section: config.py (or --help).

Every process owns two things: an FSDP2 shard of the policy (HF Qwen3-VL + PEFT LoRA, policy.py)
and a whole in-process vLLM engine (vllm_engine.py), through which rollout.py plays. One step:

    1. rollouts      every rank plays its share of the step's mazes, group_size episodes each
    2. advantages    rewards are normalised within each group over all ranks (grpo.py), plus
                     GiGPO's step-level term for moves made from the same cell
    3. update        the policy-gradient loss on the sampled tokens (update.py): by default one
                     pass and one optimizer step, so the ratio is 1 and the clip never acts; it
                     does with --num-mini-batches or --ppo-epochs above 1
    4. sync          rank 0 writes the LoRA adapter to shared storage (policy.py); every engine
                     loads it under a new id (vllm_engine.py), and the next update measures the
                     engine's log-probs against the trainer's on the tokens it trains (a step that
                     trains none measures nothing; update.StalePolicyGuard)
    5. eval / checkpoint / export on their intervals (evaluation.py, checkpoint.py), one metrics
       line per step (rundir.py); over the last average_frac of the steps, what is evaluated and
       exported is the mean of the policies of those steps (average.py), while rollouts stay on
       the current one

On a GPU the engine sleeps while the trainer updates (--engine-sleep: by default its weights go
to host RAM and its KV cache is dropped; vllm_engine.EngineSleep has the other choices) and wakes up
for the next rollouts; on a CPU sleep does not exist and both stay put.

What of GRPO this keeps (DeepSeekMath Sec. 4): group-relative advantages with the std division
(--scale-adv-by-std false gives Dr. GRPO), the clipped ratio, token-mean loss, an optional k3 KL
to the base model (off by default, as in DAPO and Dr. GRPO). What it adds: clip-higher, GiGPO's
step-level advantages for the multi-turn setting, truncated importance sampling against the
engine's own logprobs. With one optimizer step per rollout batch (the default) the old policy is
the current one, so there is no separate old-logprob pass: the ratio is 1 with the gradient of
log pi, which is exactly the policy gradient.
"""

import gc
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import average
import branch
import checkpoint
import distributed
import env
import evaluation
import grpo
import policy
import update
import rollout
import vllm_engine
import rundir
import visgym
from config import Config, parse_config
from distributed import log0


# ----------------------------------------------------------------------------- the loop

def build_rank_engine(cfg: Config, model_path: str, rank: int):
    """This rank's vLLM engine, seeded by rank, sized for the run's mazes and turns. vLLM re-seeds
    the global generators when it starts, so they are put back to what they were (a fresh run's,
    or the checkpoint's) afterwards."""
    rng, t0 = checkpoint.rng_states(), time.time()
    engine = vllm_engine.build_engine(model_path, max_model_len=cfg.max_model_len, max_lora_rank=cfg.lora_rank,
                                  seed=cfg.seed + rank, gpu_memory_utilization=cfg.gpu_memory_utilization,
                                  max_images=cfg.max_turns + 1, external_launcher=True,
                                  sleep_mode=cfg.engine_sleep != "none",
                                  max_image_px=env.DIFFICULTY_SIZES[cfg.difficulty]
                                  * env.cell_px_of(cfg.env_style, cfg.cell_px),
                                  # at T = 1 the raw model's log-probs (vLLM's default); at another
                                  # temperature, those of the distribution it sampled from
                                  logprobs_mode=vllm_engine.logprobs_mode(cfg.temperature))
    checkpoint.set_rng_states(rng)
    log0(f"vLLM engine ready in {time.time() - t0:.1f}s" + ("" if torch.cuda.is_available() else
         "; CPU: vLLM has no sleep mode here, so the engine and the trainer both stay resident"))
    return engine


def sync(model, engine, shared: Path, step: int, cfg: Config, base: dict):
    """The LoRA after `step` updates: to shared storage (policy), then into this rank's engine
    (rollout), under a new id. Returns the engine's LoRARequest, the full LoRA state, the stats."""
    t0 = time.time()
    path, lora_state, nbytes = policy.publish_adapter(model, shared, step, cfg.keep_syncs, base)
    lora_request = vllm_engine.load_adapter(engine, path, step)
    return lora_request, lora_state, {"sync_s": time.time() - t0, "sync_bytes": nbytes}


def step_metrics(metrics: dict, timing: dict, hours: float, on_gpu: bool) -> dict:
    """The step's line: means over ranks, except the generated tokens, their rate and the groups
    (totals; each rank holds the same number of each)."""
    metrics = {**metrics, **timing, "tokens_per_s": metrics["generated_tokens"] / max(timing["rollout_s"], 1e-9),
               ("gpu_hours" if on_gpu else "process_hours"): hours}
    metrics = distributed.mean_over_ranks(metrics)
    world = dist.get_world_size()
    return {**metrics, "generated_tokens": metrics["generated_tokens"] * world,
            "tokens_per_s": metrics["tokens_per_s"] * world, "num_groups": metrics["num_groups"] * world}


def main(cfg: Config):
    rank, world, local_rank = distributed.init_distributed()
    cfg.validate(world)
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    model_path = policy.resolve_model(cfg.model)  # downloads once per node, then every rank loads it
    cfg.resolve_model_defaults(model_path)  # batch, LoRA rank, reply length: the tiny model's or a real one's
    cfg.validate(world)  # again, with them
    base = checkpoint.base_model_record(model_path)
    out, shared = Path(cfg.out_dir), Path(cfg.shared_dir or Path(cfg.out_dir) / "shared")
    # the run lock, the checkpoint to resume from, and no fresh start over another run's files
    # (all before anything is written into the directory)
    ckpt, run = rundir.open_run(out, cfg, base, log=log0)
    rundir.check_shared(shared)

    # The policy first (identical seed on every rank), then this rank's engine (its own seed).
    chat = rollout.ChatFormat.for_model(model_path)
    model = policy.build_policy(cfg, model_path)
    optimizer = update.make_optimizer(model, cfg.lr, cfg.weight_decay)
    scheduler = update.make_scheduler(optimizer, cfg)
    stream = env.TrainMazeStream(cfg.difficulty, eval_n=cfg.eval_mazes, pool=cfg.train_pool, style=cfg.env_style,
                                 seed=cfg.seed)
    start_step, hours = checkpoint.load(Path(ckpt), cfg, model, optimizer, scheduler, stream, log=log0) \
        if ckpt else (0, 0.0)
    log = rundir.RunLog(out, cfg, start_step) if rank == 0 else None
    engine = build_rank_engine(cfg, model_path, rank)
    sleeper = vllm_engine.EngineSleep(cfg.engine_sleep, on_gpu, weights_bytes=policy.base_weight_bytes(model), log=log0,
                                  worst_over_ranks=distributed.max_over_ranks)
    guard = update.StalePolicyGuard(cfg.mismatch_bound, cfg.mismatch_steps, on_gpu, start_step,
                                    checkpoint.saved_meta(Path(ckpt)).get("mismatch_bound") if ckpt else None)
    # the policy the run publishes: from the first step of its last average_frac on, the mean of
    # the LoRA after each step (average.py), restored from the checkpoint
    tail = average.TailAverage(cfg.steps - round(cfg.average_frac * cfg.steps) + 1, cfg.lora_rank,
                               **checkpoint.load_average(Path(ckpt) if ckpt else None))
    lora_request, lora_state, _ = sync(model, engine, shared, start_step, cfg, base)
    # how far each update moves the policy, on fixed held-out first turns (this rank's share)
    probe_mazes = env.eval_mazes(cfg.difficulty, cfg.eval_mazes, cfg.env_style)[:max(cfg.probe_states, world)]
    probe = evaluation.PolicyProbe(chat, probe_mazes[rank::world] if cfg.probe_states else [],
                                   visgym.EnvSettings.of(cfg))
    probe.measure(engine, lora_request)
    if (start_step == 0 or start_step % cfg.eval_interval == 0) and not rundir.has_eval(out, start_step, run):
        evaluation.evaluate_published(cfg, engine, chat, lora_request, tail, model, start_step, out, shared, run, base)

    per_rank, run_start = cfg.prompts_per_step // world, time.time()
    stop, stopped, abandoned = rundir.StopRequest(), 0, False  # SIGTERM and the like: rundir.py
    saved_step = start_step if ckpt else None
    bar = tqdm(range(start_step, cfg.steps), desc="train", unit="step", initial=start_step, total=cfg.steps,
               disable=not (cfg.progress and rank == 0))
    for step in bar:
        step_start, timing, metrics = time.time(), {}, {}
        if stopped := stop.pending():  # a stop asked for during the last step (or the start-up)
            break

        # 1. rollouts: every rank draws the same mazes from the stream and plays its share
        t0 = time.time()
        stream_at_step = stream.state_dict()
        mazes = [stream.next() for _ in range(cfg.prompts_per_step)]
        mine = list(range(rank * per_rank, (rank + 1) * per_rank))
        episodes = rollout.play_episodes(
            engine, chat, [mazes[i] for i in mine], [step * cfg.prompts_per_step + i for i in mine],
            visgym.EnvSettings.of(cfg), rollout.Sampling.of(cfg), samples_per_maze=cfg.group_size,
            lora_request=lora_request, desc=f"rollout@{step + 1}", progress=cfg.progress and rank == 0)
        # and the forks the groups passed, replayed with every open move (branch.py; on by default for the tiny model)
        branch_experiences, branch_stats = branch.branch_step(cfg, engine, chat, episodes, lora_request)
        sleeper.sleep(engine)  # time-slicing: the engine gives the GPU to the trainer (--engine-sleep)
        timing["rollout_s"] = time.time() - t0
        if stopped := stop.pending():  # give up the step in hand: so far it changed nothing but the stream
            stream.load_state_dict(stream_at_step)
            abandoned = True
            break
        metrics.update(rollout.rollout_metrics(episodes))

        # 2. advantages: group-normalised over all ranks, plus GiGPO's step-level term, per token
        t0 = time.time()
        experiences, stats = grpo.episode_experiences(episodes, gamma=cfg.gamma, step_adv_weight=cfg.step_adv_weight,
                                                      scale_by_std=cfg.scale_adv_by_std)
        experiences += branch_experiences  # the forks' targets, each in its parent episode's mini-batch
        metrics.update(stats, **branch_stats)
        timing["advantages_s"] = time.time() - t0

        # 3. the update: the policy-gradient loss on the sampled tokens (update.grpo_update)
        t0 = time.time()
        batch = policy.Batch([x.sequence for x in experiences], chat.processor, model)
        metrics.update(update.grpo_update(cfg, model, optimizer, scheduler, batch, experiences, len(episodes), device,
                                          measure_every_sequence=guard.calibrating))
        del batch  # its cached image features
        timing["update_s"] = time.time() - t0

        # 4. sync: the new LoRA through shared storage into every engine (awake again from here)
        sleeper.wake(engine)
        lora_request, lora_state, sync_stats = sync(model, engine, shared, step + 1, cfg, base)
        timing["sync_s"], metrics["sync_bytes"] = sync_stats["sync_s"], sync_stats["sync_bytes"]
        t0 = time.time()
        metrics.update(probe.measure(engine, lora_request))
        timing["probe_s"] = time.time() - t0

        # 5. the tail average; eval, checkpoint, export on their intervals; one metrics line per step
        done, t0 = step + 1, time.time()
        if done >= tail.first_step:
            tail.add(lora_state)
            metrics["average_dropped"] = tail.dropped
        published = tail.state if tail.active(done) else lora_state  # what evaluations and exports show
        if done % cfg.eval_interval == 0 or done == cfg.steps:
            metrics["eval_solve_rate"] = evaluation.evaluate_published(
                cfg, engine, chat, lora_request, tail, model, done, out, shared, run, base)["solve_rate"]
        timing["eval_s"], t0 = time.time() - t0, time.time()
        hours += (time.time() - step_start) * world / 3600
        ckpt_tmp = None
        if done % cfg.ckpt_interval == 0 or done == cfg.steps:
            saved_step = done
            ckpt_tmp = checkpoint.save(cfg, model, optimizer, scheduler, lora_state, done, stream, hours, out, base,
                                       mismatch_bound=guard.bound, average=tail)
        if rank == 0 and (done % cfg.export_interval == 0 or done == cfg.steps):
            checkpoint.write_adapter(model, published, out / "adapters" / f"step_{done}", base)
        timing["checkpoint_s"], timing["step_s"] = time.time() - t0, time.time() - step_start
        metrics = step_metrics(metrics, timing, hours, on_gpu)
        if rank == 0:
            log.step(done, metrics, maze_seeds=[m.seed for m in mazes], stream_position=stream.position)
            if ckpt_tmp:  # after the step's line is on disk, so that `latest` never names a step it lacks
                checkpoint.publish(out, ckpt_tmp, done, cfg.keep_checkpoints)
            bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", mismatch=f"{metrics['mismatch_abs_mean']:.1e}",
                            step_s=f"{timing['step_s']:.1f}")
        guard.check(done, metrics["mismatch_abs_mean"], metrics["mismatch_tokens"])  # the same on every rank

    bar.close()
    if stopped:  # the last completed step is `step`: checkpointed, unless it already is
        if saved_step != step:
            ckpt_tmp = checkpoint.save(cfg, model, optimizer, scheduler, lora_state, step, stream, hours, out, base,
                                       mismatch_bound=guard.bound, average=tail)
            if rank == 0:
                checkpoint.publish(out, ckpt_tmp, step, cfg.keep_checkpoints)
        if rank == 0:
            rundir.write_stopped(out, stopped, step, abandoned)
        log0(f"stopped by {signal.Signals(stopped).name}: checkpoint step_{step} is the last completed step"
             + (f" (step {step + 1} was under way and is given up)" if abandoned else "")
             + (f", {time.time() - stop.received_at:.1f}s after the signal" if stop.received_at else "")
             + "; the same command resumes the run from there")
    elif rank == 0:
        log.finish(cfg.steps, time.time() - run_start, hours, on_gpu, log=log0)
    # Shut down in order: all ranks done, then the engine (whose teardown may already take the
    # process group down with it), then the group if it is still there.
    dist.barrier()
    del engine
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    if stopped:
        raise SystemExit(128 + stopped)  # what a process that the signal killed reports: "terminated"


if __name__ == "__main__":
    try:
        main(parse_config(description=__doc__))
    except checkpoint.WriteError as e:  # a full disk, a quota, a read-only mount: one line, nothing lost
        raise SystemExit(f"stopped: {e}")
