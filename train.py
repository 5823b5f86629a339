"""GRPO post-training of a vision-language model on visual mazes: torchrun + FSDP2 + LoRA + vLLM.

    python train.py                                  # a world of one, the tiny model, CPU
    torchrun --nproc-per-node 2 train.py --steps 40  # one process per GPU (or CPU slice)

Every process owns two things: an FSDP2 shard of the policy (HF Qwen3-VL + PEFT LoRA) and a
whole in-process vLLM engine. A step is

    rollouts (vLLM) -> old logprobs (trainer) -> group advantages (all-gather) -> GRPO update
    -> LoRA sync (rank 0 writes the adapter to shared storage, every engine loads it)
    -> eval / checkpoint / export on their intervals

On a GPU the engine sleeps (level 1: weights to CPU, KV cache dropped) while the trainer
updates, and wakes up for the next rollouts; on a CPU sleep does not exist and both stay put.
"""

import argparse
import dataclasses
import gc
import json
import math
import os
import random
import shutil
import signal
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import rollout  # first: sets vLLM's environment before anything imports vllm

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tqdm import tqdm  # noqa: E402

import env  # noqa: E402
import grpo  # noqa: E402

ROOT = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- configuration

@dataclass
class Config:
    # model and task
    model: str = ""  # any HF Qwen3-VL directory or id; empty: the tiny model, built on first use
    difficulty: str = "small"  # tiny 5x5 | small 7x7 | easy 9x9 (VisGym) | hard 11x11 (VisGym)
    cell_px: int = env.CELL_PX_TINY
    max_turns: int = 15
    # the training rollouts' turn limit (0: max_turns). A tighter one than evaluation's leaves no
    # room to wander: an episode that loops or detours fails instead of still earning the reward
    train_max_turns: int = 0
    max_new_tokens: int = 32  # per turn
    max_model_len: int = 4096
    max_images: int = 0  # keep only the last k images in the conversation; 0: full history
    # 0: an endless stream of new training mazes; N: the first N training mazes over and over
    # (overfitting a small set shows whether the loop learns at all, apart from generalising)
    train_pool: int = 0
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
    # step-level advantages (GiGPO): A_t = A_episode + step_adv_weight * A_step_t; 0 = plain GRPO
    step_adv_weight: float = 0.0
    gamma: float = 0.95  # discount of the per-turn returns G_t = gamma^(T-1-t) * reward
    # optimisation
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0  # optimizer steps
    lr_schedule: str = "constant"  # or cosine
    max_grad_norm: float = 1.0
    num_mini_batches: int = 1  # optimizer steps per rollout batch
    micro_batch_size: int = 4  # sequences per forward/backward
    # LoRA
    lora_rank: int = 0  # 0: 32 (the published recipe) for real models, 8 for the tiny one
    lora_alpha: int = 0  # 0: 2 * rank
    lora_dropout: float = 0.0
    lora_targets: str = rollout.LORA_TARGET_REGEX
    # engine
    gpu_memory_utilization: float = 0.45
    # evaluation, checkpoints, exports
    eval_interval: int = 10
    eval_mazes: int = 64
    ckpt_interval: int = 20
    export_interval: int = 20
    keep_checkpoints: int = 3
    keep_syncs: int = 3
    resume: str = "latest"  # latest | none | <checkpoint dir>
    # paths and misc
    out_dir: str = "runs/default"
    shared_dir: str = ""  # visible to every node; empty: <out_dir>/shared
    seed: int = 0
    progress: bool = True

    def validate(self, world_size: int):
        problems = []
        if self.difficulty not in env.DIFFICULTY_SIZES:
            problems.append(f"difficulty must be one of {list(env.DIFFICULTY_SIZES)}")
        if self.prompts_per_step % world_size:
            problems.append(f"prompts_per_step ({self.prompts_per_step}) must be a multiple of the "
                            f"number of processes ({world_size}) so every rank does the same work")
        if self.group_size < 2:
            problems.append("group_size must be >= 2: a group of one has no baseline")
        episodes_per_rank = self.prompts_per_step // world_size * self.group_size
        if episodes_per_rank % self.num_mini_batches:
            problems.append(f"episodes per rank ({episodes_per_rank}) must divide into num_mini_batches")
        if not self.temperature > 0:
            problems.append("temperature must be > 0 (rollouts sample; evaluation is greedy anyway)")
        if self.step_adv_weight < 0 or not 0 < self.gamma <= 1:
            problems.append("step_adv_weight must be >= 0 and gamma in (0, 1]")
        if self.loss_aggregation not in ("token-mean", "seq-mean"):
            problems.append("loss_aggregation must be token-mean or seq-mean")
        if self.lr_schedule not in ("constant", "cosine"):
            problems.append("lr_schedule must be constant or cosine")
        for name in ("steps", "max_turns", "max_new_tokens", "micro_batch_size", "eval_interval",
                     "ckpt_interval", "export_interval", "keep_checkpoints", "keep_syncs"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if self.train_pool < 0:
            problems.append("train_pool must be >= 0 (0: endless stream of new mazes)")
        if not 0 <= self.train_max_turns <= self.max_turns:
            problems.append("train_max_turns must be between 0 (= max_turns) and max_turns")
        if problems:
            raise SystemExit("bad config:\n  " + "\n  ".join(problems))


def parse_config(argv=None) -> Config:
    """One flag per Config field: --prompts-per-step 8, --scale-adv-by-std false, ..."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Config):
        kind = {bool: lambda s: s.lower() in ("1", "true", "yes")}.get(f.type, f.type)
        kind = {"int": int, "float": float, "str": str, "bool": kind}.get(f.type, kind) if isinstance(f.type, str) else kind
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)
    return Config(**vars(parser.parse_args(argv)))


# ----------------------------------------------------------------------------- distributed setup

def init_distributed() -> tuple[int, int, int]:
    """torchrun sets RANK/WORLD_SIZE/...; plain `python train.py` becomes a world of one."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])


def metrics_step(line: str) -> int | None:
    """The step of a metrics.jsonl line; None for a blank line or one torn by a crash mid-write."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError):
        return None


def log0(*args):
    if dist.get_rank() == 0:
        tqdm.write(" ".join(str(a) for a in args))


def check_shared_dir(shared: Path):
    """Rank 0 writes a fresh token; every rank must read it back, or the dir is not shared."""
    token = uuid.uuid4().hex if dist.get_rank() == 0 else None
    token = broadcast_object(token)
    marker = shared / "shared_dir_check.txt"
    if dist.get_rank() == 0:
        atomic_write_text(marker, token)
    dist.barrier()
    ok = marker.exists() and marker.read_text() == token
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, (ok, socket.gethostname()))
    bad = [host for ok, host in flags if not ok]
    if bad:
        raise SystemExit(f"shared_dir {shared} is not shared: nodes {sorted(set(bad))} cannot see what "
                         "rank 0 wrote there. Point --shared-dir at a filesystem every node mounts.")


def broadcast_object(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def mean_over_ranks(metrics: dict) -> dict:
    """Average every metric over ranks (each rank holds the same number of episodes)."""
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(values)
    return {k: v / dist.get_world_size() for k, v in zip(keys, values.tolist())}


# ----------------------------------------------------------------------------- files, atomically

def atomic_write_text(path: Path, text: str):
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_path(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path):
    for p in [*path.rglob("*"), path]:
        fsync_path(p)


def remove_dir(path: Path):
    """Delete a dir without ever showing a half-deleted one under its name: hide it, then delete."""
    trash = path.with_name(f".{path.name}.trash-{uuid.uuid4().hex[:8]}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def publish_dir(tmp: Path, final: Path):
    """Make a fully written temp dir visible under its final name in one rename."""
    fsync_dir(tmp)
    if final.exists():
        remove_dir(final)
    os.replace(tmp, final)
    fsync_path(final.parent)  # the rename itself is on disk before anything (`latest`) names it


def prune(parent: Path, prefix: str, keep: int, current: int | None = None):
    """Keep the newest `keep` <prefix><N> dirs. Call only from the one process that writes `parent`:
    it also deletes the hidden temp dirs of writes that a crash cut short.

    With `current` (the step just written), dirs numbered above it are deleted first: they are
    left over from a run that got further than the checkpoint this one resumed from, and would
    otherwise count as the newest and push out the dir just written.
    """
    for stale in parent.glob(f".{prefix}*"):
        shutil.rmtree(stale, ignore_errors=True)
    numbered = sorted((int(p.name[len(prefix):]), p) for p in parent.glob(prefix + "*")
                      if p.name[len(prefix):].isdigit())
    done = []
    for number, path in numbered:
        if current is not None and number > current:
            remove_dir(path)  # abandoned
        else:
            done.append(path)
    for old in done[:-keep]:
        remove_dir(old)


# ----------------------------------------------------------------------------- the policy

def build_policy(cfg: Config, model_path: str, world_size: int):
    """HF Qwen3-VL + PEFT LoRA on the language model, sharded with FSDP2 per decoder layer."""
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import Qwen3VLForConditionalGeneration

    on_gpu = torch.cuda.is_available()
    model = Qwen3VLForConditionalGeneration.from_pretrained(
        model_path, dtype=torch.bfloat16 if on_gpu else torch.float32)
    model.config.use_cache = False
    # PEFT draws LoRA A at random: the same seed on every rank gives every rank the same init.
    torch.manual_seed(cfg.seed)
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.lora_targets)
    model = get_peft_model(model, lora)  # freezes everything but LoRA (vision tower included)
    if on_gpu:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()

    mesh = init_device_mesh("cuda" if on_gpu else "cpu", (world_size,))
    # bf16 compute, fp32 gradient reduction and fp32 LoRA master weights on GPU; plain fp32 on CPU.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if on_gpu else MixedPrecisionPolicy()
    for layer in model.base_model.model.model.language_model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def lora_parameters(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def gather_lora_state(model) -> dict:
    """Full (unsharded) LoRA tensors on every rank, keyed as PEFT saves them. Collective."""
    from peft import get_peft_model_state_dict

    full = {}
    for name, param in lora_parameters(model):
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
        full[name] = tensor.detach().to("cpu", torch.float32).contiguous()
    return get_peft_model_state_dict(model, state_dict=full)


def write_adapter(model, state: dict, final_dir: Path):
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors), atomically."""
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = final_dir.with_name(f".{final_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    model.peft_config["default"].save_pretrained(str(tmp))
    save_file(state, str(tmp / "adapter_model.safetensors"))
    publish_dir(tmp, final_dir)


def load_lora_state(model, adapter_file: Path):
    """Load PEFT-format LoRA weights into the sharded model (every rank reads the file)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # PEFT saves `...q_proj.lora_A.weight` for the parameter `...q_proj.lora_A.default.weight`
    by_saved_name = {n.replace(".default.", "."): n for n, _ in lora_parameters(model)}
    state = load_file(str(adapter_file))
    if set(state) != set(by_saved_name):
        raise SystemExit(f"{adapter_file} does not fit this model's LoRA (rank, targets or model differ)")
    full = {by_saved_name[k]: v for k, v in state.items()}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))


def sync_adapter(model, engine, shared: Path, step: int, keep: int):
    """Write the current LoRA to <shared>/sync/step_<N> and point this rank's engine at it.

    Collective. Returns the new LoRARequest, the full LoRA state and {sync_s, sync_bytes}.
    """
    from vllm.lora.request import LoRARequest

    t0 = time.time()
    state = gather_lora_state(model)
    path = shared / "sync" / f"step_{step}"
    if dist.get_rank() == 0:
        write_adapter(model, state, path)
        prune(shared / "sync", "step_", keep, current=step)
    dist.barrier()
    # A NEW id and path per step: vLLM loads an id only once, so re-using an id would silently
    # keep generating with the old weights (and could reuse their prefix-cache blocks).
    request = LoRARequest(f"policy-step-{step}", step + 1, str(path))
    engine.llm_engine.add_lora(request)
    for old in engine.llm_engine.list_loras() - {request.lora_int_id}:
        engine.llm_engine.remove_lora(old)
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    return request, state, {"sync_s": time.time() - t0, "sync_bytes": nbytes}


# ----------------------------------------------------------------------------- trainer-side logprobs

class Batch:
    """Training sequences as trainer tensors (each distinct image processed once)."""

    def __init__(self, sequences, processor):
        self.sequences = sequences
        self.processor = processor
        self._vision = {}  # id(image) -> (pixel_values, grid_thw); turns share images
        self.image_token_id = processor.image_token_id
        self.pad_id = processor.tokenizer.pad_token_id or 0

    def length(self, i: int) -> int:
        return len(self.sequences[i].token_ids)

    def _pixels(self, image):
        if id(image) not in self._vision:
            v = self.processor.image_processor(images=[image], return_tensors="pt")
            self._vision[id(image)] = (v["pixel_values"], v["image_grid_thw"])
        return self._vision[id(image)]

    def micro(self, idx: list[int], device):
        """Right-padded inputs for the sequences `idx`; targets are shifted by one."""
        seqs = [self.sequences[i] for i in idx]
        T = max(len(s.token_ids) for s in seqs)
        ids = torch.full((len(idx), T), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(idx), T), dtype=torch.long)
        mask = torch.zeros((len(idx), T), dtype=torch.float32)
        rollout_lp = torch.zeros((len(idx), T), dtype=torch.float32)
        for row, s in enumerate(seqs):
            n = len(s.token_ids)
            ids[row, :n] = torch.tensor(s.token_ids)
            attn[row, :n] = 1
            mask[row, :n] = torch.tensor(s.response_mask, dtype=torch.float32)
            rollout_lp[row, :n] = torch.tensor(s.rollout_logprobs)
        vision = [self._pixels(image) for s in seqs for image in s.images]
        inputs = dict(
            input_ids=ids, attention_mask=attn,
            mm_token_type_ids=(ids == self.image_token_id).int(),  # M-RoPE needs to know image tokens
            pixel_values=torch.cat([v[0] for v in vision]),
            image_grid_thw=torch.cat([v[1] for v in vision]),
        )
        inputs = {k: v.to(device) for k, v in inputs.items()}
        # position t predicts token t+1: the mask and the rollout logprobs belong to the target
        return inputs, mask[:, 1:].to(device), rollout_lp[:, 1:].to(device)


def sequence_logprobs(model, inputs: dict, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of each next token under the policy the engine sampled from: pi(. | T)."""
    logits = model(**inputs).logits
    return grpo.token_logprobs(logits[:, :-1], inputs["input_ids"][:, 1:], temperature)


def pad_rows(rows: list, device) -> torch.Tensor:
    out = torch.zeros((len(rows), max(len(r) for r in rows)), device=device)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def chunks(n: int, size: int):
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def synced_micro_batches(indices: list[int], size: int, length=None) -> list:
    """Micro-batches of `indices`, padded with None up to the largest count on any rank.

    With `length` (index -> token count) the sequences are sorted longest first, so each
    micro-batch holds sequences of similar length and little compute goes to padding (episodes
    range from a few hundred to over a thousand tokens). The gradient is a sum over sequences,
    so the order does not change it.
    FSDP's forward and backward are collectives, so every rank must run the same number of
    them; ranks whose episodes made fewer sequences run a zero-weight filler (None).
    """
    if length is not None:
        indices = sorted(indices, key=length, reverse=True)
    local = [indices[i:i + size] for i in range(0, len(indices), size)]
    most = torch.tensor(len(local))
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return local + [None] * (int(most) - len(local))


class MismatchMeter:
    """Token-weighted logprob mismatch (trainer vs vLLM) over micro-batches and ranks."""

    def __init__(self):
        self.sums = torch.zeros(3, dtype=torch.float64)  # |diff| sum, k3 sum, tokens
        self.worst = torch.zeros((), dtype=torch.float64)

    def add(self, logprobs, rollout_logprobs, mask):
        m, tokens = grpo.logprob_mismatch(logprobs, rollout_logprobs, mask), mask.sum().item()
        self.sums += torch.tensor([m["mismatch_abs_mean"] * tokens, m["mismatch_k3"] * tokens, tokens],
                                  dtype=torch.float64)
        self.worst = torch.maximum(self.worst, torch.tensor(m["mismatch_abs_max"], dtype=torch.float64))

    def result(self) -> dict:
        """Reduced over all ranks (a collective: every rank must call it)."""
        dist.all_reduce(self.sums)
        dist.all_reduce(self.worst, op=dist.ReduceOp.MAX)
        tokens = self.sums[2].clamp_min(1)
        return {"mismatch_abs_mean": (self.sums[0] / tokens).item(), "mismatch_k3": (self.sums[1] / tokens).item(),
                "mismatch_abs_max": self.worst.item()}


def old_logprobs(cfg, model, batch: Batch, device) -> tuple[dict, dict, dict]:
    """Logprobs of the sampled tokens under the current policy (and the base model for KL).

    Also the per-step proof that the engine sampled from this same policy: the mismatch between
    the trainer's logprobs and the ones vLLM reported while sampling.
    """
    old, ref, mismatch = {}, {}, MismatchMeter()
    model.eval()
    with torch.no_grad():
        for idx in synced_micro_batches(list(range(len(batch.sequences))), cfg.micro_batch_size, batch.length):
            filler = idx is None
            inputs, mask, rollout_lp = batch.micro([0] if filler else idx, device)
            lp = sequence_logprobs(model, inputs, cfg.temperature)
            ref_lp = None
            if cfg.kl_coef > 0:
                with model.disable_adapter():  # the reference policy is the base model
                    ref_lp = sequence_logprobs(model, inputs, cfg.temperature)
            if filler:
                continue
            for row, i in enumerate(idx):  # unpadded rows: the update may group them differently
                n = len(batch.sequences[i].token_ids) - 1
                old[i] = lp[row, :n]
                if ref_lp is not None:
                    ref[i] = ref_lp[row, :n]
            mismatch.add(lp, rollout_lp, mask)
    return old, ref, mismatch.result()


def turn_advantages(cfg, episodes, episode_advantages, sequences, episode_of) -> tuple[list, dict]:
    """Per-token advantages A_t = A^E + w * A^S_t (GiGPO): every token of reply t carries its turn's.

    A^E is the episode's GRPO advantage, A^S_t the step-level one (grpo.step_advantages), whose
    anchor states are (group, agent cell): the same maze, the agent on the same cell. Anchor
    groups never span ranks, because a group's episodes are all played on one rank. Returns one
    row per sequence, aligned with the trainer's shifted targets (token j at position j - 1).
    """
    returns, anchors = [], []
    for e in episodes:
        returns += grpo.discounted_returns(e.reward, e.num_turns, cfg.gamma)
        cells = e.maze.size * e.maze.size
        anchors += [e.group_id * cells + r * e.maze.size + c for r, c in e.states]
    step = grpo.step_advantages(torch.tensor(returns, dtype=torch.float64), torch.tensor(anchors, dtype=torch.long),
                                scale_by_std=cfg.scale_adv_by_std)
    first_turn = np.cumsum([0] + [e.num_turns for e in episodes])
    next_turn = [0] * len(episodes)  # an episode's sequences hold its turns in order
    rows = []
    for seq, i in zip(sequences, episode_of):
        row, turn, inside = torch.zeros(len(seq.token_ids) - 1), next_turn[i] - 1, False
        for pos, m in enumerate(seq.response_mask[1:]):
            if m and not inside:  # a reply starts: the episode's next turn
                turn += 1
            if m:
                row[pos] = episode_advantages[i] + cfg.step_adv_weight * step[first_turn[i] + turn]
            inside = bool(m)
        next_turn[i] = turn + 1
        rows.append(row)
    stats = {"step_adv_nonzero_frac": (step != 0).double().mean().item() if step.numel() else 0.0}
    return rows, stats


def single_pass(cfg) -> bool:
    """One optimizer step per rollout batch and no KL term: the policy being updated IS the one
    that sampled, so pi_old = pi_theta.detach() and the separate old-logprob pass is skipped.
    (vLLM's own logprobs would do as well here, they differ by ~1e-7; recomputing keeps the
    trainer's numerics on both sides of the ratio.)"""
    return cfg.num_mini_batches == 1 and cfg.kl_coef == 0


def grpo_update(cfg, model, optimizer, scheduler, params, batch: Batch, seq_advantages, episode_of,
                old: dict | None, ref: dict, num_episodes: int, device) -> dict:
    """Mini-batches of episodes (one optimizer step each) of micro-batches of their sequences.

    `seq_advantages` is a [num_sequences] tensor (one advantage per sequence) or a list of
    per-token rows (turn_advantages).
    `old` is None in the single-pass case: the ratio is then exp(logp - logp.detach()) = 1 with
    the gradient of logp, and the rollout mismatch is measured on this very forward pass.
    Sequences with advantage 0 (every member of their group scored the same) are not run at all
    when there is no KL term: their loss and gradient are exactly zero. They still count in the
    normaliser, so the update is the same as if they had been run, only cheaper.
    """
    model.train()
    world = dist.get_world_size()
    per_mini = num_episodes // cfg.num_mini_batches
    stats = {"clip_frac": [], "ratio_mean": [], "kl": [], "pg_loss": [], "grad_norm": []}
    mismatch = MismatchMeter()  # used in the single-pass case
    trained = 0
    for mb in range(cfg.num_mini_batches):
        in_mini = [i for i, e in enumerate(episode_of) if mb * per_mini <= e < (mb + 1) * per_mini]
        # Normaliser: token-mean divides by the mini-batch's response tokens over ALL ranks
        # (seq-mean by its sequences), then by world size since FSDP averages gradients.
        if cfg.loss_aggregation == "token-mean":
            count = sum(sum(batch.sequences[i].response_mask) for i in in_mini)
        else:
            count = len(in_mini)
        count = torch.tensor(float(count))
        dist.all_reduce(count)
        normalizer = count.item() / world
        if cfg.kl_coef == 0:
            in_mini = [i for i in in_mini if bool((seq_advantages[i] != 0).any())]
        trained += len(in_mini)
        optimizer.zero_grad(set_to_none=True)
        for idx in synced_micro_batches(in_mini, cfg.micro_batch_size, batch.length):
            filler = idx is None
            rows = [0] if filler else idx  # a filler runs any one sequence, with weight 0
            inputs, mask, rollout_lp = batch.micro(rows, device)
            lp = sequence_logprobs(model, inputs, cfg.temperature)
            old_lp = lp.detach() if old is None else pad_rows([old[i] for i in rows], device)
            if isinstance(seq_advantages, list):  # per-token rows
                advantages = pad_rows([seq_advantages[i] for i in rows], device)
            else:
                advantages = seq_advantages[rows].to(device)
            loss, m = grpo.policy_loss(
                lp, old_lp, advantages, mask,
                clip_eps_low=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high,
                aggregation=cfg.loss_aggregation, loss_normalizer=normalizer,
                ref_logprobs=pad_rows([ref[i] for i in rows], device) if ref else None, kl_coef=cfg.kl_coef)
            (loss * (0.0 if filler else 1.0)).backward()
            if filler:
                continue
            for k in ("clip_frac", "ratio_mean", "kl", "pg_loss"):
                stats[k].append(m[k])
            if old is None:
                mismatch.add(lp.detach(), rollout_lp, mask)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        stats["grad_norm"].append(grad_norm.item())
        optimizer.step()
        scheduler.step()
    out = {k: sum(v) / max(len(v), 1) for k, v in stats.items()}
    out["lr"] = scheduler.get_last_lr()[0]
    out["trained_sequence_frac"] = trained / max(len(episode_of), 1)
    if old is None:
        out.update(mismatch.result())
    return out


# ----------------------------------------------------------------------------- checkpoints

def save_checkpoint(cfg, model, optimizer, scheduler, lora_state, step, stream, hours, out: Path) -> Path | None:
    """Rank 0 writes the checkpoint into a hidden temp dir and returns it; `publish_checkpoint`
    makes it step_<N> once the step's metrics line is written. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    optim_state = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    rngs = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, rng)
    if dist.get_rank() == 0:
        ckpt_root = out / "checkpoints"
        tmp = ckpt_root / f".step_{step}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        model.peft_config["default"].save_pretrained(str(tmp))
        save_file(lora_state, str(tmp / "adapter_model.safetensors"))
        torch.save({"optimizer": optim_state, "scheduler": scheduler.state_dict(), "rng": rngs}, tmp / "trainer_state.pt")
        if os.environ.get("GRPO_TEST_KILL_IN_CHECKPOINT") == str(step) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)  # tests/test_launch.py: die mid-write (first attempt only)
        meta = {"step": step, "stream": stream.state_dict(), "process_hours": hours, "config": dataclasses.asdict(cfg)}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        fsync_dir(tmp)
    dist.barrier()
    return tmp if dist.get_rank() == 0 else None


def publish_checkpoint(cfg, tmp: Path, step: int, out: Path):
    """Rank 0: rename the temp dir to step_<N>, then point `latest` at it (last: it only ever names a
    complete dir). Called after the step's metrics line is written, so a resumed run never lacks a
    line for a step it does not redo; a crash before this redoes the step."""
    ckpt_root = out / "checkpoints"
    publish_dir(tmp, ckpt_root / f"step_{step}")
    atomic_write_text(ckpt_root / "latest", f"step_{step}")
    prune(ckpt_root, "step_", cfg.keep_checkpoints, current=step)


def find_checkpoint(cfg, out: Path) -> Path | None:
    if cfg.resume == "none":
        return None
    if cfg.resume != "latest":
        path = Path(cfg.resume)
        if not (path / "meta.json").exists():
            raise SystemExit(f"--resume {path}: not a complete checkpoint (no meta.json)")
        return path
    ckpt_root = out / "checkpoints"
    pointer = ckpt_root / "latest"
    if pointer.exists() and (ckpt_root / pointer.read_text().strip() / "meta.json").exists():
        return ckpt_root / pointer.read_text().strip()
    # no pointer, or it names a pruned dir: fall back to the newest complete one (temp dirs are
    # dot-prefixed and never match)
    complete = [p for p in ckpt_root.glob("step_*") if (p / "meta.json").exists()]
    return max(complete, key=lambda p: int(p.name.split("_")[1]), default=None)


def load_checkpoint(path: Path, model, optimizer, scheduler, stream) -> tuple[int, float]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    meta = json.loads((path / "meta.json").read_text())
    load_lora_state(model, path / "adapter_model.safetensors")
    state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state["optimizer"],
                             options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(state["scheduler"])
    rng = state["rng"][dist.get_rank()] if dist.get_rank() < len(state["rng"]) else state["rng"][0]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    stream.load_state_dict(meta["stream"])
    return meta["step"], meta["process_hours"]


# ----------------------------------------------------------------------------- evaluation

def evaluate(cfg, engine, chat, lora_request, step: int, out: Path) -> dict:
    """Greedy play of the fixed evaluation mazes, split over ranks; rank 0 writes the JSON.

    Through the chat API, exactly as `serve.py eval` plays them over HTTP."""
    mazes = env.eval_mazes(cfg.difficulty, cfg.eval_mazes)
    mine = list(range(dist.get_rank(), len(mazes), dist.get_world_size()))
    episodes = rollout.play_chat_episodes(
        [mazes[i] for i in mine], rollout.engine_replies(engine, lora_request, cfg.max_new_tokens, chat.banned_token_ids),
        max_turns=cfg.max_turns, cell_px=cfg.cell_px, max_images=cfg.max_images or None, desc=f"eval@{step}",
        progress=cfg.progress and dist.get_rank() == 0)
    for i, e in zip(mine, episodes):
        e.group_id = i
    rows = [{"maze_index": e.group_id, "seed": e.maze.seed, "solved": e.solved, "turns": e.num_turns,
             "end_reason": e.end_reason, "invalid_actions": e.invalid_actions, "replies": e.replies}
            for e in episodes]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    rows = sorted((r for part in gathered for r in part), key=lambda r: r["maze_index"])
    solved = sum(r["solved"] for r in rows)
    result = {"step": step, "difficulty": cfg.difficulty, "solved": solved, "total": len(rows),
              "solve_rate": solved / len(rows), "mazes": rows}
    if dist.get_rank() == 0:
        (out / "eval").mkdir(exist_ok=True)
        atomic_write_text(out / "eval" / f"step_{step}.json", json.dumps(result, indent=1))
    return result


# ----------------------------------------------------------------------------- the loop

def main(cfg: Config):
    rank, world, local_rank = init_distributed()
    cfg.validate(world)
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")

    model_path = cfg.model
    if not model_path:
        from launch.make_tiny_model import ensure_tiny_model

        if rank == 0:
            ensure_tiny_model()
        dist.barrier()
        model_path = str(ensure_tiny_model())
    tiny = not cfg.model
    cfg.lora_rank = cfg.lora_rank or (8 if tiny else 32)
    cfg.lora_alpha = cfg.lora_alpha or 2 * cfg.lora_rank

    out = Path(cfg.out_dir)
    shared = Path(cfg.shared_dir or out / "shared")
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        shared.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    check_shared_dir(shared)

    chat = rollout.ChatFormat.for_model(model_path)
    processor = chat.processor

    # The policy first (identical seed on every rank), then this rank's engine (its own seed).
    model = build_policy(cfg, model_path, world)
    params = [p for _, p in lora_parameters(model)]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    total_updates = cfg.steps * cfg.num_mini_batches

    def lr_lambda(update: int) -> float:
        if update < cfg.warmup_steps:
            return (update + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "cosine":
            progress = (update - cfg.warmup_steps) / max(1, total_updates - cfg.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    stream = env.TrainMazeStream(cfg.difficulty, eval_n=cfg.eval_mazes, pool=cfg.train_pool)

    start_step, hours = 0, 0.0
    ckpt = broadcast_object(str(find_checkpoint(cfg, out) or ""))  # rank 0 decides for all
    if ckpt:
        start_step, hours = load_checkpoint(Path(ckpt), model, optimizer, scheduler, stream)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        log0(f"resumed from {ckpt} at step {start_step} (training maze stream at {stream.position}"
             + (f", torchrun restart {restart})" if restart != "0" else ")"))
    if rank == 0:
        # one metrics line per step: drop lines of steps that will be redone after a crash, and a
        # last line that a crash cut short
        metrics_file = out / "metrics.jsonl"
        lines = metrics_file.read_text().splitlines() if metrics_file.exists() else []
        kept = [l for l in lines if metrics_step(l) is not None and metrics_step(l) <= start_step]
        atomic_write_text(metrics_file, "".join(l + "\n" for l in kept))
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(str(out / "tb"), purge_step=start_step + 1)

    t = time.time()
    engine = rollout.build_engine(model_path, max_model_len=cfg.max_model_len, max_lora_rank=cfg.lora_rank,
                                  seed=cfg.seed + rank, gpu_memory_utilization=cfg.gpu_memory_utilization,
                                  max_images=cfg.max_turns + 1, external_launcher=True,
                                  # vLLM reports the raw model's log-probs by default; at another
                                  # temperature, those of the tempered distribution it sampled from
                                  # (which also carry the ban on vision tokens, a tiny difference)
                                  **({"logprobs_mode": "processed_logprobs"} if cfg.temperature != 1.0 else {}))
    log0(f"vLLM engine ready in {time.time() - t:.1f}s")
    if not on_gpu:
        log0("CPU: vLLM has no sleep mode here, so the engine and the trainer both stay resident")

    lora_request, lora_state, _ = sync_adapter(model, engine, shared, start_step, cfg.keep_syncs)
    if start_step == 0 or start_step % cfg.eval_interval == 0:
        if not (out / "eval" / f"step_{start_step}.json").exists():
            result = evaluate(cfg, engine, chat, lora_request, start_step, out)
            log0(f"eval step {start_step}: solved {result['solved']}/{result['total']}")

    P_rank = cfg.prompts_per_step // world
    run_start = time.time()
    bar = tqdm(range(start_step, cfg.steps), desc="train", unit="step", initial=start_step,
               total=cfg.steps, disable=not (cfg.progress and rank == 0))
    for step in bar:
        step_start, timing, metrics = time.time(), {}, {}

        # 1. rollouts: every rank draws the same mazes from the stream and plays its share
        t0 = time.time()
        mazes = [stream.next() for _ in range(cfg.prompts_per_step)]
        mine = list(range(rank * P_rank, (rank + 1) * P_rank))
        episodes = rollout.play_episodes(
            engine, chat, [mazes[i] for i in mine], [step * cfg.prompts_per_step + i for i in mine],
            samples_per_maze=cfg.group_size, max_turns=cfg.train_max_turns or cfg.max_turns,
            max_new_tokens=cfg.max_new_tokens, max_model_len=cfg.max_model_len, temperature=cfg.temperature,
            seed=cfg.seed, lora_request=lora_request, cell_px=cfg.cell_px, max_images=cfg.max_images or None,
            desc=f"rollout@{step + 1}", progress=cfg.progress and rank == 0)
        if on_gpu:
            # Time-slicing: the engine gives the GPU to the trainer. Level 1 moves the weights to
            # CPU RAM and drops the KV cache; level 2 would discard the base weights we still need.
            engine.sleep(level=1)
        timing["rollout_s"] = time.time() - t0
        metrics.update(rollout.rollout_metrics(episodes))

        # 2. group advantages over all ranks, old (and reference) logprobs from the trainer
        rewards = torch.tensor([e.reward for e in episodes])
        group_ids = torch.tensor([e.group_id for e in episodes])
        advantages, adv_stats = grpo.gather_group_advantages(rewards, group_ids, scale_by_std=cfg.scale_adv_by_std)
        metrics.update(adv_stats)
        t0 = time.time()
        sequences = [seq for e in episodes for seq in e.sequences]
        episode_of = [i for i, e in enumerate(episodes) for _ in e.sequences]
        seq_advantages = advantages[episode_of]  # every sequence of an episode shares its advantage
        if cfg.step_adv_weight > 0:  # ... plus, per turn, how its move compared from the same state
            seq_advantages, step_stats = turn_advantages(cfg, episodes, advantages, sequences, episode_of)
            metrics.update(step_stats)
        batch = Batch(sequences, processor)
        old, ref = None, {}
        if not single_pass(cfg):
            old, ref, mismatch = old_logprobs(cfg, model, batch, device)
            metrics.update(mismatch)
        timing["logprobs_s"] = time.time() - t0

        # 3. the GRPO update
        t0 = time.time()
        metrics.update(grpo_update(cfg, model, optimizer, scheduler, params, batch, seq_advantages,
                                   episode_of, old, ref, len(episodes), device))
        timing["update_s"] = time.time() - t0

        # 4. LoRA sync through shared storage (the engine is awake again from here to the next update)
        if on_gpu:
            engine.wake_up()
        lora_request, lora_state, sync_stats = sync_adapter(model, engine, shared, step + 1, cfg.keep_syncs)
        timing["sync_s"] = sync_stats["sync_s"]
        metrics["sync_bytes"] = sync_stats["sync_bytes"]

        # 5. eval, checkpoint, export on their intervals
        done = step + 1
        t0 = time.time()
        if done % cfg.eval_interval == 0 or done == cfg.steps:
            result = evaluate(cfg, engine, chat, lora_request, done, out)
            metrics["eval_solve_rate"] = result["solve_rate"]
            log0(f"eval step {done}: solved {result['solved']}/{result['total']}")
        timing["eval_s"] = time.time() - t0
        t0 = time.time()
        hours += (time.time() - step_start) * world / 3600
        ckpt_tmp = None
        if done % cfg.ckpt_interval == 0 or done == cfg.steps:
            ckpt_tmp = save_checkpoint(cfg, model, optimizer, scheduler, lora_state, done, stream, hours, out)
        if rank == 0 and (done % cfg.export_interval == 0 or done == cfg.steps):
            write_adapter(model, lora_state, out / "adapters" / f"step_{done}")
        timing["checkpoint_s"] = time.time() - t0

        # 6. logs: one metrics line per step, TensorBoard, the bar
        timing["step_s"] = time.time() - step_start
        metrics.update(timing)
        metrics["tokens_per_s"] = metrics["generated_tokens"] / max(timing["rollout_s"], 1e-9)
        metrics["gpu_hours" if on_gpu else "process_hours"] = hours
        metrics = mean_over_ranks(metrics)
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
                publish_checkpoint(cfg, ckpt_tmp, done, out)
            for k, v in metrics.items():
                writer.add_scalar(k, v, done)
            writer.flush()
            bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", mismatch=f"{metrics['mismatch_abs_mean']:.1e}",
                            step_s=f"{timing['step_s']:.1f}")

    bar.close()
    if rank == 0:
        writer.close()
        # steps_s covers every process that worked on this run (a resumed run's earlier ones too);
        # wall_s is this process's own time, start-up included
        metrics_file = out / "metrics.jsonl"
        steps_s = sum(json.loads(line)["step_s"] for line in metrics_file.read_text().splitlines()) \
            if metrics_file.exists() else 0.0
        summary = {"steps": cfg.steps, "steps_s": round(steps_s, 1), "wall_s": round(time.time() - run_start, 1),
                   ("gpu_hours" if on_gpu else "process_hours"): round(hours, 4)}
        evals = sorted((json.loads(p.read_text()) for p in (out / "eval").glob("step_*.json")), key=lambda r: r["step"])
        summary["eval"] = {r["step"]: f"{r['solved']}/{r['total']}" for r in evals}
        atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
        log0("run summary: " + json.dumps(summary))
    # Shut down in order: all ranks done, then the engine (whose teardown may already take the
    # process group down with it), then the group if it is still there.
    dist.barrier()
    del engine
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_config())
