"""How much GPU memory each resident piece of a run takes, from the model's own config.json.

    .venv/bin/python bench/sizing.py                              # the table: Qwen3-VL-8B and 2B, 80 and 141 GB, 1 and 8 GPUs
    .venv/bin/python bench/sizing.py --config <model>/config.json --gpu-gib 80 --gpus-per-node 8

An ESTIMATE, arithmetic only: nothing here has been measured on a GPU yet. What is exact is the
parameter arithmetic (tests/test_sizing.py checks it against transformers' own Qwen3-VL built on the
meta device); the activation and runtime terms are rules of thumb, named as such below. Per GPU,
each rank holding one engine and one FSDP2 shard (README, "On GPUs"):

  engine weights      every parameter in bf16 (each engine holds the whole model)
  KV cache            what vLLM's share (gpu_memory_utilization x the GPU) leaves after the weights
                      and its runtime (profiling peak, CUDA graphs: ENGINE_RUNTIME_GIB, a rule of thumb)
  trainer shard       the language model's bf16 parameters / ranks in the shard group, plus the vision
                      tower whole (it stays outside FSDP), plus the root unit (embeddings, lm_head) and
                      two decoder layers gathered at a time during forward and backward
  LoRA + optimizer    fp32 LoRA weights, gradients and Adam's two moments: 16 bytes a LoRA parameter,
                      sharded
  activations         per micro-batch of `tokens` (the qwen3-vl recipe's budget, config.QWEN3_VL_RECIPE), with
                      activation checkpointing: every layer's input kept (tokens x hidden x 2 bytes
                      each), one layer's working set recomputed (ACTIVATION_WIDTH, a rule of thumb),
                      the final hidden states, and one chunk of logits: grpo.chunked_token_logprobs
                      computes grpo.LOGITS_CHUNK positions' logits at a time and keeps none for
                      backward (LOGIT_BYTES a chunk entry: bf16 out, fp32 copy, tempered, exp, grad)
  context             CUDA context, NCCL buffers, allocator slack: CONTEXT_GIB, a rule of thumb

Which --engine-sleep fits (vllm_engine.EngineSleep): during rollouts the engine's share and the
trainer's resident part (shard, LoRA + optimizer, context) must fit; during the update the
trainer's peak plus what the engine keeps: nothing (offload), its weights + runtime (kv),
its whole share (none). The cheapest that fits is named; offload also pins the weights in host RAM,
once per rank.
"""

import argparse
import json
from pathlib import Path

GIB = 2**30
ENGINE_RUNTIME_GIB = 2.0  # vLLM's profiling peak and CUDA graphs beside weights and KV cache (rule of thumb)
CONTEXT_GIB = 1.5  # CUDA context, NCCL buffers, allocator slack per process (rule of thumb)
ACTIVATION_WIDTH = (10, 4)  # one layer's recompute: ~10 x hidden + 4 x intermediate values a token (rule of thumb)
LOGIT_BYTES = 18  # per entry of one chunk's [chunk, vocab] logits, live at once (see the docstring)

# The published shapes, for the table (a real config.json can always be given instead). The 8B one
# is bench/shapes.py's; the 2B one as Qwen/Qwen3-VL-2B-Instruct's config.json gives it, as read from
# third-party copies (not from the hub here): check against the real file with --config.
QWEN3_VL_2B = {
    "tie_word_embeddings": True,
    "text_config": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "vision_config": dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, in_channels=3,
                          patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=2048,
                          num_position_embeddings=2304, deepstack_visual_indexes=[5, 11, 17]),
}


def qwen3_vl_8b() -> dict:
    import shapes

    return {"tie_word_embeddings": False, "text_config": shapes.QWEN3_VL_8B_TEXT,
            "vision_config": shapes.QWEN3_VL_8B_VISION}


def decoder_layer_parameters(text: dict) -> int:
    """One Qwen3 decoder layer: q, k, v, o (no biases), q/k norms, the gated MLP, two RMSNorms."""
    h, i, d = text["hidden_size"], text["intermediate_size"], text["head_dim"]
    q, kv = text["num_attention_heads"] * d, text["num_key_value_heads"] * d
    return h * q + 2 * h * kv + q * h + 2 * d + 3 * h * i + 2 * h


