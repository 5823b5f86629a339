"""Benchmarks: how fast the pieces are and where the time goes. Apart from the tests; nothing
here gates CI on timing.

    .venv/bin/python bench/bench.py --quick      # about 5 minutes on 2 idle CPU cores
    .venv/bin/python bench/bench.py              # the full set, about 20 minutes
    .venv/bin/python bench/bench.py --only rollout --profile
    .venv/bin/python bench/bench.py --size tiny  # every section at its smallest: a smoke run, no figures
                                                 # worth reading (tests/test_bench.py runs it)

Sections (`--only` picks some, comma-separated):

  coldstart  engine start and first rollout, each in a fresh process, per setting
  train      real training steps, phase by phase, with 1 and 2 processes (`train.py`, `torchrun`),
             and the scaling of episodes/s from 1 to 2; the phases are the timings train.py writes
             to metrics.jsonl (every `*_s` key but the rates `*_per_s`), whatever they are named.
             The steps start from the main job's SFT warm start (built once into .cache/, or
             `--model`), so groups have reward spread and the update trains; the share of rows
             (sequences) each step trained is recorded, and a run with half or more of its timed
             steps idle (the update trained nothing) is refused: left out of the table and the
             scaling, and bench exits 3
  sync       LoRA sync: bytes, seconds and share of the step come from the train runs; here, write
             and load of a random rank-32 adapter with the shape of Qwen3-VL-8B
  rollout    `rollout.play_episodes` (in-process vLLM, token-in/token-out, prefix caching) against
             a plain transformers `generate` loop playing the same episodes, at 8 and 15 turns;
             `--profile` (on in the full set) adds where the vLLM rollout's time goes

GPU training efficiency (tokens/s, MFU, memory) is `bench/gpu_mfu.py`, for machines with a GPU.

The rollout comparison is like for like: the same maze seeds, group size, turn limit, full image
history, temperature 1 without top-k/top-p, vision tokens banned, the same random LoRA on both
sides, and every reply exactly 32 tokens long (vLLM `min_tokens` and transformers
`min_new_tokens` both equal to the maximum), so both generate the same tokens and take the same
env steps; the JSON records that they did (`same_work`). Engine start and warm-up are timed apart.
Both run in one process with the same number of torch threads (`--threads`, default 1: on a
shared machine, threads beyond the free cores made runs up to 30x slower and bimodal).

Every timing is repeated; tables give the median and the spread (min-max). Machines are often
shared, so the load average (`os.getloadavg()`) is recorded beside every section and every
rollout run: compare runs only at similar load. The table is printed at the end, and everything
is written as JSON to `bench/results/<date>-<mode>.json` (figures only, a few kB).
"""

import argparse
import contextlib
import cProfile
import datetime
import fcntl
import hashlib
import json
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import rollout  # noqa: E402
import vllm_engine  # noqa: E402

import torch  # noqa: E402

from tasks.maze import DIFFICULTY_SIZES, INSTRUCTIONS, MazeTask, generate_maze  # noqa: E402
import shapes  # noqa: E402  (bench/shapes.py)

RESULTS = ROOT / "bench" / "results"


# ----------------------------------------------------------------------------- small helpers

def load() -> list:
    """The 1, 5 and 15 minute load averages, rounded: how busy the machine was."""
    return [round(x, 2) for x in os.getloadavg()]


def summary(values: list) -> dict:
    """Median and spread of repeated measurements."""
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def fmt(s: dict, digits: int = 3) -> str:
    """`median (min-max)` for the table."""
    if s["median"] is None:
        return "n/a"
    g = lambda x: f"{x:.{digits}g}"  # noqa: E731
    return g(s["median"]) if s["n"] == 1 else f"{g(s['median'])} ({g(s['min'])}-{g(s['max'])})"


def log(*args):
    print(f"[bench {time.strftime('%H:%M:%S')}]", *args, flush=True)


def tiny_model() -> str:
    from tiny_model import ensure_tiny_model

    return str(ensure_tiny_model())


# The main job's warm start (launch/run.sh: `sft.py --difficulty small --seed 0` at sft.py's default
# 250 steps). The folder is named as tests/conftest.py's `warm_start` fixture names it, from the
# tiny model's fingerprint and sft.py's hash, so the tests and the benchmark build it once between
# them and a changed model or recipe gets a new one.
WARM_START_STEPS = 250


def warm_start_dir() -> Path:
    """Where the warm start of today's tiny model and sft.py lives (built or not)."""
    fingerprint = json.loads((Path(tiny_model()) / "BUILD_INFO.json").read_text())["fingerprint"]
    recipe = hashlib.sha256((ROOT / "sft.py").read_bytes()).hexdigest()[:8]
    return ROOT / ".cache" / f"warm-start-{WARM_START_STEPS}-{fingerprint}-{recipe}"


def warm_start(args) -> dict:
    """The warm start's model folder, built by sft.py if it is not there yet (3-5 min on 2 cores),
    under the same lock file as the tests' fixture, so a test session building it is waited for."""
    out = warm_start_dir()
    info = {"model": str(out / "model"), "built_s": None}
    with open(ROOT / ".cache" / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "model" / "config.json").exists():
            cmd = [sys.executable, "sft.py", "--out", str(out), "--difficulty", "small", "--seed", "0",
                   "--steps", str(WARM_START_STEPS), "--log-every", "50"]
            log(f"warm start: building {out.name} ({' '.join(cmd[1:])})")
            t = time.time()
            proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)),
                                  capture_output=True, text=True, timeout=args.timeout)
            if proc.returncode != 0:
                raise SystemExit(f"bench: the warm start's sft.py failed ({proc.returncode}): "
                                 f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'no stderr'}")
            info["built_s"] = round(time.time() - t, 1)
    log(f"warm start: {out / 'model'} ({'built' if info['built_s'] else 'reused'})")
    return info


