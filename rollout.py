"""Multi-turn, multimodal rollouts: the policy plays tasks (env.py) through an in-process vLLM engine.

One call to `play_episodes` plays a batch of episodes to the end. Every turn, ALL still-active
episodes go to the engine in ONE `generate` call (vLLM batches them); the task reads the reply
and renders its new state, and the new user turn (feedback text + image) is appended.

Token-in / token-out. An episode's conversation is kept as token ids from the first turn on and
only ever appended to: the tokens the engine generated are kept exactly as generated (never
re-tokenised from decoded text), and each new user turn is rendered by the model's own chat
template and tokenised on its own. What the engine saw is therefore exactly what the trainer
sees:

    token_ids      = [ user turn 0 | reply 0 | user turn 1 | reply 1 | ... | reply n ]
    response_mask  = [ 0 ...     0 | 1 ... 1 | 0 ...     0 | 1 ... 1 | ... | 1 ... 1 ]
    rollout_logprobs: vLLM's sampling log-probability of each reply token (0 elsewhere)

Images: we send one `<|image_pad|>` per image and vLLM expands it into one token per merged
patch; the expanded prompt comes back in `RequestOutput.prompt_token_ids`, and that expanded
form is what we store, because the trainer's forward pass needs it too.

What a turn costs (bench/bench.py measures it). Every turn re-sends each episode's whole
conversation, images included. Prefix caching makes the engine compute only the new tokens, but
vLLM would still hash every image of every prompt to look it up; we hash each image once, the
first time a prompt sends it, and pass the digest as its `multi_modal_uuids` entry. Replies are decoded
once per turn in one batch, instead of token by token inside the engine (`detokenize=False`).
"""

import hashlib
from dataclasses import dataclass, field, replace

from tqdm import tqdm

import env
from vllm_engine import sampling_logit_bias, vision_token_ids


