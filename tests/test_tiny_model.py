"""The tiny Qwen3-VL loads like a real one: transformers, AutoProcessor and vLLM (with LoRA)."""

import json

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoProcessor, Qwen3VLForConditionalGeneration

import tasks.maze as maze_task
import vllm_engine


def test_directory_is_an_ordinary_hf_model(tiny_model):
    for name in ["config.json", "model.safetensors", "tokenizer.json", "processor_config.json",
                 "chat_template.jinja", "generation_config.json"]:
        assert (tiny_model / name).exists(), name
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"]


def test_build_is_deterministic(tmp_path, tiny_model):
    from tiny_model import build, fingerprint

    # a short vision pretraining keeps this fast; the recipe is the same
    one, two = (build(tmp_path / name, seed=0, vision_steps=3, progress=False) for name in ("one", "two"))
    assert (one / "model.safetensors").read_bytes() == (two / "model.safetensors").read_bytes()
    assert (one / "tokenizer.json").read_text() == (tiny_model / "tokenizer.json").read_text()
    # a different recipe is a different model, which ensure_tiny_model must not mistake for the default
    assert json.loads((one / "BUILD_INFO.json").read_text())["fingerprint"] == fingerprint(0, 3) != fingerprint(0)
    # a deeper language model behind the same (bit-identical) vision tower
    assert fingerprint(0, 3, text_layers=4) != fingerprint(0, 3)
    deeper = build(tmp_path / "deeper", seed=0, vision_steps=3, text_layers=4, progress=False)
    assert json.loads((deeper / "config.json").read_text())["text_config"]["num_hidden_layers"] == 4
    from safetensors.torch import load_file

    base, deep = load_file(str(one / "model.safetensors")), load_file(str(deeper / "model.safetensors"))
    vision = [k for k in base if ".visual." in k]
    assert vision and all(torch.equal(base[k], deep[k]) for k in vision)
    assert "model.language_model.layers.3.mlp.up_proj.weight" in deep


def test_cell_targets_describe_the_picture():
    from tiny_model import PERCEPTION_TARGETS, cell_targets

    maze = maze_task.generate_maze(7, seed=3)
    agent = next(c for c in [(3, 3), (1, 3), (3, 1)] if maze.is_open(c))
    targets = cell_targets(maze, agent)
    assert targets.shape == (49, len(PERCEPTION_TARGETS))
    column = {name: targets[:, i] for i, name in enumerate(PERCEPTION_TARGETS)}
    row_major = [(r, c) for r in range(7) for c in range(7)]
    assert [bool(w) for w in column["wall"]] == [not maze.is_open(cell) for cell in row_major]
    assert row_major[int(column["agent"].argmax())] == agent and column["agent"].sum() == 1
    assert row_major[int(column["goal"].argmax())] == maze.goal and column["goal"].sum() == 1
    r, c = agent
    for d, name in enumerate(["right open", "up open", "left open", "down open"]):
        dr, dc = maze_task.MOVE_DELTAS[d]
        assert bool(column[name][r * 7 + c]) == maze.is_open((r + dr, c + dc))
    assert column["up open"][0] == 0  # beyond the border counts as closed


def test_pretrained_vision_tower_sees_the_agents_neighbours(tiny_model):
    """The build measured its vision tower on held-out mazes of every size: the agent's four
    neighbours are read right (SFT alone never learned this: its accuracy stayed at chance)."""
    info = json.loads((tiny_model / "BUILD_INFO.json").read_text())
    for difficulty in ("small", "easy", "hard"):
        accuracy = info["vision_heldout_accuracy"][difficulty]
        assert accuracy["wall"] > 0.99 and accuracy["agent"] > 0.99 and accuracy["goal"] > 0.99
        assert accuracy["agent's neighbours"] > 0.95, (difficulty, accuracy)