# ----------------------------------------------------------------------------- 1. rollout engine

def hf_play_episodes(model, processor, mazes: list, *, samples_per_maze: int, max_turns: int,
                     max_new_tokens: int, temperature: float, banned_token_ids: list, seed: int) -> dict:
    """The plain alternative to `rollout.play_episodes`: a transformers `generate` loop.

    What one writes without vLLM: every turn, the whole conversation of every active episode is
    rendered by the chat template and re-encoded by the processor (text and every image so far),
    left-padded into one batch, and `generate` samples the replies (KV cache on, no grad, eval
    mode). Replies are kept as text. The same mazes, turn limit and sampling as the vLLM side:
    temperature, no top-k/top-p, vision tokens banned, and exactly `max_new_tokens` per reply.
    """
    torch.manual_seed(seed)
    games, conversations = [], []
    for maze in mazes:
        for _ in range(samples_per_maze):
            game = MazeTask.of(maze, max_turns=max_turns)
            obs = game.reset()
            games.append(game)
            conversations.append({"messages": [rollout.ChatFormat.user_turn(INSTRUCTIONS + "\n" + obs.text)],
                                  "images": [obs.image]})
    turns = tokens = 0
    with torch.no_grad():
        while active := [i for i, g in enumerate(games) if not g.done]:
            texts = [processor.apply_chat_template(conversations[i]["messages"], add_generation_prompt=True,
                                                   tokenize=False) for i in active]
            images = [image for i in active for image in conversations[i]["images"]]
            inputs = processor(text=texts, images=images, padding=True, padding_side="left", return_tensors="pt")
            out = model.generate(**inputs, do_sample=temperature > 0, temperature=temperature, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 suppress_tokens=banned_token_ids, use_cache=True)
            new = out[:, inputs["input_ids"].shape[1]:]
            replies = processor.batch_decode(new, skip_special_tokens=True)
            for i, reply in zip(active, replies):
                obs = games[i].step(reply)
                conversations[i]["messages"].append({"role": "assistant", "content": reply})
                if not games[i].done:
                    conversations[i]["messages"].append(rollout.ChatFormat.user_turn(obs.text))
                    conversations[i]["images"].append(obs.image)
            turns += len(active)
            tokens += new.numel()
    return {"turns": turns, "tokens": tokens}


def bench_rollout(args) -> dict:
    """Section 1: the vLLM rollout against the plain transformers loop, same episodes."""
    from vllm.lora.request import LoRARequest

    model_path = tiny_model()
    size = {"tiny": dict(mazes=1, samples=2, repeats=1, turn_limits=[2]),
            "quick": dict(mazes=2, samples=4, repeats=2, turn_limits=[8, 15]),
            "full": dict(mazes=8, samples=8, repeats=3, turn_limits=[8, 15])}[args.size]
    p = dict(**size, max_new_tokens=32, temperature=1.0, lora_rank=8, difficulty="small",
             max_model_len=4096, threads=torch.get_num_threads())
    if args.rollout_repeats:
        p["repeats"] = args.rollout_repeats
    log(f"rollout: {p['mazes']} mazes x {p['samples']} samples, turns {p['turn_limits']}, "
        f"{p['max_new_tokens']} tokens per reply, {p['repeats']} repeats, {p['threads']} torch threads")
    out = {"params": p, "load_start": load()}

    chat = rollout.ChatFormat.for_model(model_path)
    processor = chat.processor
    size = DIFFICULTY_SIZES[p["difficulty"]]
    mazes = [generate_maze(size, 2_000_000 + i) for i in range(p["mazes"])]  # fixed seeds, never training's

    tmp = Path(tempfile.mkdtemp(prefix="bench-adapter-"))
    from tiny_model import random_lora

    hf_model = random_lora(model_path, tmp, rank=p["lora_rank"], seed=0, b_std=0.02)
    lora = LoRARequest("bench", 1, str(tmp))

    t = time.time()
    engine = vllm_engine.build_engine(model_path, max_model_len=p["max_model_len"], max_lora_rank=p["lora_rank"],
                                  seed=0, max_images=max(p["turn_limits"]) + 1)
    out["engine_build_s"] = time.time() - t

    def play_vllm(n_mazes, samples, turns, seed=0):
        t = time.time()
        episodes = rollout.play_episodes(
            engine, chat, [MazeTask.of(m, max_turns=turns) for m in mazes[:n_mazes]], list(range(n_mazes)),
            rollout.Sampling(p["temperature"], seed, p["max_new_tokens"], p["max_model_len"],
                             min_new_tokens=p["max_new_tokens"]),
            samples_per_task=samples, lora_request=lora, progress=False)
        return {"s": time.time() - t, "turns": sum(e.num_turns for e in episodes),
                "tokens": sum(e.num_generated_tokens for e in episodes)}

    def play_hf(n_mazes, samples, turns, seed=0):
        t = time.time()
        r = hf_play_episodes(hf_model, processor, mazes[:n_mazes], samples_per_maze=samples, max_turns=turns,
                             max_new_tokens=p["max_new_tokens"], temperature=p["temperature"],
                             banned_token_ids=chat.banned_token_ids, seed=seed)
        return {"s": time.time() - t, **r}

    # Warm-up, timed apart: the first calls compile kernels and settle shapes. Two batch sizes,
    # because a second shape makes torch.compile recompile for dynamic shapes once.
    t = time.time()
    play_vllm(1, 2, 2)
    out["engine_first_play_s"] = time.time() - t
    t = time.time()
    play_vllm(1, 3, 2)
    play_hf(1, 2, 2)
    out["warmup_rest_s"] = time.time() - t

    for turns in p["turn_limits"]:
        runs = {"vllm": [], "hf": []}
        for r in range(p["repeats"]):
            # alternate the order, so a load change in the middle hits both sides alike
            order = ("vllm", "hf") if r % 2 == 0 else ("hf", "vllm")
            for side in order:
                play = play_vllm if side == "vllm" else play_hf
                res = play(p["mazes"], p["samples"], turns, seed=r)
                res["load1"] = load()[0]
                runs[side].append(res)
                log(f"  {turns} turns, repeat {r + 1}: {side:4s} {res['s']:7.1f} s, {res['turns']} env steps, "
                    f"{res['tokens']} tokens, load {res['load1']}")
        row = {"runs": runs, "same_work": all(v["turns"] == h["turns"] and v["tokens"] == h["tokens"]
                                              for v, h in zip(runs["vllm"], runs["hf"]))}
        for side in ("vllm", "hf"):
            row[side] = {"steps_per_s": summary([x["turns"] / x["s"] for x in runs[side]]),
                         "tokens_per_s": summary([x["tokens"] / x["s"] for x in runs[side]]),
                         "seconds": summary([x["s"] for x in runs[side]])}
        # the ratio of each repeat pair (measured back to back), then its median
        row["speedup_steps"] = summary([(v["turns"] / v["s"]) / (h["turns"] / h["s"])
                                        for v, h in zip(runs["vllm"], runs["hf"])])
        row["speedup_tokens"] = summary([(v["tokens"] / v["s"]) / (h["tokens"] / h["s"])
                                         for v, h in zip(runs["vllm"], runs["hf"])])
        out[f"turns_{turns}"] = row

    if args.profile:
        out["profile"] = profile_rollout(lambda: play_vllm(p["mazes"], p["samples"], max(p["turn_limits"]), seed=99))
    out["load_end"] = load()
    del engine
    shutil.rmtree(tmp, ignore_errors=True)
    return out