class ChatFormat:
    """Turns a task's observations into prompt token ids with the model's own chat template.

    Nothing here knows the tiny model's tokenizer: the template is asked to render a
    conversation, and we take the text that a new user turn adds after an assistant reply.
    """

    MARK = "\u2063REPLY\u2063"  # a string no template produces, to find where a reply ends

    def __init__(self, processor, eos_token_ids: list[int]):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.end_of_reply_id = next(iter(eos_token_ids), None)  # what a demonstrated reply ends with (SFT)
        self.image_token_id = processor.image_token_id
        self.banned_token_ids = vision_token_ids(processor)
        self._image_tokens = {}  # image size -> number of tokens the image expands to
        self._next_turn = {}  # (observation text, with image, end token of the reply or None) -> ids
        self._replies = {}  # reply text -> its ids, the end-of-reply token included

    @classmethod
    def for_model(cls, model_path: str, processor=None) -> "ChatFormat":
        """The chat format of a model directory (or hub id): its processor, and the end-of-reply
        tokens from its generation config (falling back to the tokenizer's eos token)."""
        from transformers import AutoProcessor, GenerationConfig

        processor = processor or AutoProcessor.from_pretrained(model_path)
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [processor.tokenizer.eos_token_id])
        return cls(processor, eos)

    @staticmethod
    def user_turn(text: str, with_image: bool = True):
        image = [{"type": "image"}] if with_image else []
        return {"role": "user", "content": image + [{"type": "text", "text": text}]}

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def reply_ids(self, task, action) -> list[int]:
        """The reply that plays `action` as the model should learn it (the task's reply text, then
        the end-of-turn token): what demonstrations and branch rollouts force."""
        text = task.reply(action)
        if text not in self._replies:
            self._replies[text] = self._ids(text) + [self.end_of_reply_id]
        return list(self._replies[text])

    def action_prefix(self, task) -> list[int]:
        """The tokens every action's reply begins with (the longest common prefix of the task's
        replies, e.g. `<answer>`): the token after them is where the actions part, the one the
        policy probe and SFT's action accuracy read."""
        replies = [self.reply_ids(task, a) for a in task.actions]
        common = 0
        while all(len(r) > common and r[common] == replies[0][common] for r in replies):
            common += 1
        return replies[0][:common]

    def first_turn(self, text: str, with_image: bool = True) -> list[int]:
        """The first user turn: the task's instructions and the first observation (env.Task's
        first_text), with the image unless told otherwise."""
        message = self.user_turn(text, with_image)
        return self._ids(self.processor.apply_chat_template([message], add_generation_prompt=True,
                                                            tokenize=False))

    def next_turn(self, observation_text: str, reply_ids: list[int], with_image: bool = True) -> list[int]:
        """Ids that close the assistant reply (unless it ended itself) and open the next turn."""
        end = reply_ids[-1] if reply_ids and reply_ids[-1] in self.eos_token_ids else None
        key = (observation_text, with_image, end)
        if key not in self._next_turn:  # observation texts repeat a lot: render each one once
            conversation = [self.user_turn("x"), {"role": "assistant", "content": self.MARK},
                            self.user_turn(observation_text, with_image)]
            text = self.processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
            after_reply = text[text.index(self.MARK) + len(self.MARK):]
            if end is not None:
                # the reply already holds the end-of-turn token the template would write next
                eos_text = self.tokenizer.decode([end])
                if after_reply.startswith(eos_text):
                    after_reply = after_reply[len(eos_text):]
            self._next_turn[key] = self._ids(after_reply)
        return list(self._next_turn[key])

    def open_turn(self, text: str, image, task, after_reply: list[int] | None = None,
                  text_only: bool = False) -> "Turn":
        """The turn that shows `text` and `image` (the state `task` is in): the first one, or the
        one after the reply `after_reply`. With `text_only` it is also rendered without its image
        (what is sent once the turn is older than max_images)."""
        if after_reply is None:
            ids, text_ids = self.first_turn(text), self.first_turn(text, with_image=False) if text_only else []
        else:
            ids = self.next_turn(text, after_reply)
            text_ids = self.next_turn(text, after_reply, with_image=False) if text_only else []
        return Turn(text=text, image=image, **turn_state(task), prompt_ids=ids, prompt_ids_text_only=text_ids)

    def expand(self, ids: list[int], images: list) -> list[int]:
        """What vLLM and the HF processor do to a prompt: one <|image_pad|> -> one per patch."""
        out, images = [], iter(images)
        for t in ids:
            out += [t] * self.image_tokens(next(images)) if t == self.image_token_id else [t]
        return out

    def expanded_len(self, ids: list[int], images: list) -> int:
        """len(expand(ids, images)), without building the list: each image's one placeholder
        becomes image_tokens(image) tokens."""
        return len(ids) + sum(self.image_tokens(image) - 1 for image in images)

    def image_tokens(self, image) -> int:
        """How many tokens one image expands to (one per merged patch)."""
        if image.size not in self._image_tokens:
            grid = self.processor.image_processor(images=[image], return_tensors="pt")["image_grid_thw"][0]
            merge = self.processor.image_processor.merge_size
            self._image_tokens[image.size] = int(grid.prod()) // (merge * merge)
        return self._image_tokens[image.size]


@dataclass
class Sequence:
    """One training sequence, exactly as the engine saw it (images expanded); built from an
    episode's turns after play (training_sequences)."""
    token_ids: list
    response_mask: list  # 1 on the reply tokens that are trained
    rollout_logprobs: list  # the engine's sampling log-prob of each reply token (NaN: forced), 0 on prompts
    images: list  # the images whose tokens appear in token_ids, in order


@dataclass
class Turn:
    """One turn of an episode: what the env showed, what the agent replied.

    Rollouts, chat evaluations and SFT demonstrations all build these the same way (a turn is
    opened when the env shows a state, and answered when the reply comes; a chat evaluation's
    turns are text and images only, its server tokenises them); an episode's last turn
    stays unanswered if the episode ended without asking for it (context limit)."""
    text: str  # what the task said: the first turn's instructions and view, then its feedback on each action
    image: object  # the state the agent was shown
    key: object  # that state's key (Task.state_key): turns facing the same situation share it
    snapshot: object = None  # that state (Task.snapshot; None if the task has none): branch.py restores it
    prompt_ids: list = None  # the user turn's token ids, unexpanded (None in chat evaluations: the server tokenises)
    prompt_ids_text_only: list = None  # the same turn without its image (rendered only when max_images is set)
    reply_ids: list = None  # the reply's token ids, exactly as generated or forced; None until answered
    reply_logprobs: list = None  # the engine's sampling log-prob of each reply token (NaN: forced, 0: greedy)
    reply: str = None  # the reply decoded
    # the image as a PNG data URL, made once: a chat conversation sends every image again each turn
    image_data_url: str = field(default=None, repr=False, compare=False)

    @property
    def answered(self) -> bool:
        return self.reply is not None


