"""Greedy evaluation of held-out puzzles, through the chat API.

    result = evaluate_published(cfg, engine, chat, lora_request, tail, model, step, out, shared, run, base)
    serve.py eval: play_chat_episodes(tasks, http_replies, ...) -> eval_rows -> eval_result

Evaluation speaks the chat API: OpenAI-style messages with images as data URLs, replies as text.
The trainer's eval sends them to its in-process engine (`LLM.chat`); `serve.py`'s eval client
sends the very same messages to the HTTP server. One code path, so the numbers agree.
"""

import base64
import io
from pathlib import Path

import torch.distributed as dist
from tqdm import tqdm

import average
import distributed
import env
import policy
import rollout
import rundir
import vllm_engine
from distributed import log0


# ----------------------------------------------------------------------------- the chat path

def image_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat_user_message(text: str, image=None, url: str | None = None) -> dict:
    """A user turn as an OpenAI chat message: its image (if any; or its data URL), then its text."""
    if image is not None and url is None:
        url = image_url(image)
    picture = [{"type": "image_url", "image_url": {"url": url}}] if url is not None else []
    return {"role": "user", "content": [*picture, {"type": "text", "text": text}]}


def engine_replies(engine, lora_request, max_new_tokens: int, banned_token_ids=()):
    """reply_fn for `play_chat_episodes` backed by an in-process vLLM engine (greedy)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens,
                            logit_bias=vllm_engine.sampling_logit_bias(banned_token_ids) or None)

    def reply_fn(conversations: list) -> list:
        outputs = engine.chat(conversations, params, lora_request=lora_request, use_tqdm=False)
        return [o.outputs[0].text for o in outputs]

    return reply_fn


def chat_messages(episode: rollout.Episode, max_images: int | None = None) -> list:
    """The episode's turns as OpenAI chat messages, images only in the last k user turns."""
    first_with_image = len(episode.turns) - max_images if max_images else 0
    messages = []
    for t, turn in enumerate(episode.turns):
        if t >= first_with_image and turn.image_data_url is None:
            turn.image_data_url = image_url(turn.image)
        messages.append(chat_user_message(turn.text, url=turn.image_data_url if t >= first_with_image else None))
        if turn.answered:
            messages.append({"role": "assistant", "content": turn.reply})
    return messages


def play_chat_episodes(tasks: list, reply_fn, *, max_images: int | None = None, desc: str = "eval",
                       progress: bool = True) -> list:
    """Play each task once (on its own copy), every turn asking `reply_fn` for all active
    conversations at once (the turns are text and images here: whoever answers tokenises them)."""
    episodes = []
    for i, task in enumerate(tasks):
        game = task.clone()
        obs = game.reset()
        episodes.append(rollout.Episode(task=game, group_id=i, sample_id=i, turns=[
            rollout.Turn(text=game.first_text(obs), image=obs.image, **rollout.turn_state(game))]))
    bar = tqdm(total=len(tasks), desc=desc, unit="puzzle", disable=not progress, leave=False)
    while active := [i for i, e in enumerate(episodes) if not e.ended]:
        replies = reply_fn([chat_messages(episodes[i], max_images) for i in active])
        for i, reply in zip(active, replies):
            episode = episodes[i]
            episode.turns[-1].reply = reply
            obs = episode.task.step(reply)
            if episode.record_step(obs):
                bar.update(1)
            else:
                episode.turns.append(rollout.Turn(text=obs.text, image=obs.image, **rollout.turn_state(episode.task)))
    bar.close()
    return episodes


def eval_rows(episodes: list, indices: list) -> list[dict]:
    """One JSON row per greedy evaluation episode; the trainer, `serve.py eval` and the
    experiments all write these. A puzzle whose shortest solution does not fit in the turn limit
    cannot be solved at all (env.fits_turn_limit: at 15 turns, about 28% of VisGym's easy puzzles)."""
    return [{"index": i, "seed": e.task.seed, "solved": e.solved, "turns": e.num_turns,
             "fits_turn_limit": env.fits_turn_limit(e.task), "end_reason": e.end_reason,
             "invalid_actions": e.invalid_actions, "no_effect_actions": e.no_effect_actions, "replies": e.replies}
            for i, e in zip(indices, episodes)]


def eval_result(rows: list[dict], max_turns: int, **fields) -> dict:
    """An evaluation's JSON: the rows in order, solved of all and of those that fit the turn limit
    (a task without a solver: all count as fitting)."""
    rows = sorted(rows, key=lambda r: r["index"])
    solved, fitting = sum(r["solved"] for r in rows), sum(r["fits_turn_limit"] is not False for r in rows)
    return {**fields, "max_turns": max_turns, "solved": solved, "total": len(rows),
            "solve_rate": solved / max(len(rows), 1), "fitting": fitting,
            "solve_rate_of_fitting": solved / max(fitting, 1), "puzzles": rows}



