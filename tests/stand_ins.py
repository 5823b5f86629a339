"""Stand-ins for what these tests cannot run on a CPU machine: vLLM's sleep mode and a GPU's memory
readings. Each keeps the rule of the pinned library that the code under test depends on, as the
cited lines state it, and refuses what the library refuses: a stand-in kinder than the library
lets a call order pass here that crashes on a GPU (docs/experiments.md, 2026-12-06, lists them).

Citations are to the pinned vllm 0.33.0 wheel's source (vllm/...) and to torch 2.13's
(torch/cuda/memory.py, as installed in .venv).
"""

from collections import deque
from types import SimpleNamespace

GIB = 2**30


class StandInEngine:
    """vllm.LLM as the trainer uses it around an update, in process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
    with vLLM 0.33's rules for pausing, sleeping and releasing the KV cache:

    - generate() runs every request to the end but returns with the last step's finished request
      ids still held by the scheduler (v1/core/sched/scheduler.py:3054), and, with async
      scheduling (on for this executor on CUDA, config/vllm.py:1685-1719), with one batch
      scheduled ahead still queued (v1/engine/core.py:758-778); has_requests() counts the
      finished ids (scheduler.py:3157-3182).
    - llm_engine.step() runs one engine-core step (llm_engine.py:319, core_client.py:398-401):
      without a batch queue, schedule() if has_requests() (core.py:667-676), which clears the
      finished ids (scheduler.py:1876); with one, schedule an empty batch into the queue and
      collect the oldest (core.py:708-778).
    - sleep(level) pauses the scheduler (core.py:955-985, 1007-1010) and steps nothing; level 1
      also puts the weights and the KV cache to sleep (executor/abstract.py:400-410).
    - release_kv_cache_memory() raises unless the scheduler is paused, has no requests and the
      batch queue is empty, and unless nothing sleeps yet (core.py:1058-1075); then the KV cache
      sleeps (abstract.py:437-446).
    - wake_up(tags) wakes those tags (all with None; a tag that is not asleep: nothing,
      abstract.py:412-435); the scheduler resumes only once nothing sleeps (core.py:1031-1055).
    - generate() on a paused engine would queue its requests and wait forever (PAUSED_NEW admits
      no new request, scheduler.py:1050-1066): here it raises instead.

    `calls` records the sleep-mode calls in order; `steps` counts llm_engine.step() calls.
    """

    def __init__(self, async_scheduling: bool = True):
        self.calls, self.steps, self.generated = [], 0, 0
        self.finished_req_ids: set[str] = set()
        self.unfinished = 0  # requests added but not run to their end (generate never leaves any)
        self.paused = False
        self.sleeping_tags: set[str] = set()
        self.batch_queue = deque() if async_scheduling else None  # max_concurrent_batches 2 (config/vllm.py:588-598)
        core = SimpleNamespace(scheduler=SimpleNamespace(has_requests=self.has_requests,
                                                         has_unfinished_requests=lambda: self.unfinished > 0),
                               batch_queue=self.batch_queue)
        self.llm_engine = SimpleNamespace(step=self.step, engine_core=SimpleNamespace(engine_core=core))

    def has_requests(self) -> bool:
        return self.unfinished > 0 or bool(self.finished_req_ids)

    def generate(self, n: int = 3):
        if self.paused or self.sleeping_tags:
            raise RuntimeError(f"generate on an engine that is paused or asleep ({sorted(self.sleeping_tags)}) "
                               "would wait forever")
        # this call's own steps take away what the previous one left; its last leaves the same again
        ids = [f"{self.generated}-{i}" for i in range(n)]
        self.generated += 1
        self.finished_req_ids = set(ids)  # freed in the last step (scheduler.py:3054), not yet scheduled away
        if self.batch_queue is not None:
            self.batch_queue.clear()
            self.batch_queue.appendleft(f"the batch scheduled ahead in generate {self.generated}")
        return ids

    def step(self):
        self.steps += 1
        if self.batch_queue is None:
            if self.has_requests():
                self.finished_req_ids = set()
            return
        if self.has_requests():
            self.finished_req_ids = set()
            self.batch_queue.appendleft("an empty batch")
        if self.batch_queue:
            self.batch_queue.pop()  # its outputs name finished requests: dropped

    def sleep(self, level: int = 1, mode: str = "abort"):
        self.calls.append(f"sleep({level})")
        self.paused = True
        if level >= 1 and "weights" not in self.sleeping_tags:
            self.sleeping_tags |= {"weights", "kv_cache"}

    def release_kv_cache_memory(self):
        self.calls.append("release_kv_cache_memory")
        if not (self.paused and not self.has_requests() and not self.batch_queue):
            raise RuntimeError("release_kv_cache_memory() requires a completed pause first")
        if self.sleeping_tags:
            raise RuntimeError("release_kv_cache_memory() requires all executor memory to be resident")
        self.sleeping_tags.add("kv_cache")

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append("wake_up" if tags is None else f"wake_up({','.join(tags)})")
        if tags is not None:
            tags = [t for t in tags if t != "scheduling"]
        if (tags is None or tags) and self.sleeping_tags and all(t in self.sleeping_tags for t in tags or ()):
            self.sleeping_tags -= set(tags) if tags else self.sleeping_tags
        if not self.sleeping_tags:
            self.paused = False
        return not self.sleeping_tags