@dataclass
class Episode:
    """One play of one puzzle: its turns (the whole conversation, once), how it ended, and the
    training sequences built from the turns when it ended (training_sequences)."""
    task: env.Task  # the task it played, in the state the episode left it in
    group_id: int  # members of a GRPO group play the same puzzle and share this id
    sample_id: int  # globally unique, seeds this episode's sampling
    turns: list = field(default_factory=list)  # Turn records, in order
    sequences: list = field(default_factory=list)  # what the trainer trains on: set once the episode ends
    reward: float = 0.0
    solved: bool = False
    invalid_actions: int = 0
    no_effect_actions: int = 0  # valid actions that changed nothing (a blocked move: the turn is spent)
    truncated_replies: int = 0  # replies cut by the per-turn token limit
    end_reason: str = ""  # stop | turn_limit | context_limit | invalid
    ended: bool = False

    @property
    def played(self) -> list:
        """The answered turns (all but an unanswered last one)."""
        return [t for t in self.turns if t.answered]

    @property
    def num_turns(self) -> int:
        return len(self.played)

    @property
    def replies(self) -> list:
        """The decoded replies, one per turn played: what logs and evaluations record."""
        return [t.reply for t in self.played]

    @property
    def num_generated_tokens(self) -> int:  # 0 for a chat evaluation's turns (text only)
        return sum(len(t.reply_ids or ()) for t in self.played)

    def prefix(self, turn: int, sample_id: int) -> "Episode":
        """This episode as it stood when its reply `turn` was asked for: turns 0..turn-1 as played,
        turn `turn` unanswered, under a new sample id, on its own copy of the task restored to that
        turn's state. The played turns are shared with this episode (nothing changes an answered
        turn); turn `turn` is a new record. Its counters (invalid actions, no-effect actions,
        truncations) count only what is played from here on."""
        if not 0 <= turn < self.num_turns:
            raise ValueError(f"turn {turn}: the episode played turns 0..{self.num_turns - 1}")
        asked = replace(self.turns[turn], reply_ids=None, reply_logprobs=None, reply=None)
        task = self.task.clone()
        task.restore(asked.snapshot)
        return Episode(task=task, group_id=self.group_id, sample_id=sample_id, turns=[*self.turns[:turn], asked])

    def record_step(self, obs) -> bool:
        """Record what the task did with the last reply (both turn loops); True if that ended the
        episode (its reward, solved and end reason are then the task's)."""
        self.invalid_actions += not obs.valid
        self.no_effect_actions += obs.no_effect
        if self.task.done:
            self.ended, self.reward, self.solved, self.end_reason = (True, obs.reward, self.task.solved,
                                                                     self.task.end_reason)
        return self.task.done

    def next_prompt(self, max_images: int | None) -> tuple[list, list]:
        """The engine input for the reply the last turn waits for (images only in the last k turns)."""
        return self.prompt(len(self.turns) - 1, max_images)

    def prompt(self, turn: int, max_images: int | None) -> tuple[list, list]:
        """The engine input that asked for reply `turn` (unexpanded ids, and the images it holds):
        turns 0..turn with the replies before it, images only in the last k of them."""
        first_with_image = turn + 1 - max_images if max_images else 0
        ids, images = [], []
        for t, this in enumerate(self.turns[:turn + 1]):
            if t >= first_with_image:
                ids += this.prompt_ids
                images.append(this.image)
            else:
                ids += this.prompt_ids_text_only
            if t < turn:
                ids += this.reply_ids
        return ids, images


