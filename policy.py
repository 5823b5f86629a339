"""The trainer's side of the policy: FSDP2 + LoRA, its log-probs, and the adapter that goes to the engines.

    model = build_policy(cfg, model_path)        # HF Qwen3-VL + PEFT LoRA, sharded with FSDP2
    batch = Batch(sequences, processor, model)   # rollout sequences as trainer tensors
    inputs, mask, rollout_lp = batch.micro([0, 1, 2], device)
    logprobs = sequence_logprobs(model, inputs)  # log pi(token) of every target token
    path, state, nbytes = publish_adapter(model, shared, step, keep, base)  # LoRA -> shared disk

Only LoRA trains. The base model, the vision tower included, is frozen, which is what makes two
shortcuts exact: the vision tower's output for an image never changes, so each distinct image is
encoded once per batch and handed to the model as precomputed encoder outputs; and only the
adapter (a few MB for the tiny model, 175 MB in bf16 for rank 32 on Qwen3-VL-8B) has to travel to
the inference engines after each update.
"""

import functools
import inspect
import os
from pathlib import Path

import torch
import torch.distributed as dist

import checkpoint
import distributed
import grpo
import rollout

# ----------------------------------------------------------------------------- the policy

def build_policy(cfg, model_path: str):
    """HF Qwen3-VL + PEFT LoRA on the language model, sharded with FSDP2, read from disk once.

    The mesh is 2-D, (replicas, shard group): parameters are sharded within a shard group (by
    default one node) and replicated across groups, so the frozen base is all-gathered over the
    node's own links, never across the network; only gradients are reduced between nodes (HSDP).
    Each decoder layer is its own FSDP unit (gathered just before it runs).

    Host memory does not grow with the number of GPUs: only rank 0 reads the checkpoint into CPU
    RAM (17.5 GB for the 8B model in bf16; before, every rank did, 140 GB on an 8-GPU node).
    Every rank builds the model on the meta device (no memory), shards it, allocates only its own
    shard, and receives its part of rank 0's tensors, one tensor at a time (torch's
    set_model_state_dict with broadcast_from_rank0, as torchtitan loads its models). Rank 0's
    LoRA init travels with the base, so every rank starts from the same adapter."""
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration._from_config(AutoConfig.from_pretrained(model_path), dtype=dtype)
    model = wrap_policy(cfg, model)  # (its collectives first: the other ranks then wait for rank 0's read)
    source = None
    if dist.get_rank() == 0:
        source = add_lora(cfg, Qwen3VLForConditionalGeneration.from_pretrained(model_path, dtype=dtype))
    load_from_rank0(model, source)
    return model


def load_from_rank0(model, source):
    """Fill the (meta-built, sharded) `model` with rank 0's `source` (the same model, whole, in CPU
    RAM on rank 0 only; None elsewhere). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model.to_empty(device=device)
    full = source.state_dict() if source is not None else {}
    # (full_state_dict + broadcast_from_rank0: rank 0 sends each tensor, every rank keeps its shard;
    # torch/distributed/checkpoint/state_dict.py _load_model_state_dict -> _broadcast_state_dict)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Buffers outside the state dict (the rotary embeddings' inv_freq) are computed at init, which
    # the meta build skipped: rank 0's, which are small, go to every rank as objects.
    saved = set(model.state_dict())
    extra = {n: b.cpu() for n, b in source.named_buffers() if n not in saved} if source is not None else None
    extra = distributed.broadcast_object(extra)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name not in saved:
                buffer.copy_(extra[name].to(buffer.device))
    del full, source


def add_lora(cfg, model):
    """PEFT LoRA on the language model's linear layers; everything else frozen."""
    from peft import LoraConfig, get_peft_model

    model.config.text_config.use_cache = False  # (transformers 5 reads it from the text config)
    # PEFT draws LoRA A at random: the same seed gives the same init wherever it is built.
    torch.manual_seed(cfg.seed)
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.lora_targets)
    return get_peft_model(model, lora)  # freezes everything but LoRA (vision tower included)


