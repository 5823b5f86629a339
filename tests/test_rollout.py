"""Rollouts keep tokens exactly: the trainer sees what vLLM saw, images included."""

import math

import pytest
import torch
from transformers import AutoProcessor, GenerationConfig, Qwen3VLForConditionalGeneration

import env
import grpo
import evaluation
import rollout
import vllm_engine
import policy
import update
from conftest import masked_segments
from tasks.maze import INSTRUCTIONS, MazeTask, generate_maze, observation_text, parse_action, render, solve


def _chat(model_dir):
    processor = AutoProcessor.from_pretrained(model_dir)
    return processor, rollout.ChatFormat(processor, GenerationConfig.from_pretrained(model_dir).eos_token_id)


def _play(engine, chat, temperature=1.0, **kw):
    max_turns = kw.pop("max_turns", 4)
    tasks = [MazeTask.of(generate_maze(7, seed=s), max_turns=max_turns) for s in (11, 12)]
    sampling = rollout.Sampling(temperature=temperature, seed=0, max_new_tokens=kw.pop("max_new_tokens", 6),
                                max_model_len=kw.pop("max_model_len", 4096), max_images=kw.pop("max_images", None))
    return rollout.play_episodes(engine, chat, tasks, [0, 1], sampling, **{"samples_per_task": 3,
                                                                            "progress": False, **kw})


def test_sequences_line_up_with_the_processor(engine, warm_start):
    processor, chat = _chat(warm_start)
    episodes = _play(engine, chat)
    assert len(episodes) == 6 and all(e.ended for e in episodes)
    for e in episodes:
        assert len(e.sequences) == 1  # full history: the whole episode is one sequence
        seq = e.sequences[0]
        n = len(seq.token_ids)
        assert len(seq.response_mask) == n and len(seq.rollout_logprobs) == n
        # the masked-in segments are exactly the replies, in order
        segments = masked_segments(seq)
        assert sum(len(s) for s in segments) == e.num_generated_tokens > 0
        masked_logprobs = [lp for lp, m in zip(seq.rollout_logprobs, seq.response_mask) if m]
        assert masked_logprobs == [lp for t in e.played for lp in t.reply_logprobs]  # each turn's own, in order
        for segment, turn in zip(segments, e.played, strict=True):
            assert segment == turn.reply_ids
            # vLLM's text drops a trailing incomplete UTF-8 byte sequence; the tokens keep it
            decoded = processor.tokenizer.decode(segment, skip_special_tokens=True)
            assert decoded.startswith(turn.reply) and set(decoded[len(turn.reply):]) <= {"\ufffd"}
        # the unmasked part is the chat template's text for the observations, images expanded by
        # the HF processor exactly as vLLM expanded them
        first = processor(text=[processor.apply_chat_template([chat.user_turn(INSTRUCTIONS + "\n" + observation_text(0))],
                                                              add_generation_prompt=True, tokenize=False)],
                          images=[e.turns[0].image], return_tensors="pt")["input_ids"][0].tolist()
        assert seq.token_ids[:len(first)] == first
        assert seq.response_mask[:len(first)] == [0] * len(first)
        vision = processor.image_processor(images=seq.images, return_tensors="pt")
        image_tokens = int(vision["image_grid_thw"].prod(-1).sum()) // 4
        assert seq.token_ids.count(processor.image_token_id) == image_tokens
        assert len(seq.images) == e.num_turns  # one image per turn played (the last state is not sent)
        assert seq.images == [t.image for t in e.played]


def test_reply_seeds_are_distinct_within_and_across_groups():
    """Identical seeds give identical samples (STACK.md): every reply of a run needs its own."""
    for run_seed in (0, 1, 12345):
        # 40 steps of 8 mazes x 8 members x 15 turns, as training numbers them
        seeds = [rollout.request_seed(run_seed, sample_id, turn) for sample_id in range(40 * 8 * 8) for turn in range(15)]
        assert len(set(seeds)) == len(seeds)
    assert rollout.request_seed(0, 5, 3) == rollout.request_seed(0, 5, 3)  # a resumed run redraws the same