# Where a vLLM rollout's time goes, from cProfile's cumulative times of these functions
# (path suffix, function name). Nested ones are subtracted from their parents, so the parts add up
# to the whole of play_episodes.
PROFILED = {
    "play": ("/rollout.py", "play_episodes"),
    "run_completion": ("entrypoints/common/offline.py", "_run_completion"),
    "run_engine": ("entrypoints/common/offline.py", "_run_engine"),
    "core_step": ("v1/engine/core.py", "step"),
    "forward": ("gpu_model_runner.py", "_model_forward"),
    "logits": ("model_executor/layers/logits_processor.py", "forward"),
    "lora_linear": ("punica_cpu.py", "add_lora_linear"),
    "lora_logits": ("punica_cpu.py", "add_lora_logits"),
    "sample": ("gpu_model_runner.py", "sample_tokens"),
    "schedule": ("v1/core/sched/scheduler.py", "schedule"),
    "outputs": ("v1/engine/output_processor.py", "process_outputs"),
    "env": ("/env.py", "step"),  # Task.step, every task's turn
    "template": ("/rollout.py", "next_turn"),
    "expand": ("/rollout.py", "expand"),
    "next_prompt": ("/rollout.py", "next_prompt"),
    "decode": ("/rollout.py", "decode_replies"),
    "digest": ("/rollout.py", "image_digest"),
}


def profile_rollout(play) -> dict:
    profiler = cProfile.Profile()
    profiler.enable()
    result = play()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, tottime, cumtime, callers)
    c = {key: sum(v[3] for (f, _, n), v in stats.items() if f.endswith(suffix) and n == name)
         for key, (suffix, name) in PROFILED.items()}
    lora = c["lora_linear"] + c["lora_logits"]
    parts = {
        "engine: model forward (base layers, attention)": c["forward"] - c["lora_linear"],
        "engine: LoRA (vLLM's CPU kernels)": lora,
        "engine: output head (logits)": c["logits"] - c["lora_logits"],
        "engine: sampling + logprobs": c["sample"],
        "engine: scheduler": c["schedule"],
        "engine: other (batch preparation, bookkeeping)":
            c["core_step"] - c["forward"] - c["logits"] - c["sample"] - c["schedule"],
        "vLLM: request intake (multimodal processing, cache lookups)": c["run_completion"] - c["run_engine"],
        "vLLM: outputs": c["outputs"],
        "vLLM: engine loop other": c["run_engine"] - c["core_step"] - c["outputs"],
        "ours: env step + render": c["env"],
        "ours: chat template (next_turn)": c["template"],
        "ours: expansion check (expand)": c["expand"],
        "ours: next_prompt": c["next_prompt"],
        "ours: decode replies + image digests": c["decode"] + c["digest"],
    }
    total = c["play"]
    parts["ours: other (play_episodes itself)"] = total - sum(parts.values())
    log(f"  profile: {result['s']:.1f} s under cProfile (slower than unprofiled)")
    return {"profiled_s": total, "parts_s": {k: round(v, 3) for k, v in parts.items()},
            "parts_share": {k: round(v / total, 4) for k, v in parts.items()}}


