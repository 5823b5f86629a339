"""Supervised warm start: teach the model the task from its solver's demonstrations.

    python sft.py --out runs/sft [--model <dir>] [--task maze] [--difficulty small] [--steps 250]

GRPO only sharpens what a policy already does sometimes: from a random model no puzzle is ever
solved, every group has zero variance and nothing is learned. So, as in the published recipe,
RL starts from a supervised checkpoint. The demonstrations are the task's solver's actions
(env.Task.solve: a task without one cannot be demonstrated), played through the same task,
rendered and tokenised exactly as `rollout.py` does it (same chat template, same images, same
last-k-images policy); only the replies are trained on.

By default a full fine-tuning of the language model (`--lora-rank 0`): the tiny model's language
model is randomly initialised, so there is little for a low-rank adapter to adapt (`--lora-rank N`
trains a rank-N LoRA instead and merges it into the weights written). The vision tower stays frozen
(`--freeze-vision 1`): it arrives able to see (the tiny model's build pretrains it on the task's
pictures, standing in for a real VLM's pretrained encoder), and behaviour cloning, whose signal
is one action per turn, only blurs what it has learned. For a real pretrained Qwen3-VL, LoRA SFT
(`--lora-rank 32`) is the usual choice. The output is an ordinary HF model directory that
`train.py --model` starts from; GRPO then trains a LoRA on top of it.

Demonstrations can be made noisy (DART, Laskey et al. 2017): with probability `--noise` the
demonstrator leaves the solver's way for a detour of 1 to `--max-detour` other legal actions, and
those turns are not trained on. The model then sees states off the way and learns the way back
from them. The main job uses clean demonstrations (`--noise 0`, the default): on 7x7 mazes they
gave the better warm start in each of three seeds (docs/experiments.md, 2026-12-01). Every trained
turn is then one of a shortest solution, so the decisions that matter get all of the signal.
"""

import argparse
import copy
import itertools
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

import env
import grpo
import policy
import rollout
import rundir
import storage
import tasks
from config import Config

ROOT = Path(__file__).resolve().parent


def demonstration(task, chat: rollout.ChatFormat, rng: random.Random, *, max_images: int | None, noise: float,
                  max_detour: int = 1) -> list:
    """Play one puzzle (a copy of `task`) with its solver's actions (plus noise); return its
    training sequences."""
    game = task.clone()
    obs = game.reset()
    episode = rollout.Episode(task=game, group_id=0, sample_id=0, turns=[
        chat.open_turn(game.first_text(obs), obs.image, game, text_only=bool(max_images))])
    trained = []  # per turn: is this reply a demonstration (True) or noise (False)?
    detour = 0  # actions off the solver's way still to play
    while not game.done:
        solution = game.solve()
        best = solution[0]
        # never a detour in place of the last action, which completes the puzzle
        if not detour and len(solution) > 1 and rng.random() < noise:
            detour = rng.randint(1, max_detour)  # this many other actions in a row, starting now
        others = [a for a in game.legal_actions() if a != best]
        noisy = bool(detour) and len(solution) > 1 and bool(others)
        if noisy:
            action = rng.choice(others)
            detour -= 1
        else:
            action, detour = best, 0
        turn = episode.turns[-1]
        turn.reply_ids = chat.reply_ids(game, action)
        turn.reply = chat.tokenizer.decode(turn.reply_ids, skip_special_tokens=True)
        turn.reply_logprobs = [rollout.NO_LOGPROB] * len(turn.reply_ids)  # demonstrated, never sampled
        trained.append(not noisy)
        obs = game.step(turn.reply)
        if not game.done:
            episode.turns.append(chat.open_turn(obs.text, obs.image, game, turn.reply_ids,
                                                text_only=bool(max_images)))
    return rollout.training_sequences(episode, chat, max_images, trained=[t for t, keep in enumerate(trained) if keep])


def demonstrations(chat: rollout.ChatFormat, n: int, *, max_turns: int, noise: float = 0.5,
                   difficulty: str = "small", task_class=None) -> list:
    """Full-history demonstrations of the first n training puzzles of a level (the solver's
    actions with detours, puzzle i played with rng seed i): the small fixed batch that checks and
    tests train on. The task: the maze unless given."""
    stream = env.TrainingStream(task_class or tasks.task_class("maze"), difficulty, max_turns)
    return [demonstration(stream.next(), chat, random.Random(i), max_images=None, noise=noise)[0] for i in range(n)]


def training_tasks(task_class, levels: list[str], max_turns: int, pool: int = 0):
    """Each level's training stream (never a held-out puzzle of that level), and an endless
    iterator that takes one puzzle from each stream in turn. `pool` > 0: each stream replays its
    first `pool` puzzles (env.TrainingStream)."""
    streams = [env.TrainingStream(task_class, level, max_turns, pool=pool) for level in levels]
    return streams, (streams[i % len(streams)].next() for i in itertools.count())


