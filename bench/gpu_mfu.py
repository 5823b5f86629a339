"""GPU training efficiency of the GRPO update: tokens/s, MFU and peak memory at Qwen3-VL-8B size.

    python bench/gpu_mfu.py            # on a GPU: the 8B shape, random weights, ~8k-token sequences
    python bench/gpu_mfu.py --tiny     # anywhere, CPU included: a tiny config, to smoke-test this script

What runs is the trainer's update (policy.build_policy + update.grpo_update) without the rest:
a randomly initialised Qwen3VLForConditionalGeneration of the Qwen3-VL-8B shape (bench/shapes.py;
built from the config, nothing downloaded), bf16, PEFT LoRA rank 32 on the language model's
linear layers, FSDP2 on a one-GPU mesh (each decoder layer, then the root; bf16 compute, fp32
gradient reduction), gradient checkpointing, and forward + backward + AdamW of the GRPO loss on
multi-turn maze-like sequences: each turn an image plus a short observation text and a reply.
vLLM is not needed.

MFU is model FLOPs per second over the bf16 matmul rate measured on the same GPU in the same run
(a large square matmul), not over the datasheet peak. Model FLOPs are what the update has to
compute, with LoRA's frozen base in mind:
  language model, every token: forward 2 N + backward 2 N (input gradients only: the base weights
    are frozen, so no weight gradients; LoRA's own are negligible), N = its linear parameters
    including the output head;
  causal attention: forward 2 T^2 d per layer (QK^T and AV, half the square), backward twice that;
  vision tower: forward only (frozen, and nothing before it trains): 2 N_blocks per patch, 2 N_merger
    per merged token, and full attention within each image, 4 n^2 d per layer for n patches.
Recomputation by gradient checkpointing is not useful work; HFU (hardware FLOPs utilisation)
adds it (one more language-model forward).
"""

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import grpo  # noqa: E402
import shapes  # noqa: E402

# the tiny stand-in for --tiny (shapes of the project's tiny model)
TINY_TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=576, max_position_embeddings=8192,
                 rms_norm_eps=1e-6, hidden_act="silu",
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True,
                                  "mrope_section": [8, 4, 4]})
TINY_VISION = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, in_channels=3, patch_size=16,
                   spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=128, num_position_embeddings=576,
                   deepstack_visual_indexes=[1], hidden_act="gelu_pytorch_tanh")
# special token ids: Qwen's for the real shape; the tiny model's for --tiny
QWEN_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
TINY_IDS = dict(image_token_id=6, video_token_id=7, vision_start_token_id=3, vision_end_token_id=4)