# ----------------------------------------------------------------------------- 2. training step

# The phases are not named here: they are whatever timings train.py writes into each metrics.jsonl
# line (`timing_keys`). These are the few the summary needs by name: the step's whole time, the
# two that run on intervals (reported "when run" and left out of the core step), and the sync.
STEP_KEY, INTERVAL_KEYS, SYNC_KEY = "step_s", ("eval_s", "checkpoint_s"), "sync_s"
# What the update trained, from update.grpo_update's metrics: the share of rank 0's sequences it ran
# (the others had all-zero advantages: their group's rewards were equal), and the gradient's norm,
# which FSDP reduces over every rank, so a step is idle (trained nothing anywhere, its update_s
# times no backward pass) exactly when it is 0. With 2 processes rank 0's share can be 0 while
# rank 1 trains; rank 0 then runs zero-weight fillers as long as rank 1's update, so the step's
# time is a training step's. The first step runs every sequence (the stale-policy guard's
# calibration) whatever its advantages; it is not timed.
TRAINED_KEY, GRAD_NORM_KEY = "trained_sequence_frac", "grad_norm"


def timing_keys(rows: list) -> list:
    """The timings of train.py's metrics rows, in the rows' order (train.py sorts its metrics by
    name): every number under a key ending in `_s` except the rates (`*_per_s`, such as
    tokens_per_s). Fails, naming what it found, if one the summary needs by name is gone."""
    keys = []
    for row in rows:
        keys += [k for k, v in row.items() if k.endswith("_s") and not k.endswith("_per_s")
                 and isinstance(v, (int, float)) and k not in keys]
    missing = [k for k in (STEP_KEY, *INTERVAL_KEYS, SYNC_KEY) if k not in keys]
    if missing:
        raise KeyError(f"train.py's metrics.jsonl has no {missing}; its timings are {keys}: "
                       "bench/bench.py's STEP_KEY, INTERVAL_KEYS, SYNC_KEY must follow the trainer")
    return keys


def train_args(size: str) -> list:
    """A few real steps of the main job's step: the recipe (train.py's defaults: 4 puzzles x 8, 15
    turns, 8-token replies, LoRA rank 32, branch rollouts), so the update's time is comparable to
    the main job's; only the number of steps and the evaluation's size differ, with eval,
    checkpoint and export every 2 steps. The tiny size, a smoke run, plays its one timed step
    without branches on the first step's 4 puzzles again (--train-pool 4), some of which the warm
    start solves some of the time, so that its groups get reward spread whatever the stream's next
    puzzles are (a maze needs most of its 15 turns to be solved at all)."""
    size = {"tiny": ["--train-pool", "4", "--branch-points-per-group", "0", "--steps", "2", "--eval-puzzles", "2",
                     "--sampled-eval-samples", "1"],
            "quick": ["--steps", "4", "--eval-puzzles", "2"],
            "full": ["--steps", "5", "--eval-puzzles", "8"]}[size]
    return size + ["--eval-interval", "2", "--ckpt-interval", "2", "--export-interval", "2", "--progress", "false",
                   "--resume", "none"]