def _first_reply_logprob(model, processor, chat, episode, temperature: float) -> float:
    """log P(the episode's first reply) under the distribution the engine sampled it from,
    recomputed by the trainer (policy.sequence_logprobs: at T != 1 with the engine's vision-token
    bias, applied before the temperature as vLLM's sampler does; fp32, equal to vLLM's to ~1e-7)."""
    inputs, mask, _ = policy.Batch(episode.sequences, processor).micro([0], torch.device("cpu"))
    with torch.no_grad():
        logprobs = policy.sequence_logprobs(model, inputs, temperature, chat.banned_token_ids)[0]
    first = mask[0].nonzero().flatten()[:len(episode.turns[0].reply_ids)]
    assert inputs["input_ids"][0, 1:][first].tolist() == episode.turns[0].reply_ids
    return logprobs[first].sum().item()


def test_group_members_play_the_same_maze_with_different_samples(engine, warm_start):
    """Members of a group get distinct seeds, and so draw independent samples.

    Whether 8 samples of a confident policy coincide depends on the policy's weights (trained in
    the test run, so different on every machine), so agreement alone proves nothing. What would
    is agreement on a reply too improbable to be drawn 8 times independently: if the first
    member's first reply s has probability P(s), all 7 others repeating it has probability
    P(s)^7. The test fails when a group agrees on an s with P(s)^7 < 1e-9; for independent
    samples that happens with probability sum over such s of P(s)^8 <= 1e-9 * sum P(s) <= 1e-9,
    whatever the weights. Where this was written, P(s) of the groups' first replies at T = 2 was
    below 1e-2 (printed below with -s), so members sharing one seed fail it (tried: a seed without
    the sample id)."""
    processor, chat = _chat(warm_start)
    seen = []  # every request's seed, as the engine received it

    class Recording:
        def generate(self, prompts, params, **kw):
            seen.extend(p.seed for p in params)
            return engine.generate(prompts, params, **kw)

    args = dict(samples_per_task=8, max_turns=2, temperature=2.0)  # 2: vLLM's highest
    episodes = _play(Recording(), chat, **args)
    assert len(seen) == len(set(seen)) == sum(e.num_turns for e in episodes)  # one seed per reply, all distinct
    model = Qwen3VLForConditionalGeneration.from_pretrained(warm_start, dtype=torch.float32)
    for group in (0, 1):
        members = [e for e in episodes if e.group_id == group]
        assert len(members) == 8 and len({e.task.maze.layout_key() for e in members}) == 1  # one maze per group
        logp = _first_reply_logprob(model, processor, chat, members[0], args["temperature"])
        print(f"group {group}: P(first reply) = {math.exp(logp):.2e}")
        agree = len({tuple(e.turns[0].reply_ids) for e in members}) == 1
        assert not (agree and 7 * logp < math.log(1e-9)), "8 members drew the same improbable reply"
    again = _play(engine, chat, **args)  # seeded per episode and turn: reproducible
    assert [[t.reply_ids for t in e.played] for e in again] == [[t.reply_ids for t in e.played] for e in episodes]


def test_trainer_logprobs_match_vllm(engine, warm_start):
    """fp32 on CPU: the trainer's recomputed logprobs equal vLLM's sampling logprobs."""
    processor, chat = _chat(warm_start)
    model = Qwen3VLForConditionalGeneration.from_pretrained(warm_start, dtype=torch.float32)
    for max_images in (None, 1):
        episodes = _play(engine, chat, max_images=max_images)
        sequences = [s for e in episodes for s in e.sequences]
        batch = policy.Batch(sequences, processor)
        with torch.no_grad():
            inputs, mask, rollout_lp = batch.micro(list(range(len(sequences))), torch.device("cpu"))
            lp = policy.sequence_logprobs(model, inputs)
        mismatch = grpo.logprob_mismatch(lp, rollout_lp, mask)
        assert mismatch["mismatch_abs_mean"] < 1e-4, (max_images, mismatch)
        assert mask.sum() == sum(e.num_generated_tokens for e in episodes)


def test_last_k_images_makes_one_sequence_per_turn(engine, warm_start):
    processor, chat = _chat(warm_start)
    episodes = _play(engine, chat, max_images=1)
    for e in episodes:
        assert len(e.sequences) == e.num_turns
        for turn, seq in enumerate(e.sequences):
            image = e.turns[turn].image
            assert seq.images == [image]  # only the current state's image
            assert seq.token_ids.count(processor.image_token_id) == chat.image_tokens(image)
            # the reply of this turn (and only it) is trained in this sequence
            reply = e.turns[turn].reply_ids
            assert sum(seq.response_mask) == len(reply) and seq.token_ids[-len(reply):] == reply
            # earlier replies are still in the context, token for token, masked out
            for earlier in (t.reply_ids for t in e.turns[:turn]):
                assert any(seq.token_ids[j:j + len(earlier)] == earlier for j in range(len(seq.token_ids)))