def wrap_policy(cfg, model):
    """LoRA and FSDP2 around a Qwen3VLForConditionalGeneration (build_policy's meta-built one, or
    launch/gpu_check.py's randomly initialised one). A model on the meta device stays there (its
    shards are allocated and filled afterwards, load_from_rank0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    on_gpu = torch.cuda.is_available()
    model = add_lora(cfg, model)
    if on_gpu:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()

    world, shard = dist.get_world_size(), distributed.shard_group_size(cfg.shard_group_size)
    mesh = init_device_mesh("cuda" if on_gpu else "cpu", (world // shard, shard),
                            mesh_dim_names=("replicate", "shard"))
    # bf16 compute, fp32 gradient reduction and fp32 LoRA master weights on GPU; plain fp32 on CPU.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if on_gpu else MixedPrecisionPolicy()
    inner = model.base_model.model.model
    for layer in inner.language_model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    # The frozen vision tower is kept whole on every rank, outside FSDP: Batch calls it on its
    # own, before and apart from the model's forward, which FSDP's root unit does not allow. It
    # is small next to the language model (0.6 B of Qwen3-VL-8B's 8.8 B parameters).
    if not any(p.is_meta for p in inner.visual.parameters()):
        inner.visual.to(mesh.device_type)
    fully_shard(model, mesh=mesh, mp_policy=mp, ignored_params=set(inner.visual.parameters()))
    return model


def resolve_model(model: str, collective: bool = True) -> str:
    """The local directory of the policy's base model, checked before anything expensive starts.

    '' is the tiny model (built on first use); a directory must hold a Qwen3-VL config; anything
    else is taken for a hub id and downloaded once per node (by local rank 0; the other ranks
    wait, then read the same cache), never by every rank of every node at once. A mistake ends in
    one line that says what is wrong."""
    import re

    first = not collective or int(os.environ.get("LOCAL_RANK", "0")) == 0
    if not model:
        import tiny_model

        path = str(tiny_model.ensure_tiny_model()) if first else ""
        if collective:
            distributed.wait_on_cpu()  # gloo, with a long timeout: never NCCL's 10 minutes
        return path or str(tiny_model.ensure_tiny_model())
    local = Path(model).expanduser()
    if local.exists() or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", model):
        if not local.is_dir():
            raise SystemExit(f"--model {model}: no such directory" + ("" if local.exists() else
                             " (and not a hub id, which reads 'name' or 'org/name')"))
        return check_model_dir(local)
    from huggingface_hub import snapshot_download

    def download(offline: bool) -> str:
        try:
            return snapshot_download(model, local_files_only=offline)
        except Exception as e:  # no network, no such repo, no access: one line, not a traceback
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SystemExit(f"--model {model}: not a local directory, and the hub copy could not be had "
                             f"({type(e).__name__}: {reason[:200]})")

    path = download(offline=False) if first else ""
    if collective:
        distributed.wait_on_cpu()  # the download may take long: gloo, with a long timeout
    return check_model_dir(Path(path or download(offline=True)))


def check_model_dir(path: Path) -> str:
    """`path` if it is a readable Qwen3-VL model directory; else one clear line."""
    import json

    config = path / "config.json"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except FileNotFoundError:
        raise SystemExit(f"{path}: not a model directory (no config.json)")
    except (OSError, ValueError) as e:
        raise SystemExit(f"{config}: unreadable ({getattr(e, 'strerror', None) or e})")
    if model_type != "qwen3_vl":
        raise SystemExit(f"{path}: a {model_type!r} model; this trainer needs a Qwen3-VL one (model_type 'qwen3_vl')")
    return str(path)


def lora_parameters(model) -> list:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def base_weight_bytes(model, bytes_per_parameter: int = 2) -> int:
    """What the engine's copy of the frozen base takes on the GPU (bf16: 2 bytes a parameter),
    counted from the trainer's model (a sharded parameter counts whole)."""
    return bytes_per_parameter * sum(p.numel() for p in model.parameters() if not p.requires_grad)


def make_optimizer(model, lr: float, weight_decay: float = 0.0):
    """AdamW over the LoRA weights, one rate for A and B (LoRA+'s faster B did not help here:
    docs/experiments.md, 'Other levers')."""
    return torch.optim.AdamW([p for _, p in lora_parameters(model)], lr=lr, weight_decay=weight_decay)


