"""Build a tiny Qwen3-VL as an ordinary Hugging Face model directory: a randomly initialised
language model and a vision tower pretrained for a minute or two to see maze cells.

No hub access is needed: the tokenizer is a byte-level BPE trained here with the `tokenizers`
library on a small built-in corpus (the maze prompts plus some plain English), with Qwen's special
tokens added. The result loads with `Qwen3VLForConditionalGeneration.from_pretrained`,
`AutoProcessor.from_pretrained` and `vllm.LLM`, exactly like a real Qwen3-VL-8B directory, so the
trainer, the rollout engine and the server take the same code path for both.

    python tiny_model.py --out .cache/tiny-qwen3-vl [--seed 0] [--force]
    python tiny_model.py --task visgym     # the build for VisGym's maze_2d/easy: .cache/tiny-qwen3-vl-visgym
    python tiny_model.py --task sokoban    # the build for tasks/sokoban.py: .cache/tiny-qwen3-vl-sokoban

Deterministic from the seed. The directory holds a `BUILD_INFO.json` fingerprint; an existing
directory with the same fingerprint is reused, and the build is written to a temporary directory
and renamed into place so a killed build never leaves a half-written model behind.
"""

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent

DEFAULT_DIR = ROOT / ".cache" / "tiny-qwen3-vl"
BUILD_VERSION = 3  # bump when the architecture, processor, tokenizer or vision pretraining recipe changes
VISION_STEPS = 800  # perception pretraining of the vision tower (see pretrain_vision)
TEXT_LAYERS = 2  # language-model depth; deeper ones generalise better to unseen layouts, at a cost (docs/experiments.md)

# What the eyes are built for. "ours": our 32 px drawings of every size, one cell per merged token
# as drawn. "visgym": VisGym's maze_2d/easy, 9x9 mazes of 25 px cells (225 px frames). Its
# processor's minimum pixel count makes smart_resize upscale 225 px to 288 px (not round it down
# to 224 px = 7x7 tokens for 81 cells), so a 25 px cell becomes 32 px, exactly one merged token,
# and the tower is pretrained on VisGym's drawings of VisGym's mazes at that resize. Only 9x9
# lines up: 7x7 (175 px) and 11x11 (275 px) frames also become 288 px, 41 and 26 px a cell.
# "sokoban": tasks/sokoban.py's 6x6 rooms of 32 px cells, as drawn.
TASKS = ("ours", "visgym", "sokoban")
TASK_DIRS = {"ours": DEFAULT_DIR, "visgym": ROOT / ".cache" / "tiny-qwen3-vl-visgym",
             "sokoban": ROOT / ".cache" / "tiny-qwen3-vl-sokoban"}
MIN_PIXELS = {"ours": 64 * 64, "visgym": 288 * 288, "sokoban": 64 * 64}
MAX_PIXELS = 512 * 512
# A share of the VisGym pictures with the agent off the goal shows the white hole VisGym's canvas
# leaves in the target once the agent has stood there (tasks/visgym_maze.py's render_visgym, `vacated`), so the
# goal is known by its red border, not only by a full red square.
VACATED_GOAL_SHARE = 0.25
# Everything of the "visgym" recipe that the code's constants do not already fingerprint; a
# version to bump when it changes (the default build's BUILD_VERSION does not move for it).
VISGYM_RECIPE = {"task": "visgym", "version": 1, "min_pixels": MIN_PIXELS["visgym"], "difficulty": "easy",
                 "vacated_goal_share": VACATED_GOAL_SHARE}
SOKOBAN_RECIPE = {"task": "sokoban", "version": 1, "min_pixels": MIN_PIXELS["sokoban"], "level": "6x6"}

# Qwen's special tokens. The vision ones are what the Qwen3-VL processor and vLLM look for.
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]

# A Qwen-style chat template of our own. Images become <|vision_start|><|image_pad|><|vision_end|>;
# the processor expands the single <|image_pad|> into one token per merged 32x32 patch.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

GENERIC_TEXT = """\
You are a helpful assistant. Look at the image and answer the question.
The quick brown fox jumps over the lazy dog. A maze is a path or collection of paths from an
entrance to a goal. The agent moves one cell at a time: right, up, left or down. Walls block the
way; open cells are white. When you reach the target, stop. Think step by step, then answer.
This is step one. This is step two. Moved right. Moved up. Moved left. Moved down. Invalid action.
Cannot move into a wall. Reached the target. Stopped off the target. The episode is over.
"""