def test_actions_are_single_tokens(tiny_model):
    tok = AutoProcessor.from_pretrained(tiny_model).tokenizer
    for action in maze_task.ACTION_STRINGS:
        ids = tok(f"<answer>{action}</answer>", add_special_tokens=False)["input_ids"]
        assert len(ids) == 3
        assert tok.decode(ids) == f"<answer>{action}</answer>"


def test_transformers_forward_with_a_maze_image(tiny_model):
    processor = AutoProcessor.from_pretrained(tiny_model)
    model = Qwen3VLForConditionalGeneration.from_pretrained(tiny_model, dtype=torch.float32)
    maze = maze_task.generate_maze(7, seed=0)
    image = maze_task.render(maze, maze.start)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": maze_task.INSTRUCTIONS}]}]
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
    maze = maze_task.generate_maze(7, seed=3)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": maze_task.INSTRUCTIONS}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": [maze_task.render(maze, maze.start)]}}


def test_untrained_vision_tower_tells_walls_from_paths(tiny_model):
    """Regression: with mean-0.5 pixel normalisation, uniform gray (wall) and white (path) patches
    embedded to parallel vectors, the LayerNorms made them identical, and no amount of training
    taught the model to see walls. Every kind of cell must start out distinguishable, before
    the vision pretraining."""
    processor = AutoProcessor.from_pretrained(tiny_model)
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration._from_config(AutoConfig.from_pretrained(tiny_model)).eval()
    maze = maze_task.generate_maze(7, seed=3)
    agent = next(c for c in [(3, 3), (1, 3), (3, 1)] if maze.is_open(c) and c != maze.goal)
    pixels = processor.image_processor(images=[maze_task.render(maze, agent)], return_tensors="pt")
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


def test_vllm_generates_from_an_image_prompt(engine, warm_start):
    """(The engine serves the warm start: the tiny model after a short SFT, the same architecture.)"""
    from vllm import SamplingParams

    out = engine.generate([_first_turn(warm_start)], SamplingParams(temperature=0.0, max_tokens=8),
                          use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) > 0
    # vLLM expands the single <|image_pad|> into one token per merged patch (49 for a 7x7 maze)
    image_token_id = AutoProcessor.from_pretrained(warm_start).image_token_id
    assert _first_turn(warm_start)["prompt_token_ids"].count(image_token_id) == 1
    assert list(out.prompt_token_ids).count(image_token_id) == 49


def test_peft_adapter_changes_vllm_output(engine, warm_start, tmp_path):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    model = Qwen3VLForConditionalGeneration.from_pretrained(warm_start, dtype=torch.float32)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=vllm_engine.LORA_TARGET_REGEX)
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
    prompt = _first_turn(warm_start)
    base = engine.generate([prompt], params, use_tqdm=False)[0]
    tuned = engine.generate([prompt], params, use_tqdm=False,
                            lora_request=LoRARequest("test-adapter", 1, str(tmp_path / "adapter")))[0]

    def prompt_lps(out):
        return torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])

    assert (prompt_lps(base) - prompt_lps(tuned)).abs().max() > 0.1
    assert base.outputs[0].token_ids != tuned.outputs[0].token_ids


# ----------------------------------------------------------------------------- the VisGym build

def test_default_build_keeps_its_fingerprint_beside_the_visgym_task():
    """The task is a knob of the recipe that leaves the default build alone: existing results
    (BUILD_INFO 35b3004615208e81, BUILD_VERSION 3) stay valid. Change the literal only with a
    deliberate rebuild of the default model."""
    from tiny_model import TASK_DIRS, fingerprint

    assert fingerprint(0) == fingerprint(0, task="ours") == "35b3004615208e81"
    assert fingerprint(0, task="visgym") != fingerprint(0)
    assert TASK_DIRS["visgym"] != TASK_DIRS["ours"]