def qwen3_vl_model(model):
    """The Qwen3VLModel inside the PEFT wrapper (or a plain HF Qwen3VLForConditionalGeneration): the
    vision tower (.visual) and the language model together, without the LM head."""
    inner = model.base_model.model if hasattr(model, "peft_config") else model
    return inner.model


# ----------------------------------------------------------------------------- trainer tensors

class Batch:
    """Training sequences as trainer tensors.

    Images are keyed by content, so an image that several sequences share (the 8 episodes of a
    group all start from the same picture, and meet the same states again) is preprocessed once.
    With `model` given and its vision tower frozen, it is also encoded once: the features of the
    images a micro-batch needs are computed without gradient, kept for the rest of the batch, and
    passed to the model as `mm_encoder_outputs` instead of pixels (exactly the same numbers)."""

    def __init__(self, sequences: list, processor, model=None):
        self.sequences = sequences
        self.processor = processor
        self.image_token_id = processor.image_token_id
        self.banned_token_ids = rollout.vision_token_ids(processor)  # what sampling was biased against
        self.pad_id = processor.tokenizer.pad_token_id or 0
        self._keys = {}  # id(image) -> content digest
        self._pixels = {}  # digest -> (pixel_values, grid_thw)
        self._features = {}  # digest -> (embeds, [deepstack embeds])
        frozen = model is not None and not any(p.requires_grad for p in qwen3_vl_model(model).visual.parameters())
        self.model = model if frozen and takes_encoder_outputs() else None

    def length(self, i: int) -> int:
        return len(self.sequences[i].token_ids)

    def _key(self, image) -> str:
        if id(image) not in self._keys:
            self._keys[id(image)] = rollout.image_digest(image)
        return self._keys[id(image)]

    def _pixel_values(self, key: str, image):
        if key not in self._pixels:
            v = self.processor.image_processor(images=[image], return_tensors="pt")
            self._pixels[key] = (v["pixel_values"], v["image_grid_thw"])
        return self._pixels[key]

    @torch.no_grad()
    def _encode(self, keys: list[str], device):
        """Vision features of the images not encoded yet, in one call to the (frozen) tower."""
        todo = list(dict.fromkeys(k for k in keys if k not in self._features))
        if not todo:
            return
        pixels = torch.cat([self._pixels[k][0] for k in todo]).to(device)
        grid = torch.cat([self._pixels[k][1] for k in todo]).to(device)
        out = qwen3_vl_model(self.model).get_image_features(pixels, grid, return_dict=True)
        for i, key in enumerate(todo):
            self._features[key] = (out.pooler_output[i], [feat[i] for feat in out.deepstack_features])

    def micro(self, idx: list[int], device):
        """Right-padded inputs for the sequences `idx`, and the response mask and rollout
        log-probs aligned with the targets (position t predicts token t+1)."""
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        seqs = [self.sequences[i] for i in idx]
        T = max(len(s.token_ids) for s in seqs)
        ids = torch.full((len(idx), T), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), T), dtype=torch.float32)
        rollout_lp = torch.zeros((len(idx), T), dtype=torch.float32)
        for row, s in enumerate(seqs):
            n = len(s.token_ids)
            ids[row, :n] = torch.tensor(s.token_ids)
            mask[row, :n] = torch.tensor(s.response_mask, dtype=torch.float32)
            rollout_lp[row, :n] = torch.tensor(s.rollout_logprobs)
        images = [(self._key(image), image) for s in seqs for image in s.images]
        pixels = [self._pixel_values(key, image) for key, image in images]
        inputs = dict(
            input_ids=ids.to(device),
            # No padding mask: the padding is on the right and attention is causal, so no real
            # token ever attends to a pad. An all-ones mask lets SDPA take its causal fast path
            # (it skips the upper triangle instead of masking a full square): ~25% of a step.
            attention_mask=torch.ones_like(ids).to(device),
            mm_token_type_ids=(ids == self.image_token_id).int().to(device),  # M-RoPE's image positions
            image_grid_thw=torch.cat([g for _, g in pixels]).to(device),
        )
        if self.model is None:
            inputs["pixel_values"] = torch.cat([p for p, _ in pixels]).to(device)
        else:
            self._encode([key for key, _ in images], device)
            features = [self._features[key] for key, _ in images]
            depth = len(features[0][1])
            inputs["mm_encoder_outputs"] = {"image": BaseModelOutputWithDeepstackFeatures(
                pooler_output=tuple(f[0] for f in features),
                deepstack_features=[tuple(f[1][level] for f in features) for level in range(depth)])}
        return inputs, mask[:, 1:].to(device), rollout_lp[:, 1:].to(device)