def training_corpus() -> list[str]:
    """Text the tokenizer is trained on: the maze prompts (so they cost few tokens) + plain English."""
    import tasks.maze

    texts = [GENERIC_TEXT, tasks.maze.INSTRUCTIONS]
    texts += [tasks.maze.observation_text(step, fb) for step in range(16)
              for fb in (None, "Moved right.", "Cannot move into a wall.")]
    for size in tasks.maze.DIFFICULTY_SIZES.values():
        maze = tasks.maze.generate_maze(size, seed=0)
        game = tasks.maze.MazeTask.of(maze, max_turns=100)
        texts.append(game.reset().text)
        for action in tasks.maze.solve(maze) + ["garbage", "('move', 9)"]:
            if not game.done:
                texts.append(game.step(f"<answer>{action}</answer>").text)
    return texts * 4


def fingerprint(seed: int, vision_steps: int = VISION_STEPS, text_layers: int = TEXT_LAYERS, task: str = "ours") -> str:
    import tasks.maze

    _check_task(task)
    recipe = [BUILD_VERSION, vision_steps, seed, training_corpus(), tasks.maze.ACTION_STRINGS, CHAT_TEMPLATE,
              tasks.maze.CELL_PX_TINY, tasks.maze.WALL_RGB, tasks.maze.PATH_RGB, tasks.maze.GOAL_RGB, tasks.maze.AGENT_RGB]
    if text_layers != TEXT_LAYERS:  # (so the default build's fingerprint did not change when depth became a knob)
        recipe.append({"text_layers": text_layers})
    if task == "visgym":  # (likewise for the task: the default build keeps its fingerprint)
        recipe.append({**VISGYM_RECIPE, "cell_px": tasks.maze.CELL_PX_VISGYM})
    if task == "sokoban":
        import tasks.sokoban

        recipe.append({**SOKOBAN_RECIPE, "cell_px": tasks.sokoban.CELL_PX, "colours": [
            tasks.sokoban.WALL_RGB, tasks.sokoban.FLOOR_RGB, tasks.sokoban.TARGET_RGB, tasks.sokoban.BOX_RGB,
            tasks.sokoban.PLAYER_RGB], "box_inset": tasks.sokoban.BOX_INSET})
    recipe = json.dumps(recipe)
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