class StandInMemory:
    """A GPU's memory readings as vllm_engine.CudaMemory takes them, by torch 2.13's rules
    (torch/cuda/memory.py): max_memory_reserved() is the peak since the program began, or since
    the last reset_peak_memory_stats() (:586-604), which starts it again from what is reserved
    then; a peak is a maximum, so never below that; mem_get_info() is the device's free and
    total (:846-862), and free plus what is reserved fit in the total.

    `free`: free bytes after the engine's sleep; `reserved`: what the trainer holds then; `extra`:
    what its update adds at its peak (set it before each step); `peak_before_reset`: the peak
    since the program began (the engine awake with its whole share: 90% of the GPU)."""

    def __init__(self, free: float, extra: float, total: float = 100 * GIB, reserved: float = 10 * GIB,
                 peak_before_reset: float | None = None):
        self.free_bytes, self.total_bytes, self.reserved = free, total, reserved
        self.peak_bytes = 0.9 * total if peak_before_reset is None else peak_before_reset
        self.extra = extra

    def free(self) -> float:
        assert 0 <= self.free_bytes and self.free_bytes + self.reserved <= self.total_bytes, "more than the GPU"
        return self.free_bytes

    def total(self) -> float:
        return self.total_bytes

    def start_peak(self) -> float:  # reset_peak_memory_stats(), then memory_reserved()
        self.peak_bytes = self.reserved
        return self.reserved

    def peak(self) -> float:  # max_memory_reserved(): the update has run since the reset
        assert self.extra >= 0, "a peak below what was reserved when it was reset"
        self.peak_bytes = max(self.peak_bytes, self.reserved + self.extra)
        return self.peak_bytes


def ranks_worst(*others: float):
    """worst_over_ranks for a world of len(others) + 1 ranks, as distributed.max_over_ranks does it
    (an all-reduce with MAX): the largest of this rank's value and the others'."""
    return lambda value: max(value, *others)


def called_as(real, fake):
    """`fake`, callable only as `real` is: arguments that `real`'s signature does not take raise
    the TypeError they raise there (a bare lambda with **kwargs takes a misspelt keyword too)."""
    import inspect

    signature = inspect.signature(real)

    def checked(*args, **kwargs):
        signature.bind(*args, **kwargs)
        return fake(*args, **kwargs)

    return checked


def peft_model(rank: int = 8):
    """What checkpoint.write_adapter needs of a PEFT model, its `peft_config`, without the model:
    a real peft.LoraConfig, whose save_pretrained writes the adapter_config.json that PEFT and
    vLLM read (peft 0.21.2, peft/config.py: save_pretrained)."""
    from peft import LoraConfig

    import vllm_engine

    return SimpleNamespace(peft_config={"default": LoraConfig(r=rank, lora_alpha=2 * rank,
                                                              target_modules=vllm_engine.LORA_TARGET_REGEX)})
