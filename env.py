"""
The visual maze environment: a faithful, dependency-light re-implementation of VisGym's `maze_2d`.

A maze is a square grid of cells, each either a wall or a path. Rooms sit at odd (row, col)
coordinates, the outer ring is wall, and the cells between two neighbouring rooms are carved
open by Wilson's algorithm, which yields a *perfect* maze (the rooms form a spanning tree, so
there is exactly one path between any two rooms), drawn uniformly among all perfect mazes.

The agent (a blue circle) starts in one interior corner and must reach the red target in the
opposite corner, then say stop. Each turn the model sees a rendered image plus a short text and
replies with one action string, e.g. `<think>...</think><answer>('move', 0)</answer>`.

    python env.py --difficulty small --seed 0 --out maze_episode.gif

Two styles. "ours" (the default, used for all training so far) is described above and lives here.
"visgym" is a VisGym-compatible mode, checked against facts recorded from VisGym's own code
(tests/data/visgym_maze2d.json): `generate_maze_visgym` (here, beside ours: both are the maze core)
gives VisGym's maze, start and goal for a seed; visgym.py holds the rest of that style (its drawing,
prompt, feedback, per-step budget text and reply parsing) as `VisGymMazeEnv`, built on `MazeEnv`.
"""

import random
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

# -----------------------------------------------------------------------------
# constants shared with the rest of the project

# grid side length, outer walls included; VisGym defines easy (9) and hard (11), the two smaller
# ones are ours, for tiny models and quick experiments
DIFFICULTY_SIZES = {"tiny": 5, "small": 7, "easy": 9, "hard": 11}

MOVE_NAMES = {0: "right", 1: "up", 2: "left", 3: "down"}
MOVE_DELTAS = {0: (0, 1), 1: (-1, 0), 2: (0, -1), 3: (1, 0)}  # (d_row, d_col); row grows downwards
# the tokenizer gives each of these strings its own token, so their spelling must never change
ACTION_STRINGS = [f"('move', {d})" for d in MOVE_NAMES] + ["('stop', 'stop')"]
STOP_ACTION = ACTION_STRINGS[-1]

CELL_PX_VISGYM = 25  # VisGym's cell size
CELL_PX_TINY = 32  # vision patch 16 x spatial merge 2: one cell is exactly one merged visual token
WALL_RGB = (169, 169, 169)
PATH_RGB = (255, 255, 255)
GOAL_RGB = (255, 0, 0)
AGENT_RGB = (0, 0, 255)
AGENT_RADIUS_FRACTION = 0.25  # VisGym: radius 6.25 px in a 25 px cell

# a model reply longer than this is rejected outright, before any parsing work is done
MAX_ACTION_CHARS = 4096

INSTRUCTIONS = (
    "You are in a maze shown as an image: gray cells are walls, white cells are paths. "
    "You are the blue circle; your goal is the red square. "
    "Each turn, reply with exactly one action: <answer>('move', d)</answer> "
    "with d 0=right, 1=up, 2=left, 3=down, or <answer>('stop', 'stop')</answer> "
    "once you are on the red square. You succeed only if you stop on it."
)

# -----------------------------------------------------------------------------
# the maze itself

@dataclass(frozen=True)
class Maze:
    walls: tuple  # tuple of rows, each a tuple of bool, True = wall; tuples keep Maze hashable
    start: tuple  # (row, col) of the agent's first cell
    goal: tuple  # (row, col) of the red target
    seed: int  # the seed it was generated from (not part of the layout)

    @property
    def size(self) -> int:
        return len(self.walls)

    def is_open(self, cell) -> bool:
        r, c = cell
        return 0 <= r < self.size and 0 <= c < self.size and not self.walls[r][c]

    def layout_key(self) -> bytes:
        # The walls alone. Start and goal are left out on purpose: a training maze with an
        # evaluation maze's walls and its corners swapped would still teach that maze's paths.
        # Two seeds may well produce the same layout, especially when small.
        return bytes(wall for row in self.walls for wall in row)