def training_sequences(episode: Episode, chat: ChatFormat, max_images: int | None, trained=None,
                       through: int | None = None) -> list[Sequence]:
    """An episode's training tokens, built from its turns once it is played; the one place that
    lays out a training sequence, for rollouts, branch targets and SFT demonstrations alike.

    Full history (`max_images` None): every prompt extends the previous one token for token, so
    the episode is ONE sequence, each turn's prompt (images expanded) then its reply. With
    `max_images=k`, earlier prompts are not prefixes of later ones (older turns lose their
    image), so each turn is its own sequence: its prompt as sent (Episode.prompt) plus its reply.
    The replies of the turns in `trained` (default: every played turn) get response mask 1, and
    per-turn sequences with nothing trained are left out; `through`: only the turns up to that
    one. Reply tokens carry the engine's sampling log-probs (NaN: forced), prompt tokens 0."""
    played = episode.played[:None if through is None else through + 1]
    trained = set(range(len(played))) if trained is None else set(trained)
    if max_images is None:
        ids, mask, logprobs = [], [], []
        for t, turn in enumerate(played):
            prompt = chat.expand(turn.prompt_ids, [turn.image])
            ids += prompt + turn.reply_ids
            mask += [0] * len(prompt) + [int(t in trained)] * len(turn.reply_ids)
            logprobs += [0.0] * len(prompt) + list(turn.reply_logprobs)
        return [Sequence(ids, mask, logprobs, [turn.image for turn in played])] if played else []
    sequences = []
    for t in sorted(trained & set(range(len(played)))):
        ids, images = episode.prompt(t, max_images)
        prompt, reply = chat.expand(ids, images), played[t]
        sequences.append(Sequence(prompt + reply.reply_ids, [0] * len(prompt) + [1] * len(reply.reply_ids),
                                  [0.0] * len(prompt) + list(reply.reply_logprobs), images))
    return sequences


def request_seed(run_seed: int, sample_id: int, turn: int) -> int:
    """The sampling seed of one reply: distinct per (run seed, episode, turn), so that a group's
    members draw different samples (identical seeds give identical samples), and a resumed run
    draws exactly what an uninterrupted run would have drawn. Within a run it is one-to-one for
    turn < 1,009 and sample_id < 2,128,000 (then 1,009 * sample_id + turn < 2**31 - 1)."""
    return (run_seed * 1_000_003 + sample_id * 1_009 + turn) % (2**31 - 1)


@dataclass(frozen=True)
class Sampling:
    """How the engine is asked for every reply of a batch of episodes, as one record. Each reply's
    seed is request_seed(seed, its episode's sample id, its turn). With `max_images=k` only the
    last k user turns keep their image (training_sequences then makes one sequence per turn).
    `min_new_tokens` forbids ending a reply earlier (benchmarks set it to `max_new_tokens`: every
    reply the same length). `end_on_invalid` ends an episode at its first invalid reply, unsolved
    (training's --end-on-invalid; otherwise the reply spends its turn, the task's rule)."""
    temperature: float  # 0: greedy (no log-probs asked for)
    seed: int
    max_new_tokens: int
    max_model_len: int  # an episode whose next prompt and reply would not fit ends ("context_limit")
    max_images: int | None = None  # None: every turn keeps its image (full history)
    min_new_tokens: int = 0
    end_on_invalid: bool = False

    @classmethod
    def of(cls, cfg, **changes) -> "Sampling":
        """A run's (from its Config), with `changes` (another temperature or seed)."""
        return replace(cls(temperature=cfg.temperature, seed=cfg.seed, max_new_tokens=cfg.max_new_tokens,
                           max_model_len=cfg.max_model_len, max_images=cfg.max_images or None,
                           end_on_invalid=cfg.end_on_invalid), **changes)


def play_episodes(engine, chat: ChatFormat, tasks: list, group_ids: list, sampling: Sampling, *,
                  samples_per_task: int, lora_request=None, desc: str = "rollout", progress: bool = True) -> list:
    """Play every task `samples_per_task` times to the end, each on its own copy; return the
    finished episodes. `group_ids` must be unique across the whole run (and across ranks): with the
    member index they give each episode the id that seeds its sampling."""
    episodes = []
    for task, group_id in zip(tasks, group_ids):
        for member in range(samples_per_task):
            game = task.clone()
            obs = game.reset()
            first = chat.open_turn(game.first_text(obs), obs.image, game, text_only=bool(sampling.max_images))
            episodes.append(Episode(task=game, group_id=group_id, sample_id=group_id * samples_per_task + member,
                                    turns=[first]))
    return play_turns(engine, chat, episodes, [[] for _ in episodes], sampling, lora_request=lora_request,
                      desc=desc, progress=progress)


