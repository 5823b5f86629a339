"""Check the pinned GPU stack (requirements.txt) from a machine without a GPU.

    bash launch/check_gpu_stack.sh        # builds .venv-gpu from requirements.txt, then runs this in it

The official CUDA wheels of vllm 0.33 and torch 2.14 install and import on a CPU machine; what
needs the GPU itself (NCCL, CUDA kernels, vLLM's CUDA platform) cannot run here. So this checks
everything short of that, through the project's own code wherever it can:

  versions         the installed vllm, torch, transformers, peft are the pinned ones
  project imports  every top-level module imports against this stack
  serve.py         its vLLM entry points resolve (serve.vllm_server_api), and vLLM's own parser and
                   validator accept the command line serve.vllm_argv builds on a GPU
  engine           vllm_engine.engine_arguments(on_gpu=True) are all EngineArgs fields, and vLLM builds a
                   full engine config from them on the tiny model
  sampling, LoRA   SamplingParams as rollout.py makes them; LoRARequest, the resolver API
  process group    distributed.backend(True) routes cpu -> gloo and cuda -> nccl
  trainer          policy.build_policy (FSDP2 on a 2-D mesh), Batch with precomputed image
                   features, update.grpo_update with TIS, the LoRA gather and a checkpoint round trip,
                   on the CPU with torch 2.14 and transformers 5.19 (the CPU branch of that code)

vLLM cannot start a CPU engine in this build, and it asks its platform for a device type before it
parses a server command line; the checks marked [platform stub] tell it "cuda" and claim sleep mode.
Prints one line per check and writes a JSON report (--out).
"""

import argparse
import datetime
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PINS = {"vllm": "0.33.0", "torch": "2.14.0", "torchvision": "0.29.0", "transformers": "5.19.0", "peft": "0.21.2"}
RESULTS = []


