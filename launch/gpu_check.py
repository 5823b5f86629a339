"""The trainer's GPU code path on one GPU, without vLLM and without a network, then its speed.

    bash launch/gpu_check.sh                 # on a GPU machine: both shapes, then bench/gpu_mfu.py
    python launch/gpu_check.py --dry-run     # anywhere: the small shape on the CPU (tests run this)

Made for a bare one-GPU machine that has torch, transformers, peft, safetensors and tensorboard
but no vLLM and no hub access. First it checks, from package metadata alone, every requirement
that the pinned transformers and peft declare (and transformers checks at import): anything
missing or too old is listed in the JSON report and nothing else runs. Then: the model is a randomly initialised Qwen3VLForConditionalGeneration
built from a config (nothing downloaded), the tokenizer is replaced by token ids drawn at random,
the images are real maze renders. What runs is the project's own code, in train.py's order:

  process group     distributed.init_distributed (on a GPU: "cpu:gloo,cuda:nccl", bound to the
                    device), and every collective the trainer uses, on CPU and on CUDA tensors
  policy            policy.wrap_policy: PEFT LoRA, bf16 FSDP2 on the 2-D mesh, gradient checkpointing
  forward           policy.Batch with precomputed image features vs the plain pixel path: the same
                    log-probs (to bf16 precision)
  update            policy.grpo_update on multi-turn sequences with images: real gradients, TIS
                    weights from made-up rollout log-probs, the LoRA moves
  adapter           policy.gather_lora_state + checkpoint.write_adapter (a PEFT directory)
  checkpoint        checkpoint.save / publish / find / verify / load, and the LoRA and Adam state
                    come back equal
  speed             bench/gpu_mfu.py at the Qwen3-VL-8B shape (tokens/s, MFU, peak memory)

"small" is a few-layer model for correctness; "8b" the Qwen3-VL-8B shape (bench/shapes.py) for
the same path at full size (memory, checkpointing). One JSON report (--out); exit status 1 if a
check failed. Meant to finish in well under 8 minutes on an H100/H200.
"""

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402

SMALL_TEXT = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=2048, max_position_embeddings=16384,
                  rms_norm_eps=1e-6, hidden_act="silu",
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True,
                                   "mrope_section": [16, 8, 8]})
SMALL_VISION = dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2, in_channels=3, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=256, num_position_embeddings=2304,
                    deepstack_visual_indexes=[1], hidden_act="gelu_pytorch_tanh")
IDS = dict(image_token_id=6, video_token_id=7, vision_start_token_id=3, vision_end_token_id=4)
RESULTS = []
# What this check imports, and whose declared requirements must hold on the machine: transformers
# checks some of them when it is imported (transformers/dependency_versions_check.py), and a miss
# there (the device image's regex may be older than 5.19's regex>=2025.10.22) would end the run
# before any report is written.
CHECKED_DISTRIBUTIONS = ("torch", "transformers", "peft", "safetensors", "tensorboard")


def requirements(extra: list[str]) -> list[dict]:
    """Every distribution this check needs and every requirement they declare (extras left out),
    each with the version installed here and whether it satisfies the requirement. Reads package
    metadata only: nothing is imported, so it works where an import would fail."""
    from importlib.metadata import PackageNotFoundError, requires, version

    from packaging.requirements import Requirement

    def have(name: str):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    rows, seen = [], set()
    wanted = [(None, Requirement(name)) for name in CHECKED_DISTRIBUTIONS] + [(None, Requirement(r)) for r in extra]
    for dist in ("transformers", "peft"):
        if have(dist):
            wanted += [(dist, Requirement(r)) for r in requires(dist) or []]
    for by, req in wanted:
        if (req.marker and not req.marker.evaluate({"extra": ""})) or (req.name, str(req.specifier)) in seen:
            continue
        seen.add((req.name, str(req.specifier)))
        installed = have(req.name)
        ok = installed is not None and req.specifier.contains(installed, prereleases=True)
        rows.append({"name": req.name, "need": str(req.specifier) or "any", "by": by or "gpu_check",
                     "have": installed, "ok": ok})
    return rows


def check(name: str, fn):
    t = time.time()
    try:
        detail, ok = fn(), True
    except Exception as e:  # the report says how it failed, and the next checks still run
        detail, ok = f"{type(e).__name__}: {e}".strip().splitlines()[0][:400], False
        traceback.print_exc(limit=3, file=sys.stderr)
    RESULTS.append({"check": name, "ok": ok, "detail": detail, "seconds": round(time.time() - t, 2)})
    print(f"[{'ok' if ok else 'FAIL'}] {name} ({time.time() - t:.1f}s): {detail}", flush=True)
    return ok