def run_train(nproc: int, args, out_dir: Path, threads: int | None = None) -> dict:
    """One `train.py` run (a world of one, or torchrun) with `threads` torch threads a process
    (default --threads); its metrics.jsonl, summarised."""
    if nproc == 1:
        cmd = [sys.executable, "train.py"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "train.py"]
    cmd += ["--model", args.model, "--out-dir", str(out_dir), *train_args(args.size)]
    threads = threads or args.threads
    environ = dict(os.environ, OMP_NUM_THREADS=str(threads))
    log(f"train: {nproc} process(es) of {threads} thread(s): {' '.join(cmd[1:])}")
    t = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=args.timeout)
    wall = time.time() - t
    if proc.returncode != 0:
        log(f"  train.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return {"nproc": nproc, "threads": threads, "failed": proc.returncode, "stderr_tail": proc.stderr[-2000:]}
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    config = json.loads((out_dir / "config.json").read_text())  # the settings the run took, defaults included
    return {"nproc": nproc, "threads": threads, "wall_s": wall, **summarise_train(rows, config)}


def summarise_train(rows: list, config: dict) -> dict:
    """train.py's metrics rows, summarised: each timing it wrote (`timing_keys`) over the steps
    after the first, the core step and episodes/s, the sync's share, and per step the share of
    rows the update trained. `refused` (a reason) when a timed step trained none: its update_s
    would time no backward pass, so the run's figures are not a training step's."""
    phases = timing_keys(rows)
    missing = sorted({k for r in rows for k in (TRAINED_KEY, GRAD_NORM_KEY) if k not in r})
    if missing:
        raise KeyError(f"train.py's metrics.jsonl has no {missing}: bench/bench.py's TRAINED_KEY and GRAD_NORM_KEY "
                       "must follow update.grpo_update's metrics")
    later = rows[1:]  # the first step pays for warm-up (compilation, first shapes)
    episodes = config["prompts_per_step"] * config["group_size"]
    res = {"steps": len(rows), "episodes_per_step": episodes, "lora_rank": config["lora_rank"], "phases": phases,
           "first_step": {k: rows[0].get(k) for k in phases},
           "per_step": [{"step": r.get("step", i + 1), "trained_frac": r[TRAINED_KEY], "idle": r[GRAD_NORM_KEY] == 0,
                         # every rank's sampled tokens the update ran (single pass; branch targets' are forced)
                         "trained_sampled_tokens": r.get("mismatch_tokens"),
                         "zero_variance_group_frac": r.get("zero_variance_group_frac"),
                         "update_s": r.get("update_s")} for i, r in enumerate(rows)],
           "trained_frac": summary([r[TRAINED_KEY] for r in later])}
    # Refused when at least half the timed steps are idle: the median update_s is (or averages in)
    # an idle step's, no update's time. A lone idle step stays in, shown by the rows-trained
    # column's minimum: GRPO's own steps are sometimes idle, at 4 groups rarely.
    idle = [p["step"] for p in res["per_step"][1:] if p["idle"]]
    res["idle_steps"] = idle
    if not later or 2 * len(idle) >= len(later):
        res["refused"] = (f"step(s) {idle} of the {len(later)} timed trained no rows (every group's rewards equal, "
                          "all advantages 0)" if later else "no step after the first to time")
    for k in phases:
        res[k] = summary([r.get(k) for r in later])
    for k in INTERVAL_KEYS:  # they run every 2 steps: their cost when they run
        res[k + "_when_run"] = summary([r[k] for r in later if r[k] > 1e-3])
    # the step without eval and checkpoint, which run every 10 and 20 steps in the recipe: the
    # step's whole time less those two (a sum of the other phases would count nested ones twice:
    # branch_s is inside rollout_s)
    core = [r[STEP_KEY] - sum(r[k] for k in INTERVAL_KEYS) for r in later]
    res["core_step_s"] = summary(core)
    res["episodes_per_s"] = summary([episodes / c for c in core])
    res["sync_bytes"] = rows[-1]["sync_bytes"]
    res["sync_share_of_core_step"] = summary([r[SYNC_KEY] / c for r, c in zip(later, core)])
    res["sync_share_of_step"] = summary([r[SYNC_KEY] / r[STEP_KEY] for r in later])
    log(f"  core step {fmt(res['core_step_s'])} s, {fmt(res['episodes_per_s'])} episodes/s, update "
        f"{fmt(res['update_s'])} s, rows trained {[round(p['trained_frac'], 3) for p in res['per_step']]}, "
        f"idle steps {idle}; phases {phases}")
    if "refused" in res:
        log(f"  REFUSED: {res['refused']}")
    return res


def bench_train(args) -> dict:
    """Section 2 (and the measured half of 3): real steps with 1 and 2 processes, and 1 process with
    as many threads as the 2 processes have together: what the second process buys over giving
    the one process the second core (at --size tiny, 1 process only: the other runs would triple
    the smoke run's time and test nothing of bench's own)."""
    out = {"args": train_args(args.size), "threads_per_process": args.threads, "load_start": load()}
    if args.model:
        out["model"] = {"model": args.model, "built_s": None, "given": True}
    else:
        out["model"] = warm_start(args)
        args.model = out["model"]["model"]
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        for nproc in (1,) if args.size == "tiny" else (1, 2):
            out[f"nproc_{nproc}"] = run_train(nproc, args, Path(tmp) / f"n{nproc}")
        if args.size != "tiny":
            out["nproc_1_threads_2"] = run_train(1, args, Path(tmp) / "n1t2", threads=2 * args.threads)
    one, two = out["nproc_1"], out.get("nproc_2", {"failed": "not run"})
    wide = out.get("nproc_1_threads_2", {"failed": "not run"})
    usable = lambda x: "failed" not in x and "refused" not in x  # noqa: E731
    if usable(one) and usable(two):
        out["scaling_2_vs_1"] = two["episodes_per_s"]["median"] / one["episodes_per_s"]["median"]
    if usable(wide) and usable(two):
        out["scaling_2_vs_1_with_the_threads"] = two["episodes_per_s"]["median"] / wide["episodes_per_s"]["median"]
    out["load_end"] = load()
    return out


# ----------------------------------------------------------------------------- 3. LoRA sync at 8B

def bench_sync_8b(args) -> dict:
    """Write and load a random rank-32 LoRA with Qwen3-VL-8B's shape, as the sync path does.

    Write: safetensors save + fsync (checkpoint.write_adapter also fsyncs). Load: safetensors load
    (what PEFT reads), and vLLM's own adapter parsing (`LoRAModel.from_local_checkpoint`, the call
    its worker makes on every new adapter, on the CPU, before copying it into the device slot).
    The file was just written, so reads come from the page cache: a shared network filesystem
    between nodes is slower.
    """
    from peft import LoraConfig
    from safetensors.torch import load_file, save_file

    rank = 1 if args.size == "tiny" else 32
    tensor_shapes = shapes.lora_tensor_shapes(shapes.QWEN3_VL_8B_TEXT, rank)
    params = shapes.lora_parameter_count(shapes.QWEN3_VL_8B_TEXT, rank)
    assert params == sum(a * b for a, b in tensor_shapes.values())
    out = {"rank": rank, "targets": list(shapes.LORA_TARGETS), "text_config": shapes.QWEN3_VL_8B_TEXT,
           "parameters": params, "load_start": load()}
    repeats = 3 if args.size == "full" else 1
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[1]
        state = {k: (torch.randn(s) * 0.01).to(dtype) for k, s in tensor_shapes.items()}
        nbytes = sum(v.numel() * v.element_size() for v in state.values())
        writes, reads, vllm_loads = [], [], []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory(prefix="bench-lora8b-") as tmp:
                path = Path(tmp) / "adapter"
                path.mkdir()
                t = time.time()
                config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=vllm_engine.LORA_TARGET_REGEX)
                config.save_pretrained(str(path))
                save_file(state, str(path / "adapter_model.safetensors"))
                fd = os.open(path / "adapter_model.safetensors", os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
                writes.append(time.time() - t)
                t = time.time()
                loaded = load_file(str(path / "adapter_model.safetensors"))
                loaded = {k: v.clone() for k, v in loaded.items()}  # really read it, not just map it
                reads.append(time.time() - t)
                assert len(loaded) == len(state)
                del loaded
                vllm_loads.append(vllm_parse_adapter(path))
        out[name] = {"bytes": nbytes, "write_s": summary(writes), "safetensors_load_s": summary(reads),
                     "vllm_parse_s": summary(vllm_loads)}
        log(f"  8B rank-32 LoRA, {name}: {nbytes / 1e6:.0f} MB, write {fmt(out[name]['write_s'])} s, "
            f"load {fmt(out[name]['safetensors_load_s'])} s, vLLM parse {fmt(out[name]['vllm_parse_s'])} s")
        del state
    out["load_end"] = load()
    return out


def vllm_parse_adapter(path: Path) -> float | None:
    """Seconds for vLLM to read and parse a PEFT adapter dir into its LoRAModel (bf16, CPU)."""
    try:
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration as VllmQwen3VL
    except ImportError as e:
        log(f"  vLLM adapter parse skipped: {e}")
        return None
    t = time.time()
    helper = PEFTHelper.from_local_dir(str(path), max_position_embeddings=None)
    LoRAModel.from_local_checkpoint(str(path), set(shapes.LORA_TARGETS), helper, lora_model_id=1, device="cpu",
                                    dtype=torch.bfloat16, model_vocab_size=shapes.QWEN3_VL_8B_TEXT["vocab_size"],
                                    weights_mapper=VllmQwen3VL.hf_to_vllm_mapper)
    return time.time() - t


# ----------------------------------------------------------------------------- 4. engine cold start

# What each setting changes: `enforce_eager` skips vLLM's graph capture and compilation; no_torch_compile
# (TORCHDYNAMO_DISABLE=1) stops the small torch.compile'd ops in vLLM's sampler from compiling on
# the first request; bytecode_cache lets Python keep compiled .pyc files (in a private folder, via
# PYTHONPYCACHEPREFIX) where the environment has PYTHONDONTWRITEBYTECODE=1 and the packages ship none.
COLDSTART_CONFIGS = {
    "default": {"engine": {}, "env": {}},
    "enforce_eager": {"engine": {"enforce_eager": True}, "env": {}},
    "no_torch_compile": {"engine": {}, "env": {"TORCHDYNAMO_DISABLE": "1"}},
    "bytecode_cache": {"engine": {}, "env": {"PYTHONDONTWRITEBYTECODE": ""}, "pycache": True},
    "bytecode_cache+no_torch_compile": {"engine": {}, "pycache": True,
                                        "env": {"PYTHONDONTWRITEBYTECODE": "", "TORCHDYNAMO_DISABLE": "1"}},
}


def coldstart_child(engine_kwargs: dict):
    """In a fresh process: import, build the engine, the first and second small rollouts."""
    t0 = time.time()
    import transformers  # noqa: F401  (timed as part of the import)
    from vllm import LLM  # noqa: F401  (timed as part of the import)

    model_path = tiny_model()
    t_import = time.time() - t0
    t = time.time()
    engine = vllm_engine.build_engine(model_path, max_model_len=4096, max_lora_rank=8, seed=0, **engine_kwargs)
    t_build = time.time() - t
    chat = rollout.ChatFormat.for_model(model_path)
    mazes = [generate_maze(7, 2_000_000 + i) for i in range(2)]
    times = []
    for _ in range(2):
        t = time.time()
        rollout.play_episodes(engine, chat, [MazeTask.of(m, max_turns=3) for m in mazes], [0, 1],
                              rollout.Sampling(1.0, 0, 16, 4096), samples_per_task=2, progress=False)
        times.append(time.time() - t)
    print("BENCH_RESULT " + json.dumps({"import_s": t_import, "build_s": t_build, "first_play_s": times[0],
                                        "second_play_s": times[1]}), flush=True)


def bench_coldstart(args) -> dict:
    names = {"tiny": ["default"], "quick": ["default", "enforce_eager"], "full": list(COLDSTART_CONFIGS)}[args.size]
    repeats = 2 if args.size == "full" else 1
    out = {"play": "2 mazes x 2 samples, 3 turns, 16 tokens", "load_start": load()}
    pycache = Path(tempfile.mkdtemp(prefix="bench-pycache-"))
    for name in names:
        cfg = COLDSTART_CONFIGS[name]
        environ = dict(os.environ, OMP_NUM_THREADS=str(args.threads), **cfg["env"])
        if cfg.get("pycache"):
            environ["PYTHONPYCACHEPREFIX"] = str(pycache)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--coldstart-child", json.dumps(cfg["engine"])]
        if cfg.get("pycache"):  # one run to fill the bytecode cache, not counted
            subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=args.timeout)
        runs = []
        for _ in range(repeats):
            t = time.time()
            proc = subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=args.timeout)
            wall = time.time() - t
            line = [l for l in proc.stdout.splitlines() if l.startswith("BENCH_RESULT ")]
            if proc.returncode != 0 or not line:
                log(f"  coldstart {name} failed:\n{proc.stderr[-2000:]}")
                continue
            runs.append({**json.loads(line[-1][len("BENCH_RESULT "):]), "process_s": wall})
        keys = ("import_s", "build_s", "first_play_s", "second_play_s", "process_s")
        out[name] = {k: summary([r[k] for r in runs]) for k in keys} if runs else {"failed": True}
        out[name]["settings"] = cfg
        if runs:
            log(f"  coldstart {name}: build {fmt(out[name]['build_s'])} s, "
                f"first play {fmt(out[name]['first_play_s'])} s, whole process {fmt(out[name]['process_s'])} s")
    out["load_end"] = load()
    return out