def build_tokenizer(vocab_size: int):
    """Byte-level BPE + Qwen special tokens + one token per maze action string."""
    import tasks.maze
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    # The answer tags and the five actions get their own (non-special) tokens, so a whole answer
    # `<answer>('move', 0)</answer>` is three tokens and decodes back to the exact text.
    tok.add_tokens(["<think>", "</think>", "<answer>", "</answer>", *tasks.maze.ACTION_STRINGS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        bos_token=None, unk_token=None, model_max_length=32768, chat_template=CHAT_TEMPLATE,
    )


# ----------------------------------------------------------------------------- the eyes
#
# Qwen3-VL-8B arrives with a vision encoder pretrained on a huge number of images; a random one
# arrives blind. Behaviour cloning alone does not fix that: to choose a move, the policy must
# read the cells *next to* the agent, a relational pattern (find the blue circle, then look one
# cell to its right) that a sparse "which move" signal did not teach in thousands of SFT steps
# (the held-out accuracy was the same with shuffled images). So the stand-in gets a stand-in
# pretraining: the vision tower alone, with a throwaway linear head, learns what each cell of a
# maze picture shows. Dense targets (7 per cell, ~50-120 cells per image) teach the relation in a
# few hundred steps. The targets describe the picture only (no solver, nothing about which way to
# go), and the mazes come from the training streams, never an evaluation layout.

PERCEPTION_TARGETS = ["wall", "agent", "goal", "right open", "up open", "left open", "down open"]
# Sokoban's pictures: what each cell holds, and which of the player's neighbours are wall
SOKOBAN_TARGETS = ["wall", "agent", "box", "target", "right open", "up open", "left open", "down open"]


def targets_of(task: str) -> list[str]:
    return SOKOBAN_TARGETS if task == "sokoban" else PERCEPTION_TARGETS


def _check_task(task: str) -> str:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {list(TASKS)}")
    return task


def cell_targets(maze, agent):
    """(size * size, 7) float tensor of PERCEPTION_TARGETS for each cell, row-major."""
    import torch

    import tasks.maze

    rows = []
    for r in range(maze.size):
        for c in range(maze.size):
            neighbours_open = [maze.is_open((r + dr, c + dc)) for dr, dc in tasks.maze.MOVE_DELTAS.values()]
            rows.append([not maze.is_open((r, c)), (r, c) == tuple(agent), (r, c) == maze.goal, *neighbours_open])
    return torch.tensor(rows, dtype=torch.float32)


def sokoban_batch(puzzles, image_processor, rng):
    """Pixels, grid sizes and per-cell SOKOBAN_TARGETS for Sokoban `puzzles` (tasks.sokoban.SokobanTask),
    the player and the box each on a random floor cell (the box on the target too, now and then)."""
    import torch

    import tasks.sokoban

    images, targets = [], []
    for puzzle in puzzles:
        game = puzzle.clone()
        floor = [(r, c) for r in range(tasks.sokoban.SIZE) for c in range(tasks.sokoban.SIZE)
                 if (r, c) not in game.walls]
        game.player, game.box = rng.sample(floor, 2)
        images.append(game.render())
        for r in range(tasks.sokoban.SIZE):
            for c in range(tasks.sokoban.SIZE):
                open_around = [(r + dr, c + dc) not in game.walls for dr, dc in tasks.sokoban.MOVES.values()]
                targets.append([(r, c) in game.walls, (r, c) == game.player, (r, c) == game.box,
                                (r, c) == game.target, *open_around])
    pixels = image_processor(images=images, return_tensors="pt")
    return pixels["pixel_values"], pixels["image_grid_thw"], torch.tensor(targets, dtype=torch.float32)


def perception_batch(mazes, image_processor, rng, task: str = "ours"):
    """Pixels, grid sizes and per-cell targets for `mazes`, the agent on a random open cell of each.

    The merged visual tokens come out row-major, one per 32x32 cell (task "visgym": one per 25 px
    cell, upscaled to 32 px by the processor), so token i is cell (i // size, i % size) and the
    targets line up with them by simple concatenation."""
    import torch

    import tasks.maze
    import tasks.visgym_maze

    if _check_task(task) == "sokoban":
        return sokoban_batch(mazes, image_processor, rng)
    visgym_drawing = task == "visgym"
    images, targets = [], []
    for maze in mazes:
        agent = rng.choice([(r, c) for r in range(maze.size) for c in range(maze.size) if maze.is_open((r, c))])
        if visgym_drawing:
            vacated = [maze.goal] if agent != maze.goal and rng.random() < VACATED_GOAL_SHARE else []
            images.append(tasks.visgym_maze.render_visgym(maze, agent, vacated=vacated))
        else:
            images.append(tasks.maze.render(maze, agent))
        targets.append(cell_targets(maze, agent))
    pixels = image_processor(images=images, return_tensors="pt")
    return pixels["pixel_values"], pixels["image_grid_thw"], torch.cat(targets)


def heldout_accuracy(visual, head, image_processor, rng, task: str = "ours", n: int = 32) -> dict:
    """Per difficulty, the share of PERCEPTION_TARGETS read right on `n` evaluation mazes (the
    agent on a random open cell), and on the agent's four neighbours alone."""
    import torch

    import env
    import tasks.maze
    import tasks.sokoban
    import tasks.visgym_maze

    task_class, difficulties = {"visgym": (tasks.visgym_maze.VisGymMazeTask, ("easy",)),
                                "sokoban": (tasks.sokoban.SokobanTask, ("6x6",))}.get(
        _check_task(task), (tasks.maze.MazeTask, ("small", "easy", "hard")))
    names = targets_of(task)
    was_training = visual.training
    visual.eval()
    accuracy = {}
    with torch.no_grad():
        for difficulty in difficulties:
            held_out = env.held_out(task_class, difficulty, n)
            pixels, grid, targets = perception_batch(held_out if task == "sokoban" else [t.maze for t in held_out],
                                                     image_processor, rng, task)
            right = (head(visual(pixels, grid_thw=grid).pooler_output) > 0) == (targets > 0.5)
            at_agent = targets[:, names.index("agent")] > 0.5
            accuracy[difficulty] = {**dict(zip(names, right.float().mean(0).tolist())),
                                    "agent's neighbours": right[at_agent, -4:].float().mean().item()}
    visual.train(was_training)
    return accuracy


def pretrain_vision(visual, image_processor, *, steps: int = VISION_STEPS, batch_size: int = 16,
                    lr: float = 2e-3, warmup: int = 50, seed: int = 0, progress: bool = True,
                    task: str = "ours", curve_every: int = 0, curve: list | None = None) -> dict:
    """Train `visual` (the model's vision tower) in place to see the task's cells; return held-out accuracy.

    Task "ours": each batch mixes the 7x7, 9x9 and 11x11 sizes so one tower serves all of them.
    Task "visgym": VisGym's 9x9 mazes (its training stream, never an evaluation layout) in its
    drawing. Task "sokoban": tasks/sokoban.py's training puzzles, the player and the box placed at
    random. Warm-up, clipping and a cosine decay to zero: at a constant 3e-3 the loss spiked now
    and then and undid what was learned.

    `curve_every` N > 0 appends the held-out accuracy after every N steps to `curve` (measured
    with an RNG of its own, so the training and the final numbers are the same either way)."""
    import math
    import random

    import torch
    from tqdm import tqdm

    import env
    import tasks.maze
    import tasks.sokoban
    import tasks.visgym_maze

    rng = random.Random(seed)
    head = torch.nn.Linear(visual.config.out_hidden_size, len(targets_of(task)))
    params = [*visual.parameters(), *head.parameters()]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup)
                                                 * 0.5 * (1 + math.cos(math.pi * s / steps)))
    if _check_task(task) == "visgym":
        streams = [env.TrainingStream(tasks.visgym_maze.VisGymMazeTask, "easy")]
    elif task == "sokoban":
        streams = [env.TrainingStream(tasks.sokoban.SokobanTask, "6x6")]
    else:
        streams = [env.TrainingStream(tasks.maze.MazeTask, d) for d in ("small", "easy", "hard")]
    curve_rng = random.Random(seed + 1)
    visual.train()
    bar = tqdm(range(steps), desc="vision pretraining", unit="step", disable=not progress)
    for step in bar:
        drawn = [streams[i % len(streams)].next() for i in range(batch_size)]
        mazes = drawn if task == "sokoban" else [t.maze for t in drawn]
        pixels, grid, targets = perception_batch(mazes, image_processor, rng, task)
        logits = head(visual(pixels, grid_thw=grid).pooler_output)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if curve_every and (step + 1) % curve_every == 0 and step + 1 < steps:
            curve.append({"step": step + 1, "loss": loss.item(),
                          "heldout": heldout_accuracy(visual, head, image_processor, curve_rng, task)})
    # Held out: the evaluation mazes themselves, seen here for the first time. What a policy needs
    # most is the agent's own cell: which of its four neighbours are open.
    accuracy = heldout_accuracy(visual, head, image_processor, rng, task)
    if curve_every:
        curve.append({"step": steps, "loss": loss.item(), "heldout": accuracy})
    return accuracy


