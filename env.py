"""The environment interface: what a task gives the trainer, and the rules every task shares.

A task is a puzzle the policy plays over several turns, looking at a picture each turn:

    task = tasks.make("maze", level="small", seed=3, max_turns=15)   # tasks/__init__.py
    obs = task.reset()                      # the first picture and text
    user_turn = task.instructions + "\n" + obs.text
    obs = task.step(reply)                  # then each reply: its reward, the next picture and text
    ... until obs.done (the task ended the episode, or the turn limit did)

The trainer (rollout, grpo, branch, evaluation, train) knows nothing else about a task: a new one
is one module in tasks/ with a subclass of `Task` that fills in the methods below under "what a
task implements". The rest is here, the same for every task: turns and the turn limit, an invalid
reply (one that `parse` cannot read spends its turn, changes nothing, and counts as invalid),
snapshots, copies, and the split of the seeds into held-out and training puzzles.

Which trainer feature needs which method (`features` says what a task class has):

    method                    needed by                                       without it
    instructions, parse,      every rollout and evaluation                    (required)
      apply, render,
      state_key, start
    reply                     SFT demonstrations, branch rollouts' forced     "<answer>action</answer>"
                              replies
    text                      what each later user turn says                  "This is step N." + feedback
    state, set_state          branch rollouts (a fork is replayed from its    no branch rollouts
                              snapshot), evaluation's per-turn records
    legal_actions             branch rollouts: the replies forced at a fork   every action in `actions`
    is_decision_point         branch rollouts: which states are forks         more than one legal action
    solve                     SFT demonstrations (sft.py), whether a held-    no SFT; "fits the turn limit"
                              out puzzle fits the turn limit, the share of    and the optimal share unknown;
                              branch targets that are optimal; two branch     those options refused
                              options, off in the recipe (--branch-tiebreak
                              progress, --branch-winnable-only)
    held_out_key              keeping training puzzles off the held-out ones  the seed (seeds never collide)

Synchronous and plain: a task is a Python object whose state is plain data. `state_key` is what
GiGPO groups turns by (the same key: the same situation, so their moves are compared) and what
branch rollouts find forks by; `reset`, `step`, `snapshot` and `restore` are the trainer's handles.
`task_check.py` checks that a task keeps these promises.
"""

import copy
from dataclasses import dataclass

from PIL import Image

INVALID_FEEDBACK = "Invalid action."  # what a task says about a reply it cannot read, unless it says more


@dataclass
class Observation:
    """What the policy is shown after a turn (or after `reset`)."""
    image: Image.Image  # the state's picture (Task.render)
    text: str  # the next user turn's text (Task.text)
    reward: float  # what the last action earned
    done: bool  # the episode is over
    valid: bool  # the reply named an action (Task.parse); an invalid one spends its turn
    feedback: str  # what the last action did ("" after reset)
    no_effect: bool = False  # a valid action that left the state as it was (a move into a wall)