def parameter_counts(config: dict) -> dict:
    """Parameters of a Qwen3-VL config.json: the language model (embeddings, decoder layers, final
    norm, lm_head unless tied) and the vision tower (patch embedding, position embedding, blocks,
    merger and DeepStack mergers)."""
    text, vision = config["text_config"], config["vision_config"]
    h, vocab = text["hidden_size"], text["vocab_size"]
    embeddings = vocab * h
    lm_head = 0 if config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)) else vocab * h
    language = embeddings + text["num_hidden_layers"] * decoder_layer_parameters(text) + h + lm_head
    vh, vi = vision["hidden_size"], vision["intermediate_size"]
    patch = vision["in_channels"] * vision["temporal_patch_size"] * vision["patch_size"] ** 2 * vh + vh
    block = (vh * 3 * vh + 3 * vh) + (vh * vh + vh) + (vh * vi + vi) + (vi * vh + vh) + 2 * 2 * vh
    merged = vh * vision["spatial_merge_size"] ** 2

    def merger(norm_width: int) -> int:  # LayerNorm, fc1 (merged -> merged), fc2 (merged -> out)
        return 2 * norm_width + merged * merged + merged + merged * vision["out_hidden_size"] + vision["out_hidden_size"]

    visual = (patch + vision["num_position_embeddings"] * vh + vision["depth"] * block + merger(vh)
              + len(vision.get("deepstack_visual_indexes", [])) * merger(merged))
    return {"language": language, "vision": visual, "embeddings": embeddings, "lm_head": lm_head,
            "decoder_layer": decoder_layer_parameters(text), "total": language + visual}


def lora_parameters(text: dict, rank: int) -> int:
    """rank x (in + out) on q, k, v, o, gate, up, down of every decoder layer (vllm_engine.LORA_TARGET_REGEX)."""
    import shapes

    return shapes.lora_parameter_count(text, rank)


def kv_bytes_per_token(text: dict) -> int:
    """K and V of every layer in bf16."""
    return 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * text["head_dim"] * 2


def activation_bytes_per_token(text: dict) -> int:
    """Saved layer inputs, one layer's recompute and the final hidden state, per token of a micro-batch."""
    h, i = text["hidden_size"], text["intermediate_size"]
    return (text["num_hidden_layers"] + 1) * h * 2 + (ACTIVATION_WIDTH[0] * h + ACTIVATION_WIDTH[1] * i) * 2


def logits_chunk_bytes(text: dict) -> int:
    """One chunk of logits (grpo.chunked_token_logprobs): the same whatever the micro-batch's length."""
    import grpo

    return grpo.LOGITS_CHUNK * text["vocab_size"] * LOGIT_BYTES


def update_activation_bytes(text: dict, tokens: int) -> int:
    """What the update's forward and backward hold for a micro-batch of `tokens` (padded)."""
    return tokens * activation_bytes_per_token(text) + logits_chunk_bytes(text)


def recipe_tokens() -> int:
    """The qwen3-vl recipe's micro-batch token budget (config.QWEN3_VL_RECIPE): what train.py uses."""
    import config

    return config.QWEN3_VL_RECIPE["micro_batch_tokens"]