# ----------------------------------------------------------------------------- the report

def machine() -> dict:
    import transformers
    import vllm

    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "gpu": torch.cuda.is_available(),
            "python": platform.python_version(), "torch": torch.__version__, "vllm": vllm.__version__,
            "transformers": transformers.__version__}


def table(results: dict) -> str:
    """The results as markdown: medians, with (min-max) where there were several repeats."""
    m = results["meta"]
    lines = [f"## Benchmark {m['date']} ({m['mode']})", "",
             f"`{m['command']}` on {m['machine']['cpu']}, {m['machine']['cores']} cores, "
             f"{'a GPU' if m['machine']['gpu'] else 'no GPU'}; torch {m['machine']['torch']}, "
             f"vllm {m['machine']['vllm']}; {m['threads']} torch thread(s) per process; "
             f"load average at start {m['load_start']}, at end {m['load_end']}. "
             "Medians, (min-max) over repeats.", ""]
    if r := results.get("rollout"):
        p = r["params"]
        lines += [f"### Rollout: vLLM engine vs transformers `generate` ({p['mazes']} mazes x {p['samples']} samples, "
                  f"{p['max_new_tokens']} tokens per reply, LoRA rank {p['lora_rank']}, {p['repeats']} repeats)", "",
                  "| turns | vLLM env steps/s | HF env steps/s | vLLM tokens/s | HF tokens/s "
                  "| speedup (median of pairs) | same tokens and steps |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for turns in p["turn_limits"]:
            row = r[f"turns_{turns}"]
            lines.append(f"| {turns} | {fmt(row['vllm']['steps_per_s'])} | {fmt(row['hf']['steps_per_s'])} | "
                         f"{fmt(row['vllm']['tokens_per_s'])} | {fmt(row['hf']['tokens_per_s'])} | "
                         f"**{fmt(row['speedup_steps'])}x** | {'yes' if row['same_work'] else 'NO'} |")
        lines += ["", f"Engine build {r['engine_build_s']:.1f} s and warm-up {r['engine_first_play_s']:.1f} s "
                  f"(first play) + {r['warmup_rest_s']:.1f} s, not in the figures above.", ""]
        if prof := r.get("profile"):
            lines += [f"Where the vLLM rollout's time goes (cProfile, {prof['profiled_s']:.1f} s profiled, "
                      f"{max(p['turn_limits'])} turns):", "", "| part | share |", "| --- | --- |"]
            for part, share in sorted(prof["parts_share"].items(), key=lambda kv: -kv[1]):
                lines.append(f"| {part} | {100 * share:.1f}% |")
            lines.append("")
    if t := results.get("train"):
        # the columns are the timings the trainer wrote (either run's), those on intervals and the
        # whole step (as the core step) last
        runs = [n for n in ("1", "1_threads_2", "2") if f"nproc_{n}" in t]
        phases = []
        for n in runs:
            phases += [k for k in t[f"nproc_{n}"].get("phases", []) if k not in phases and k != STEP_KEY]
        phases = [k for k in phases if k not in INTERVAL_KEYS] + [k for k in INTERVAL_KEYS if k in phases]
        columns = [(k[:-2].replace("_", " ") + (" (when run)" if k in INTERVAL_KEYS else ""),
                    k + "_when_run" if k in INTERVAL_KEYS else k) for k in phases]
        columns += [("step w/o " + "+".join(k[:-2] for k in INTERVAL_KEYS), "core_step_s"),
                    ("episodes/s", "episodes_per_s"), ("rows trained (rank 0)", "trained_frac")]
        model = t.get("model", {})
        lines += ["### Training step, phase by phase (seconds; steps after the first)", "",
                  f"`train.py --model {model.get('model', '?')} {' '.join(t['args'])}`, "
                  f"{t['threads_per_process']} thread(s) per process. Rows trained: the share of rank 0's "
                  "sequences the update ran (those whose advantages were not all 0), median (min-max) over the "
                  "timed steps; a run with half or more of them idle (nothing trained on any rank) is refused.",
                  "",
                  "| processes x threads | " + " | ".join(name for name, _ in columns) + " |",
                  "| --- " * (len(columns) + 1) + "|"]
        for n in runs:
            x = t[f"nproc_{n}"]
            who = f"{x['nproc']} x {x.get('threads', t['threads_per_process'])}"
            if "failed" in x:
                lines.append(f"| {who} | failed ({x['failed']}) |" + " |" * (len(columns) - 1))
                continue
            if "refused" in x:
                lines.append(f"| {who} | refused: {x['refused']} |" + " |" * (len(columns) - 1))
                continue
            lines.append(f"| {who} | " + " | ".join(fmt(x[key]) if key in x else "n/a" for _, key in columns) + " |")
        if "scaling_2_vs_1" in t:
            lines += ["", f"Scaling, episodes/s with 2 processes over 1: **{t['scaling_2_vs_1']:.2f}x**"
                      + (f"; over 1 process with both threads: **{t['scaling_2_vs_1_with_the_threads']:.2f}x**"
                         if "scaling_2_vs_1_with_the_threads" in t else "") + "."]
        lines.append("")
    if t := results.get("train"):
        lines += ["### LoRA sync", "", "| what | bytes | seconds | share of step (w/o eval+ckpt) |",
                  "| --- | --- | --- | --- |"]
        for n in [n for n in ("1", "2") if f"nproc_{n}" in t]:
            x = t[f"nproc_{n}"]
            if "failed" not in x and "refused" not in x:
                lines.append(f"| tiny model, rank {x['lora_rank']}, {n} process(es) | {x['sync_bytes']:.0f} | "
                             f"{fmt(x['sync_s'])} | "
                             f"{100 * x['sync_share_of_core_step']['median']:.2f}% |")
    if s := results.get("sync_8b"):
        if not results.get("train"):
            lines += ["### LoRA sync", "", "| what | bytes | seconds | |", "| --- | --- | --- | --- |"]
        for dtype in ("float32", "bfloat16"):
            x = s[dtype]
            lines.append(f"| Qwen3-VL-8B shape, rank {s['rank']} ({s['parameters'] / 1e6:.1f} M params), {dtype}: "
                         f"write + fsync / safetensors load / vLLM parse | {x['bytes']} | {fmt(x['write_s'])} / "
                         f"{fmt(x['safetensors_load_s'])} / {fmt(x['vllm_parse_s'])} | |")
    if results.get("train") or results.get("sync_8b"):
        lines.append("")
    if c := results.get("coldstart"):
        lines += [f"### Engine cold start (fresh process each; play: {c['play']})", "",
                  "| setting | imports | engine build | first play | second play | whole process |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for name in COLDSTART_CONFIGS:
            if name in c and "failed" not in c[name]:
                x = c[name]
                lines.append(f"| {name} | {fmt(x['import_s'])} | {fmt(x['build_s'])} | {fmt(x['first_play_s'])} | "
                             f"{fmt(x['second_play_s'])} | {fmt(x['process_s'])} |")
        lines.append("")
    lines.append("GPU training efficiency (tokens/s, MFU, memory): `bench/gpu_mfu.py`, not part of this run.")
    return "\n".join(lines)


SECTIONS = {"coldstart": bench_coldstart, "train": bench_train, "sync": bench_sync_8b, "rollout": bench_rollout}
RESULT_KEYS = {"coldstart": "coldstart", "train": "train", "sync": "sync_8b", "rollout": "rollout"}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["tiny", "quick", "full"], default="full",
                        help="full (default, ~20 min), quick (small sizes, fewer repeats, a few minutes) or tiny "
                             "(every section at its smallest, once: a smoke run for the tests, no figures to keep)")
    parser.add_argument("--quick", action="store_true", help="the same as --size quick")
    parser.add_argument("--only", default="", help=f"comma-separated sections of {list(SECTIONS)}; default all")
    parser.add_argument("--profile", action="store_true", help="profile a vLLM rollout (on by default at --size full)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per process, the same for both rollout loops and every child (default 1: "
                             "on a shared machine more threads than free cores made runs up to 30x slower)")
    parser.add_argument("--rollout-repeats", type=int, default=0, help="override the number of rollout repeats")
    parser.add_argument("--model", default="",
                        help="the training section's model; default: the main job's SFT warm start, built once into "
                             ".cache/ (3-5 min on 2 cores) and reused. A model whose groups never get reward spread "
                             "(the untrained tiny model) gets its runs refused")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds allowed per child process")
    parser.add_argument("--out", default="", help="JSON path; default bench/results/<date>-<mode>.json")
    parser.add_argument("--coldstart-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # before any engine exists: vLLM's CPU worker then forbids changes
    if args.coldstart_child is not None:
        return coldstart_child(json.loads(args.coldstart_child))
    if args.quick:
        args.size = "quick"
    args.profile = args.profile or args.size == "full"

    sections = [s for s in (args.only.split(",") if args.only else SECTIONS) if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {list(SECTIONS)}")
    mode = args.size
    date = datetime.datetime.now().strftime("%Y-%m-%d-%H%M")
    results = {"meta": {"date": date, "mode": mode, "command": " ".join([Path(sys.executable).name, *sys.argv]),
                        "machine": machine(), "threads": args.threads, "load_start": load()}}
    t0 = time.time()
    # Children first: the in-process engine of the rollout section comes last, alone.
    for name in [s for s in SECTIONS if s in sections]:
        log(f"section {name} (load {load()})")
        t = time.time()
        results[RESULT_KEYS[name]] = SECTIONS[name](args)
        results[RESULT_KEYS[name]]["section_s"] = round(time.time() - t, 1)
    results["meta"]["load_end"] = load()
    results["meta"]["total_s"] = round(time.time() - t0, 1)

    out = Path(args.out) if args.out else RESULTS / f"{date}-{mode}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=float))
    print("\n" + table(results) + "\n")
    log(f"wrote {out} ({results['meta']['total_s']:.0f} s in all)")
    refused = [f"{v['nproc']} x {v['threads']}: {v['refused']}" for k, v in results.get("train", {}).items()
               if k.startswith("nproc_") and "refused" in v]
    if refused:
        print(f"bench: training runs refused, their updates trained nothing: {'; '.join(refused)}", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    main()
