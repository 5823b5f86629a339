"""The tiny Qwen3-VL loads like a real one: transformers, AutoProcessor and vLLM (with LoRA)."""

import json

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

import env
import rollout


def test_directory_is_an_ordinary_hf_model(tiny_model):
    for name in ["config.json", "model.safetensors", "tokenizer.json", "processor_config.json",
                 "chat_template.jinja", "generation_config.json"]:
        assert (tiny_model / name).exists(), name
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"]


def test_build_is_deterministic(tmp_path, tiny_model):
    from make_tiny_model import build

    other = build(tmp_path / "again", seed=0)
    assert (other / "model.safetensors").read_bytes() == (tiny_model / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_text() == (tiny_model / "tokenizer.json").read_text()


def test_actions_are_single_tokens(tiny_model):
    tok = AutoProcessor.from_pretrained(tiny_model).tokenizer
    for action in env.ACTION_STRINGS:
        ids = tok(f"<answer>{action}</answer>", add_special_tokens=False)["input_ids"]
        assert len(ids) == 3
        assert tok.decode(ids) == f"<answer>{action}</answer>"


def test_transformers_forward_with_a_maze_image(tiny_model):
    processor = AutoProcessor.from_pretrained(tiny_model)
    model = Qwen3VLForConditionalGeneration.from_pretrained(tiny_model, dtype=torch.float32)
    maze = env.generate_maze(7, seed=0)
    image = env.render(maze, maze.start)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": env.INSTRUCTIONS}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    batch = processor(text=[text], images=[image], return_tensors="pt")
    # 7x7 cells of 32 px -> 14x14 patches of 16 px -> 7x7 merged tokens: one token per cell
    assert batch["image_grid_thw"].tolist() == [[1, 14, 14]]
    assert (batch["input_ids"] == processor.image_token_id).sum().item() == 49
    out = model.generate(**batch, max_new_tokens=5, do_sample=False)
    new_tokens = out.shape[1] - batch["input_ids"].shape[1]
    assert 1 <= new_tokens <= 5


def _first_turn(tiny_model):
    processor = AutoProcessor.from_pretrained(tiny_model)
    maze = env.generate_maze(7, seed=3)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": env.INSTRUCTIONS}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": [env.render(maze, maze.start)]}}


def test_untrained_vision_tower_tells_walls_from_paths(tiny_model):
    """Regression: with mean-0.5 pixel normalisation, uniform gray (wall) and white (path) patches
    embedded to parallel vectors, the LayerNorms made them identical, and no amount of SFT taught
    the model to see walls. Every kind of cell must start out distinguishable."""
    processor = AutoProcessor.from_pretrained(tiny_model)
    model = Qwen3VLForConditionalGeneration.from_pretrained(tiny_model, dtype=torch.float32).eval()
    maze = env.generate_maze(7, seed=3)
    agent = next(c for c in [(3, 3), (1, 3), (3, 1)] if maze.is_open(c) and c != maze.goal)
    pixels = processor.image_processor(images=[env.render(maze, agent)], return_tensors="pt")
    with torch.no_grad():
        tokens = model.model.visual(pixels["pixel_values"], grid_thw=pixels["image_grid_thw"]).pooler_output
    tokens = torch.nn.functional.normalize(tokens, dim=-1)  # one token per cell, row-major
    index = {cell: cell[0] * maze.size + cell[1] for cell in [(r, c) for r in range(7) for c in range(7)]}
    paths = [index[c] for c in index if maze.is_open(c) and c not in (agent, maze.goal)]
    walls = [index[c] for c in index if not maze.is_open(c)]
    wall_vs_path = (tokens[walls] @ tokens[paths].T).mean().item()
    agent_vs_path = (tokens[index[agent]] @ tokens[paths].T).mean().item()
    goal_vs_path = (tokens[index[maze.goal]] @ tokens[paths].T).mean().item()
    assert max(wall_vs_path, agent_vs_path, goal_vs_path) < 0.5, (wall_vs_path, agent_vs_path, goal_vs_path)


def test_vllm_generates_from_an_image_prompt(engine, tiny_model):
    from vllm import SamplingParams

    out = engine.generate([_first_turn(tiny_model)], SamplingParams(temperature=0.0, max_tokens=8),
                          use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) > 0
    # vLLM expands the single <|image_pad|> into one token per merged patch (49 for a 7x7 maze)
    image_token_id = AutoProcessor.from_pretrained(tiny_model).image_token_id
    assert _first_turn(tiny_model)["prompt_token_ids"].count(image_token_id) == 1
    assert list(out.prompt_token_ids).count(image_token_id) == 49


def test_peft_adapter_changes_vllm_output(engine, tiny_model, tmp_path):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    model = Qwen3VLForConditionalGeneration.from_pretrained(tiny_model, dtype=torch.float32)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=rollout.LORA_TARGET_REGEX)
    model = get_peft_model(model, lora)
    torch.manual_seed(0)
    with torch.no_grad():  # PEFT starts B at zero (a no-op adapter); give it real weights
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["r"] == 8

    params = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=0)
    prompt = _first_turn(tiny_model)
    base = engine.generate([prompt], params, use_tqdm=False)[0]
    tuned = engine.generate([prompt], params, use_tqdm=False,
                            lora_request=LoRARequest("test-adapter", 1, str(tmp_path / "adapter")))[0]

    def prompt_lps(out):
        return torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])

    assert (prompt_lps(base) - prompt_lps(tuned)).abs().max() > 0.1
    assert base.outputs[0].token_ids != tuned.outputs[0].token_ids
