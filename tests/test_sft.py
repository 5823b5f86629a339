"""The SFT data path: demonstrations in the rollout's exact format, replies the only targets."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoProcessor, GenerationConfig

import env
import rollout
import sft
from conftest import masked_segments
from tasks.maze import ACTION_STRINGS, MazeTask, eval_mazes, generate_maze, render, solve

ROOT = Path(__file__).resolve().parent.parent


def _setup(tiny_model):
    processor = AutoProcessor.from_pretrained(tiny_model)
    eos = GenerationConfig.from_pretrained(tiny_model).eos_token_id
    chat = rollout.ChatFormat(processor, eos)
    replies = {a: chat._ids(f"<answer>{a}</answer>") + [eos[0]] for a in ACTION_STRINGS}
    return processor, chat, replies


def test_demonstrations_train_only_on_replies(tiny_model):
    processor, chat, replies = _setup(tiny_model)
    maze = generate_maze(7, seed=1_000_123)
    plan = solve(maze)
    seqs = sft.demonstration(MazeTask.of(maze, max_turns=30), chat, random.Random(0), max_images=1, noise=0.0)
    assert len(seqs) == len(plan)  # one sequence per turn with the last-image policy
    for seq, action in zip(seqs, plan):
        assert masked_segments(seq) == [replies[action]]  # exactly the reply, nothing else
        assert processor.tokenizer.decode(replies[action], skip_special_tokens=True) == f"<answer>{action}</answer>"
        assert len(seq.images) == 1
        assert seq.token_ids.count(processor.image_token_id) == chat.image_tokens(seq.images[0])

    full = sft.demonstration(MazeTask.of(maze, max_turns=30), chat, random.Random(0), max_images=None, noise=0.0)
    assert len(full) == 1 and len(full[0].images) == len(plan)  # full history: one sequence
    assert masked_segments(full[0]) == [replies[a] for a in plan]


def test_noisy_turns_are_context_not_targets(tiny_model):
    _, chat, replies = _setup(tiny_model)
    maze = generate_maze(7, seed=1_000_456)
    seqs = sft.demonstration(MazeTask.of(maze, max_turns=15), chat, random.Random(3), max_images=1, noise=0.5)
    # every trained reply is the BFS move from the state its image shows
    for seq in seqs:
        (target,) = masked_segments(seq)
        action = next(a for a, ids in replies.items() if ids == target)
        agent = next((r, c) for r in range(maze.size) for c in range(maze.size)
                     if render(maze, (r, c)).tobytes() == seq.images[0].tobytes())
        assert action == solve(maze, start=agent)[0]


def test_detours_leave_the_path_for_several_moves(tiny_model):
    _, chat, replies = _setup(tiny_model)
    answer_id = chat._ids("<answer>")[0]
    longest = 0
    for seed in range(5):
        maze = generate_maze(7, seed=1_000_100 + seed)
        (seq,) = sft.demonstration(MazeTask.of(maze, max_turns=15), chat, random.Random(seed), max_images=None,
                                   noise=0.5, max_detour=3)
        # one entry per reply: was it trained on? (the token after <answer> is the action)
        trained = [seq.response_mask[i + 1] for i, t in enumerate(seq.token_ids) if t == answer_id]
        run = 0
        for keep in trained:
            run = 0 if keep else run + 1
            longest = max(longest, run)
        assert any(trained) and not all(trained)
    assert longest >= 2  # detours of several wrong moves in a row, not single random moves


@pytest.mark.slow
def test_sft_then_grpo_smoke_in_the_visgym_style(tmp_path, tiny_model):
    """A few SFT steps write an ordinary HF model that train.py starts GRPO from; the whole
    pipeline in the VisGym-compatible style (its mazes, 25 px drawing, texts and parser). The SFT
    goes through a LoRA (--lora-rank), merged on the way out: the projections moved, the
    embeddings and the vision tower are the base's, bit for bit. --save-every writes a merged
    mid-run snapshot beside it."""
    from safetensors.torch import load_file

    sft_out = tmp_path / "sft"
    proc = subprocess.run([sys.executable, "sft.py", "--out", str(sft_out), "--steps", "3", "--batch-size", "8",
                           "--log-every", "1", "--task", "visgym-maze", "--difficulty", "easy", "--lora-rank", "4",
                           "--warmup", "0", "--lr", "1e-2", "--save-every", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (sft_out / "model" / "config.json").exists() and (sft_out / "model" / "chat_template.jinja").exists()
    assert not list((sft_out / "model").glob("adapter_*"))  # merged, not an adapter directory
    base = load_file(str(tiny_model / "model.safetensors"))
    tuned = load_file(str(sft_out / "model" / "model.safetensors"))
    moved = {k for k in base if not (base[k] == tuned[k]).all()}
    assert set(base) == set(tuned) and moved
    assert all(k.endswith("_proj.weight") and "language_model" in k for k in moved)
    snapshot = sft_out / "model_step_2"
    assert json.loads((snapshot / "SFT_INFO.json").read_text())["snapshot_step"] == 2
    assert not list(snapshot.glob("adapter_*")) and not (sft_out / "model_step_3").exists()
    earlier = load_file(str(snapshot / "model.safetensors"))
    assert set(earlier) == set(base) and {k for k in base if not (base[k] == earlier[k]).all()} <= moved
    assert any(not (earlier[k] == tuned[k]).all() for k in moved)  # step 3 moved on from it
    lines = [json.loads(line) for line in (sft_out / "sft_metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 3]  # one per step, then the image-reliance check
    assert 0 <= lines[-1]["heldout_action_accuracy"] <= 1
    assert 0 <= lines[-1]["heldout_action_accuracy_shuffled_images"] <= 1
    run = tmp_path / "grpo"
    proc = subprocess.run([sys.executable, "train.py", "--model", str(sft_out / "model"), "--out-dir", str(run),
                           "--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--max-turns", "3",
                           "--max-new-tokens", "6", "--eval-puzzles", "4", "--sampled-eval-samples", "0", "--max-images", "1",
                           "--task", "visgym-maze", "--difficulty", "easy", "--progress", "false"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((run / "eval" / "step_1.json").read_text())
    assert result["task"] == "visgym-maze" and (run / "adapters" / "step_1").exists()
    # the mazes played are VisGym's own for seeds 0..3
    assert [m["seed"] for m in result["puzzles"]] == [0, 1, 2, 3]
    assert json.loads((run / "config.json").read_text())["task"] == "visgym-maze"


def test_action_hits_count_one_action_token_per_trained_reply(tiny_model):
    import torch

    from policy import Batch

    processor, chat, replies = _setup(tiny_model)
    maze = generate_maze(7, seed=1_000_789)
    (seq,) = sft.demonstration(MazeTask.of(maze, max_turns=15), chat, random.Random(1), max_images=None, noise=0.3)
    inputs, mask, _ = Batch([seq], processor).micro([0], torch.device("cpu"))
    targets = inputs["input_ids"][:, 1:]
    answer_id = chat._ids("<answer>")[0]
    perfect = torch.nn.functional.one_hot(targets, num_classes=int(targets.max()) + 1).float()
    hits, total = sft.action_hits(perfect, inputs, mask, answer_id)
    assert total == len(masked_segments(seq)) > 0 and hits == total  # one action per trained reply
    wrong = perfect.roll(1, dims=-1)  # every argmax shifted to another token
    assert sft.action_hits(wrong, inputs, mask, answer_id) == (0, total)


def test_mixed_sizes_take_turns_and_skip_evaluation_layouts():
    streams, puzzles = sft.training_tasks(MazeTask, ["small", "easy"], 15)
    drawn = [next(puzzles).maze for _ in range(40)]
    assert [m.size for m in drawn] == [7, 9] * 20
    for size, difficulty in ((7, "small"), (9, "easy")):
        eval_keys = {m.layout_key() for m in eval_mazes(difficulty, 64)}
        assert not any(m.layout_key() in eval_keys for m in drawn if m.size == size)
    assert [s.position for s in streams] >= [20, 20]  # skipped seeds are counted too


def test_the_vision_tower_is_frozen_or_trained_at_its_own_rate(tiny_model):
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(str(tiny_model), dtype=torch.float32)
    vision = {id(p) for p in model.model.visual.parameters()}
    model.model.visual.requires_grad_(False)  # --freeze-vision 1: not in the optimizer at all
    [group] = sft.make_optimizer(model, 2e-3, 2e-4).param_groups
    assert group["lr"] == 2e-3 and not vision & {id(p) for p in group["params"]}
    model.model.visual.requires_grad_(True)
    language, visual = sft.make_optimizer(model, 2e-3, 2e-4).param_groups
    assert (language["lr"], visual["lr"]) == (2e-3, 2e-4)
    assert {id(p) for p in visual["params"]} == vision and not vision & {id(p) for p in language["params"]}
    assert len(language["params"]) + len(visual["params"]) == len(list(model.parameters()))
    assert sft.make_optimizer(model, 2e-3).param_groups[1]["lr"] == 2e-3  # 0: the same rate as the rest

