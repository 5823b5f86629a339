"""The shape of Qwen3-VL-8B, for benchmarks that need a real-sized model without downloading one.

transformers' `Qwen3VLConfig()` defaults are NOT the 8B model (they give 32 layers, intermediate
22016 and 32 KV heads). The figures below are the published Qwen3-VL-8B architecture, as also
written in torchtitan's Qwen3-VL "8B" flavour (pytorch/torchtitan,
torchtitan/experiments/qwen3_vl/__init__.py): text hidden 4096, 36 layers, MLP 12288, 32 query
heads and 8 KV heads of 128, vocabulary 151936, untied embeddings; vision tower 27 layers of
width 1152 (MLP 4304, 16 heads), patch 16, 2x2 merge, DeepStack taps at layers 8/16/24.
"""

QWEN3_VL_8B_TEXT = dict(
    hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=262144,
    rms_norm_eps=1e-6, hidden_act="silu",
    rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_interleaved": True,
                     "mrope_section": [24, 20, 20]},
)
QWEN3_VL_8B_VISION = dict(
    depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
    spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=4096, num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh",
)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear_shapes(text: dict) -> dict:
    """(in_features, out_features) of each LoRA target in one decoder layer."""
    h, i = text["hidden_size"], text["intermediate_size"]
    q = text["num_attention_heads"] * text["head_dim"]
    kv = text["num_key_value_heads"] * text["head_dim"]
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def lora_tensor_shapes(text: dict, rank: int) -> dict:
    """PEFT's saved names and shapes of a LoRA on every target of every decoder layer:
    A is (rank, in), B is (out, rank)."""
    shapes = {}
    for layer in range(text["num_hidden_layers"]):
        for name, (fan_in, fan_out) in linear_shapes(text).items():
            group = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.language_model.layers.{layer}.{group}.{name}"
            shapes[f"{prefix}.lora_A.weight"] = (rank, fan_in)
            shapes[f"{prefix}.lora_B.weight"] = (fan_out, rank)
    return shapes


def lora_parameter_count(text: dict, rank: int) -> int:
    """rank * (in + out) per target, summed over targets and layers."""
    per_layer = sum(rank * (fan_in + fan_out) for fan_in, fan_out in linear_shapes(text).values())
    return per_layer * text["num_hidden_layers"]