def generate_maze(size: int, seed: int) -> Maze:
    """A perfect maze of `size` x `size` cells, carved by Wilson's algorithm; deterministic in `seed`."""
    if not isinstance(size, int) or size < 5 or size % 2 == 0:
        raise ValueError(f"maze size must be an odd integer >= 5 (walls included), got {size!r}")
    rng = random.Random(seed)
    walls = [[True] * size for _ in range(size)]
    rooms = [(r, c) for r in range(1, size - 1, 2) for c in range(1, size - 1, 2)]

    def neighbour_rooms(room):
        r, c = room
        return [(r + 2 * dr, c + 2 * dc) for dr, dc in MOVE_DELTAS.values()
                if 1 <= r + 2 * dr <= size - 2 and 1 <= c + 2 * dc <= size - 2]

    # Wilson's algorithm: grow a tree from one room. From each room not yet in the tree, take a
    # random walk until it hits the tree, then add the walk's loop-erased path to the tree.
    # Remembering only the *last* exit from each room erases the loops for free. The result is a
    # uniformly random spanning tree, unlike depth-first carving, which favours long corridors.
    first = rng.choice(rooms)
    in_tree = {first}
    walls[first[0]][first[1]] = False
    for origin in rooms:
        last_exit = {}
        room = origin
        while room not in in_tree:
            last_exit[room] = rng.choice(neighbour_rooms(room))
            room = last_exit[room]
        room = origin
        while room not in in_tree:
            nxt = last_exit[room]
            walls[room[0]][room[1]] = False
            walls[(room[0] + nxt[0]) // 2][(room[1] + nxt[1]) // 2] = False  # the wall in between
            in_tree.add(room)
            room = nxt

    # start and goal sit at opposite interior corners; like VisGym, the seed picks one of the four
    # (start, goal) assignments: either diagonal, in either direction
    near, far = 1, size - 2
    start, goal = rng.choice([
        ((near, near), (far, far)), ((far, far), (near, near)),
        ((far, near), (near, far)), ((near, far), (far, near)),
    ])
    return Maze(walls=tuple(tuple(row) for row in walls), start=start, goal=goal, seed=seed)


def generate_maze_visgym(size: int, seed: int) -> Maze:
    """VisGym's maze_2d maze for `seed`: the same walls, start and goal as its `reset(seed=seed)`.

    Also Wilson's algorithm, so the same distribution of layouts as `generate_maze`, but VisGym's
    exact sequence of random draws, which this follows step by step.
    """
    if not isinstance(size, int) or size < 5 or size % 2 == 0:
        raise ValueError(f"maze size must be an odd integer >= 5 (walls included), got {size!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"VisGym seeds are non-negative integers, got {seed!r}")
    # gymnasium's seeding.np_random(seed) is numpy's PCG64 seeded through a SeedSequence, which is
    # what default_rng builds; its first draw seeds the maze generator's own Python RNG, its
    # second picks the corners
    np_rng = np.random.default_rng(seed)
    rng = random.Random(int(np_rng.integers(2**32)))
    walls = [[True] * size for _ in range(size)]
    # the generator's walk directions, in its own order (not the action order): right, down, left, up
    steps = [(0, 1), (1, 0), (0, -1), (-1, 0)]

    def on_grid(room):
        return 1 <= room[0] <= size - 2 and 1 <= room[1] <= size - 2

    def carve(cell):
        walls[cell[0]][cell[1]] = False

    # rooms not yet in the tree, in row-major order; draws index into this list, so its order and
    # the order of removals matter
    outside = [(r, c) for r in range(1, size - 1, 2) for c in range(1, size - 1, 2)]
    first = outside.pop(rng.randint(0, len(outside) - 1))
    in_tree = {first}
    carve(first)
    while outside:
        # a walk from a random room outside the tree until it hits the tree; each room keeps its
        # last exit, which erases the loops
        origin = outside[rng.randint(0, len(outside) - 1)]
        last_exit = {}
        room = origin
        while room not in in_tree:
            d = rng.randint(0, 3)
            while not on_grid((room[0] + 2 * steps[d][0], room[1] + 2 * steps[d][1])):
                d = rng.randint(0, 3)  # a step off the grid is redrawn, not skipped
            last_exit[room] = d
            room = (room[0] + 2 * steps[d][0], room[1] + 2 * steps[d][1])
        # add the loop-erased walk to the tree, opening each room and the wall after it
        room = origin
        while room not in in_tree:
            in_tree.add(room)
            outside.remove(room)
            carve(room)
            dr, dc = steps[last_exit[room]]
            carve((room[0] + dr, room[1] + dc))
            room = (room[0] + 2 * dr, room[1] + 2 * dc)
    # the four (start, goal) pairs in VisGym's order: both diagonals, both directions
    near, far = 1, size - 2
    start, goal = [
        ((near, near), (far, far)), ((far, far), (near, near)),
        ((far, near), (near, far)), ((near, far), (far, near)),
    ][int(np_rng.integers(0, 4))]
    return Maze(walls=tuple(tuple(row) for row in walls), start=start, goal=goal, seed=seed)


MAZE_STYLES = ("ours", "visgym")
_GENERATORS = {"ours": generate_maze, "visgym": generate_maze_visgym}


def cell_px_of(style: str, cell_px: int | None = None) -> int:
    """The cell size a style draws with: `cell_px` if given (non-zero), else the style's own."""
    return cell_px or (CELL_PX_VISGYM if style == "visgym" else CELL_PX_TINY)


def _check_style(style: str) -> str:
    if style not in MAZE_STYLES:
        raise ValueError(f"unknown style {style!r}; choose one of {list(MAZE_STYLES)}")
    return style


def goal_distances(maze: Maze) -> dict:
    """The shortest-path distance (in moves) from every open cell to the goal: a breadth-first
    search outward from the goal."""
    dist, frontier = {maze.goal: 0}, deque([maze.goal])
    while frontier:
        cell = frontier.popleft()
        for dr, dc in MOVE_DELTAS.values():
            nxt = (cell[0] + dr, cell[1] + dc)
            if maze.is_open(nxt) and nxt not in dist:
                dist[nxt] = dist[cell] + 1
                frontier.append(nxt)
    return dist


def solve(maze: Maze, start=None) -> list:
    """Shortest action sequence from `start` (default: maze.start) to the goal, ending with stop:
    from each cell, the move to the neighbour one step nearer the goal (goal_distances)."""
    start = tuple(maze.start if start is None else start)
    if not maze.is_open(start):
        raise ValueError(f"start {start} is not an open cell of the maze")
    dist = goal_distances(maze)
    if start not in dist:
        raise ValueError("the goal is unreachable from start")  # impossible in a perfect maze
    actions, cell = [], start
    while cell != maze.goal:
        for d, (dr, dc) in MOVE_DELTAS.items():
            nxt = (cell[0] + dr, cell[1] + dc)
            if dist.get(nxt) == dist[cell] - 1:
                break
        actions.append(ACTION_STRINGS[d])
        cell = nxt
    return actions + [STOP_ACTION]

# -----------------------------------------------------------------------------
# reading the model's reply

# a tight grammar for the two action forms: either quote style, any whitespace, nothing else
_MOVE_RE = re.compile(r"""\(\s*(['"])move\1\s*,\s*([0-3])\s*\)""")
_STOP_RE = re.compile(r"""\(\s*(['"])stop\1\s*,\s*(['"])stop\2\s*\)""")


def parse_action(text):
    """('move', d) or ('stop', 'stop') from a model reply, or None if it holds no valid action.

    Accepts `<answer>ACTION</answer>` (the last answer block counts; anything inside <think> is
    ignored) or a bare ACTION string. Never raises, never evaluates the text.
    """
    if not isinstance(text, str) or len(text) > MAX_ACTION_CHARS:
        return None
    # only the text after the reasoning counts: an <answer> mentioned while thinking is not one
    think_end = text.rfind("</think>")
    if think_end >= 0:
        text = text[think_end + len("</think>"):]
    # Plain string searches from the right, rather than a regex, keep this linear in the length.
    # A missing </answer> is tolerated, as generation is often stopped on that very string, and
    # so is a missing <answer>, as a prompt may end with it.
    open_at = text.rfind("<answer>")
    if open_at >= 0:
        text = text[open_at + len("<answer>"):]
        close_at = text.find("</answer>")
        text = text if close_at < 0 else text[:close_at]
    elif (close_at := text.rfind("</answer>")) >= 0:
        text = text[:close_at]
    text = text.strip().strip("`").strip()
    if (m := _MOVE_RE.fullmatch(text)):
        return ("move", int(m.group(2)))
    if _STOP_RE.fullmatch(text):
        return ("stop", "stop")
    return None

# -----------------------------------------------------------------------------
# what the model sees

def render(maze: Maze, agent, cell_px: int = CELL_PX_TINY) -> Image.Image:
    """The maze as an RGB image of (size * cell_px) pixels square, the agent drawn at `agent`."""
    image = Image.new("RGB", (maze.size * cell_px, maze.size * cell_px), PATH_RGB)
    draw = ImageDraw.Draw(image)

    def fill_cell(cell, rgb):
        x0, y0 = cell[1] * cell_px, cell[0] * cell_px  # (row, col) -> (x, y) pixels
        draw.rectangle([x0, y0, x0 + cell_px - 1, y0 + cell_px - 1], fill=rgb)  # bounds inclusive

    for r, row in enumerate(maze.walls):
        for c, wall in enumerate(row):
            if wall:
                fill_cell((r, c), WALL_RGB)
    fill_cell(maze.goal, GOAL_RGB)
    # the agent is drawn last, so it covers the target once it stands on it; no anti-aliasing,
    # so every pixel has one of the four pure colours
    cx, cy = (agent[1] + 0.5) * cell_px, (agent[0] + 0.5) * cell_px
    radius = AGENT_RADIUS_FRACTION * cell_px
    draw.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], fill=AGENT_RGB)
    return image


