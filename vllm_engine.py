"""The in-process vLLM engine: how it is built, how it gives the GPU to the trainer, and how it takes
each new adapter.

    engine = build_engine(model_path, max_model_len=4096, max_lora_rank=32, seed=rank)
    sleeper = EngineSleep("offload", on_gpu=True)       # sleep(engine) before the update, wake(engine) after
    lora_request = load_adapter(engine, path, step)     # a new id per step (its docstring: why)

Every torchrun rank owns one whole engine beside its FSDP shard (`external_launcher`). What it
samples is described for the trainer by `logprobs_mode` and `sampling_logit_bias`: the trainer's
log-probs (policy.sequence_logprobs) follow the same rule, so both sides describe one policy.
rollout.py plays episodes through it.
"""

import logging
import os

import torch

# vLLM reads these when it is imported. An in-process engine (no engine-core subprocess) is what
# lets each torchrun rank own an engine beside its FSDP shard; on CPU the KV cache size is given in
# GiB. Where this module is imported does not matter: vllm is imported only inside functions (here
# and in serve.py, which imports this module), so always after these lines have run
# (tests/test_imports.py checks that no module imports vllm at its top).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # torchrun ranks share the cores

# The ranks vLLM's engine takes for max_lora_rank (vllm/config/lora.py: MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# LoRA goes on the language model's linear layers only; the vision tower stays frozen (and vLLM
# does not apply LoRA to it anyway). A regex, so it works for any Qwen3-VL size.
LORA_TARGET_REGEX = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def build_engine(model: str, **kwargs):
    """An in-process vLLM engine with LoRA and prefix caching (engine_arguments says which)."""
    # vLLM's native top-k/top-p sampler (PyTorch; Triton kernels from batches of 8, built locally),
    # not FlashInfer's, unless the user chose: vLLM 0.33's CUDA wheel ships none of FlashInfer's
    # precompiled kernels, which it would fetch or compile at run time (an offline node can do
    # neither). In the pinned vllm 0.33.0 the variable (vllm/envs.py: on unless set) is read when
    # the engine builds its sampler (vllm/v1/sample/ops/topk_topp_sampler.py: 0 turns FlashInfer
    # off), which decides for Model Runner V1's sampler and V2's (vllm/v1/worker/gpu/sample/
    # sampler.py); off CUDA it is never read. serve.py does the same for the server.
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm import LLM

    for name in ("vllm.v1.worker.cpu_worker", "vllm.lora.model_manager"):
        logging.getLogger(name).addFilter(ONCE_PER_CALL_SITE)
    return LLM(**engine_arguments(model, **kwargs))


def engine_arguments(model: str, *, max_model_len: int, max_lora_rank: int, seed: int,
                     gpu_memory_utilization: float = 0.45, max_images: int = 16, max_image_px: int = 0,
                     external_launcher: bool = False, on_gpu: bool | None = None, sleep_mode: bool = True,
                     **engine_kwargs) -> dict:
    """The keyword arguments of `vllm.LLM` for this machine (on_gpu: default, whether CUDA is here).

    With `external_launcher` every torchrun rank builds its own engine inside its own process
    (vLLM then joins the process group torchrun created instead of spawning workers).
    `max_image_px` (the largest image's side) lets vLLM size its memory profile for the images
    the task really draws instead of max_images images of the largest size the processor takes.
    `sleep_mode` False (--engine-sleep none) leaves vLLM's sleep-mode allocator out on a GPU.
    Any other keyword goes to `vllm.LLM` as is, overriding ours (bench/bench.py tries `enforce_eager`).
    """
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    kwargs = dict(
        model=model, seed=seed, max_model_len=max_model_len,
        dtype="bfloat16" if on_gpu else "float32",  # fp32 on CPU: logprobs match the trainer's
        enable_prefix_caching=True,  # turn k's prompt is turn k-1's prompt + reply + new turn
        enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1, max_cpu_loras=2,
        limit_mm_per_prompt={"image": {"count": max_images, "width": max_image_px, "height": max_image_px}
                             if max_image_px else max_images, "video": 0},
    )
    if on_gpu:
        kwargs.update(gpu_memory_utilization=gpu_memory_utilization)
        if sleep_mode:  # sleep offloads the CUDA graphs' memory too, not only the weights and the KV cache
            kwargs.update(enable_sleep_mode=True, sleep_mode_offload_cudagraph=True)
    else:
        # Whole prefills only. A prefill split over two engine steps samples a token after the
        # first part and throws it away, rewinding that request's seeded generator, and a CPU
        # generator cannot rewind ("CPU Generator does not use offset"): with per-request seeds
        # that crashes as soon as a turn's prompts exceed one step's token budget. The budget is
        # then the smallest that fits one whole prompt: vLLM's CPU LoRA kernels copy the adapter
        # weights per token, and smaller steps ran faster (bench/bench.py).
        # Prefix-cache blocks of 32 tokens instead of the CPU default 128: the cache reuses whole
        # blocks only, so a turn recomputes the tail of the previous one; 32 cut the prompt
        # tokens computed per rollout by 14%.
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 2048),
                      block_size=32)
    if external_launcher:
        kwargs.update(distributed_executor_backend="external_launcher")
    return {**kwargs, **engine_kwargs}