def test_stop_conditions(engine, warm_start):
    """Each way an episode ends. The warm start has learned to stop, and does so at a sampled turn
    now and then (a first-turn stop has probability ~1e-3 here, more or less elsewhere): an
    episode that stopped must say so, every other one must end at the limit under test, and at
    least one must reach it (all 6 stopping early has probability ~1e-18)."""
    _, chat = _chat(warm_start)

    def check(episodes, reason):
        for e in episodes:
            if parse_action(e.replies[-1]) == ("stop", "stop"):
                assert e.end_reason == "stop" and e.num_turns == len(e.replies), e.end_reason
            else:
                assert e.end_reason == reason, (e.end_reason, e.replies)
        assert any(e.end_reason == reason for e in episodes)

    # turn limit
    episodes = _play(engine, chat, max_turns=2)
    check(episodes, "turn_limit")
    assert all(e.num_turns == 2 for e in episodes if e.end_reason == "turn_limit")
    # per-turn token limit: replies are cut at max_new_tokens
    assert all(e.num_generated_tokens <= 2 * 6 for e in episodes)
    # context limit: a budget that fits two turns but not three
    first = len(episodes[0].sequences[0].token_ids) // 2
    limited = _play(engine, chat, max_turns=10, max_model_len=first * 2 + 20)
    check(limited, "context_limit")
    assert all(e.num_turns < 10 for e in limited)


def test_chat_episodes_parse_and_score():
    """The eval path (chat messages) with a scripted replier: BFS answers solve every maze."""
    mazes = [t.maze for t in env.held_out(MazeTask, "small", 4)]
    plans = {m.seed: solve(m) for m in mazes}
    episodes = evaluation.play_chat_episodes(env.held_out(MazeTask, "small", 4, max_turns=30),
                                             lambda batch: _scripted(batch, mazes, plans), progress=False)
    assert all(e.solved and e.end_reason == "stop" and e.reward == 1.0 for e in episodes)
    assert [e.num_turns for e in episodes] == [len(plans[m.seed]) for m in mazes]
    # a replier that always walks into garbage never solves and hits the turn limit
    episodes = evaluation.play_chat_episodes(env.held_out(MazeTask, "small", 4, max_turns=3),
                                             lambda batch: ["no idea"] * len(batch), progress=False)
    assert all(not e.solved and e.end_reason == "turn_limit" and e.invalid_actions == 3 for e in episodes)


def test_an_episode_is_its_turns_read_the_same_way_by_engine_prompts_and_chat_messages(monkeypatch):
    """Prompts (token ids) and chat messages are both read off the Turn records, images only in
    the last k user turns; prefix(t) shares turns 0..t-1 and asks turn t anew, leaving the
    parent's turn t as it was."""
    from PIL import Image

    image_pad = 7
    images = [Image.new("RGB", (32, 32), (40 * k, 0, 0)) for k in range(3)]
    maze = generate_maze(7, seed=1)
    turns = [rollout.Turn(text=f"view {k}", image=images[k], key=(k, 1), snapshot=(k, ((1, 1), ())),
                          prompt_ids=[10 + k, image_pad], prompt_ids_text_only=[10 + k], reply_ids=[20 + k],
                          reply_logprobs=[-0.5], reply=f"r{k}") for k in range(3)]
    episode = rollout.Episode(task=MazeTask.of(maze), group_id=0, sample_id=0, turns=turns,
                              sequences=[rollout.Sequence([k], [1], [-0.5], [images[k]]) for k in range(3)])
    assert episode.prompt(2, None) == ([10, 7, 20, 11, 7, 21, 12, 7], images)  # what asked for reply 2
    assert episode.prompt(2, 1) == ([10, 20, 11, 21, 12, 7], images[2:])
    messages = evaluation.chat_messages(episode, max_images=1)
    assert [m["role"] for m in messages] == ["user", "assistant"] * 3
    assert [m["content"] for m in messages[1::2]] == ["r0", "r1", "r2"]
    assert [[p["type"] for p in m["content"]] for m in messages[0::2]] == [["text"], ["text"], ["image_url", "text"]]
    assert [m["content"][-1]["text"] for m in messages[0::2]] == ["view 0", "view 1", "view 2"]
    full = evaluation.chat_messages(episode)
    assert [len(m["content"]) for m in full[0::2]] == [2, 2, 2]
    assert [m["content"][0]["image_url"]["url"] for m in full[0::2]] == [evaluation.image_url(i) for i in images]
    encoded = []  # a conversation resends every image each turn: each is encoded once, then reused
    monkeypatch.setattr(evaluation, "image_url", lambda image: encoded.append(image) or "data:fresh")
    assert evaluation.chat_messages(episode) == full and encoded == []
    branch = episode.prefix(2, sample_id=5)
    assert branch.turns[:2] == turns[:2] and branch.num_turns == 2 and not branch.turns[2].answered
    assert branch.next_prompt(1) == ([10, 20, 11, 21, 12, 7], images[2:])  # waiting for its reply 2
    assert branch.sequences == [] and branch.replies == ["r0", "r1"]  # its own are built once it is played
    assert branch.task is not episode.task and branch.task.turn == 2  # its own task, at that turn's state
    branch.turns[2].reply = "another"
    assert episode.turns[2].reply == "r2" and episode.replies == ["r0", "r1", "r2"]