def evaluate_run(cfg, engine, chat, lora_request, step: int, out: Path, task_class, run: dict | None = None,
                 last_iterate=None) -> dict:
    """Greedy play of the fixed held-out puzzles, split over ranks, through the chat API exactly as
    `serve.py eval` plays them over HTTP (play_chat_episodes); rank 0 writes the JSON.
    Beside them, greedy play of the first eval_puzzles training puzzles (`training_puzzles`): a
    policy that memorises rises there only. With sampled_eval_samples, also the mean solve rate of
    that many sampled episodes per held-out puzzle. The file names the run, adapter and base it
    played. With `last_iterate` (the current policy, when `lora_request` is the tail average), its
    greedy play of the held-out puzzles too: the average against the policy it would otherwise publish."""

    def greedy(tasks: list, desc: str, request=lora_request) -> dict:
        replies = engine_replies(engine, request, cfg.max_new_tokens, chat.banned_token_ids)
        mine = list(range(dist.get_rank(), len(tasks), dist.get_world_size()))
        episodes = play_chat_episodes([tasks[i] for i in mine], replies, max_images=cfg.max_images or None,
                                      desc=desc, progress=cfg.progress and dist.get_rank() == 0)
        rows = [row for part in distributed.all_gather_objects(eval_rows(episodes, mine)) for row in part]
        return eval_result(rows, cfg.max_turns)

    held_out = env.held_out(task_class, cfg.difficulty, cfg.eval_puzzles, cfg.max_turns)
    result = {"step": step, "task": cfg.task, "difficulty": cfg.difficulty, **greedy(held_out, f"eval@{step}")}
    first_training = env.TrainingStream(task_class, cfg.difficulty, cfg.max_turns, eval_n=cfg.eval_puzzles,
                                        seed=cfg.seed).first(min(cfg.train_pool or cfg.eval_puzzles, cfg.eval_puzzles))
    result["training_puzzles"] = greedy(first_training, f"training puzzles@{step}")  # a pool's, or the stream's first
    if last_iterate is not None:
        result["last_iterate"] = {"adapter": last_iterate.lora_path,
                                  **greedy(held_out, f"last iterate@{step}", last_iterate)}
    if cfg.sampled_eval_samples and (step == 0 or step == cfg.steps):
        mine = list(range(dist.get_rank(), len(held_out), dist.get_world_size()))
        sampled = rollout.play_episodes(
            engine, chat, [held_out[i] for i in mine], mine,
            rollout.Sampling.of(cfg, temperature=cfg.sampled_eval_temperature, seed=cfg.seed + 1, end_on_invalid=False),
            samples_per_task=cfg.sampled_eval_samples, lora_request=lora_request, desc=f"sampled eval@{step}",
            progress=False)
        solved, total = distributed.sum_over_ranks([sum(e.solved for e in sampled), len(sampled)])
        result["sampled_solve_rate"] = solved / total
        result["sampled_temperature"] = cfg.sampled_eval_temperature
    if dist.get_rank() == 0:
        rundir.eval_file(out, result, run or {"run_id": None, "base": None}, lora_request)
    training = result["training_puzzles"]
    log0(f"eval step {step}: solved {result['solved']}/{result['total']} held-out"
         + (f" (the tail average; the current policy {result['last_iterate']['solved']})" if last_iterate else "")
         + f", {training['solved']}/{training['total']} of the first training puzzles")
    return result


def evaluate_published(cfg, engine, chat, lora_request, tail: average.TailAverage, model, step: int, out: Path,
                       shared: Path, run: dict, base: dict, task_class) -> dict:
    """Evaluate the policy the run publishes after `step`: the current one (`lora_request`), or
    once the tail average has begun, the average, written beside the syncs and loaded next to the
    current policy (which the next rollouts use), with the current one's held-out play beside it."""
    if not tail.active(step):
        return evaluate_run(cfg, engine, chat, lora_request, step, out, task_class, run)
    path = shared / "average" / f"step_{step}"
    policy.write_shared_adapter(model, tail.state, path, cfg.keep_syncs, base, what="the tail average's write")
    request = vllm_engine.add_adapter(engine, path, f"average-step-{step}", vllm_engine.AVERAGE_ID_OFFSET + step)
    try:
        return evaluate_run(cfg, engine, chat, request, step, out, task_class, run, last_iterate=lora_request)
    finally:
        engine.llm_engine.remove_lora(request.lora_int_id)