# ----------------------------------------------------------------------------- sharing the GPU

ENGINE_SLEEP_MODES = ("auto", "offload", "kv", "none")


def engine_reserve(total_bytes: float) -> float:
    """What kv mode keeps free beside the engine's weights: 5% of the GPU, at least 2 GiB."""
    return max(0.05 * total_bytes, 2 * 2**30)


def choose_engine_sleep(headroom_bytes: float, weights_bytes: float, total_bytes: float) -> tuple[str, str]:
    """auto's choice, from what the first step measured: "kv" if the GPU memory that stayed free
    during the trainer's update, with the engine fully asleep, would also hold the engine's
    weights plus a reserve (5% of the GPU, at least 2 GiB: the CUDA graphs, LoRA buffers and
    workspace that stay with them); else "offload". Returns (mode, the reason in words)."""
    gib = 2**30
    reserve = engine_reserve(total_bytes)
    fits = headroom_bytes >= weights_bytes + reserve
    return ("kv" if fits else "offload",
            f"--engine-sleep auto: {headroom_bytes / gib:.1f} GiB stayed free during the update with the engine "
            f"offloaded; its weights need {weights_bytes / gib:.1f} GiB + a {reserve / gib:.1f} GiB reserve: "
            + ("they fit, so from now on the engine keeps its weights on the GPU and drops only its KV cache (kv)"
               if fits else "they do not fit, so the engine keeps offloading its weights to host RAM (offload)"))


class CudaMemory:
    """The few device-memory readings EngineSleep's auto mode takes (a stand-in replaces it in tests)."""

    @staticmethod
    def free() -> int:
        return torch.cuda.mem_get_info()[0]

    @staticmethod
    def total() -> int:
        return torch.cuda.mem_get_info()[1]

    @staticmethod
    def start_peak() -> int:
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_reserved()

    @staticmethod
    def peak() -> int:
        return torch.cuda.max_memory_reserved()