@functools.cache
def takes_encoder_outputs() -> bool:
    """Whether this transformers' Qwen3-VL takes precomputed image features (5.19 does, 5.17 not)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    return "mm_encoder_outputs" in inspect.signature(Qwen3VLModel.forward).parameters


def sequence_logprobs(model, inputs: dict, temperature: float = 1.0, banned_token_ids=()) -> torch.Tensor:
    """Log-probs of each next token under the policy the engine sampled from, as the engine reports
    them: at T = 1 the model's own, at another temperature those of the tempered distribution after
    the engine's logit bias against `banned_token_ids` (rollout.logprobs_mode).

    The model runs without its LM head over the sequence (it computes the last position's logits
    only, logits_to_keep=1); the final hidden states, caught as the last norm's output, go through
    the head a chunk at a time (grpo.chunked_token_logprobs), so that no full-vocabulary logits
    are ever held for backward."""
    hidden = []
    hook = qwen3_vl_model(model).language_model.norm.register_forward_hook(lambda m, i, out: hidden.append(out))
    try:
        model(**inputs, logits_to_keep=1)
    finally:
        hook.remove()
    processed = rollout.logprobs_mode(temperature) == "processed_logprobs"
    bias = rollout.sampling_logit_bias(banned_token_ids) if processed else None
    # (after the root FSDP unit's forward its own parameters, the head among them, stay gathered)
    head = model.get_output_embeddings().weight
    return grpo.chunked_token_logprobs(hidden[-1][:, :-1], head, inputs["input_ids"][:, 1:], temperature, bias)


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


@torch.no_grad()
def fill_old_logprobs(model, batch: Batch, experiences: list, cfg, device, with_ref: bool) -> dict:
    """pi_old (and pi_ref for the KL) of every sampled token, when the update is not single-pass;
    also the proof that the engine sampled from this same policy (the mismatch)."""
    mismatch, temperature = MismatchMeter(), cfg.temperature
    model.eval()
    for idx in synced_micro_batches(list(range(len(experiences))), cfg.micro_batch_size, batch.length,
                                    cfg.micro_batch_tokens):
        inputs, mask, rollout_lp = batch.micro([0] if idx is None else idx, device)
        lp = sequence_logprobs(model, inputs, temperature, batch.banned_token_ids)
        ref = None
        if with_ref:
            with model.disable_adapter():  # the reference policy is the base model
                ref = sequence_logprobs(model, inputs, temperature, batch.banned_token_ids)
        if idx is None:  # a filler: FSDP needs every rank in every forward
            continue
        for row, i in enumerate(idx):  # unpadded rows: the update may group them differently
            n = len(experiences[i].sequence.token_ids) - 1
            experiences[i].old_logprobs = lp[row, :n].cpu()
            experiences[i].ref_logprobs = None if ref is None else ref[row, :n].cpu()
        mismatch.add(lp, rollout_lp, mask)
    return mismatch.result()



# ----------------------------------------------------------------------------- the update

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
                device, measure_every_sequence: bool = False) -> dict:
    """Mini-batches of episodes (one optimizer step each) of micro-batches of their sequences.

    Without old logprobs (single pass) the ratio is exp(logp - logp.detach()) = 1 with the
    gradient of logp, and the rollout mismatch is measured on this very forward pass. Sequences
    whose advantages are all 0 (every member of their group scored the same) are not run when
    there is no KL term: their loss and gradient are exactly zero. They still count in the
    normaliser, so the update is the same as if they had been run, only cheaper.

    Otherwise (mini-batches, epochs or a KL term) pi_old, and pi_ref for the KL, are computed
    first, before the first optimizer step moves the policy (fill_old_logprobs).

    measure_every_sequence runs the zero-advantage sequences too (their gradient is still exactly
    zero), so that the mismatch covers every sampled token: StalePolicyGuard's calibration step."""
    before = {}
    if not single_pass(cfg):
        before = fill_old_logprobs(model, batch, experiences, cfg, device, with_ref=cfg.kl_coef > 0)
    model.train()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    per_mini = num_episodes // cfg.num_mini_batches
    stats = {k: [] for k in ("clip_frac", "ratio_mean", "kl", "pg_loss", "tis_weight_mean", "tis_capped_frac",
                             "grad_norm")}
    mismatch, trained = MismatchMeter(), 0
    for mb in [m for _ in range(cfg.ppo_epochs) for m in range(cfg.num_mini_batches)]:
        in_mini = [i for i, x in enumerate(experiences) if mb * per_mini <= x.episode < (mb + 1) * per_mini]
        # Normaliser: token-mean divides by the mini-batch's response tokens over ALL ranks
        # (seq-mean by its sequences), then by world size since FSDP averages gradients.
        count = sum(sum(experiences[i].sequence.response_mask) if cfg.loss_aggregation == "token-mean" else 1
                    for i in in_mini)
        normalizer = distributed.sum_over_ranks([count])[0] / dist.get_world_size()
        if cfg.kl_coef == 0 and not measure_every_sequence:
            in_mini = [i for i in in_mini if bool(experiences[i].advantages.any())]
        trained += len(in_mini)
        optimizer.zero_grad(set_to_none=True)
        for idx in synced_micro_batches(in_mini, cfg.micro_batch_size, batch.length, cfg.micro_batch_tokens):
            rows = [0] if idx is None else idx  # a filler runs any one sequence, with weight 0
            inputs, mask, rollout_lp = batch.micro(rows, device)
            lp = sequence_logprobs(model, inputs, cfg.temperature, batch.banned_token_ids)
            xs = [experiences[i] for i in rows]
            old_lp = lp.detach() if xs[0].old_logprobs is None else pad_rows([x.old_logprobs for x in xs], device)
            loss, m = grpo.policy_loss(
                lp, old_lp, pad_rows([x.advantages for x in xs], device), mask,
                clip_eps_low=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high,
                aggregation=cfg.loss_aggregation, loss_normalizer=normalizer,
                ref_logprobs=pad_rows([x.ref_logprobs for x in xs], device) if cfg.kl_coef > 0 else None,
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
    out.update(mismatch.result() if single_pass(cfg) else before)
    if torch.cuda.is_available():
        optimizer.zero_grad(set_to_none=True)  # the gradients are spent: free them for the engine
        torch.cuda.empty_cache()  # and the trainer's cached blocks (vLLM's wake_up does it too)
    return out


# ----------------------------------------------------------------------------- the adapter

def gather_lora_state(model) -> dict:
    """Full (unsharded) LoRA tensors on every rank, keyed as PEFT saves them. Collective."""
    from peft import get_peft_model_state_dict

    full = {}
    for name, param in lora_parameters(model):
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
        # a copy, not a view: with one rank on a CPU, full_tensor and .to() can hand back the
        # parameter's own storage, which the next optimizer step would change under the caller
        full[name] = tensor.detach().to("cpu", torch.float32, copy=True).contiguous()
    return get_peft_model_state_dict(model, state_dict=full)


def publish_adapter(model, shared: Path, step: int, keep: int, base_model: dict) -> tuple[Path, dict, int]:
    """Write the current LoRA to <shared>/sync/step_<N>, where every rank's engine can read it
    (rollout.load_adapter). Collective: every rank gathers the full LoRA, rank 0 writes it, and
    a failed write stops every rank, not only the one that failed. Returns the adapter's
    directory, the full LoRA state (for checkpoints and exports) and its size in bytes."""
    state = gather_lora_state(model)
    path = shared / "sync" / f"step_{step}"
    error = None
    if dist.get_rank() == 0:
        try:
            checkpoint.write_adapter(model, state, path, base_model)
            checkpoint.prune(shared / "sync", "step_", keep, current=step)
        except checkpoint.WriteError as e:
            error = str(e)
    error = distributed.broadcast_object(error)
    if error:
        raise SystemExit(f"LoRA sync failed: {error}")
    return path, state, sum(v.numel() * v.element_size() for v in state.values())