def test_training_sequences_are_laid_out_from_the_turns():
    """The one layout of a training sequence: full history, one sequence of every prompt (image
    placeholders expanded) and reply; with max_images, one per turn, its prompt as then sent.
    Only the trained replies are masked in; the replies carry their log-probs, the prompts 0."""
    from types import SimpleNamespace

    pad = 7
    chat = SimpleNamespace(expand=lambda ids, images: [x for t in ids for x in ([t, t] if t == pad else [t])])
    images = [object() for _ in range(3)]
    turns = [rollout.Turn(text="", image=images[k], key=(k, 1), prompt_ids=[10 + k, pad], prompt_ids_text_only=[10 + k],
                          reply_ids=[20 + k], reply_logprobs=[-0.1 * (k + 1)], reply=f"r{k}") for k in range(3)]
    turns.append(rollout.Turn(text="", image=object(), key=(3, 1), prompt_ids=[13, pad], prompt_ids_text_only=[13]))
    episode = rollout.Episode(task=MazeTask.of(generate_maze(7, seed=1)), group_id=0, sample_id=0,
                              turns=turns)  # ended unasked
    (full,) = rollout.training_sequences(episode, chat, None)
    assert full.token_ids == [10, 7, 7, 20, 11, 7, 7, 21, 12, 7, 7, 22] and full.images == images
    assert full.response_mask == [0, 0, 0, 1] * 3
    assert full.rollout_logprobs == [0.0, 0.0, 0.0, -0.1, 0.0, 0.0, 0.0, -0.2, 0.0, 0.0, 0.0, pytest.approx(-0.3)]
    (cut,) = rollout.training_sequences(episode, chat, None, trained={1}, through=1)
    assert cut.token_ids == full.token_ids[:8] and cut.response_mask == [0] * 7 + [1] and cut.images == images[:2]
    per_turn = rollout.training_sequences(episode, chat, 1)
    assert [s.token_ids for s in per_turn] == [[10, 7, 7, 20], [10, 20, 11, 7, 7, 21], [10, 20, 11, 21, 12, 7, 7, 22]]
    assert [s.response_mask for s in per_turn] == [[0, 0, 0, 1], [0] * 5 + [1], [0] * 7 + [1]]
    assert [s.images for s in per_turn] == [[images[0]], [images[1]], [images[2]]]
    assert rollout.training_sequences(episode, chat, 1, trained=[0, 2]) == [per_turn[0], per_turn[2]]