def observation_text(step: int, feedback=None) -> str:
    """The user text of a turn: its number and what the previous action did."""
    return f"This is step {step}." + (f" {feedback}" if feedback else "")

# -----------------------------------------------------------------------------
# the multi-turn environment

INVALID_FEEDBACK = "Invalid action. Reply with <answer>('move', d)</answer> or <answer>('stop', 'stop')</answer>."
WALL_FEEDBACK = "Cannot move into a wall."


@dataclass
class Observation:
    image: Image.Image  # the maze after the action
    text: str  # observation_text for the next user turn
    reward: float  # 1.0 only for stopping on the target
    done: bool  # the episode is over
    valid: bool  # the action text parsed to an action (style "visgym": one VisGym executes)
    feedback: str  # what the action did ("" after reset)
    bumped: bool = False  # a move into a wall: the agent stayed put and the turn is spent


class MazeEnv:
    """One episode on one maze, in our style. Each step consumes a turn, whether the action was
    valid or not; the reward is 1.0 only for stopping on the target.

    The first user turn is `instructions + "\n" + obs.text`, later ones `obs.text`. What the model
    is shown and how its reply is read are four methods (`read_action`, `feedback`, `draw`,
    `turn_text`); visgym.VisGymMazeEnv replaces them with VisGym's and keeps the rules.
    """

    default_cell_px = CELL_PX_TINY
    instructions = INSTRUCTIONS

    def __init__(self, maze: Maze, max_turns: int = 15, cell_px: int | None = None):
        self.maze = maze
        self.max_turns = max_turns
        self.cell_px = cell_px or self.default_cell_px
        self.reset()

    # --- what the model sees and how its reply is read (our style)

    def read_action(self, text: str):
        """(('move', d) or ('stop', 'stop') or None, the feedback when nothing else is said)."""
        return parse_action(text), INVALID_FEEDBACK

    def feedback(self, outcome: str, said: str) -> str:
        """What the next turn says an action did: outcome is "solved", "stopped_off" or "moved:<d>"."""
        if outcome.startswith("moved:"):
            return f"Moved {MOVE_NAMES[int(outcome[6:])]}."
        return "Reached the target." if outcome == "solved" else "Stopped off the target."

    def draw(self) -> Image.Image:
        return render(self.maze, self.agent, self.cell_px)

    def turn_text(self, feedback: str) -> str:
        return observation_text(self.turn, feedback)

    # --- the rules

    def first_text(self, first: Observation) -> str:
        """The first user turn's text: the task's instructions, then the first observation."""
        return self.instructions + "\n" + first.text

    def reset(self) -> Observation:
        self.agent = self.maze.start
        self.vacated = set()  # cells the agent has moved off (VisGym's canvas keeps a mark there)
        self.turn = 0  # actions taken so far
        self.done = False
        self.solved = False
        self.end_reason = None  # "stop" or "turn_limit" once done
        return self._observe(reward=0.0, valid=True, feedback="")

    def restore(self, agent, turn: int, vacated=()) -> Observation:
        """Put the episode back into a state it passed through: the agent on `agent` after `turn`
        actions, having moved off the cells `vacated` (VisGym's canvas marks them). The next step
        then plays exactly as it did from that state (branch.py replays forks this way); the
        observation is the state's picture (its text carries no feedback)."""
        if not self.maze.is_open(agent) or not 0 <= turn < self.max_turns:
            raise ValueError(f"cannot restore to cell {agent} after {turn} turns: not an open cell, "
                             f"or not a turn before the limit {self.max_turns}")
        self.agent, self.turn, self.vacated = tuple(agent), turn, set(vacated)
        self.done, self.solved, self.end_reason = False, False, None
        return self._observe(reward=0.0, valid=True, feedback="")

    def step(self, action_text: str) -> Observation:
        if self.done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        self.turn += 1
        action, feedback = self.read_action(action_text)
        reward, bumped = 0.0, False
        if action is None:
            pass  # feedback says why
        elif action[0] == "stop":
            # the only rewarded event: reaching the target without saying stop earns nothing
            self.solved = self.agent == self.maze.goal
            reward = 1.0 if self.solved else 0.0
            feedback = self.feedback("solved" if self.solved else "stopped_off", feedback)
            self.done, self.end_reason = True, "stop"
        else:
            dr, dc = MOVE_DELTAS[action[1]]
            target = (self.agent[0] + dr, self.agent[1] + dc)
            if self.maze.is_open(target):
                self.vacated.add(self.agent)
                self.agent = target
                feedback = self.feedback(f"moved:{action[1]}", feedback)
            else:
                feedback, bumped = WALL_FEEDBACK, True  # the same words in both styles
        if not self.done and self.turn >= self.max_turns:
            self.done, self.end_reason = True, "turn_limit"
        return self._observe(reward=reward, valid=action is not None, feedback=feedback, bumped=bumped)

    def _observe(self, reward, valid, feedback, bumped=False) -> Observation:
        return Observation(image=self.draw(), text=self.turn_text(feedback), reward=reward, done=self.done,
                           valid=valid, feedback=feedback, bumped=bumped)