class Task:
    """One episode of one puzzle. Subclasses implement the methods under "what a task
    implements"; `reset`, `step`, `snapshot`, `restore` and `clone` are the same for every task.

    Attributes the trainer reads: `turn` (actions taken), `done`, `solved` (the episode ended with
    a positive reward), `end_reason` ("stop": the task ended it; "turn_limit"), `max_turns`,
    `level`, `seed`.
    """

    name = ""  # how --task names it (tasks/__init__.py)
    levels: tuple = ()  # the levels it has (--difficulty), easiest first
    actions: tuple = ()  # every action there is (hashable values; a reply names one)
    instructions = ""  # the task, as the first user turn states it before the first observation

    def __init__(self, level: str, seed: int, max_turns: int = 15):
        if level not in self.levels:
            raise ValueError(f"{self.name}: unknown level {level!r}; choose one of {list(self.levels)}")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.level, self.seed, self.max_turns = level, seed, max_turns
        self.turn, self.done, self.solved, self.end_reason = 0, False, False, None

    # ------------------------------------------------------------------ what a task implements

    def start(self):
        """Put the puzzle in its first state (reset calls it)."""
        raise NotImplementedError

    def parse(self, reply: str):
        """The action a reply names (one of `actions`), or None if it names none. Never raises."""
        raise NotImplementedError

    def apply(self, action) -> tuple[float, bool, str]:
        """Play a parsed action: (the reward, whether the task ends the episode, feedback text)."""
        raise NotImplementedError

    def render(self) -> Image.Image:
        """The picture of the current state; a function of the state alone."""
        raise NotImplementedError

    def reply(self, action) -> str:
        """The reply that plays `action`, as the model should learn to write it: what SFT
        demonstrates and branch rollouts force. `parse(reply(a)) == a`. By default the action in
        answer tags, as the shipped tasks' parsers read it."""
        return f"<answer>{action}</answer>"

    def state_key(self):
        """A hashable summary of the state: equal for two turns exactly when they face the same
        situation of this puzzle (the same legal actions with the same outcomes), whatever the
        turn count or the way there."""
        raise NotImplementedError

    def text(self, feedback: str) -> str:
        """The user text that shows the current state, after the last action's `feedback`. By
        default the turn's number, then the feedback."""
        return f"This is step {self.turn}." + (f" {feedback}" if feedback else "")

    def invalid_feedback(self, reply: str) -> str:
        """What the next turn says about a reply `parse` could not read."""
        return INVALID_FEEDBACK

    def state(self):
        """The current state as plain picklable data (set_state puts it back)."""
        raise NotImplementedError

    def set_state(self, state):
        raise NotImplementedError

    def legal_actions(self) -> list:
        """The actions worth trying here, in a fixed order: what branch rollouts force at a fork."""
        return list(self.actions)

    def is_decision_point(self) -> bool:
        """Whether a choice made here matters: where branch rollouts look for forks."""
        return len(self.legal_actions()) > 1

    def solve(self) -> list | None:
        """A shortest list of actions from the current state to success (None: there is none)."""
        raise NotImplementedError

    def held_out_key(self):
        """What makes two puzzles the same one for the held-out split (by default the seed:
        two seeds are two puzzles)."""
        return self.seed

    # ------------------------------------------------------------------ the episode, for every task

    def reset(self) -> Observation:
        self.turn, self.done, self.solved, self.end_reason = 0, False, False, None
        self.start()
        return self._observe(0.0, True, "")

    def step(self, reply: str) -> Observation:
        """One turn: the reply's action (or none), then the turn limit."""
        if self.done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        self.turn += 1
        action = self.parse(reply)
        if action is None:
            reward, ended, feedback, no_effect = 0.0, False, self.invalid_feedback(reply), False
        else:
            before = self.state_key()
            reward, ended, feedback = self.apply(action)
            no_effect = not ended and self.state_key() == before
        if ended:
            self.done, self.end_reason, self.solved = True, "stop", reward > 0
        elif self.turn >= self.max_turns:
            self.done, self.end_reason = True, "turn_limit"
        return self._observe(reward, action is not None, feedback, no_effect)

    def _observe(self, reward: float, valid: bool, feedback: str, no_effect: bool = False) -> Observation:
        return Observation(image=self.render(), text=self.text(feedback), reward=reward, done=self.done,
                           valid=valid, feedback=feedback, no_effect=no_effect)

    def snapshot(self):
        """The episode's state now, as plain data: restore() on a copy of this task puts it back."""
        return (self.turn, self.state())

    def restore(self, snapshot):
        """Put the episode back into a state it passed through (snapshot): the next step plays as
        it did from there (branch.py replays forks this way)."""
        turn, state = snapshot
        if not 0 <= turn < self.max_turns:
            raise ValueError(f"cannot restore to turn {turn}: not a turn before the limit {self.max_turns}")
        self.turn, self.done, self.solved, self.end_reason = turn, False, False, None
        self.set_state(state)

    def clone(self) -> "Task":
        """An independent copy, in the same state (each group member and branch plays its own)."""
        return copy.deepcopy(self)

    def first_text(self, first: Observation) -> str:
        """The first user turn's text: the instructions, then the first observation."""
        return self.instructions + "\n" + first.text


def features(task_class) -> dict[str, bool]:
    """Which optional parts a task class implements (Task's docstring: the features they serve)."""
    def has(name):
        return getattr(task_class, name) is not getattr(Task, name)

    return {"snapshots": has("state") and has("set_state"), "solver": has("solve")}


# ----------------------------------------------------------------------------- held-out and training puzzles

TRAIN_SEED_OFFSET = 1_000_000  # training seeds start here, far from the held-out seeds 0..n-1
STREAM_SEED_STRIDE = 10_000_000  # run seed s plays the training seeds from TRAIN_SEED_OFFSET + s x this
MAX_CONSECUTIVE_SKIPS = 10_000


