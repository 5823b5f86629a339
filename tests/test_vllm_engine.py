"""The engine's sleep modes (vllm_engine.EngineSleep) against vLLM's rules, and how it is built.

vLLM has no sleep mode on a CPU, so the modes run against tests/stand_ins.py's StandInEngine,
which refuses what vLLM 0.33 refuses; the one rule a CPU engine can show, that an engine just out
of generate() is not idle enough to drop its KV cache until it is settled, runs on the real one.
"""

import os
import sys
import types

import pytest

import vllm_engine
from stand_ins import GIB, StandInEngine, StandInMemory, ranks_worst


def one_step(sleeper, engine):
    """A training step as train.py makes it: rollouts, the engine's sleep, the update, its wake."""
    engine.generate()
    sleeper.sleep(engine)
    sleeper.wake(engine)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_each_engine_sleep_mode_makes_the_vllm_calls_it_documents(async_scheduling):
    """Right after the rollouts' generate, as in train.py. kv must settle the engine first: vLLM
    refuses to drop the KV cache while the last step's finished requests (and, with async
    scheduling, a batch scheduled ahead) are still held."""
    expected = {"offload": ["sleep(1)", "wake_up"], "kv": ["sleep(0)", "release_kv_cache_memory", "wake_up"],
                "none": []}
    for mode, calls in expected.items():
        engine = StandInEngine(async_scheduling)
        sleeper = vllm_engine.EngineSleep(mode, on_gpu=True)
        for _ in range(2):
            one_step(sleeper, engine)
        assert engine.calls == calls * 2, mode
        assert not engine.paused and not engine.sleeping_tags, mode  # awake, and it generates again
        engine.generate()
    engine = StandInEngine(async_scheduling)  # on a CPU vLLM has no sleep mode: whatever was asked, nothing is called
    one_step(vllm_engine.EngineSleep("offload", on_gpu=False), engine)
    assert engine.calls == []


def test_the_stand_in_refuses_what_vllm_refuses():
    """The order of calls the kv mode made before settle() existed fails here as it does on a GPU;
    so do the other orders vLLM 0.33 refuses."""
    for async_scheduling in (True, False):
        engine = StandInEngine(async_scheduling)
        engine.generate()
        engine.sleep(level=0)
        with pytest.raises(RuntimeError, match="requires a completed pause first"):
            engine.release_kv_cache_memory()  # finished ids held (and a batch queued)
        engine.wake_up()
        vllm_engine.settle(engine)
        assert engine.steps == (2 if async_scheduling else 1)  # one clears the ids, one collects the queued batch
        with pytest.raises(RuntimeError, match="requires a completed pause first"):
            engine.release_kv_cache_memory()  # idle but not paused
        engine.sleep(level=1)
        with pytest.raises(RuntimeError, match="requires all executor memory to be resident"):
            engine.release_kv_cache_memory()
        with pytest.raises(RuntimeError, match="wait forever"):
            engine.generate()  # asleep
        assert engine.wake_up(["kv_cache"]) is False and engine.paused  # weights still asleep: still paused
        assert engine.wake_up() is True and not engine.paused


def test_settle_refuses_an_engine_it_cannot_make_idle():
    engine = StandInEngine()
    engine.unfinished = 2  # requests added but never run to their end
    with pytest.raises(RuntimeError, match="still has requests running"):
        vllm_engine.settle(engine)
    engine = StandInEngine()
    engine.llm_engine.engine_core = object()  # the engine core in another process
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        vllm_engine.settle(engine)