def test_visgym_processor_gives_one_token_per_25px_cell():
    """A 225 px VisGym frame (9x9 cells of 25 px) becomes 288 px, 18x18 patches, 9x9 merged
    tokens; the default processor rounds it down to 224 px, 7x7 tokens for 81 cells."""
    import tasks.visgym_maze as visgym
    from tiny_model import build_image_processor

    maze = maze_task.generate_maze_visgym(9, 0)
    frame = visgym.render_visgym(maze, maze.start)
    assert frame.size == (225, 225)
    assert build_image_processor("visgym")(images=[frame], return_tensors="pt")["image_grid_thw"].tolist() == [[1, 18, 18]]
    assert build_image_processor("ours")(images=[frame], return_tensors="pt")["image_grid_thw"].tolist() == [[1, 14, 14]]


class _AlwaysVacate:
    """random.Random that always takes the first branch of a `random() < share` draw."""

    def __init__(self, seed):
        import random

        self.rng = random.Random(seed)

    def choice(self, seq):
        return self.rng.choice(seq)

    def random(self):
        return 0.0


def _token_blocks(pixel_values, n_tokens):
    """(n_tokens, 32, 32, 3) RGB in [0, 1] of each merged token, undoing the processor's
    normalisation and its patch order (merged token, then its 2x2 patches; channel, time, 16x16)."""
    patches = pixel_values.reshape(n_tokens, 2, 2, 3, 2, 16, 16)[:, :, :, :, 0] * 0.2 + 0.8
    return patches.permute(0, 1, 4, 2, 5, 3).reshape(n_tokens, 32, 32, 3)


def test_visgym_perception_targets_line_up_with_the_tokens():
    """Each 25 px cell of VisGym's drawing is one merged token after the processor's resize, and
    the targets of cell (r, c) sit at token r * 9 + c: what each token's pixels show (wall gray,
    path white, the red target, the blue agent) is what its targets say. With every goal vacated,
    the target shows VisGym's white hole inside its red border."""
    from tiny_model import PERCEPTION_TARGETS, build_image_processor, perception_batch

    from tasks.visgym_maze import VisGymMazeTask

    mazes = maze_task.eval_mazes("easy", 4, VisGymMazeTask)
    pixels, grid, targets = perception_batch(mazes, build_image_processor("visgym"), _AlwaysVacate(0), "visgym")
    assert grid.tolist() == [[1, 18, 18]] * len(mazes) and len(targets) == 81 * len(mazes)
    blocks = _token_blocks(pixels, len(targets))
    column = {name: targets[:, i] > 0.5 for i, name in enumerate(PERCEPTION_TARGETS)}
    for i, block in enumerate(blocks):
        centre = block[8:24, 8:24].reshape(-1, 3).mean(0)
        if column["agent"][i]:
            assert centre[2] - centre[0] > 0.3, (i, centre)  # mostly the blue disc
        elif column["goal"][i]:
            corner = block[:4, :4].reshape(-1, 3).mean(0)
            assert corner[0] > 0.9 and corner[1] < 0.1, (i, corner)  # red border
            assert block[12:20, 12:20].min() > 0.9, i  # the white hole where the agent stood
        elif column["wall"][i]:
            assert (centre - 169 / 255).abs().max() < 0.02, (i, centre)
        else:
            assert centre.min() > 0.98, (i, centre)


def test_visgym_build_is_saved_with_its_resize(tmp_path):
    """The saved directory is what rollouts load (AutoProcessor): 81 image tokens for a VisGym
    easy frame, and BUILD_INFO names the task."""
    import tasks.visgym_maze as visgym
    from tiny_model import build, fingerprint

    out = build(tmp_path / "visgym", seed=0, vision_steps=2, progress=False, task="visgym")
    info = json.loads((out / "BUILD_INFO.json").read_text())
    assert info["task"] == "visgym" and info["fingerprint"] == fingerprint(0, 2, task="visgym")
    assert set(info["vision_heldout_accuracy"]) == {"easy"}
    processor = AutoProcessor.from_pretrained(out)
    maze = maze_task.generate_maze_visgym(9, 1)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "go"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    batch = processor(text=[text], images=[visgym.render_visgym(maze, maze.start)], return_tensors="pt")
    assert (batch["input_ids"] == processor.image_token_id).sum().item() == 81