def make_optimizer(model, lr: float, vision_lr: float = 0.0) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; the vision tower's, if it is trained at all, at
    `vision_lr` (0: `lr`): it arrives pretrained and may need a gentler hand than the randomly
    initialised language model."""
    visual = policy.qwen3_vl_model(model).visual
    vision = {id(p) for p in visual.parameters()}
    groups = [{"params": [p for p in model.parameters() if p.requires_grad and id(p) not in vision]},
              {"params": [p for p in visual.parameters() if p.requires_grad], "lr": vision_lr or lr}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, weight_decay=0.01)


def action_hits(logits, inputs: dict, mask, answer_id: int) -> tuple[int, int]:
    """(right, total) over the action tokens, the ones right after `answer_id` (the last token of
    ChatFormat.action_prefix: `<answer>`): the rest of a reply is fixed syntax, learned in a few
    steps. logits and mask are aligned to targets input_ids[:, 1:]."""
    is_action = (mask > 0) & (inputs["input_ids"][:, :-1] == answer_id)
    right = (logits.argmax(-1) == inputs["input_ids"][:, 1:]) & is_action
    return int(right.sum()), int(is_action.sum())


@torch.no_grad()
def action_accuracy(model, processor, sequences: list, answer_id: int, shuffle_images: random.Random | None = None,
                    micro_batch_size: int = 8) -> float:
    """Teacher-forced accuracy on the action token (the one right after `answer_id`).

    With `shuffle_images`, every image is swapped for a random image from other sequences: a
    model that really reads the picture drops towards chance, one that only learned the text
    history's habits (e.g. "keep going the way you went") does not notice. The gap between the
    two is how much the policy uses its eyes.
    """
    if shuffle_images is not None:
        pool = [image for s in sequences for image in s.images]
        sequences = [rollout.Sequence(s.token_ids, s.response_mask, s.rollout_logprobs,
                                      [shuffle_images.choice(pool) for _ in s.images]) for s in sequences]
    batch = policy.Batch(sequences, processor, model)
    right = total = 0
    was_training = model.training
    model.eval()
    for start in range(0, len(sequences), micro_batch_size):
        idx = list(range(start, min(start + micro_batch_size, len(sequences))))
        inputs, mask, _ = batch.micro(idx, torch.device("cpu"))
        hits, n = action_hits(model(**inputs).logits[:, :-1], inputs, mask, answer_id)
        right, total = right + hits, total + n
    model.train(was_training)
    return right / max(total, 1)


def write_model(model, processor, base: str, final: Path, info: dict) -> None:
    """An ordinary HF model directory at `final` (with SFT_INFO.json), written to a temp dir beside
    it and renamed into place."""
    from transformers import GenerationConfig

    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        GenerationConfig.from_pretrained(base).save_pretrained(tmp)  # the base model's end-of-reply tokens
        (tmp / "SFT_INFO.json").write_text(json.dumps(info, indent=2))
        tmp.chmod(0o755)
        storage.publish_dir(tmp, final)
    finally:
        storage.remove_tmp(tmp)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="HF model dir or id; empty: the tiny model")
    parser.add_argument("--out", default="runs/sft", help="where the fine-tuned model is written")
    parser.add_argument("--task", default="maze", help="the task (train.py's --task): a name in tasks/ or module:Class")
    parser.add_argument("--difficulty", default="small", help="the task's level")
    parser.add_argument("--steps", type=int, default=250,
                        help="the main job's warm start: it stops in the 30-60%% band of held-out solve rate, so "
                             "that GRPO has room to show what it adds (3,000 steps reach ~92%%: docs/experiments.md)")
    parser.add_argument("--batch-size", type=int, default=4,
                        help="sequences per optimizer step (one per puzzle with full history, one per turn otherwise)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=30, help="linear warm-up steps, then cosine decay to 0")
    parser.add_argument("--also-train-on", default="",
                        help="comma-separated other levels whose training puzzles are mixed in, one puzzle in turn "
                             "from each stream: many more layouts than 7x7's 135 training mazes, against memorising")
    parser.add_argument("--train-pool", type=int, default=0,
                        help="0: new training puzzles throughout; N: the first N over and over (a set to overfit)")
    parser.add_argument("--noise", type=float, default=0.0,
                        help="chance, per turn on the solver's way, of starting a detour")
    parser.add_argument("--max-detour", type=int, default=3, help="longest detour, in actions off the way")
    parser.add_argument("--max-turns", type=int, default=15)
    parser.add_argument("--max-images", type=int, default=0, help="0: full image history (the walkthrough's format)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--save-every", type=int, default=0,
                        help="N > 0: also write the model every N steps to <out>/model_step_<N>, mid-schedule "
                             "snapshots for a solve-rate curve (a run stopped there would have decayed its lr)")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="0: train the whole language model; N: a rank-N LoRA on it (as train.py's GRPO "
                             "does), merged into the weights that are written")
    parser.add_argument("--freeze-vision", type=int, default=1,
                        help="1: keep the vision tower as it is (it arrives pretrained); 0: train it too")
    parser.add_argument("--vision-lr", type=float, default=0.0,
                        help="with --freeze-vision 0: the vision tower's learning rate (0: --lr)")
    args = parser.parse_args()

    from transformers import Qwen3VLForConditionalGeneration, get_scheduler

    try:
        task_class = tasks.task_class(args.task)
        levels = [args.difficulty, *filter(None, args.also_train_on.split(","))]
        streams, puzzles = training_tasks(task_class, levels, args.max_turns, pool=args.train_pool)
    except ValueError as e:
        raise SystemExit(f"sft.py: {e}")
    if not env.features(task_class)["solver"]:
        raise SystemExit(f"sft.py: the task {args.task} has no solver (env.Task.solve) to demonstrate it")
    model_path = policy.resolve_model(args.model, collective=False)
    out = Path(args.out)
    rundir.check_writable(out)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    chat = rollout.ChatFormat.for_model(model_path)
    processor = chat.processor
    answer_id = chat.action_prefix(streams[0].first(1)[0])[-1]  # the token an action follows
    model = Qwen3VLForConditionalGeneration.from_pretrained(model_path, dtype=torch.float32)
    model.train()
    model.model.visual.requires_grad_(not args.freeze_vision)
    if args.lora_rank:  # only the adapter learns: what GRPO's LoRA can take in per step, with SFT's signal
        model = policy.add_lora(Config(lora_rank=args.lora_rank, lora_alpha=2 * args.lora_rank, seed=args.seed), model)
    optimizer = make_optimizer(model, args.lr, args.vision_lr)
    # linear warm-up, then a cosine decay to zero at the last step
    schedule = get_scheduler("cosine", optimizer, num_warmup_steps=args.warmup, num_training_steps=args.steps)

    pool, log, t_start, puzzles_seen = [], [], time.time(), 0
    bar = tqdm(range(args.steps), desc="sft", unit="step")
    for step in bar:
        while len(pool) < args.batch_size:
            pool += demonstration(next(puzzles), chat, rng, max_images=args.max_images or None, noise=args.noise,
                                  max_detour=args.max_detour)
            puzzles_seen += 1
        rng.shuffle(pool)
        sequences, pool = pool[:args.batch_size], pool[args.batch_size:]
        batch = policy.Batch(sequences, processor, model)  # a frozen vision tower encodes each image once
        inputs, mask, _ = batch.micro(list(range(len(sequences))), torch.device("cpu"))
        logits = model(**inputs).logits[:, :-1]
        logprobs = grpo.token_logprobs(logits, inputs["input_ids"][:, 1:])
        loss = -grpo.masked_mean(logprobs, mask)  # cross-entropy on reply tokens only
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            hits, n = action_hits(logits, inputs, mask, answer_id)
        log.append({"step": step + 1, "loss": loss.item(), "action_accuracy": hits / max(n, 1)})
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            recent = log[-args.log_every:]
            acc = sum(r["action_accuracy"] for r in recent) / len(recent)
            bar.set_postfix(loss=f"{recent[-1]['loss']:.3f}", acc=f"{acc:.2f}")
            with open(out / "sft_metrics.jsonl", "a") as f:
                f.write(json.dumps({**log[-1], "action_accuracy_avg": acc, "wall_s": time.time() - t_start,
                                    "puzzles_seen": puzzles_seen}) + "\n")
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            # a merged copy: merging in place would fold the LoRA into the weights still training
            snapshot = copy.deepcopy(model).merge_and_unload() if args.lora_rank else model
            write_model(snapshot, processor, model_path, out / f"model_step_{step + 1}",
                        {**vars(args), "base": model_path, "snapshot_step": step + 1, "wall_s": time.time() - t_start})

    # Does the policy read the image? Demonstrations on the held-out puzzles (evaluated on, never
    # trained on), with their real images and with shuffled ones.
    held_out = []
    for task in env.held_out(task_class, args.difficulty, 32, args.max_turns):
        held_out += demonstration(task, chat, rng, max_images=args.max_images or None, noise=args.noise,
                                  max_detour=args.max_detour)
    check = {"heldout_action_accuracy": action_accuracy(model, processor, held_out, answer_id),
             "heldout_action_accuracy_shuffled_images": action_accuracy(model, processor, held_out, answer_id,
                                                                        shuffle_images=random.Random(0))}
    print("held-out action accuracy: {heldout_action_accuracy:.3f} with the real images, "
          "{heldout_action_accuracy_shuffled_images:.3f} with shuffled ones".format(**check))
    with open(out / "sft_metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": args.steps, **check}) + "\n")

    # an ordinary HF model directory, written to a temp dir and renamed into place
    if args.lora_rank:
        model = model.merge_and_unload()
    final = out / "model"
    write_model(model, processor, model_path, final, {**vars(args), "base": model_path,
                                                      "final_action_accuracy_avg": acc, **check})
    print(f"SFT model written to {final} ({time.time() - t_start:.0f}s)")


if __name__ == "__main__":
    sys.exit(main())