def test_settle_leaves_the_real_engine_as_release_kv_cache_memory_needs_it(engine):
    """On the CPU build of vLLM (0.32, the same rule as 0.33: v1/engine/core.py release_kv_cache_memory):
    right after generate the library itself refuses to drop the KV cache of a paused engine; after
    settle() what it checks holds. (Dropping it needs a GPU: the CPU build has no sleep mode. Nor
    does it schedule asynchronously (platforms/cpu.py), so only the stand-in has a queued batch.)"""
    from vllm import SamplingParams

    core = engine.llm_engine.engine_core.engine_core
    params = SamplingParams(max_tokens=4, temperature=0)
    first = engine.generate(["a maze"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert core.scheduler.has_requests()  # the last step's finished request, still held
    engine.sleep(level=0)
    with pytest.raises(RuntimeError, match="requires a completed pause first"):
        engine.release_kv_cache_memory()
    engine.wake_up()
    engine.generate(["a maze"], params, use_tqdm=False)
    vllm_engine.settle(engine)
    engine.sleep(level=0)
    assert core.is_scheduler_paused() and not core.scheduler.has_requests() and not core.batch_queue
    assert engine.wake_up() is True and not core.is_scheduler_paused()  # no tags: the scheduler resumes
    assert engine.generate(["a maze"], params, use_tqdm=False)[0].outputs[0].token_ids == first


def test_auto_chooses_kv_where_the_weights_fit_and_measures_the_worst_rank():
    # auto: offload first; then kv where the weights fit in what stayed free during the update
    for free, choice in ((60 * GIB, "kv"), (25 * GIB, "offload")):
        engine, said = StandInEngine(), []
        sleeper = vllm_engine.EngineSleep("auto", on_gpu=True, weights_bytes=16 * GIB, log=said.append,
                                          memory=StandInMemory(free=free, extra=30 * GIB))
        for _ in range(2):
            one_step(sleeper, engine)
        assert sleeper.mode == choice and len(said) == 1 and f"({choice})" in said[0], said
        assert engine.calls[:2] == ["sleep(1)", "wake_up"]
        assert engine.calls[2:] == {"kv": ["sleep(0)", "release_kv_cache_memory", "wake_up"],
                                    "offload": ["sleep(1)", "wake_up"]}[choice]
    # every rank chooses alike, from the rank where the least stayed free: here another rank's
    # update used 20 GiB more (distributed.max_over_ranks of the negated headroom)
    engine, said = StandInEngine(), []
    sleeper = vllm_engine.EngineSleep("auto", on_gpu=True, weights_bytes=16 * GIB, log=said.append,
                                      memory=StandInMemory(free=60 * GIB, extra=30 * GIB),
                                      worst_over_ranks=ranks_worst(-10 * GIB))
    one_step(sleeper, engine)
    assert sleeper.mode == "offload" and "10.0 GiB stayed free" in said[0], said


def test_auto_in_kv_goes_back_to_offload_when_an_update_leaves_too_little():
    """auto in kv measures every step, each update from its own start (the peak is reset at each
    sleep): an update that leaves less than the reserve free (a longer batch) sends it back to
    offload for good, in one line."""
    memory = StandInMemory(free=60 * GIB, extra=38 * GIB)
    engine, said = StandInEngine(), []
    sleeper = vllm_engine.EngineSleep("auto", on_gpu=True, weights_bytes=16 * GIB, log=said.append, memory=memory)
    one_step(sleeper, engine)  # offload: 22 GiB stayed free, the weights and the reserve (21 GiB) fit: kv
    memory.free_bytes, memory.extra = 40 * GIB, 30 * GIB  # kv, weights resident: 10 GiB stay free
    one_step(sleeper, engine)  # (with the first update's peak still counted, only 2 GiB would)
    assert sleeper.mode == "kv" and len(said) == 1
    memory.extra = 40 * GIB  # a longer batch: 4 GiB stay free, under the 5 GiB reserve
    one_step(sleeper, engine)
    assert sleeper.mode == "offload" and len(said) == 2 and "back to offloading" in said[1] and "(offload)" in said[1]
    memory.extra = 0
    one_step(sleeper, engine)  # and stays there
    assert sleeper.mode == "offload" and len(said) == 2
    assert engine.calls == ["sleep(1)", "wake_up", "sleep(0)", "release_kv_cache_memory", "wake_up",
                            "sleep(0)", "release_kv_cache_memory", "wake_up", "sleep(1)", "wake_up"]


def test_sleep_settings_and_their_arithmetic():
    # 100 GiB GPU, reserve 5 GiB; 30 GiB left free, weights 25 GiB fit, 26 not
    assert vllm_engine.choose_engine_sleep(30 * GIB, 25 * GIB, 100 * GIB)[0] == "kv"
    assert vllm_engine.choose_engine_sleep(30 * GIB, 26 * GIB, 100 * GIB)[0] == "offload"
    with pytest.raises(ValueError, match="engine sleep mode"):
        vllm_engine.EngineSleep("level2", on_gpu=True)
    import train

    with pytest.raises(SystemExit, match="engine_sleep must be one of.*; mismatch_bound and mismatch_steps"):
        train.Config(engine_sleep="level2", mismatch_steps=-1).validate(1)
    # none leaves vLLM's sleep-mode allocator out; the others ask for it
    args = vllm_engine.engine_arguments("m", max_model_len=64, max_lora_rank=8, seed=0, on_gpu=True, sleep_mode=False)
    assert "enable_sleep_mode" not in args
    assert vllm_engine.engine_arguments("m", max_model_len=64, max_lora_rank=8, seed=0, on_gpu=True)["enable_sleep_mode"]


def llm_keywords() -> set[str]:
    """The keywords the installed vllm.LLM takes: its own parameters and EngineArgs' fields (the
    rest of **kwargs goes to EngineArgs, which refuses any other: vllm/entrypoints/llm.py)."""
    import dataclasses
    import inspect

    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    own = {n for n, p in inspect.signature(LLM.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY
           or p.kind is p.POSITIONAL_OR_KEYWORD}
    return (own | {f.name for f in dataclasses.fields(EngineArgs)}) - {"self"}


def test_the_engine_is_built_with_vllms_native_top_k_top_p_sampler(monkeypatch):
    """build_engine sets VLLM_USE_FLASHINFER_SAMPLER=0 before vLLM is imported (vLLM 0.33's CUDA
    wheel lacks FlashInfer's kernels; see build_engine), and leaves a value the user set alone.
    The stand-in LLM takes only the keywords the installed vLLM takes."""
    taken, seen = llm_keywords(), []

    def llm(**kwargs):
        unknown = sorted(set(kwargs) - taken)
        assert not unknown, f"vllm.LLM takes no {unknown}"
        seen.append(os.environ.get("VLLM_USE_FLASHINFER_SAMPLER"))
        return kwargs

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=llm))
    for user, expected in ((None, "0"), ("1", "1")):
        if user is None:
            monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
        else:
            monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", user)
        args = vllm_engine.build_engine("m", max_model_len=64, max_lora_rank=8, seed=0)
        assert args["model"] == "m" and seen[-1] == expected
    for on_gpu in (True, False):  # the GPU's keywords too
        assert set(vllm_engine.engine_arguments("m", max_model_len=64, max_lora_rank=8, seed=0, on_gpu=on_gpu,
                                                external_launcher=True)) <= taken
