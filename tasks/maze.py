"""The maze task: a faithful, dependency-light re-implementation of VisGym's `maze_2d`, in our style.

A maze is a square grid of cells, each either a wall or a path. Rooms sit at odd (row, col)
coordinates, the outer ring is wall, and the cells between two neighbouring rooms are carved
open by Wilson's algorithm, which yields a *perfect* maze (the rooms form a spanning tree, so
there is exactly one path between any two rooms), drawn uniformly among all perfect mazes.

The agent (a blue circle) starts in one interior corner and must reach the red target in the
opposite corner, then say stop. Each turn the model sees a rendered image plus a short text and
replies with one action string, e.g. `<think>...</think><answer>('move', 0)</answer>`.

    python -m tasks.maze --difficulty small --seed 0 --out maze_episode.gif

`MazeTask` is the env.Task the trainer plays (--task maze). tasks/visgym_maze.py is VisGym's own
(--task visgym-maze): `generate_maze_visgym` (here, beside ours: both are the maze core) gives
VisGym's maze, start and goal for a seed, checked against facts recorded from VisGym's own code
(tests/data/visgym_maze2d.json), and that module holds the rest of its style (its drawing, prompt,
feedback, per-step budget text and reply parsing) on top of `MazeTask`.
"""

import random
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

import env

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

def action_string(action: tuple) -> str:
    """The action string (ACTION_STRINGS, the task's actions) of a parsed ("move", d) or ("stop", "stop")."""
    return STOP_ACTION if action[0] == "stop" else ACTION_STRINGS[action[1]]

# -----------------------------------------------------------------------------
# what the model sees

def draw_board(maze: Maze, cell_px: int) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    """The maze without the agent, an RGB image of (size * cell_px) pixels square: white paths, gray
    walls, the red target; and a pen on it for the agent (ours: render; VisGym's: tasks/visgym_maze.py)."""
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
    return image, draw


def render(maze: Maze, agent, cell_px: int = CELL_PX_TINY) -> Image.Image:
    """The maze as an RGB image of (size * cell_px) pixels square, the agent drawn at `agent`."""
    image, draw = draw_board(maze, cell_px)
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
# the task: a maze played one move per turn (env.Task)

INVALID_FEEDBACK = "Invalid action. Reply with <answer>('move', d)</answer> or <answer>('stop', 'stop')</answer>."
WALL_FEEDBACK = "Cannot move into a wall."