def build_image_processor(task: str = "ours"):
    """The tiny model's image processor for `task`, as `build` saves it."""
    from transformers import Qwen2VLImageProcessor

    # Pixel budget: enough for an 11x11 maze at 32 px (352x352) without resizing, small minimum so
    # a 5x5 maze (160x160) is not upscaled. 16 px patches merged 2x2 -> one token per 32x32 cell.
    # Task "visgym" raises the minimum so a 225 px frame is upscaled to 288 px (TASKS' comment).
    #
    # Pixel normalisation: centred between the maze's two main colours, white path (1.0) and gray
    # wall (0.66). With Qwen's usual mean 0.5 both are positive multiples of (1, 1, 1), so a
    # uniform path patch and a uniform wall patch embed to parallel vectors (the patch embedding is
    # linear, its bias starts at 0) and the vision tower's LayerNorms make them identical: a
    # random-init model then literally cannot see the walls (cosine 0.99 between wall and path
    # tokens), and SFT learns to ignore the image. Centred at 0.8 they point opposite ways.
    return Qwen2VLImageProcessor(
        patch_size=16, merge_size=2, temporal_patch_size=2,
        min_pixels=MIN_PIXELS[_check_task(task)], max_pixels=MAX_PIXELS,
        image_mean=[0.8, 0.8, 0.8], image_std=[0.2, 0.2, 0.2],
    )


