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

import os
from pathlib import Path

import torch
import torch.distributed as dist

import checkpoint
import storage
import distributed
import grpo
import rollout
import vllm_engine

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
        self.banned_token_ids = vllm_engine.vision_token_ids(processor)  # what sampling was biased against
        self.pad_id = processor.tokenizer.pad_token_id or 0
        self._keys = {}  # id(image) -> content digest
        self._pixels = {}  # digest -> (pixel_values, grid_thw)
        self._features = {}  # digest -> (embeds, [deepstack embeds])
        frozen = model is not None and not any(p.requires_grad for p in qwen3_vl_model(model).visual.parameters())
        self.model = model if frozen else None

    def length(self, i: int) -> int:
        return len(self.sequences[i].token_ids)

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
        images = [image for s in seqs for image in s.images]
        images = list(zip(rollout.image_digests(images, self._keys), images))
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


def sequence_logprobs(model, inputs: dict, temperature: float = 1.0, banned_token_ids=()) -> torch.Tensor:
    """Log-probs of each next token under the policy the engine sampled from, as the engine reports
    them: at T = 1 the model's own, at another temperature those of the tempered distribution after
    the engine's logit bias against `banned_token_ids` (vllm_engine.logprobs_mode).

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
    processed = vllm_engine.logprobs_mode(temperature) == "processed_logprobs"
    bias = vllm_engine.sampling_logit_bias(banned_token_ids) if processed else None
    # (after the root FSDP unit's forward its own parameters, the head among them, stay gathered)
    head = model.get_output_embeddings().weight
    return grpo.chunked_token_logprobs(hidden[-1][:, :-1], head, inputs["input_ids"][:, 1:], temperature, bias)


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
    (vllm_engine.load_adapter). Collective: every rank gathers the full LoRA, rank 0 writes it, and
    a failed write stops every rank, not only the one that failed. Returns the adapter's
    directory, the full LoRA state (for checkpoints and exports) and its size in bytes."""
    state = gather_lora_state(model)
    path = shared / "sync" / f"step_{step}"
    write_shared_adapter(model, state, path, keep, base_model)
    return path, state, sum(v.numel() * v.element_size() for v in state.values())


def write_shared_adapter(model, state: dict, path: Path, keep: int, base_model: dict, what: str = "LoRA sync"):
    """Rank 0 writes `state` as an adapter at `path` and keeps the newest `keep` of its siblings;
    a failed write stops every rank, not only the one that failed. Collective."""
    def write():
        checkpoint.write_adapter(model, state, path, base_model)
        storage.prune(path.parent, "step_", keep, current=int(path.name.removeprefix("step_")))

    distributed.on_rank0(write, storage.WriteError, prefix=f"{what} failed: ")