class MazeTask(env.Task):
    """One episode on one maze, in our style: the agent moves one cell per valid move (a move into
    a wall spends the turn and leaves it where it was), and the reward is 1.0 only for stopping on
    the target. What the model is shown and how its reply is read are five methods (`parse`,
    `invalid_feedback`, `describe`, `render`, `text`); tasks/visgym_maze.py replaces them with
    VisGym's and keeps the rules.

    The state is the agent's cell and the cells it has moved off (VisGym's canvas marks them); the
    state key is the cell alone: what the right move depends on.
    """

    name = "maze"
    levels = tuple(DIFFICULTY_SIZES)
    actions = tuple(ACTION_STRINGS)
    instructions = INSTRUCTIONS
    cell_px = CELL_PX_TINY
    generate = staticmethod(generate_maze)

    def __init__(self, level: str, seed: int, max_turns: int = 15, maze: Maze | None = None):
        super().__init__(level, seed, max_turns)
        self.maze = maze or self.generate(DIFFICULTY_SIZES[level], seed)
        self.agent, self.vacated = self.maze.start, set()

    @classmethod
    def of(cls, maze: Maze, max_turns: int = 15, cell_px: int | None = None, **kwargs) -> "MazeTask":
        """The task on a given maze (its size names the level)."""
        level = {size: name for name, size in DIFFICULTY_SIZES.items()}[maze.size]
        task = cls(level, maze.seed, max_turns, maze=maze, **kwargs)
        task.cell_px = cell_px or task.cell_px
        return task

    # --- what the model sees and how its reply is read (our style)

    def parse(self, reply: str):
        action = parse_action(reply)
        return None if action is None else action_string(action)

    def invalid_feedback(self, reply: str) -> str:
        return INVALID_FEEDBACK

    def describe(self, outcome: str) -> str:
        """What the next turn says an action did: outcome is "solved", "stopped_off" or "moved:<d>"."""
        if outcome.startswith("moved:"):
            return f"Moved {MOVE_NAMES[int(outcome[6:])]}."
        return "Reached the target." if outcome == "solved" else "Stopped off the target."

    def render(self) -> Image.Image:
        return render(self.maze, self.agent, self.cell_px)

    def text(self, feedback: str) -> str:
        return observation_text(self.turn, feedback)

    # --- the rules

    def start(self):
        self.agent, self.vacated = self.maze.start, set()

    def apply(self, action) -> tuple[float, bool, str]:
        if action == STOP_ACTION:
            # the only rewarded event: reaching the target without saying stop earns nothing
            on_goal = self.agent == self.maze.goal
            return (1.0 if on_goal else 0.0), True, self.describe("solved" if on_goal else "stopped_off")
        move = ACTION_STRINGS.index(action)
        dr, dc = MOVE_DELTAS[move]
        target = (self.agent[0] + dr, self.agent[1] + dc)
        if not self.maze.is_open(target):
            return 0.0, False, WALL_FEEDBACK  # the same words in both styles
        self.vacated.add(self.agent)
        self.agent = target
        return 0.0, False, self.describe(f"moved:{move}")

    def state_key(self):
        return self.agent

    def state(self):
        return (self.agent, tuple(sorted(self.vacated)))

    def set_state(self, state):
        agent, vacated = state
        if not self.maze.is_open(tuple(agent)):
            raise ValueError(f"cannot restore to cell {tuple(agent)}: not an open cell of the maze")
        self.agent, self.vacated = tuple(agent), {tuple(c) for c in vacated}

    def legal_actions(self) -> list:
        """Every move into an open cell, and stop on the goal."""
        moves = [ACTION_STRINGS[m] for m, (dr, dc) in MOVE_DELTAS.items()
                 if self.maze.is_open((self.agent[0] + dr, self.agent[1] + dc))]
        return moves + [STOP_ACTION] if self.agent == self.maze.goal else moves

    def is_decision_point(self) -> bool:
        """A fork: another open way than the one in and the one out (at the start, which has no way
        in: more than one way out), or the goal (stop, or walk on)."""
        ways = len(self.legal_actions())
        return self.agent == self.maze.goal or ways >= 3 or (self.agent == self.maze.start and ways >= 2)

    def solve(self) -> list:
        return solve(self.maze, self.agent)

    def held_out_key(self) -> bytes:
        return self.maze.layout_key()


def training_mazes(difficulty: str, n: int, eval_n: int = 64, task_class=MazeTask, seed: int = 0) -> list:
    """The first n mazes of a run's training stream (env.TrainingStream)."""
    return [t.maze for t in env.TrainingStream(task_class, difficulty, eval_n=eval_n, seed=seed).first(n)]


def eval_mazes(difficulty: str, n: int = 64, task_class=MazeTask) -> list:
    """The held-out mazes: seeds 0..n-1 (env.held_out)."""
    return [t.maze for t in env.held_out(task_class, difficulty, n)]

# -----------------------------------------------------------------------------
# play the shortest solution of one maze and save it as an animation

if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Render the solved episode of one maze.")
    parser.add_argument("--difficulty", default="small", choices=list(DIFFICULTY_SIZES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--visgym", action="store_true", help="VisGym's maze for the seed (our drawing and texts "
                        "either way; tasks/visgym_maze.py draws VisGym's)")
    parser.add_argument("--cell-px", type=int, default=None, help="default: 32")
    parser.add_argument("--out", default="maze_episode.gif", help="animated GIF; a PNG of the last frame goes next to it")
    args = parser.parse_args()

    maze = (generate_maze_visgym if args.visgym else generate_maze)(DIFFICULTY_SIZES[args.difficulty], args.seed)
    actions = solve(maze)
    game = MazeTask.of(maze, max_turns=len(actions), cell_px=args.cell_px)
    frames = [game.reset().image]
    print(f"{args.difficulty} maze, seed {args.seed}: start {maze.start}, goal {maze.goal}")
    for action in actions:
        obs = game.step(game.reply(action))
        frames.append(obs.image)
        print(f"{action:18s} -> {obs.text}")
    out = Path(args.out)
    frames[0].save(out, save_all=True, append_images=frames[1:], duration=400, loop=0)
    frames[-1].save(out.with_suffix(".png"))
    print(f"{len(actions)} actions, reward {obs.reward}, wrote {out} and {out.with_suffix('.png')}")