# -----------------------------------------------------------------------------
# evaluation and training mazes

TRAIN_SEED_OFFSET = 1_000_000  # training seeds start here, far from the evaluation seeds 0..n-1
STREAM_SEED_STRIDE = 10_000_000  # run seed s plays the training seeds from TRAIN_SEED_OFFSET + s x this
MAX_CONSECUTIVE_SKIPS = 10_000


def _size_of(difficulty: str) -> int:
    if difficulty not in DIFFICULTY_SIZES:
        raise ValueError(f"unknown difficulty {difficulty!r}; choose one of {list(DIFFICULTY_SIZES)}")
    return DIFFICULTY_SIZES[difficulty]


def eval_mazes(difficulty: str, n: int = 64, style: str = "ours") -> list:
    """The fixed evaluation set: seeds 0..n-1. It may repeat layouts, small sizes especially."""
    generate = _GENERATORS[_check_style(style)]
    return [generate(_size_of(difficulty), seed) for seed in range(n)]


def first_training_mazes(difficulty: str, n: int, eval_n: int = 64, style: str = "ours", seed: int = 0) -> list:
    """The first n mazes of the training stream (what a run with train_pool n trains on): played
    greedy beside the evaluation mazes, they tell memorising from generalising."""
    stream = TrainMazeStream(difficulty, eval_n=eval_n, style=style, seed=seed)
    return [stream.next() for _ in range(n)]