def build_model(text: dict, vision: dict, ids: dict, rank: int, device, dtype, grad_ckpt: bool):
    """Random Qwen3-VL + PEFT LoRA + FSDP2, the way policy.build_policy builds the real one."""
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    import vllm_engine  # the LoRA target regex (rollout imports no vLLM at module level)

    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    config.text_config.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3VLForConditionalGeneration._from_config(config, dtype=dtype, attn_implementation="sdpa")
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=vllm_engine.LORA_TARGET_REGEX))
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    mesh = init_device_mesh(device.type, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # as train.py on GPU
    for layer in model.base_model.model.model.language_model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model, config


def linear_params(module) -> int:
    """Weights of the base model's linear layers under `module` (LoRA's own excluded)."""
    return sum(m.weight.numel() for name, m in module.named_modules()
               if isinstance(m, torch.nn.Linear) and "lora_" not in name)


def maze_sequence(text: dict, ids: dict, *, turns: int, image_px: int, seq_len: int, device, generator):
    """One multi-turn sequence: per turn <vision_start> image <vision_end>, an observation text and
    a reply, sized to about seq_len tokens; random ids and pixels (only the shapes matter)."""
    patches_side = image_px // 16
    image_tokens = (patches_side // 2) ** 2  # 2x2 merge
    per_turn = seq_len // turns
    text_tokens = max(8, per_turn - image_tokens - 2)
    user_text, reply = text_tokens // 3, text_tokens - text_tokens // 3
    special = set(ids.values())
    pieces, response = [], []
    for _ in range(turns):
        words = torch.randint(0, text["vocab_size"], (user_text + reply,), generator=generator).tolist()
        words = [w if w not in special else 10 for w in words]  # no stray vision tokens
        turn = [ids["vision_start_token_id"]] + [ids["image_token_id"]] * image_tokens + [ids["vision_end_token_id"]]
        turn += words[:user_text] + words[user_text:]
        pieces += turn
        response += [0] * (len(turn) - reply) + [1] * reply
    input_ids = torch.tensor([pieces], device=device)
    pixel_values = torch.randn((turns * patches_side**2, 3 * 2 * 16 * 16), generator=generator).to(device)
    grid = torch.tensor([[1, patches_side, patches_side]] * turns, device=device)
    inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                  mm_token_type_ids=(input_ids == ids["image_token_id"]).int(), pixel_values=pixel_values,
                  image_grid_thw=grid)
    return inputs, torch.tensor([response], device=device, dtype=torch.float32)[:, 1:]


def model_flops(n: dict, text: dict, vision: dict, tokens: int, images: int, patches_per_image: int,
                recompute: bool) -> float:
    """FLOPs of one forward + backward of one sequence (see the module docstring)."""
    d_attn = text["num_attention_heads"] * text["head_dim"]
    attn_fwd = text["num_hidden_layers"] * 2 * tokens * tokens * d_attn  # 4 T^2 d / 2 (causal)
    lm_fwd = 2 * n["lm"] * tokens + attn_fwd
    patches = images * patches_per_image
    vision_fwd = (2 * n["vision_blocks"] * patches + 2 * n["vision_merger"] * patches // 4
                  + images * vision["depth"] * 4 * patches_per_image**2 * vision["hidden_size"])
    flops = lm_fwd + (2 * n["lm"] * tokens + 2 * attn_fwd) + vision_fwd
    return flops + (lm_fwd if recompute else 0)


def matmul_rate(device, dtype, n: int, iters: int) -> float:
    """FLOP/s of an n x n x n matmul on this device, after warm-up."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - t)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny config and few tokens (a CPU smoke test)")
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence (about)")
    parser.add_argument("--turns", type=int, default=15, help="turns (images) per sequence")
    parser.add_argument("--image-px", type=int, default=448, help="image side in pixels (multiple of 32)")
    parser.add_argument("--micro-batches", type=int, default=4, help="sequences per optimizer step, one at a time")
    parser.add_argument("--steps", type=int, default=4, help="measured optimizer steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--no-grad-ckpt", action="store_true",
                        help="no gradient checkpointing (train.py uses it on GPU)")
    parser.add_argument("--out", default="", help="JSON path; default bench/results/<date>-gpu_mfu[-tiny].json")
    args = parser.parse_args()

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if args.tiny:
        text, vision, ids = TINY_TEXT, TINY_VISION, TINY_IDS
        args.seq_len, args.turns, args.image_px = min(args.seq_len, 512), min(args.turns, 3), min(args.image_px, 64)
        args.micro_batches, args.steps = min(args.micro_batches, 2), min(args.steps, 2)
    else:
        text, vision, ids = shapes.QWEN3_VL_8B_TEXT, shapes.QWEN3_VL_8B_VISION, QWEN_IDS
    dtype = torch.bfloat16  # as train.py on GPU (and on the CPU too here, to smoke-test the same path)
    if not on_gpu and not args.tiny:
        raise SystemExit("no GPU here: the 8B shape needs one (about 40 GB); use --tiny for a CPU smoke test")

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=0, world_size=1)
    if on_gpu:
        torch.cuda.set_device(device)

    rate = matmul_rate(device, torch.bfloat16, 8192 if on_gpu else 512, 20 if on_gpu else 3)
    grad_ckpt = not args.no_grad_ckpt
    t = time.time()
    model, config = build_model(text, vision, ids, args.lora_rank, device, dtype, grad_ckpt)
    build_s = time.time() - t
    inner = model.base_model.model
    visual = inner.model.visual
    n = {"lm": linear_params(inner.model.language_model) + inner.lm_head.weight.numel(),
         "vision_blocks": linear_params(visual.blocks) + visual.patch_embed.proj.weight.numel(),
         "vision_merger": linear_params(visual.merger) + linear_params(visual.deepstack_merger_list)}
    n_total = sum(p.numel() for p in model.parameters())
    n_lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)

    generator = torch.Generator().manual_seed(0)
    batch = [maze_sequence(text, ids, turns=args.turns, image_px=args.image_px, seq_len=args.seq_len, device=device,
                           generator=generator) for _ in range(args.micro_batches)]
    tokens = batch[0][0]["input_ids"].shape[1]
    patches = batch[0][0]["pixel_values"].shape[0]

    def step():
        optimizer.zero_grad(set_to_none=True)
        model.train()
        for inputs, mask in batch:
            logits = model(**inputs).logits
            lp = grpo.token_logprobs(logits[:, :-1], inputs["input_ids"][:, 1:])
            advantages = torch.ones(1, device=device)
            loss, _ = grpo.policy_loss(lp, lp.detach(), advantages, mask, loss_normalizer=mask.sum() * len(batch))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    for _ in range(args.warmup):
        step()
    sync(device)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t)
    step_s = sorted(times)[len(times) // 2]
    per_image = (args.image_px // 16) ** 2
    seq_flops = model_flops(n, text, vision, tokens, args.turns, per_image, recompute=False)
    seq_hw_flops = model_flops(n, text, vision, tokens, args.turns, per_image, recompute=grad_ckpt)
    achieved = seq_flops * args.micro_batches / step_s
    result = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d-%H%M"), "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(device) if on_gpu else f"CPU ({platform.processor() or 'unknown'})",
        "gpu_measured": on_gpu, "tiny": args.tiny, "dtype": str(dtype), "torch": torch.__version__,
        "shape": "tiny" if args.tiny else "Qwen3-VL-8B", "parameters": n_total, "flop_parameters": n,
        "lora_parameters": n_lora, "lora_rank": args.lora_rank, "flops_per_sequence": seq_flops,
        "tokens_per_sequence": tokens, "image_tokens_per_sequence": patches // 4, "turns": args.turns,
        "image_px": args.image_px, "sequences_per_step": args.micro_batches, "gradient_checkpointing": grad_ckpt,
        "build_s": build_s, "step_s_median": step_s, "step_s_all": times,
        "tokens_per_s": tokens * args.micro_batches / step_s,
        "matmul_flops_per_s": rate, "model_flops_per_s": achieved,
        "mfu_vs_measured_matmul": achieved / rate,
        "hfu_vs_measured_matmul": seq_hw_flops * args.micro_batches / step_s / rate,
        "six_n_mfu_vs_measured_matmul": 6 * n["lm"] * tokens * args.micro_batches / step_s / rate,
        "peak_memory_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else None,
        "peak_memory_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if on_gpu else None,
        "load": [round(x, 2) for x in os.getloadavg()],
    }
    assert math.isfinite(result["tokens_per_s"])

    print()
    print(f"## GPU training efficiency ({result['shape']}, {result['device']})")
    print()
    if not on_gpu:
        print("**GPU figures were not measured: this ran on a CPU, with a tiny config, as a smoke test of the script. "
              "Its numbers say nothing about GPU efficiency.**")
        print()
    print("| what | value |")
    print("| --- | --- |")
    rows = [
        ("parameters (LoRA trainable)", f"{n_total / 1e6:.1f} M ({n_lora / 1e6:.2f} M, rank {args.lora_rank})"),
        ("sequence", f"{tokens} tokens, {args.turns} images of {args.image_px} px ({patches // 4} image tokens)"),
        ("sequences per optimizer step", str(args.micro_batches)),
        ("gradient checkpointing", str(grad_ckpt)),
        ("step (median)", f"{step_s:.3f} s over {args.steps} steps"),
        ("tokens/s", f"{result['tokens_per_s']:.0f}"),
        ("measured matmul rate", f"{rate / 1e12:.2f} TFLOP/s (bf16, {'8192' if on_gpu else '512'}^3)"),
        ("model FLOP/s", f"{achieved / 1e12:.2f} TFLOP/s"),
        ("MFU (vs measured matmul)", f"{100 * result['mfu_vs_measured_matmul']:.1f}%"),
        ("HFU (with recompute)", f"{100 * result['hfu_vs_measured_matmul']:.1f}%"),
        ("6N-convention MFU (as if full fine-tuning)", f"{100 * result['six_n_mfu_vs_measured_matmul']:.1f}%"),
        ("peak memory allocated / reserved",
         f"{result['peak_memory_allocated_gib']:.1f} / {result['peak_memory_reserved_gib']:.1f} GiB" if on_gpu
         else "n/a (CPU)"),
    ]
    for k, v in rows:
        print(f"| {k} | {v} |")
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / (
        f"{result['date']}-gpu_mfu{'-tiny' if args.tiny else ''}{'' if on_gpu else '-cpu'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