def estimate(config: dict, gpu_gib: float, gpus_per_node: int, *, gpu_memory_utilization: float = 0.45,
             lora_rank: int = 32, tokens: int | None = None) -> dict:
    """GiB per GPU of each piece, the update's peak, and the cheapest engine sleep mode that fits."""
    text = config["text_config"]
    tokens = tokens or recipe_tokens()
    n = parameter_counts(config)
    lora = lora_parameters(text, lora_rank)
    h, i, vocab, layers = text["hidden_size"], text["intermediate_size"], text["vocab_size"], text["num_hidden_layers"]
    pieces = {
        "engine_weights": 2 * n["total"] / GIB,
        "trainer_shard": (2 * n["language"] / gpus_per_node + 2 * n["vision"]) / GIB,
        "trainer_gathered": 2 * (n["embeddings"] + n["lm_head"] + 2 * n["decoder_layer"]) / GIB,
        "lora_and_optimizer": 16 * lora / gpus_per_node / GIB,
        "activations": update_activation_bytes(text, tokens) / GIB,
        "context": CONTEXT_GIB,
    }
    engine_share = gpu_memory_utilization * gpu_gib
    kv = engine_share - pieces["engine_weights"] - ENGINE_RUNTIME_GIB
    resident = pieces["trainer_shard"] + pieces["lora_and_optimizer"] + pieces["context"]
    update_peak = resident + pieces["trainer_gathered"] + pieces["activations"]
    keeps = {"none": engine_share, "kv": pieces["engine_weights"] + ENGINE_RUNTIME_GIB, "offload": 0.0}
    fits_rollout = kv > 0 and engine_share + resident <= gpu_gib
    fitting = [m for m in ("none", "kv", "offload") if fits_rollout and update_peak + keeps[m] <= gpu_gib]
    mode = fitting[0] if fitting else "does not fit"
    # the longest micro-batch (tokens) each mode leaves room for
    room = {m: ((gpu_gib - keeps[m] - update_peak + pieces["activations"]) * GIB - logits_chunk_bytes(text))
               / activation_bytes_per_token(text) for m in keeps}
    max_tokens = {m: int(max(room[m], 0) // 1024) for m in ("none", "kv", "offload")}
    return {**{k: round(v, 2) for k, v in pieces.items()},
            "engine_share": round(engine_share, 2), "kv_cache": round(max(kv, 0.0), 2),
            "kv_cache_tokens": int(max(kv, 0.0) * GIB // kv_bytes_per_token(text)),
            "update_peak": round(update_peak, 2), "engine_sleep": mode,
            "max_tokens_k": max_tokens if fits_rollout else {m: 0 for m in max_tokens},
            "pinned_host_gib_per_node": round(pieces["engine_weights"] * gpus_per_node, 1) if mode == "offload" else 0.0,
            "load_host_gib_per_node": round(pieces["engine_weights"], 1),  # rank 0 reads the checkpoint once
            "parameters_b": round(n["total"] / 1e9, 2), "lora_parameters_m": round(lora / 1e6, 1)}


def checkpoint_gib(config: dict, lora_rank: int = 32) -> dict:
    """What a checkpoint holds (checkpoint.save): the LoRA in fp32 and Adam's two fp32 moments (the
    full state, gathered to rank 0, which writes it), and the servable adapter export beside it.
    A preempted run writes one after its last completed step (rundir.StopRequest)."""
    lora = lora_parameters(config["text_config"], lora_rank)
    return {"checkpoint": round(12 * lora / GIB, 2), "adapter_export": round(4 * lora / GIB, 2)}


COLUMNS = [("model", "model"), ("GPU GiB", "gpu_gib"), ("GPUs/node", "gpus_per_node"),
           ("engine weights", "engine_weights"), ("KV cache (tokens)", "kv"), ("trainer shard", "trainer_shard"),
           ("gathered", "trainer_gathered"), ("LoRA + Adam", "lora_and_optimizer"),
           ("activations / micro-batch", "activations"), ("update peak", "update_peak"),
           ("--engine-sleep", "engine_sleep"), ("max k tokens / micro-batch: none, kv, offload", "max_tokens"),
           ("pinned host GiB / node", "pinned_host_gib_per_node")]


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(name for name, _ in COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for r in rows:
        r = {**r, "kv": f"{r['kv_cache']} ({r['kv_cache_tokens'] // 1000}k)",
             "max_tokens": ", ".join(str(r["max_tokens_k"][m]) for m in ("none", "kv", "offload"))}
        lines.append("| " + " | ".join(str(r[key]) for _, key in COLUMNS) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a Qwen3-VL config.json; default: the 8B and 2B shapes")
    parser.add_argument("--gpu-gib", type=float, nargs="+", default=[80.0, 141.0])
    parser.add_argument("--gpus-per-node", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per micro-batch; default: the qwen3-vl recipe's budget")
    args = parser.parse_args()
    configs = ({Path(args.config).parent.name: json.loads(Path(args.config).read_text())} if args.config
               else {"Qwen3-VL-8B": qwen3_vl_8b(), "Qwen3-VL-2B": QWEN3_VL_2B})
    rows = [{"model": name, "gpu_gib": gpu, "gpus_per_node": per_node,
             **estimate(config, gpu, per_node, gpu_memory_utilization=args.gpu_memory_utilization,
                        lora_rank=args.lora_rank, tokens=args.tokens)}
            for name, config in configs.items() for gpu in args.gpu_gib for per_node in args.gpus_per_node]
    print(f"ESTIMATE (GiB per GPU; not measured on a GPU): gpu_memory_utilization {args.gpu_memory_utilization}, "
          f"LoRA rank {args.lora_rank}, {args.tokens or recipe_tokens()} tokens per micro-batch, activation "
          "checkpointing, chunked logits\n")
    print(table(rows))
    print("\nPreemption (SIGTERM -> checkpoint of the last completed step -> exit), per run, written by rank 0:")
    for name, config in configs.items():
        sizes = checkpoint_gib(config, args.lora_rank)
        print(f"- {name}: a checkpoint is {sizes['checkpoint']} GiB (LoRA + Adam, fp32): "
              f"{sizes['checkpoint'] / 0.5:.1f} s at 0.5 GiB/s, {sizes['checkpoint'] / 2:.1f} s at 2 GiB/s to "
              "shared storage; add the step in hand if it is past its rollouts (an update, a sync)")


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # grpo, config
    main()