def turn_state(task) -> dict:
    """What a Turn records of the state its task is in: the state key, and a snapshot if the task
    takes them (env.features)."""
    return {"key": task.state_key(), "snapshot": task.snapshot() if env.features(type(task))["snapshots"] else None}


def play_turns(engine, chat: ChatFormat, episodes: list, forced: list, sampling: Sampling, *,
               lora_request=None, desc: str = "rollout", progress: bool = True) -> list:
    """The turn loop: play `episodes` on their tasks from wherever they stand to the end.

    Each episode waits for its next reply (a fresh one from `play_episodes`, or a copy of another
    up to some turn with its task restored to that turn's state: branch.py). `forced[i]` is a list
    of replies (token ids) episode i gives at its next turns, in order, instead of samples (a
    demonstration's replies: the answer, then the end-of-reply token); once they are used up it
    samples. Forced tokens are trained like generated ones (response mask 1), but the engine never
    sampled them, so their rollout log-prob is NaN, "none": TIS and the mismatch meter leave them
    out (grpo.sampled_mask). Each reply's seed is request_seed(seed, sample_id, its turn index).
    Once all have ended, each episode's training sequences are built from its turns.
    """
    forced = [list(replies) for replies in forced]  # consumed below; the caller's lists stay as they are
    digests = {}  # id(image) -> its content digest, computed once (the episodes keep the images alive)
    bar = tqdm(total=len(episodes), desc=desc, unit="ep", disable=not progress, leave=False)
    while active := [i for i, e in enumerate(episodes) if not e.ended]:
        replies = next_replies(engine, chat, [episodes[i] for i in active], [forced[i] for i in active], sampling,
                               lora_request, digests)
        texts = decode_replies(chat.tokenizer, [reply_ids for reply_ids, _, _ in replies])
        for i, (reply_ids, reply_logprobs, truncated), text in zip(active, replies, texts):
            episode = episodes[i]
            turn = episode.turns[-1]
            turn.reply_ids, turn.reply_logprobs, turn.reply = reply_ids, reply_logprobs, text
            episode.truncated_replies += truncated
            obs = episode.task.step(text)
            ended = episode.record_step(obs)
            if not ended and not obs.valid and sampling.end_on_invalid:
                episode.ended, episode.end_reason = True, "invalid"  # reward 0: the junk reply loses the episode
            elif not ended:
                episode.turns.append(chat.open_turn(obs.text, obs.image, episode.task, reply_ids,
                                                    text_only=bool(sampling.max_images)))
                ids, images = episode.next_prompt(sampling.max_images)
                if chat.expanded_len(ids, images) + sampling.max_new_tokens > sampling.max_model_len:
                    episode.ended, episode.end_reason = True, "context_limit"
            if episode.ended:
                bar.update(1)
    bar.close()
    for episode in episodes:
        episode.sequences = training_sequences(episode, chat, sampling.max_images)
    return episodes