def random_model(text: dict, vision: dict, device):
    """A Qwen3-VL of the given shape with random weights, built where it will run (bf16 on a GPU)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **IDS)
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3VLForConditionalGeneration._from_config(
            config, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, attn_implementation="sdpa")


def maze_sequences(n: int, vocab: int, cell_px: int, difficulty: str, turns: int, processor):
    """n multi-turn sequences shaped like rollouts: per turn a rendered maze image (its placeholder
    expanded to one token per merged patch), some observation text and a reply of 8 tokens."""
    import env
    import rollout

    rng = random.Random(0)
    special = set(IDS.values())
    sequences = []
    for i in range(n):
        maze = env.generate_maze(env.DIFFICULTY_SIZES[difficulty], seed=1_000_000 + i)
        game = env.MazeEnv(maze, max_turns=turns + 1, cell_px=cell_px)
        images = [game.reset().image]
        ids, mask = [], []
        for t in range(turns):
            grid = processor.image_processor(images=[images[-1]], return_tensors="pt")["image_grid_thw"][0]
            image = [IDS["vision_start_token_id"]] + [IDS["image_token_id"]] * (int(grid.prod()) // 4) + \
                [IDS["vision_end_token_id"]]
            text = [t for t in (rng.randrange(10, vocab) for _ in range(24)) if t not in special]
            reply = [rng.randrange(10, vocab) for _ in range(8)]
            ids += image + text + reply
            mask += [0] * (len(image) + len(text)) + [1] * len(reply)
            if t < turns - 1:
                images.append(game.step(f"<answer>('move', {rng.randrange(4)})</answer>").image)
        # made-up sampling log-probs: TIS then has weights other than 1 to apply
        sequences.append(rollout.Sequence(ids, mask, [(-0.5 - 0.1 * rng.random()) if m else 0.0 for m in mask], images))
    return sequences


def shape_checks(shape: str, device, text: dict, vision: dict, cell_px: int, difficulty: str, turns: int,
                 n_sequences: int) -> dict:
    """The trainer's path on one shape; returns figures for the report."""
    from transformers import Qwen2VLImageProcessor

    import checkpoint
    import env
    import grpo
    import policy
    import train

    figures = {}
    processor = SimpleNamespace(image_processor=Qwen2VLImageProcessor(patch_size=16, merge_size=2,
                                                                      temporal_patch_size=2),
                                image_token_id=IDS["image_token_id"], tokenizer=SimpleNamespace(pad_token_id=0))
    cfg = train.Config(lora_rank=32 if shape == "8b" else 8, lora_alpha=64 if shape == "8b" else 16,
                       micro_batch_size=1 if shape == "8b" else 2, tis_cap=2.0, lr=1e-3,
                       temperature=1.0, warmup_steps=0)  # the logprobs below are T = 1 ones
    state = {}

    def build():
        t = time.time()
        model = random_model(text, vision, device)
        state["model"] = policy.wrap_policy(cfg, model)
        trainable = sum(p.numel() for _, p in policy.lora_parameters(state["model"]))
        figures["build_s"] = round(time.time() - t, 1)
        return f"{sum(p.numel() for p in state['model'].parameters()) / 1e6:.0f} M parameters, {trainable / 1e6:.2f} M LoRA"

    def forward_paths():
        model = state["model"]
        sequences = maze_sequences(2, text["vocab_size"], cell_px, difficulty, turns, processor)
        model.eval()
        with torch.no_grad():
            inputs, mask, _ = policy.Batch(sequences, processor).micro([0, 1], device)
            plain = policy.sequence_logprobs(model, inputs)
            inputs, mask, _ = policy.Batch(sequences, processor, model).micro([0, 1], device)
            cached = policy.sequence_logprobs(model, inputs)
        diff = ((plain - cached).abs() * mask).max().item()
        tolerance = 0.05 if device.type == "cuda" else 1e-5  # bf16 kernels vs fp32
        assert diff < tolerance, f"log-probs differ by {diff} (> {tolerance})"
        figures["precomputed_vs_pixels_max_diff"] = diff
        return f"max |difference| {diff:.2e} on {int(mask.sum())} reply tokens, {inputs['input_ids'].shape[1]} positions"

    def update():
        model = state["model"]
        sequences = maze_sequences(n_sequences, text["vocab_size"], cell_px, difficulty, turns, processor)
        # the engine's log-probs, as if it had sampled these replies: the trainer's own plus a
        # bf16-sized disagreement (about 1e-2), so TIS has weights near 1 but not 1 to apply
        model.eval()
        noise = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for i, s in enumerate(sequences):
                inputs, _, _ = policy.Batch([s], processor, model).micro([0], device)
                lp = policy.sequence_logprobs(model, inputs)[0].float().cpu()
                jitter = 0.01 * torch.randn(lp.shape, generator=noise)
                s.rollout_logprobs = [0.0] + [(lp[j] + jitter[j]).item() if s.response_mask[j + 1] else 0.0
                                              for j in range(len(lp))]
        advantages = [1.0 if i % 2 == 0 else -1.0 for i in range(n_sequences)]
        experiences = [grpo.Experience(s, a * torch.tensor(s.response_mask[1:], dtype=torch.float32), i)
                       for i, (s, a) in enumerate(zip(sequences, advantages))]
        optimizer = torch.optim.AdamW([p for _, p in policy.lora_parameters(model)], lr=cfg.lr)
        scheduler = policy.make_scheduler(optimizer, cfg)
        before = policy.gather_lora_state(model)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.synchronize(device)
        t = time.time()
        stats = policy.grpo_update(cfg, model, optimizer, scheduler, policy.Batch(sequences, processor, model),
                                  experiences, n_sequences, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            figures["update_peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        figures["update_s"] = round(time.time() - t, 2)
        after = policy.gather_lora_state(model)
        moved = max((after[k] - before[k]).abs().max().item() for k in after)
        assert stats["grad_norm"] > 0 and moved > 0, stats
        assert stats["tis_weight_mean"] != 1.0 and abs(stats["tis_weight_mean"] - 1) < 0.05, stats
        figures.update(grad_norm=stats["grad_norm"], tis_weight_mean=stats["tis_weight_mean"],
                       tokens=sum(len(s.token_ids) for s in sequences))
        state.update(optimizer=optimizer, scheduler=scheduler, lora=after)
        return (f"{n_sequences} sequences of ~{figures['tokens'] // n_sequences} tokens in {figures['update_s']} s, "
                f"grad norm {stats['grad_norm']:.3g}, TIS weight {stats['tis_weight_mean']:.4f}, LoRA moved {moved:.2e}")

    def adapter_and_checkpoint():
        model, optimizer, scheduler, lora = state["model"], state["optimizer"], state["scheduler"], state["lora"]
        base = {"path": f"random {shape}", "fingerprint": None}
        with tempfile.TemporaryDirectory() as out:
            out = Path(out)
            t = time.time()
            if torch.distributed.get_rank() == 0:
                checkpoint.write_adapter(model, lora, out / "adapters" / "step_1", base)
            stream = env.TrainMazeStream("small", eval_n=8)
            tmp = checkpoint.save(cfg, model, optimizer, scheduler, lora, 1, stream, 0.0, out, base)
            if torch.distributed.get_rank() == 0:
                checkpoint.publish(out, tmp, 1, keep=2)
            torch.distributed.barrier()
            figures["checkpoint_write_s"] = round(time.time() - t, 2)
            found = checkpoint.find(out, "latest")
            assert checkpoint.verify(found) is None
            saved_moments = {k: v["exp_avg"].clone() for k, v in optimizer.state_dict()["state"].items()}
            with torch.no_grad():  # scramble, then load back
                for _, p in policy.lora_parameters(model):
                    p.zero_()
            checkpoint.load(found, cfg, model, optimizer, scheduler, stream)
            restored = policy.gather_lora_state(model)
            worst = max((restored[k] - lora[k]).abs().max().item() for k in lora)
            moments = optimizer.state_dict()["state"]
            worst_moment = max((moments[k]["exp_avg"].cpu() - saved_moments[k].cpu()).abs().max().item()
                               for k in saved_moments)
            assert worst == 0 and worst_moment == 0, (worst, worst_moment)
            size = sum(f.stat().st_size for f in found.iterdir())
            from peft import PeftConfig

            assert PeftConfig.from_pretrained(str(out / "adapters" / "step_1")).r == cfg.lora_rank
        return f"adapter + checkpoint ({size / 2**20:.0f} MiB) written in {figures['checkpoint_write_s']} s, restored exactly"

    ok = check(f"{shape}: policy (LoRA + bf16 FSDP2 on the 2-D mesh, gradient checkpointing)", build)
    if ok:
        check(f"{shape}: precomputed image features = pixel path", forward_paths)
        if check(f"{shape}: policy.grpo_update with TIS on multi-turn image sequences", update):
            check(f"{shape}: adapter export, checkpoint save/verify/load round trip", adapter_and_checkpoint)
    state.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return figures


def collectives(device) -> str:
    """Every collective the trainer issues outside FSDP, on CPU tensors and (on a GPU) CUDA ones."""
    import torch.distributed as dist

    import distributed
    import grpo

    done = []
    distributed.mean_over_ranks({"a": 1.0, "b": 2.0})
    distributed.sum_over_ranks([1.0, 2.0])
    distributed.max_over_ranks(3.0)
    assert distributed.broadcast_object({"x": 1}) == {"x": 1}
    assert distributed.all_gather_objects(dist.get_rank())[0] == 0
    dist.barrier()
    done.append("cpu: mean/sum/max over ranks, broadcast/all_gather objects, barrier")
    grpo.gather_group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    for where in ["cpu"] + (["cuda"] if device.type == "cuda" else []):
        x = torch.ones(4, device=where)
        dist.all_reduce(x)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x)
        done.append(f"{where}: all_reduce + all_gather")
    routes = dict(dist.BackendConfig(dist.get_backend()).get_device_backend_map()) if "," in dist.get_backend() \
        else {"*": dist.get_backend()}
    return f"backend {dist.get_backend()!r} {routes}; " + "; ".join(done)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="the small shape on the CPU only (no GPU needed)")
    parser.add_argument("--shapes", default="small,8b", help="comma-separated: small, 8b")
    parser.add_argument("--no-bench", action="store_true", help="skip bench/gpu_mfu.py")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "gpu_check.json"))
    parser.add_argument("--require", action="append", default=[], metavar="SPEC",
                        help="one more requirement to check first, e.g. 'regex>=2025.10.22' (repeatable)")
    args = parser.parse_args()

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.dry_run:
        raise SystemExit("no GPU here: run with --dry-run for the small shape on the CPU")
    report = {"date": datetime.datetime.now().isoformat(timespec="minutes"), "command": " ".join(sys.argv),
              "gpu": on_gpu, "dry_run": args.dry_run, "versions": {"python": platform.python_version()},
              "requirements": requirements(args.require), "shapes": {}}
    missing = [f"{r['name']} {r['need']} (have {r['have'] or 'none'}, for {r['by']})"
               for r in report["requirements"] if not r["ok"]]
    if missing:  # before any import that would die of it: the report says what to carry
        report.update(missing=missing, checks=[], passed=0, total=0)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
        raise SystemExit(f"missing or too old: {'; '.join(missing)}. Nothing was run; carry wheels for them "
                         f"(launch/gpu_check.sh --fetch-wheels). Report in {args.out}")

    import distributed
    import shapes

    rank, world, local_rank = distributed.init_distributed()
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    import peft
    import transformers

    report.update(device=torch.cuda.get_device_name(device) if on_gpu else f"CPU ({platform.processor() or '?'})",
                  world_size=world)
    report["versions"].update(torch=torch.__version__, transformers=transformers.__version__, peft=peft.__version__)
    start = time.time()
    check("process group and the trainer's collectives", lambda: collectives(device))
    wanted = ["small"] if args.dry_run else args.shapes.split(",")
    if "small" in wanted:
        report["shapes"]["small"] = shape_checks("small", device, SMALL_TEXT, SMALL_VISION, cell_px=32,
                                                 difficulty="small", turns=4 if args.dry_run else 15, n_sequences=4)
    if "8b" in wanted and on_gpu:
        # 9x9 mazes at 64 px cells (576 px images, 324 image tokens a turn), 15 turns: ~5k tokens
        report["shapes"]["8b"] = shape_checks("8b", device, shapes.QWEN3_VL_8B_TEXT, shapes.QWEN3_VL_8B_VISION,
                                              cell_px=64, difficulty="easy", turns=15, n_sequences=4)
    if not args.no_bench and on_gpu and rank == 0:
        with tempfile.TemporaryDirectory() as tmp:
            bench_out = Path(tmp) / "gpu_mfu.json"

            def bench():
                proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_mfu.py"), "--out", str(bench_out)],
                                      cwd=ROOT, capture_output=True, text=True, timeout=420,
                                      env={**os.environ, "MASTER_PORT": str(29700 + os.getpid() % 200)})
                assert proc.returncode == 0, proc.stderr[-1500:]
                report["gpu_mfu"] = json.loads(bench_out.read_text())
                r = report["gpu_mfu"]
                return (f"{r['tokens_per_s']:.0f} tokens/s, MFU {100 * r['mfu_vs_measured_matmul']:.1f}% of a measured "
                        f"{r['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s, peak {r['peak_memory_allocated_gib']:.1f} GiB")

            check("bench/gpu_mfu.py at the Qwen3-VL-8B shape", bench)
    report.update(checks=RESULTS, passed=sum(r["ok"] for r in RESULTS), total=len(RESULTS),
                  seconds=round(time.time() - start, 1))
    if rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"{report['passed']}/{report['total']} checks passed in {report['seconds']} s; report in {args.out}")
    torch.distributed.destroy_process_group()
    sys.exit(0 if report["passed"] == report["total"] else 1)


if __name__ == "__main__":
    main()
