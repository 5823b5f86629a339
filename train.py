"""GRPO post-training of a vision-language model on a multi-turn visual task: torchrun + FSDP2 + LoRA + vLLM.

    python train.py --model runs/main/sft/model      # the main job's GRPO (its defaults are the recipe)
    torchrun --nproc-per-node 8 train.py --model Qwen/Qwen3-VL-8B-Instruct --task sokoban
    bash launch/run.sh                               # the main job end to end: tiny model, SFT, GRPO

Every flag, its default and its section: config.py (or --help). The task (--task) is any env.Task:
tasks/ holds the ones shipped, and the trainer knows them only through env.py's interface.

Every process owns two things: an FSDP2 shard of the policy (HF Qwen3-VL + PEFT LoRA, policy.py)
and a whole in-process vLLM engine (vllm_engine.py), through which rollout.py plays. One step of
plain GRPO (train_step):

    1. rollouts      every rank plays its share of the step's puzzles, group_size episodes each
    2. advantages    rewards are normalised within each group (grpo.py); a group is all on one rank
    3. update        the policy-gradient loss on the sampled tokens (update.py): by default one
                     pass and one optimizer step, so the ratio is 1 and the clip never acts; it
                     does with --num-mini-batches or --ppo-epochs above 1
    4. sync          rank 0 writes the LoRA adapter to shared storage (policy.py); every engine
                     loads it under a new id (vllm_engine.py), and the next update measures the
                     engine's log-probs against the trainer's on the tokens it trains (a step that
                     trains none measures nothing; update.StalePolicyGuard)
    5. eval / checkpoint / export on their intervals (evaluation.py, checkpoint.py), one metrics
       line per step (rundir.py)

and the additions the recipe turns on, each in a module of its own, entered by one line of
train_step marked `+`: branch rollouts (branch.py), GiGPO's step-level term (gigpo.py), truncated
importance sampling (tis.py), the policy probe (probe.py) and the tail average (average.py: over
the last average_frac of the steps, what is evaluated and exported is the mean of the policies of
those steps, while rollouts stay on the current one).

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
from dataclasses import dataclass
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
import gigpo
import grpo
import policy
import probe
import rollout
import rundir
import storage
import tasks
import tis
import update
import vllm_engine
from config import Config, parse_config
from distributed import log0


# ----------------------------------------------------------------------------- the loop

def build_rank_engine(cfg: Config, model_path: str, rank: int, task_class):
    """This rank's vLLM engine, seeded by rank, sized for the run's pictures and turns. vLLM re-seeds
    the global generators when it starts, so they are put back to what they were (a fresh run's,
    or the checkpoint's) afterwards."""
    rng, t0 = checkpoint.rng_states(), time.time()
    picture = env.held_out(task_class, cfg.difficulty, 1, cfg.max_turns)[0].reset().image
    engine = vllm_engine.build_engine(model_path, max_model_len=cfg.max_model_len, max_lora_rank=cfg.lora_rank,
                                  seed=cfg.seed + rank, gpu_memory_utilization=cfg.gpu_memory_utilization,
                                  max_images=cfg.max_turns + 1, external_launcher=True,
                                  sleep_mode=cfg.engine_sleep != "none",
                                  max_image_px=max(picture.size),
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


@dataclass
class Run:
    """What a run holds from its start-up (start_run) to its end: the policy and its optimizer,
    this rank's engine and the things around them, and the few values the loop moves on."""
    cfg: Config
    rank: int
    world: int
    device: torch.device
    out: Path  # the run directory (rundir.py)
    shared: Path  # where the adapter syncs go, visible to every node
    base: dict  # the base model's record (checkpoint.base_model_record)
    record: dict  # the run's identity in run.json (rundir.open_run)
    chat: rollout.ChatFormat
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    task_class: type  # the task (env.Task) the run plays: tasks.task_class(cfg.task)
    stream: env.TrainingStream
    engine: object  # vllm.LLM
    sleeper: vllm_engine.EngineSleep
    guard: update.StalePolicyGuard
    tail: average.TailAverage
    probe: probe.PolicyProbe
    log: rundir.RunLog | None  # rank 0's
    start_step: int
    hours: float  # process-hours so far, over all ranks (GPU-hours on GPUs)
    saved_step: int | None  # the newest checkpoint's step
    lora_request: object = None  # the engine's handle on the current policy
    lora_state: dict = None  # the current policy's LoRA weights (full, on every rank)


def start_run(cfg: Config) -> Run:
    """Start-up: the process group, the model's recipe, the run directory and its lock, the policy
    and its optimizer (restored from the checkpoint to resume from), this rank's engine; the
    engine gets the policy, and a fresh run is evaluated before its first step."""
    rank, world, local_rank = distributed.init_distributed()
    on_gpu = torch.cuda.is_available()
    model_path = policy.resolve_model(cfg.model)  # downloads once per node, then every rank loads it
    cfg.resolve_model_defaults(model_path)  # batch, LoRA rank, reply length: the tiny model's or a real one's
    cfg.validate(world)
    task_class = tasks.task_class(cfg.task)
    if cfg.branch_points_per_group and not env.features(task_class)["snapshots"]:
        log0(f"the task {cfg.task} takes no snapshots (env.Task.state): this run has no branch rollouts")
        cfg.branch_points_per_group = 0
    needs_solver = [name for name, on in (("branch_tiebreak progress", cfg.branch_tiebreak == "progress"),
                                          ("branch_winnable_only", cfg.branch_winnable_only)) if on]
    if needs_solver and not env.features(task_class)["solver"]:
        raise SystemExit(f"bad config: {needs_solver[0]} needs the task's solver (env.Task.solve); {cfg.task} has none")
    base = checkpoint.base_model_record(model_path)
    out, shared = Path(cfg.out_dir), Path(cfg.shared_dir or Path(cfg.out_dir) / "shared")
    # the run lock, the checkpoint to resume from, and no fresh start over another run's files
    # (all before anything is written into the directory)
    ckpt, record = rundir.open_run(out, cfg, base, log=log0)
    rundir.check_shared(shared)

    # The policy first (identical seed on every rank), then this rank's engine (its own seed).
    chat = rollout.ChatFormat.for_model(model_path)
    model = policy.build_policy(cfg, model_path)
    optimizer = update.make_optimizer(model, cfg.lr, cfg.weight_decay)
    scheduler = update.make_scheduler(optimizer, cfg)
    stream = env.TrainingStream(task_class, cfg.difficulty, cfg.max_turns, eval_n=cfg.eval_puzzles, pool=cfg.train_pool,
                                seed=cfg.seed)
    meta = checkpoint.load(Path(ckpt), cfg, model, optimizer, scheduler, stream, log=log0) if ckpt else {}
    start_step = meta.get("step", 0)
    engine = build_rank_engine(cfg, model_path, rank, task_class)
    # the policy the run publishes: from the first step of its last average_frac on, the mean of
    # the LoRA after each step (average.py), restored from the checkpoint
    tail = average.TailAverage(cfg.steps - round(cfg.average_frac * cfg.steps) + 1, cfg.lora_rank,
                               **(checkpoint.load_average(Path(ckpt), meta) if ckpt else {}))
    # how far each update moves the policy, on fixed held-out first turns (this rank's share)
    probe_tasks = env.held_out(task_class, cfg.difficulty, min(cfg.eval_puzzles, max(cfg.probe_states, world)),
                               cfg.max_turns)
    run = Run(
        cfg=cfg, rank=rank, world=world, device=torch.device("cuda", local_rank) if on_gpu else torch.device("cpu"),
        out=out, shared=shared, base=base, record=record, chat=chat, model=model, optimizer=optimizer,
        scheduler=scheduler, task_class=task_class, stream=stream, engine=engine,
        sleeper=vllm_engine.EngineSleep(cfg.engine_sleep, on_gpu, weights_bytes=policy.base_weight_bytes(model),
                                        log=log0, worst_over_ranks=distributed.max_over_ranks),
        guard=update.StalePolicyGuard(cfg.mismatch_bound, cfg.mismatch_steps, on_gpu, start_step,
                                      meta.get("mismatch_bound")),
        tail=tail, probe=probe.PolicyProbe(chat, probe_tasks[rank::world] if cfg.probe_states else []),
        log=rundir.RunLog(out, cfg, start_step) if rank == 0 else None, start_step=start_step,
        hours=meta.get("process_hours", 0.0), saved_step=start_step if ckpt else None)
    run.lora_request, run.lora_state, _ = sync(model, engine, shared, start_step, cfg, base)
    run.probe.measure(engine, run.lora_request)
    if (start_step == 0 or start_step % cfg.eval_interval == 0) and not rundir.has_eval(out, start_step, record):
        evaluate(run, start_step)
    return run


def evaluate(run: Run, step: int) -> dict:
    """The published policy (the tail average once it is active, else the current one), held-out greedy."""
    return evaluation.evaluate_published(run.cfg, run.engine, run.chat, run.lora_request, run.tail, run.model, step,
                                         run.out, run.shared, run.record, run.base, run.task_class)


def save_checkpoint(run: Run, step: int) -> Path | None:
    """Rank 0's checkpoint of the run after `step` steps, written but not yet published (collective)."""
    run.saved_step = step
    return checkpoint.save(run.cfg, run.model, run.optimizer, run.scheduler, run.lora_state, step, run.stream,
                           run.hours, run.out, run.base, mismatch_bound=run.guard.bound, average=run.tail)


def train_step(run: Run, step: int, stop: rundir.StopRequest) -> dict | None:
    """One step (`step` steps done before it): plain GRPO in five numbered parts, and the additions
    the recipe turns on, each entered by one line marked `+`. Returns the step's metrics line, or
    None if a stop arrived during the rollouts (the step is given up: only the stream moved)."""
    cfg, step_start, timing = run.cfg, time.time(), {}

    # 1. rollouts: every rank draws the same puzzles from the stream and plays its share
    stream_at_step = run.stream.state_dict()
    puzzles, episodes = play_rollouts(run, step)
    # + branch rollouts: the forks each group passed, replayed with every legal action, and a target
    # row toward the best branch (branch.py)
    branch_targets, branch_stats = (branch.branch_step(cfg, run.engine, run.chat, episodes, run.lora_request)
                                    if cfg.branch_points_per_group else ([], {}))
    run.sleeper.sleep(run.engine)  # time-slicing: the engine gives the GPU to the trainer (--engine-sleep)
    timing["rollout_s"] = time.time() - step_start
    if stop.pending():
        run.stream.load_state_dict(stream_at_step)
        return None
    metrics = {**rollout.rollout_metrics(episodes), **branch_stats}

    # 2. advantages: each episode's reward normalised within its group, on every token of its replies
    t0 = time.time()
    turn_advantages, stats = grpo.episode_advantages(episodes, scale_by_std=cfg.scale_adv_by_std)
    # + GiGPO: w x each turn's return normalised among the group's turns from the same state (gigpo.py)
    if cfg.step_adv_weight:
        stats |= gigpo.add_step_term(turn_advantages, episodes, cfg.step_adv_weight, cfg.gamma, cfg.scale_adv_by_std)
    experiences = grpo.to_experiences(episodes, turn_advantages) + branch_targets  # each in its parent's mini-batch
    metrics.update(stats)
    timing["advantages_s"] = time.time() - t0

    # 3. the update: the policy-gradient loss on the sampled tokens (update.py)
    t0 = time.time()
    batch = policy.Batch([x.sequence for x in experiences], run.chat.processor, run.model)
    metrics.update(update.grpo_update(
        cfg, run.model, run.optimizer, run.scheduler, batch, experiences, len(episodes), run.device,
        measure_every_sequence=run.guard.calibrating,
        reweight=tis.TruncatedIS(cfg.tis_cap)))  # + TIS: each token's loss x min(pi_old / pi_engine, cap) (tis.py)
    del batch  # its cached image features
    timing["update_s"] = time.time() - t0

    # 4. sync: the new LoRA through shared storage into every engine (awake again from here)
    run.sleeper.wake(run.engine)
    run.lora_request, run.lora_state, sync_stats = sync(run.model, run.engine, run.shared, step + 1, cfg, run.base)
    timing["sync_s"], metrics["sync_bytes"] = sync_stats["sync_s"], sync_stats["sync_bytes"]
    t0 = time.time()
    # + the policy probe: how far this update moved the policy's first action on held-out states (probe.py)
    metrics.update(run.probe.measure(run.engine, run.lora_request) if cfg.probe_states else {})
    timing["probe_s"] = time.time() - t0

    # 5. eval, checkpoint, export on their intervals; one metrics line per step
    completed, t0 = step + 1, time.time()  # the step's number: its metrics line, evaluation and checkpoint
    # + the tail average: what evaluations and exports publish, the mean of the last steps' LoRA (average.py)
    published, average_stats = (run.tail.after_step(completed, run.lora_state) if cfg.average_frac
                                else (run.lora_state, {}))
    metrics.update(average_stats)
    if completed % cfg.eval_interval == 0 or completed == cfg.steps:
        metrics["eval_solve_rate"] = evaluate(run, completed)["solve_rate"]
    timing["eval_s"] = time.time() - t0
    return finish_step(run, completed, published, metrics, timing, step_start, puzzles)


def play_rollouts(run: Run, step: int) -> tuple[list, list]:
    """The step's puzzles, drawn from the stream alike on every rank, and this rank's episodes: its
    share of the puzzles, each played group_size times (the group ids unique over the run)."""
    cfg = run.cfg
    puzzles = [run.stream.next() for _ in range(cfg.prompts_per_step)]
    per_rank = cfg.prompts_per_step // run.world
    mine = range(run.rank * per_rank, (run.rank + 1) * per_rank)
    return puzzles, rollout.play_episodes(
        run.engine, run.chat, [puzzles[i] for i in mine], [step * cfg.prompts_per_step + i for i in mine],
        rollout.Sampling.of(cfg), samples_per_task=cfg.group_size, lora_request=run.lora_request,
        desc=f"rollout@{step + 1}", progress=cfg.progress and run.rank == 0)


def finish_step(run: Run, completed: int, published: dict, metrics: dict, timing: dict, step_start: float,
                puzzles: list) -> dict:
    """The checkpoint and the export of the published policy on their intervals, and the step's
    metrics line (means over ranks); then the stale-policy check. Returns the line."""
    cfg, t0 = run.cfg, time.time()
    run.hours += (time.time() - step_start) * run.world / 3600
    ckpt_tmp = save_checkpoint(run, completed) if completed % cfg.ckpt_interval == 0 or completed == cfg.steps else None
    if run.rank == 0 and (completed % cfg.export_interval == 0 or completed == cfg.steps):
        checkpoint.write_adapter(run.model, published, run.out / "adapters" / f"step_{completed}", run.base)
    timing["checkpoint_s"], timing["step_s"] = time.time() - t0, time.time() - step_start
    metrics = step_metrics(metrics, timing, run.hours, run.device.type == "cuda")
    if run.rank == 0:
        run.log.step(completed, metrics, seeds=[p.seed for p in puzzles], stream_position=run.stream.position)
        if ckpt_tmp:  # after the step's line is on disk, so that `latest` never names a step it lacks
            checkpoint.publish(run.out, ckpt_tmp, completed, cfg.keep_checkpoints)
    run.guard.check(completed, metrics["mismatch_abs_mean"], metrics["mismatch_tokens"])  # the same on every rank
    return metrics


def main(cfg: Config):
    run = start_run(cfg)
    run_start, stop, stopped, abandoned = time.time(), rundir.StopRequest(), 0, False  # SIGTERM and the like
    bar = tqdm(range(run.start_step, cfg.steps), desc="train", unit="step", initial=run.start_step, total=cfg.steps,
               disable=not (cfg.progress and run.rank == 0))
    step = run.start_step
    for step in bar:
        if stopped := stop.pending():  # a stop asked for during the last step (or the start-up)
            break
        metrics = train_step(run, step, stop)
        if metrics is None:  # the stop came during the rollouts, and the step is given up
            stopped, abandoned = stop.pending(), True
            break
        bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", mismatch=f"{metrics['mismatch_abs_mean']:.1e}",
                        step_s=f"{metrics['step_s']:.1f}")
    bar.close()
    if stopped:
        stop_at(run, step, stopped, abandoned, stop)
    elif run.rank == 0:
        run.log.finish(cfg.steps, time.time() - run_start, run.hours, run.device.type == "cuda", log=log0)
    # Shut down in order: all ranks done, then the engine (whose teardown may already take the
    # process group down with it), then the group if it is still there.
    dist.barrier()
    del run.engine
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    if stopped:
        raise SystemExit(128 + stopped)  # what a process that the signal killed reports: "terminated"


def stop_at(run: Run, step: int, signum: int, abandoned: bool, stop: rundir.StopRequest):
    """A stop was asked for (SIGTERM and the like): the last completed step is `step`; it is
    checkpointed unless it already is, and the run directory says why the run stopped."""
    if run.saved_step != step:
        ckpt_tmp = save_checkpoint(run, step)
        if run.rank == 0:
            checkpoint.publish(run.out, ckpt_tmp, step, run.cfg.keep_checkpoints)
    if run.rank == 0:
        rundir.write_stopped(run.out, signum, step, abandoned)
    log0(f"stopped by {signal.Signals(signum).name}: checkpoint step_{step} is the last completed step"
         + (f" (step {step + 1} was under way and is given up)" if abandoned else "")
         + (f", {time.time() - stop.received_at:.1f}s after the signal" if stop.received_at else "")
         + "; the same command resumes the run from there")


if __name__ == "__main__":
    try:
        main(parse_config(description=__doc__))
    except storage.WriteError as e:  # a full disk, a quota, a read-only mount: one line, nothing lost
        raise SystemExit(f"stopped: {e}")