def next_replies(engine, chat: ChatFormat, episodes: list, forced: list, sampling: Sampling, lora_request,
                 digests: dict) -> list[tuple[list, list, bool]]:
    """Each episode's next reply: (its token ids, their rollout log-probs, whether the token limit
    cut it). An episode with replies left in `forced[k]` gives the first of them (consumed here);
    the others are sampled, all in ONE engine call (vLLM batches them)."""
    sampled, prompts = [k for k in range(len(episodes)) if not forced[k]], {}
    for k in sampled:
        ids, images = episodes[k].next_prompt(sampling.max_images)
        prompts[k] = {"prompt_token_ids": ids, "multi_modal_data": {"image": images},
                      "multi_modal_uuids": {"image": image_digests(images, digests)}}
    outputs = dict(zip(sampled, engine.generate(
        [prompts[k] for k in sampled], [sampling_params(sampling, episodes[k], chat.banned_token_ids) for k in sampled],
        lora_request=lora_request, use_tqdm=False))) if sampled else {}
    replies = []
    for k in range(len(episodes)):
        if k not in outputs:
            reply_ids = list(forced[k].pop(0))
            replies.append((reply_ids, [NO_LOGPROB] * len(reply_ids), False))  # forced: the engine sampled none
            continue
        completion, reply_ids = outputs[k].outputs[0], list(outputs[k].outputs[0].token_ids)
        # vLLM expands the image placeholders exactly as training_sequences does
        assert list(outputs[k].prompt_token_ids) == chat.expand(
            prompts[k]["prompt_token_ids"], prompts[k]["multi_modal_data"]["image"]), "expansion differs"
        reply_logprobs = ([lp[t].logprob for lp, t in zip(completion.logprobs, reply_ids)]
                          if completion.logprobs is not None else [0.0] * len(reply_ids))  # greedy: none asked
        replies.append((reply_ids, reply_logprobs, completion.finish_reason == "length"))
    return replies


def sampling_params(sampling: Sampling, episode: Episode, banned_token_ids):
    """The engine's SamplingParams for `episode`'s next reply, seeded by request_seed."""
    from vllm import SamplingParams

    # detokenize=False: the engine returns token ids only; play_turns decodes each reply once
    common = dict(max_tokens=sampling.max_new_tokens, min_tokens=sampling.min_new_tokens,
                  logit_bias=sampling_logit_bias(banned_token_ids), detokenize=False)
    if sampling.temperature == 0.0:
        return SamplingParams(temperature=0.0, **common)
    return SamplingParams(temperature=sampling.temperature, logprobs=0,
                          seed=request_seed(sampling.seed, episode.sample_id, episode.num_turns), **common)


# The rollout log-prob of a token the engine did not sample (a forced reply): "none", not 0.
NO_LOGPROB = float("nan")


def image_digest(image) -> str:
    """A content digest of an image, vLLM's key for it in its caches (our `multi_modal_uuids`)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.mode}:{image.size}:".encode())
    h.update(image.tobytes())
    return "img-" + h.hexdigest()


def image_digests(images: list, known: dict) -> list[str]:
    """image_digest of each image, computed once per image object: `known` (id(image) -> digest)
    holds them while its owner keeps the images alive (a rollout's episodes, a Batch's sequences)."""
    for image in images:
        if id(image) not in known:
            known[id(image)] = image_digest(image)
    return [known[id(image)] for image in images]


def decode_replies(tokenizer, replies: list) -> list[str]:
    """Reply texts as vLLM's detokenizer gives them: special tokens skipped, and an incomplete
    UTF-8 sequence at the very end (a reply cut mid-character) left out."""
    texts = tokenizer.batch_decode([list(r) for r in replies], skip_special_tokens=True,
                                   clean_up_tokenization_spaces=False)
    return [t.rstrip("\ufffd") for t in texts]


def rollout_metrics(episodes: list) -> dict:
    """Per-batch statistics for logs (means over episodes)."""
    n = max(len(episodes), 1)
    turns = sum(e.num_turns for e in episodes)
    metrics = {
        "reward_mean": sum(e.reward for e in episodes) / n,
        "solve_rate": sum(e.solved for e in episodes) / n,
        "episode_turns": turns / n,
        "generated_tokens": sum(e.num_generated_tokens for e in episodes),
        "sequences_per_episode": sum(len(e.sequences) for e in episodes) / n,
        "invalid_action_rate": sum(e.invalid_actions for e in episodes) / max(turns, 1),
        "no_effect_rate": sum(e.no_effect_actions for e in episodes) / max(turns, 1),
        "stopped_unsolved": sum(e.end_reason == "stop" and not e.solved for e in episodes) / n,
        "truncated_reply_rate": sum(e.truncated_replies for e in episodes) / max(turns, 1),
        "sequence_tokens_mean": sum(len(s.token_ids) for e in episodes for s in e.sequences)
        / max(sum(len(e.sequences) for e in episodes), 1),
    }
    for reason in ("stop", "turn_limit", "context_limit", "invalid"):
        metrics[f"end_{reason}"] = sum(e.end_reason == reason for e in episodes) / n
    return metrics