class TrainMazeStream:
    """An endless, resumable stream of training mazes, none with the layout of an evaluation maze.

    Seeds are disjoint from evaluation by construction, but layouts (wall patterns) are not:
    there are only 4 spanning trees of 2x2 rooms, so "tiny" (5x5) has just 4 layouts and the
    evaluation mazes cover them all (then next() raises; lower eval_n). "small" (7x7) has 192,
    of which 64 evaluation mazes take about a quarter; larger sizes have far too many to collide.

    The run's seed picks the stream (seed s: the training seeds from TRAIN_SEED_OFFSET +
    s x STREAM_SEED_STRIDE on), so runs of several seeds train on different mazes; the
    evaluation mazes are the same for all.
    """

    def __init__(self, difficulty: str, position: int = 0, eval_n: int = 64, pool: int = 0, style: str = "ours",
                 seed: int = 0):
        if eval_n > TRAIN_SEED_OFFSET:
            raise ValueError(f"eval_n must be at most {TRAIN_SEED_OFFSET} to keep seeds disjoint")
        if pool < 0:
            raise ValueError(f"pool must be >= 0 (0: endless), got {pool}")
        self.eval_n = eval_n
        self.difficulty = difficulty
        self.style = _check_style(style)  # which generator; the evaluation set is of the same style
        self.position = position  # seeds consumed so far, skipped ones included
        self.seed = seed
        self._eval_keys = {m.layout_key() for m in eval_mazes(difficulty, eval_n, style)}
        # pool > 0 replays the first `pool` training mazes over and over (a small set to overfit:
        # the check that a learner can learn at all); _pool_end is the seed position just past them
        self.pool = pool
        self._pool_end = self._position_after(pool)

    def _position_after(self, n: int) -> int:
        position = 0
        for _ in range(n):
            position = self._next_from(position)[1]
        return position

    def _next_from(self, position: int) -> tuple:
        """The first training maze at or after seed `position`, and the position after it."""
        for _ in range(MAX_CONSECUTIVE_SKIPS):
            maze = _GENERATORS[self.style](_size_of(self.difficulty),
                                           TRAIN_SEED_OFFSET + self.seed * STREAM_SEED_STRIDE + position)
            position += 1
            if maze.layout_key() not in self._eval_keys:
                return maze, position
        raise RuntimeError(
            f"{MAX_CONSECUTIVE_SKIPS} consecutive {self.difficulty!r} training mazes all share a layout "
            f"with one of the {self.eval_n} evaluation mazes: this size has too few layouts; lower eval_n"
        )

    def next(self) -> Maze:
        if self.pool and self.position >= self._pool_end:
            self.position = 0
        maze, self.position = self._next_from(self.position)
        return maze

    __next__ = next

    def __iter__(self):
        return self

    def state_dict(self) -> dict:
        """Everything the stream is built from, and where it stands (the style only when not the
        default, so that states saved before styles existed read the same)."""
        state = {"difficulty": self.difficulty, "eval_n": self.eval_n, "pool": self.pool, "position": self.position,
                 "seed": self.seed}
        return state if self.style == "ours" else {**state, "style": self.style}

    def load_state_dict(self, state: dict) -> None:
        """Continue a saved stream; one built otherwise (other size, style, evaluation set, pool or
        seed) is refused. (States saved before eval_n and pool were recorded are taken as this
        stream's; one saved before the stream followed the run's seed was seed 0's.)"""
        built = {k: state.get(k, getattr(self, k)) for k in ("difficulty", "eval_n", "pool")}
        built["style"] = _check_style(state.get("style", "ours"))
        built["seed"] = int(state.get("seed", 0))
        mine = {k: getattr(self, k) for k in built}
        if built != mine:
            raise ValueError(f"the saved maze stream was built with {built}, this one with {mine}")
        self.position = int(state["position"])