def build(out_dir: Path, seed: int = 0, vocab_size: int = 1024, vision_steps: int = VISION_STEPS,
          text_layers: int = TEXT_LAYERS, progress: bool = True, task: str = "ours", curve_every: int = 0) -> Path:
    import torch
    from transformers import GenerationConfig, Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tokenizer = build_tokenizer(vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    image_processor = build_image_processor(task)
    video_processor = Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2)
    processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                 video_processor=video_processor, chat_template=CHAT_TEMPLATE)

    # Shapes follow Qwen3-VL-8B's config, scaled down; the vocabulary is padded to a multiple of 64
    # (like the real model's, it is larger than the tokenizer). head_dim 32 because vLLM's CPU paged
    # attention rejects 16; mrope_section must sum to head_dim / 2 (t, h, w rotary frequencies).
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=128, intermediate_size=256,
            num_hidden_layers=TEXT_LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=8192, rms_norm_eps=1e-6, hidden_act="silu",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [8, 4, 4], "mrope_interleaved": True},
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
            patch_size=16, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
            num_position_embeddings=576, deepstack_visual_indexes=[1],
            hidden_act="gelu_pytorch_tanh",
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).to(torch.float32)
    curve = []
    vision_accuracy = pretrain_vision(model.model.visual, image_processor, steps=vision_steps, seed=seed,
                                      progress=progress, task=task, curve_every=curve_every, curve=curve)
    if text_layers != TEXT_LAYERS:
        # Another language-model depth behind the very same eyes: the vision tower just trained is
        # the default depth's bit for bit (of the same task), so a depth comparison changes one thing only.
        config.text_config.num_hidden_layers = text_layers
        torch.manual_seed(seed + 1)
        other = Qwen3VLForConditionalGeneration(config).to(torch.float32)
        other.model.visual.load_state_dict(model.model.visual.state_dict())
        model = other
    model.generation_config = GenerationConfig(
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"],
        do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
    )

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        processor.save_pretrained(tmp)
        n_params = sum(p.numel() for p in model.parameters())
        info = {"fingerprint": fingerprint(seed, vision_steps, text_layers, task), "seed": seed,
                "parameters": n_params, "text_layers": text_layers,
                "vision_steps": vision_steps, "vision_heldout_accuracy": vision_accuracy}
        if task != "ours":  # (the default build's record keeps its exact form)
            info = {**info, "task": task, "min_pixels": MIN_PIXELS[task]}
        if curve:
            info["vision_heldout_curve"] = curve
        (tmp / "BUILD_INFO.json").write_text(json.dumps(info, indent=2))
        tmp.chmod(0o755)  # mkdtemp makes it private; the model is meant to be shared
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def ensure_tiny_model(out_dir: Path | None = None, seed: int = 0, force: bool = False,
                      text_layers: int = TEXT_LAYERS, task: str = "ours") -> Path:
    """Return the tiny model directory (by default the task's own, TASK_DIRS), building it only if
    missing or built from another recipe (another task is another recipe)."""
    out_dir = Path(out_dir or TASK_DIRS[_check_task(task)])
    info = out_dir / "BUILD_INFO.json"
    if not force and info.exists():
        if json.loads(info.read_text()).get("fingerprint") == fingerprint(seed, text_layers=text_layers, task=task):
            return out_dir
    return build(out_dir, seed=seed, text_layers=text_layers, task=task)


def random_lora(model_dir, out_dir, *, rank: int = 8, seed: int = 0, b_std: float = 0.5):
    """The HF model with a PEFT LoRA as train.py attaches it, saved to `out_dir` for vLLM/serving.

    LoRA B is drawn at random too (PEFT starts it at zero, i.e. no change), so the adapter really
    changes the model. Returns the PEFT model in eval mode. For tests and benchmarks.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3VLForConditionalGeneration

    import vllm_engine

    model = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=vllm_engine.LORA_TARGET_REGEX))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, b_std)
    model.save_pretrained(str(out_dir))
    return model.eval()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="default: the task's own directory "
                        f"({', '.join(f'{t}: {d.relative_to(ROOT)}' for t, d in TASK_DIRS.items())})")
    parser.add_argument("--task", default="ours", choices=list(TASKS),
                        help="what the eyes are built for: ours (32 px cells, every size), visgym (VisGym's easy) "
                             "or sokoban (tasks/sokoban.py)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild even if an identical build exists")
    parser.add_argument("--text-layers", type=int, default=TEXT_LAYERS, help="language-model depth")
    parser.add_argument("--curve-every", type=int, default=0,
                        help="N > 0: (re)build, recording the vision tower's held-out accuracy every N steps in "
                             "BUILD_INFO.json (vision_heldout_curve); the weights are the same as without it")
    args = parser.parse_args()
    if args.text_layers < 1:
        parser.error("--text-layers must be at least 1")
    if args.curve_every > 0:
        path = build(args.out or TASK_DIRS[args.task], seed=args.seed, text_layers=args.text_layers, task=args.task,
                     curve_every=args.curve_every)
    else:
        path = ensure_tiny_model(args.out, seed=args.seed, force=args.force, text_layers=args.text_layers,
                                 task=args.task)
    info = json.loads((path / "BUILD_INFO.json").read_text())
    print(f"tiny Qwen3-VL at {path} ({info['parameters']:,} parameters, fingerprint {info['fingerprint']})")


if __name__ == "__main__":
    main()