def check(name: str, fn):
    t = time.time()
    try:
        detail = fn()
        ok = True
    except Exception as e:  # a check that fails says how, and the rest still run
        detail = f"{type(e).__name__}: {e}".strip().splitlines()[0][:300]
        ok = False
        traceback.print_exc(limit=2, file=sys.stderr)
    RESULTS.append({"check": name, "ok": ok, "detail": str(detail or ""), "seconds": round(time.time() - t, 2)})
    print(f"[{'ok' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail else ""), flush=True)


def versions():
    from importlib.metadata import version

    found = {name: version(name) for name in PINS}
    wrong = {n: v for n, v in found.items() if v.split("+")[0] != PINS[n]}
    if wrong:
        raise AssertionError(f"not the pinned versions: {wrong} (pins {PINS})")
    return ", ".join(f"{n} {v}" for n, v in found.items())


def project_imports():
    import importlib

    names = ["env", "rollout", "grpo", "distributed", "checkpoint", "rundir", "policy", "train", "sft", "serve", "tiny_model"]
    for name in names:
        importlib.import_module(name)
    return " ".join(names)


def stub_platform():
    """Tell vLLM it is on CUDA (only what its config code asks: the device type, sleep mode)."""
    from vllm.platforms import current_platform

    current_platform.device_type = "cuda"
    type(current_platform).is_sleep_mode_available = classmethod(lambda cls: True)
    type(current_platform).is_cumem_allocator_available = classmethod(lambda cls: True)
    return f"{type(current_platform).__name__}: device_type 'cuda', sleep mode available"


def serve_entry_points():
    import serve

    run_server, make_arg_parser, validate, cli_env_setup, parser_class = serve.vllm_server_api()
    return ", ".join(f"{f.__module__}.{f.__name__}" for f in (run_server, make_arg_parser, validate, cli_env_setup))


def serve_command_line(tiny: str):
    import torch

    import serve

    args = argparse.Namespace(model=tiny, served_name="tiny", host="127.0.0.1", port=8000, max_model_len=16000,
                              images_per_prompt=16, max_loras=4, max_cpu_loras=16, api_key="secret")
    available = torch.cuda.is_available
    torch.cuda.is_available = lambda: True  # the GPU branch of vllm_argv
    try:
        argv = serve.vllm_argv(args, 32, ["--gpu-memory-utilization", "0.85"])
    finally:
        torch.cuda.is_available = available
    _, make_arg_parser, validate, _, parser_class = serve.vllm_server_api()
    parsed = make_arg_parser(parser_class()).parse_args(argv)
    validate(parsed)
    assert parsed.dtype == "bfloat16" and parsed.enable_lora and parsed.max_lora_rank == 32
    return f"{len(argv)} arguments parsed and validated; middleware {parsed.middleware}"


def engine_config(tiny: str):
    from vllm.engine.arg_utils import EngineArgs

    import vllm_engine

    kwargs = vllm_engine.engine_arguments(tiny, max_model_len=4096, max_lora_rank=8, seed=0, max_images=16,
                                      max_image_px=224, external_launcher=True, on_gpu=True,
                                      logprobs_mode="processed_logprobs")
    config = EngineArgs(**kwargs).create_engine_config()
    return (f"dtype {config.model_config.dtype}, sleep {config.model_config.enable_sleep_mode}, "
            f"executor {config.parallel_config.distributed_executor_backend}, "
            f"lora rank {config.lora_config.max_lora_rank}, logprobs {config.model_config.logprobs_mode}")


def sampling_and_lora():
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolver, LoRAResolverRegistry  # noqa: F401 (serve.py's)

    SamplingParams(temperature=1.0, max_tokens=8, min_tokens=0, logprobs=0, seed=123,
                   logit_bias={5: -100.0}, detokenize=False)
    SamplingParams(temperature=0.0, max_tokens=8, logit_bias=None)
    request = LoRARequest("policy-step-1", 2, "/tmp/x")
    return f"SamplingParams ok, LoRARequest(id {request.lora_int_id})"


def process_group_routing():
    import torch.distributed as dist

    import distributed

    routes = dict(dist.BackendConfig(distributed.backend(True)).get_device_backend_map())
    assert routes == {"cpu": "gloo", "cuda": "nccl"}, routes
    return f"{distributed.backend(True)!r}: {routes}"


def trainer_step(tiny: str):
    """The trainer's tensors on this stack (CPU branch): one real update and a checkpoint."""
    import os

    import torch

    import checkpoint
    import distributed
    import env
    import grpo
    from tasks.maze import MazeTask
    import policy
    import update
    import rollout
    import sft
    import tis
    import train

    os.environ.pop("RANK", None)
    distributed.init_distributed()
    cfg = train.Config(lora_rank=8, lora_alpha=16, micro_batch_size=2, temperature=1.0, warmup_steps=0)
    model = policy.build_policy(cfg, tiny)
    chat = rollout.ChatFormat.for_model(tiny)
    sequences = sft.demonstrations(chat, 4, max_turns=5)
    model.eval()
    with torch.no_grad():  # the "engine's" log-probs: the trainer's own (demonstrations carry none)
        for s in sequences:
            lp = policy.sequence_logprobs(model, policy.Batch([s], chat.processor, model).micro([0], "cpu")[0])[0]
            s.rollout_logprobs = [0.0] + [float(x) if m else 0.0 for x, m in zip(lp, s.response_mask[1:])]
    experiences = [grpo.Experience(s, a * torch.tensor(s.response_mask[1:], dtype=torch.float32), i)
                   for i, (s, a) in enumerate(zip(sequences, [1.0, -1.0, 0.5, 0.0]))]
    optimizer = update.make_optimizer(model, 1e-2)
    scheduler = update.make_scheduler(optimizer, cfg)
    batch = policy.Batch(sequences, chat.processor, model)
    stats = update.grpo_update(cfg, model, optimizer, scheduler, batch, experiences, 4, torch.device("cpu"),
                               reweight=tis.TruncatedIS(cfg.tis_cap))
    state = policy.gather_lora_state(model)
    moved = sum(v.abs().sum().item() for k, v in state.items() if "lora_B" in k)
    assert moved > 0, "the update left LoRA B at zero"
    with tempfile.TemporaryDirectory() as out:
        stream_state = env.TrainingStream(MazeTask, "small")
        base = checkpoint.base_model_record(tiny)
        tmp = checkpoint.save(cfg, model, optimizer, scheduler, state, 1, stream_state, 0.0, Path(out), base)
        checkpoint.publish(Path(out), tmp, 1, keep=2)
        found = checkpoint.find(Path(out), "latest")
        assert checkpoint.verify(found) is None
        checkpoint.load(found, cfg, model, optimizer, scheduler, stream_state)
    assert grpo.masked_mean  # (grpo imported on this stack)
    return f"grad norm {stats['grad_norm']:.3g}, TIS weight {stats['tis_weight_mean']:.6f}, checkpoint round trip"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "gpu_stack_check.json"))
    args = parser.parse_args()
    import tiny_model

    tiny = str(tiny_model.ensure_tiny_model())
    check("versions are the pins", versions)
    check("project modules import", project_imports)
    check("serve.py: vLLM server entry points", serve_entry_points)
    check("process group: split backend routing", process_group_routing)
    check("sampling parameters and LoRA requests", sampling_and_lora)
    check("[platform stub] tell vLLM it is on CUDA", stub_platform)
    check("[platform stub] serve.py's GPU command line: parsed and validated by vLLM", lambda: serve_command_line(tiny))
    check("[platform stub] vllm_engine.engine_arguments(on_gpu=True) -> vLLM engine config", lambda: engine_config(tiny))
    check("trainer: FSDP2 policy, update with TIS, LoRA gather, checkpoint round trip (CPU)",
          lambda: trainer_step(tiny))
    report = {"date": datetime.datetime.now().isoformat(timespec="minutes"), "python": platform.python_version(),
              "machine": platform.machine(), "gpu": False, "pins": PINS, "checks": RESULTS,
              "passed": sum(r["ok"] for r in RESULTS), "total": len(RESULTS)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{report['passed']}/{report['total']} checks passed; report in {args.out}")
    sys.exit(0 if report["passed"] == report["total"] else 1)


if __name__ == "__main__":
    main()