class EngineSleep:
    """How the engine gives the GPU to the trainer between rollouts (--engine-sleep), on vLLM 0.33:

      offload  sleep(level=1): the weights (and CUDA graphs, LoRA buffers) are copied to pinned host
               RAM, the KV cache is dropped; wake_up() copies them back. Frees the most memory; costs
               a copy of the whole base model each way every step and that much pinned host RAM per
               rank (~17 GB for Qwen3-VL-8B in bf16). The safe default.
      kv       settle() steps the engine until it holds no work (vLLM refuses to drop the KV cache
               of an engine that does), sleep(level=0) pauses the scheduler,
               release_kv_cache_memory() discards the KV cache's memory without a copy; wake_up()
               maps it again and resumes the scheduler. The weights stay on the GPU: no copy,
               no host RAM, but the trainer gets the GPU minus the engine's weights.
      none     the engine keeps everything (its gpu_memory_utilization share) while the trainer
               runs beside it; vLLM's sleep-mode allocator is not even set up.
      auto     offload on the first step, where it measures what stayed free during the update,
               then kv if the weights fit there (choose_engine_sleep); it says what it chose. In kv
               it measures again every step, and when what stays free during an update falls
               below the reserve (a longer batch than the first), it goes back to offload for
               good, in one line, before a longer one runs out of memory.

    Level 2 (weights discarded, reloaded from disk on wake) is not offered: the base never
    changes in a LoRA run, so a reload every step would only add disk reads, and level 2 with
    LoRA has an open crash report (vLLM issue 39934; and NeMo-RL issue 2631 saw level 2 corrupt a
    vision-language model's rollouts). On a CPU vLLM has no sleep mode: "none".

    The engine is passed to each call, not kept: train.py's shutdown frees it by dropping its one
    reference (`del engine`) before the process group goes.
    """

    def __init__(self, mode: str, on_gpu: bool, weights_bytes: float = 0.0, log=print,
                 memory=CudaMemory, worst_over_ranks=None):
        if mode not in ENGINE_SLEEP_MODES:
            raise ValueError(f"engine sleep mode must be one of {ENGINE_SLEEP_MODES}, not {mode!r}")
        self.mode = mode if on_gpu else "none"
        self.weights_bytes, self.log, self.memory = weights_bytes, log, memory
        self.worst_over_ranks = worst_over_ranks or (lambda x: x)  # every rank must choose alike
        self.auto = self.mode == "auto"  # measuring, and choosing again, each step
        self.asleep, self._measure = False, None

    def sleep(self, engine):
        mode = "offload" if self.mode == "auto" else self.mode
        if mode == "offload":
            engine.sleep(level=1)
        elif mode == "kv":
            settle(engine)  # release_kv_cache_memory refuses an engine that still holds work (settle: why)
            engine.sleep(level=0)  # pause the scheduler: a completed pause is the other thing it needs
            engine.release_kv_cache_memory()
        self.asleep = mode != "none"
        if self.auto and self.mode in ("auto", "kv"):
            self._measure = (self.memory.free(), self.memory.start_peak())

    def wake(self, engine):
        if self._measure is not None:
            free_after_sleep, reserved_at_start = self._measure
            self._measure = None
            # what stayed free while the trainer updated, on the rank where the least did
            headroom = -self.worst_over_ranks(-(free_after_sleep - (self.memory.peak() - reserved_at_start)))
            if self.mode == "auto":
                self.mode, reason = choose_engine_sleep(headroom, self.weights_bytes, self.memory.total())
                self.log(reason)
            elif headroom < engine_reserve(self.memory.total()):  # kv, with the weights on the GPU
                self.mode = "offload"
                self.log(f"--engine-sleep auto: only {headroom / 2**30:.1f} GiB stayed free during this update "
                         f"with the engine's weights on the GPU, under the {engine_reserve(self.memory.total()) / 2**30:.1f}"
                         " GiB reserve: back to offloading them to host RAM from the next step on (offload)")
        if self.asleep:
            # No tags: whatever sleeps is mapped again (after kv only the KV cache: the executor's and
            # the CuMem allocator's wake_up), and once nothing sleeps the scheduler resumes (EngineCore)
            engine.wake_up()
            self.asleep = False


# Engine steps settle() may take: one clears the finished requests, a second collects the batch
# that async scheduling queued ahead; work left after 4 is not the rollouts' (a KV connector's, say).
SETTLE_STEPS = 4