def held_out(task_class, level: str, n: int, max_turns: int = 15) -> list:
    """The fixed evaluation puzzles: seeds 0..n-1 (they may repeat one another: a small level has
    few puzzles)."""
    return [task_class(level, seed, max_turns) for seed in range(n)]


class TrainingStream:
    """An endless, resumable stream of training puzzles, none the same (held_out_key) as a held-out one.

    Seeds are disjoint from the held-out ones by construction, but puzzles need not be (a small
    level has few distinct ones; if the held-out set holds them all, next() raises: lower eval_n).
    The run's seed picks the stream (seed s: the training seeds from TRAIN_SEED_OFFSET +
    s x STREAM_SEED_STRIDE on), so runs of several seeds train on different puzzles. `pool` > 0
    replays the first `pool` training puzzles over and over (a small set to overfit).
    """

    def __init__(self, task_class, level: str, max_turns: int = 15, position: int = 0, eval_n: int = 64,
                 pool: int = 0, seed: int = 0):
        if eval_n > TRAIN_SEED_OFFSET:
            raise ValueError(f"eval_n must be at most {TRAIN_SEED_OFFSET} to keep seeds disjoint")
        if pool < 0:
            raise ValueError(f"pool must be >= 0 (0: endless), got {pool}")
        self.task_class, self.level, self.max_turns = task_class, level, max_turns
        self.eval_n, self.pool, self.position, self.seed = eval_n, pool, position, seed
        self._held_out = {t.held_out_key() for t in held_out(task_class, level, eval_n, max_turns)}
        self._pool_end = 0  # the seed position just past the pool's puzzles
        for _ in range(pool):
            self._pool_end = self._next_from(self._pool_end)[1]

    def _next_from(self, position: int) -> tuple:
        """The first training puzzle at or after seed `position`, and the position after it."""
        for _ in range(MAX_CONSECUTIVE_SKIPS):
            task = self.task_class(self.level, TRAIN_SEED_OFFSET + self.seed * STREAM_SEED_STRIDE + position,
                                   self.max_turns)
            position += 1
            if task.held_out_key() not in self._held_out:
                return task, position
        raise RuntimeError(f"{MAX_CONSECUTIVE_SKIPS} consecutive {self.task_class.name} {self.level!r} training "
                           f"puzzles are all held-out ones ({self.eval_n}): this level has too few; lower eval_n")

    def next(self):
        if self.pool and self.position >= self._pool_end:
            self.position = 0
        task, self.position = self._next_from(self.position)
        return task

    def first(self, n: int) -> list:
        """The stream's first n puzzles (a run with pool n trains on these), the stream untouched."""
        position, tasks = 0, []
        for _ in range(n):
            task, position = self._next_from(position)
            tasks.append(task)
        return tasks

    def state_dict(self) -> dict:
        """What the stream is built from, and where it stands."""
        return {"task": self.task_class.name, "level": self.level, "eval_n": self.eval_n, "pool": self.pool,
                "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Continue a saved stream; one built otherwise (another task, level, held-out set, pool
        or seed) is refused."""
        built = {k: state.get(k) for k in ("task", "level", "eval_n", "pool", "seed")}
        mine = {k: v for k, v in self.state_dict().items() if k in built}
        if built != mine:
            raise ValueError(f"the saved training stream was built with {built}, this one with {mine}")
        self.position = int(state["position"])


# ----------------------------------------------------------------------------- what a solver tells

def fits_turn_limit(task) -> bool | None:
    """Whether the puzzle can be solved at all within its turn limit (None: no solver to say)."""
    if not features(type(task))["solver"]:
        return None
    start = task.clone()
    start.reset()
    solution = start.solve()
    return solution is not None and len(solution) <= task.max_turns


def is_optimal(task, snapshot, action) -> bool | None:
    """Whether `action`, played from the state `snapshot`, is on a shortest way to success (by the
    task's solver; None: no solver): it succeeds at once, or leaves a solution one action shorter."""
    if not features(type(task))["solver"]:
        return None
    game = task.clone()
    game.max_turns = snapshot[0] + 2  # the turn limit plays no part here
    game.restore(snapshot)
    before = game.solve()
    if game.step(game.reply(action)).done:
        return game.solved
    after = game.solve()
    return before is not None and after is not None and len(after) == len(before) - 1