def test_end_on_invalid_ends_a_training_episode_at_its_first_unreadable_reply(tiny_model):
    """--end-on-invalid: the first reply the task cannot parse ends the episode there, unsolved, with
    the turns played so far kept for training; by the task's own rule it spends its turn instead.
    Every reply is forced, so no engine is asked."""
    _, chat = _chat(tiny_model)
    task = MazeTask.of(generate_maze(7, seed=11), max_turns=4)
    move = chat.reply_ids(task, task.clone().legal_actions()[0])
    junk = chat.tokenizer("<answer></answer>", add_special_tokens=False).input_ids + [chat.end_of_reply_id]

    def play(end_on_invalid):
        game = task.clone()
        obs = game.reset()
        episode = rollout.Episode(task=game, group_id=0, sample_id=0,
                                  turns=[chat.open_turn(game.first_text(obs), obs.image, game)])
        sampling = rollout.Sampling(temperature=1.0, seed=0, max_new_tokens=8, max_model_len=4096,
                                    end_on_invalid=end_on_invalid)
        (episode,) = rollout.play_turns(None, chat, [episode], [[move, junk, junk, junk]], sampling, progress=False)
        return episode

    kept = play(False)
    assert (kept.end_reason, kept.num_turns, kept.invalid_actions) == ("turn_limit", 4, 3)
    ended = play(True)
    assert (ended.end_reason, ended.num_turns, ended.invalid_actions, ended.reward, ended.solved) == \
        ("invalid", 2, 1, 0.0, False)
    assert [t.reply_ids for t in ended.turns] == [move, junk]  # no turn is opened after the junk reply
    assert sum(ended.sequences[0].response_mask) == len(move) + len(junk)  # both replies are trained
    assert rollout.rollout_metrics([kept, ended])["end_invalid"] == 0.5


def _scripted(batch, mazes, plans):
    """Answer each conversation from its maze's BFS plan (the maze is found by its first image)."""
    first_images = {evaluation.image_url(render(m, m.start)): m.seed for m in mazes}
    replies = []
    for conv in batch:
        seed = first_images[conv[0]["content"][0]["image_url"]["url"]]
        turn = sum(m["role"] == "assistant" for m in conv)
        replies.append(f"<think>plan</think><answer>{plans[seed][turn]}</answer>")
    return replies


def test_a_warning_is_said_once_per_line_of_code():
    import logging

    log = logging.getLogger("test.once")
    log.setLevel(logging.INFO)
    log.propagate = False
    log.addFilter(vllm_engine.OncePerCallSite())
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log.addHandler(handler)
    for _ in range(3):
        log.warning("the same line, again")  # one call site, three calls
    log.warning("another line")
    for _ in range(2):
        log.info("progress")  # below WARNING: every one
    assert [r.getMessage() for r in records] == ["the same line, again", "another line", "progress", "progress"]


def test_a_stale_adapter_stops_the_run_with_one_line(engine, warm_start):
    """The engine samples from the warm start while the trainer holds a LoRA that moved (a sync that
    never reached the engine): the mismatch the trainer logs is far above the CPU stack's noise and
    the guard stops at the third such step. With the engine on the trainer's own policy it is quiet."""
    from peft import LoraConfig, get_peft_model

    processor, chat = _chat(warm_start)
    base = Qwen3VLForConditionalGeneration.from_pretrained(warm_start, dtype=torch.float32)
    episodes = _play(engine, chat)
    sequences = [s for e in episodes for s in e.sequences]
    inputs, mask, rollout_lp = policy.Batch(sequences, processor).micro(list(range(len(sequences))), torch.device("cpu"))

    def mismatch(model):
        with torch.no_grad():
            return grpo.logprob_mismatch(policy.sequence_logprobs(model, inputs), rollout_lp, mask)["mismatch_abs_mean"]

    in_sync = mismatch(base)
    guard = update.StalePolicyGuard(steps=3)
    for step in range(1, 6):
        guard.check(step, in_sync)  # the stack's own noise: never stops
    torch.manual_seed(0)
    trained = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=vllm_engine.LORA_TARGET_REGEX))
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # the trainer's policy moved; the engine never heard of it
    stale = mismatch(trained)
    print(f"mismatch in sync {in_sync:.2e}, with a stale adapter {stale:.3g}")
    guard.check(1, stale), guard.check(2, stale)
    with pytest.raises(SystemExit) as stop:
        guard.check(3, stale)
    message = str(stop.value)
    assert "\n" not in message and "step 3" in message and "not sampling from the policy being trained" in message
    assert "adapter" in message and "--mismatch-bound" in message
    guard = update.StalePolicyGuard(steps=3)  # a single bad step between good ones does not stop it
    for step, m in enumerate([stale, stale, in_sync, stale, stale, in_sync], 1):
        guard.check(step, m)