def settle(engine):
    """Step the in-process engine until its core holds no work, as vLLM's own server loop does
    before it idles (its has_work()), so that release_kv_cache_memory() accepts it.

    In the pinned vllm 0.33.0, EngineCore's release_kv_cache_memory() raises "requires a
    completed pause first" unless the scheduler is paused, has_requests() is false and the batch
    queue is empty. LLM.generate returns while the last step's finished request ids are still
    held (the scheduler counts them in has_requests(); only its next schedule() clears them) and,
    with async scheduling (on CUDA, on for this executor), with a batch scheduled ahead still
    queued; pausing (sleep(level=0)) steps nothing. LLMEngine.step() runs one step of the
    in-process core: it schedules an empty batch, which clears the finished ids, and collects the
    queued one, whose outputs name finished requests and are dropped by the output processor."""
    client = engine.llm_engine.engine_core
    core = getattr(client, "engine_core", None)  # the in-process EngineCore (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    if core is None:
        raise RuntimeError("--engine-sleep kv needs vLLM's engine core in this process "
                           "(VLLM_ENABLE_V1_MULTIPROCESSING=0, which vllm_engine sets unless it is set)")
    if core.scheduler.has_unfinished_requests():
        raise RuntimeError("--engine-sleep kv: the engine still has requests running; "
                           "it can only drop its KV cache once every generate call has returned")
    for _ in range(SETTLE_STEPS):
        if not core.scheduler.has_requests() and not core.batch_queue:
            return
        engine.llm_engine.step()
    raise RuntimeError(f"--engine-sleep kv: the engine still holds work after {SETTLE_STEPS} steps "
                       f"(requests: {core.scheduler.has_requests()}, queued batches: {len(core.batch_queue or ())})")


def load_adapter(engine, path, step: int):
    """Point the engine at the adapter the trainer published for `step` (policy.publish_adapter);
    returns the LoRARequest every later request names. A NEW id and path per step: vLLM loads an
    id only once, so re-using an id would silently keep generating with the old weights (and could
    reuse their prefix-cache blocks). The previous adapters are dropped from the engine."""
    request = add_adapter(engine, path, f"policy-step-{step}", step + 1)
    for old in engine.llm_engine.list_loras() - {request.lora_int_id}:
        engine.llm_engine.remove_lora(old)
    return request


# The tail average (average.py) is evaluated beside the current policy, which stays loaded for the
# next rollouts: its ids lie above every step's.
AVERAGE_ID_OFFSET = 1 << 30


def add_adapter(engine, path, name: str, lora_id: int):
    """Load the adapter at `path` into the engine under `name` and `lora_id` (new ones: see
    load_adapter); returns the LoRARequest that names it."""
    from vllm.lora.request import LoRARequest

    request = LoRARequest(name, lora_id, str(path))
    engine.llm_engine.add_lora(request)
    return request


class OncePerCallSite(logging.Filter):
    """Lets each warning's line of code speak once. vLLM's CPU worker replaces torch.set_num_threads
    with a refusal that warns on every call, and its own input processing calls it twice per prompt
    (tens of thousands of identical lines in a run); its LoRA manager warns once for every vision
    tower layer it leaves alone (LoRA is on the language model only, by design)."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        site = (record.pathname, record.lineno)
        if site in self.seen:
            return False
        self.seen.add(site)
        return True


ONCE_PER_CALL_SITE = OncePerCallSite()


def vision_token_ids(processor) -> list[int]:
    """Vision placeholders must never appear in a reply: the trainer's forward pass would take a
    generated <|image_pad|> for an image slot. Sampling gives them a logit bias of
    VISION_TOKEN_BIAS (sampling_logit_bias)."""
    return [t for t in (getattr(processor, name, None) for name in (
        "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")) if isinstance(t, int)]


VISION_TOKEN_BIAS = -100.0


def sampling_logit_bias(banned_token_ids) -> dict[int, float]:
    """The logit bias of every sampled request ({} for none)."""
    return {t: VISION_TOKEN_BIAS for t in banned_token_ids}


def logprobs_mode(temperature: float) -> str:
    """What the engine reports for each sampled token. At T = 1, vLLM's default "raw_logprobs":
    the model's own log-probs, before the logit bias. At any other temperature, those of the
    distribution it sampled from, "processed_logprobs": after the logit bias and the temperature
    (vLLM 0.33: vllm/v1/sample/sampler.py and, under Model Runner V2, vllm/v1/worker/gpu/sample/
    sampler.py). The trainer's log-probs follow the same rule (policy.sequence_logprobs), so both
    sides always describe the same policy."""
    return "raw_logprobs" if temperature == 1.0 else "processed_logprobs"