# -----------------------------------------------------------------------------
# play the shortest solution of one maze and save it as an animation

if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Render the solved episode of one maze.")
    parser.add_argument("--difficulty", default="small", choices=list(DIFFICULTY_SIZES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--style", default="ours", choices=list(MAZE_STYLES), help="the mazes' generator "
                        "(our drawing and texts either way; visgym.py draws VisGym's)")
    parser.add_argument("--cell-px", type=int, default=None, help="default: 32")
    parser.add_argument("--out", default="maze_episode.gif", help="animated GIF; a PNG of the last frame goes next to it")
    args = parser.parse_args()

    maze = _GENERATORS[args.style](DIFFICULTY_SIZES[args.difficulty], args.seed)
    actions = solve(maze)
    env = MazeEnv(maze, max_turns=len(actions), cell_px=args.cell_px)
    frames = [env.reset().image]
    print(f"{args.difficulty} maze, seed {args.seed}: start {maze.start}, goal {maze.goal}")
    for action in actions:
        obs = env.step(action)
        frames.append(obs.image)
        print(f"{action:18s} -> {obs.text}")
    out = Path(args.out)
    frames[0].save(out, save_all=True, append_images=frames[1:], duration=400, loop=0)
    frames[-1].save(out.with_suffix(".png"))
    print(f"{len(actions)} actions, reward {obs.reward}, wrote {out} and {out.with_suffix('.png')}")
