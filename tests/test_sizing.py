"""bench/sizing.py's arithmetic: parameter counts equal transformers' own Qwen3-VL (built on the meta
device, so no memory), and the memory pieces add up the way its docstring says."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import sizing  # noqa: E402


def meta_model_counts(config: dict) -> dict:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    cfg = Qwen3VLConfig(text_config=config["text_config"], vision_config=config["vision_config"],
                        tie_word_embeddings=config["tie_word_embeddings"])
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration._from_config(cfg)
    unique = {id(p): p for p in model.parameters()}  # a tied lm_head is the embedding itself
    visual = {id(p) for p in model.model.visual.parameters()}
    return {"total": sum(p.numel() for p in unique.values()),
            "vision": sum(p.numel() for k, p in unique.items() if k in visual)}


@pytest.mark.parametrize("name", ["8b", "2b"])
def test_parameter_counts_are_transformers_own(name):
    config = sizing.qwen3_vl_8b() if name == "8b" else sizing.QWEN3_VL_2B
    counts, real = sizing.parameter_counts(config), meta_model_counts(config)
    assert (counts["total"], counts["vision"]) == (real["total"], real["vision"])
    assert 8.5e9 < counts["total"] < 9e9 if name == "8b" else 2e9 < counts["total"] < 2.3e9


def test_memory_pieces_and_the_sleep_mode_they_imply():
    config = sizing.qwen3_vl_8b()
    n = sizing.parameter_counts(config)
    one, eight = sizing.estimate(config, 141, 1), sizing.estimate(config, 141, 8)
    assert one["engine_weights"] == eight["engine_weights"] == round(2 * n["total"] / 2**30, 2)
    # the language model is sharded over the node, the vision tower is not
    assert eight["trainer_shard"] == pytest.approx((2 * n["language"] / 8 + 2 * n["vision"]) / 2**30, abs=0.01)
    assert one["lora_and_optimizer"] == pytest.approx(8 * eight["lora_and_optimizer"], abs=0.05)
    assert one["kv_cache"] == pytest.approx(0.45 * 141 - one["engine_weights"] - sizing.ENGINE_RUNTIME_GIB, abs=0.01)
    assert one["kv_cache_tokens"] == int(one["kv_cache"] * 2**30 // (2 * 36 * 8 * 128 * 2))  # 144 KiB a token
    # more room, a cheaper mode; a GPU too small for engine + trainer fits none
    order = ["none", "kv", "offload", "does not fit"]
    assert order.index(sizing.estimate(config, 141, 8)["engine_sleep"]) <= order.index(
        sizing.estimate(config, 80, 8)["engine_sleep"])
    assert sizing.estimate(config, 24, 1)["engine_sleep"] == "does not fit"
    assert eight["pinned_host_gib_per_node"] in (0.0, round(8 * eight["engine_weights"], 1))
    # the longer a micro-batch, the more the engine must give up; offload leaves the most room
    room = sizing.estimate(config, 80, 8)["max_tokens_k"]
    assert room["none"] < room["kv"] < room["offload"]
    assert sizing.estimate(config, 80, 8, tokens=1024 * room["kv"] + 4096)["engine_sleep"] == "offload"


def test_the_recipes_micro_batch_fits_every_gpu_in_the_table():
    """The qwen3-vl recipe's token budget (config.QWEN3_VL_RECIPE, what train.py packs
    micro-batches by) is the table's default, and its update fits on 80 and 141 GB GPUs for
    Qwen3-VL-8B and 2B, one GPU or eight, because the logits are computed a chunk at a time: with
    fp32 logits held for every token (the old path) 16k tokens of 8B's vocabulary alone took ~18 GiB."""
    import config

    assert sizing.recipe_tokens() == config.QWEN3_VL_RECIPE["micro_batch_tokens"] == 16384
    for shape in (sizing.qwen3_vl_8b(), sizing.QWEN3_VL_2B):
        for gpu in (80, 141):
            for per_node in (1, 8):
                row = sizing.estimate(shape, gpu, per_node)
                assert row["engine_sleep"] != "does not fit", (gpu, per_node)
                assert min(row["max_tokens_k"].values()) * 1024 >= sizing.recipe_tokens()
    text = sizing.qwen3_vl_8b()["text_config"]
    assert sizing.logits_chunk_bytes(text) < 3 * 2**30  # one chunk, whatever the length
    assert sizing.update_activation_bytes(text, 32768) - sizing.update_activation_bytes(text, 16384) == \
        16384 * sizing.activation_bytes_per_token(text)  # the rest grows with tokens, not tokens x vocabulary


def test_a_checkpoint_is_the_lora_and_adams_moments():
    sizes = sizing.checkpoint_gib(sizing.qwen3_vl_8b(), 32)
    lora = sizing.lora_parameters(sizing.qwen3_vl_8b()["text_config"], 32)
    assert 85e6 < lora < 90e6 and sizes["checkpoint"] == round(12 * lora / 2**30, 2)  # ~1 GiB: seconds to write
