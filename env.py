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

Two styles. "ours" (the default, used for all training so far) is described above. "visgym" is a
VisGym-compatible mode, checked against facts recorded from VisGym's own code
(tests/data/visgym_maze2d.json): `generate_maze_visgym` gives VisGym's maze, start and goal for a
seed, and `MazeEnv(..., style="visgym")` uses VisGym's drawing (25 px cells, its canvas leaving a
white hole in the target once the agent has left it), prompt, feedback, per-step budget text and
reply parsing (the last Python-literal tuple anywhere in the reply).

The 25 px cells do not line up with the tiny model's 32 px merged patches (16 px patch x spatial
merge 2). Its processor also resizes to a multiple of 32 px first (225 -> 224, 275 -> 288), so a
9x9 maze arrives as 7x7 visual tokens for 81 cells, each token mixing parts of up to four cells
at varying offsets. The perception pretraining, done at 32 px (one cell = one token), does not
cover that: the style would need its own pretraining on 25 px renders as the processor sees them.
"""

import ast
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
# the VisGym-compatible style: its drawing, texts and reply parsing

def _visgym_disc(cell, cell_px: int) -> list:
    """The pixels of the agent's circle in `cell`, exactly as VisGym's pygame draws it.

    pygame truncates the centre ((col + 0.5) * cell_px) and the radius (cell_px / 4) to integers
    and fills a midpoint circle whose rows span x0 - h .. x0 + h - 1. Counting offsets i, j >= 1
    from that centre point (i = x - x0 + 1 to the right, x0 - x to the left; j alike), a pixel is
    in it when i*i + j*j - max(i, j) < r*r. Checked against pygame 2.6.1 for 8 to 64 px cells.
    """
    radius = int(cell_px / 4)
    x0, y0 = int((cell[1] + 0.5) * cell_px), int((cell[0] + 0.5) * cell_px)

    def offset(p, p0):
        return p - p0 + 1 if p >= p0 else p0 - p

    return [(x, y) for y in range(y0 - radius, y0 + radius) for x in range(x0 - radius, x0 + radius)
            if offset(x, x0) ** 2 + offset(y, y0) ** 2 - max(offset(x, x0), offset(y, y0)) < radius ** 2]


def render_visgym(maze: Maze, agent, cell_px: int = CELL_PX_VISGYM, left=()) -> Image.Image:
    """The frame VisGym shows: `render` in VisGym's drawing, `left` the cells the agent has left.

    VisGym paints onto one canvas per episode and, after each move, covers the old circle with a
    white one instead of redrawing the cell. On white paths that changes nothing; on the target it
    leaves a white hole once the agent has stood there and moved on. Replaying those white
    circles on a fresh drawing gives the same pixels.
    """
    if cell_px < 8:
        raise ValueError(f"VisGym-style cells need cell_px >= 8 (a circle of radius >= 2), got {cell_px}")
    image = Image.new("RGB", (maze.size * cell_px, maze.size * cell_px), PATH_RGB)
    draw = ImageDraw.Draw(image)

    def fill_cell(cell, rgb):
        x0, y0 = cell[1] * cell_px, cell[0] * cell_px
        draw.rectangle([x0, y0, x0 + cell_px - 1, y0 + cell_px - 1], fill=rgb)

    for r, row in enumerate(maze.walls):
        for c, wall in enumerate(row):
            if wall:
                fill_cell((r, c), WALL_RGB)
    fill_cell(maze.goal, GOAL_RGB)
    for cell in set(map(tuple, left)) - {tuple(agent)}:
        draw.point(_visgym_disc(cell, cell_px), fill=PATH_RGB)
    draw.point(_visgym_disc(agent, cell_px), fill=AGENT_RGB)
    return image


# The task text VisGym's get_prompt() gives for an image maze (its height x width; ours are square).
# The wording must match VisGym's character for character, so it is kept verbatim.
_VISGYM_PROMPT = (
    "You are navigating a {size}x{size} maze. The maze consists of walls (gray) and paths (white). "
    "You are represented by a blue circle, and your goal is to reach the red target square.\n\n"
    "Available actions:\n"
    "1. 'move': Move in one of four directions. Format: `('move', direction)` where direction is an integer:\n"
    "   - 0=right, 1=up, 2=left, 3=down\n"
    "2. 'stop': End the navigation session. Format: `('stop', 'stop')`\n\n"
    "Success: You succeed if you reach the red target square.\n\n"
    "Please respond with exactly one action and its arguments in the specified format. For example:\n"
    "- To move right: `('move', 0)`\n"
    "- To move up: `('move', 1)`\n"
    "- To move left: `('move', 2)`\n"
    "- To move down: `('move', 3)`\n"
    "- To stop: `('stop', 'stop')`"
)
# what VisGym's harness appends to the task text when asked to elicit verbalized reasoning
_VISGYM_VERBALIZE = "\n\nVerbalize your reasoning in <think>\u2026</think> and give the final result in <answer>\u2026</answer>."

VISGYM_DONE = "Action executed successfully."  # a move that happened, or any accepted stop
VISGYM_FORMAT_FEEDBACK = (
    "The action format is invalid. The action should be a tuple of two elements with the first "
    "element being the action name and the second element being the action payload."
)
# the characters VisGym's stop payload may use (gymnasium Text's default character set)
_ALPHANUMERIC = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")


def visgym_prompt(size: int, verbalize: bool = False) -> str:
    """VisGym's task text for a `size` x `size` maze (the first user turn puts the step text after it)."""
    return _VISGYM_PROMPT.format(size=size) + (_VISGYM_VERBALIZE if verbalize else "")


def visgym_step_text(step: int, max_turns: int, feedback=None) -> str:
    """The user text VisGym's harness sends before action `step + 1` (`step` actions taken so far).

    It tells the model its remaining budget; after the first turn it leads with the feedback.
    """
    budget = f"This is step {step + 1}. You are allowed to take {max_turns - step - 1} more steps."
    return budget if feedback is None else f"Environment feedback: {feedback}\n\n{budget}"


def _visgym_normalize(text: str) -> str:
    # the clean-up VisGym's harness applies before looking for tuples: code fences and backticks,
    # some models' box and think markers, "Action:" labels, and runs of whitespace
    text = re.sub(r"```[\w-]*", "", text).replace("```", "").replace("`", "")
    for marker in ("<|begin_of_box|>", "<|end_of_box|>", "\u25c1think\u25b7", "\u25c1/think\u25b7"):
        text = text.replace(marker, "")
    text = re.sub(r"\bAction\s*:\s*", " ", text, flags=re.IGNORECASE)
    return re.sub(r"\s+", " ", text).strip()


_BARE_NAME_RE = re.compile(r"^\(\s*([A-Za-z_]\w*)(\s*,)")


def visgym_extract_action(reply: str, verbalize: bool = False) -> str:
    """The action string VisGym's harness hands its environment for a model reply.

    With `verbalize`, only the text between the first <answer> and the next </answer> counts (if
    there is an <answer>). That text is cleaned up, then every parenthesised span (balanced by
    counting brackets, quotes ignored) is a candidate: a bare first name gets quoted, and the span
    counts if `ast.literal_eval` reads a tuple whose first item is a string. The last such span
    wins; with none, the text goes on unchanged (uncleaned), for the environment to reject.
    """
    if verbalize and "<answer>" in reply:
        reply = reply.split("<answer>")[1].split("</answer>")[0]
    text = _visgym_normalize(str(reply))
    if not text:
        return reply
    # match every "(" with its ")" in one pass; an unmatched "(" is never a candidate
    ends, opened = {}, []
    for i, ch in enumerate(text):
        if ch == "(":
            opened.append(i)
        elif ch == ")" and opened:
            ends[opened.pop()] = i
    # the last candidate is the one opening furthest right, so search from the right and stop at
    # the first hit rather than evaluating them all
    for start in sorted(ends, reverse=True):
        span = text[start:ends[start] + 1]
        span = _BARE_NAME_RE.sub(lambda m: f"('{m.group(1)}'{m.group(2)}", span, count=1)
        try:
            value = ast.literal_eval(span)
        except Exception:  # literal_eval raises several kinds (SyntaxError, ValueError, ...)
            continue
        if isinstance(value, tuple) and value and isinstance(value[0], str):
            return span
    return reply


def visgym_interpret(action: str):
    """What VisGym's maze makes of an action string: (("move", d) or ("stop", "stop"), feedback),
    or (None, feedback) when nothing is executed. A move's feedback here is VISGYM_DONE; the
    environment swaps in the wall text if the move is blocked.
    """
    try:
        value = ast.literal_eval(action)
    except Exception as exc:
        return None, f"Cannot parse action string {action!r}: {exc} so the action is invalid."
    if not isinstance(value, tuple) or len(value) != 2:
        return None, VISGYM_FORMAT_FEEDBACK
    name, payload = value
    if name == "move":
        # VisGym's Discrete(4) takes any int in range, bools included (True is 1); a huge int
        # makes VisGym raise, here it is merely out of range
        if isinstance(payload, int) and 0 <= payload < 4:
            return ("move", int(payload)), VISGYM_DONE
    elif name == "stop":
        # VisGym's Text(4): any string of 1 to 4 ASCII letters or digits stops the episode
        if isinstance(payload, str) and 1 <= len(payload) <= 4 and set(payload) <= _ALPHANUMERIC:
            return ("stop", "stop"), VISGYM_DONE
    else:
        return None, f"The action name '{name}' is not recognized in the available action space."
    return None, f"The action {payload} is not in the valid action space of {name} so nothing is executed."


def parse_action_visgym(reply: str, verbalize: bool = False):
    """A model reply read the way VisGym reads it: (action or None, feedback); see the two steps above."""
    return visgym_interpret(visgym_extract_action(reply, verbalize))


# -----------------------------------------------------------------------------
# SkyRL's shaped reward, for comparison only (the strict reward of MazeEnv stays the default)

_SKYRL_TAG_RES = [re.compile(rf"<{tag}>(.*?)</{tag}>", re.DOTALL) for tag in ("observation", "justification", "action")]


def skyrl_shaped_reward(replies, solved: bool) -> float:
    """The episode reward of SkyRL's VisGym SFT recipe: 0.8 x task + 0.2 x the share of well-formed turns.

    Source: NovaSky-AI/SkyRL, examples/train/visgym/env_sft.py (commit a9564572). A turn is
    well-formed when the first <observation>, <justification> and <action> blocks of its reply are
    all present and non-blank; the share counts every turn of the episode. SkyRL pays it once, on
    the last turn, and its pass metric is reward > 0, so under this reward an unsolved episode with
    one well-formed turn already "passes": compare solved episodes, not that metric.
    """
    replies = list(replies)
    if not replies:
        raise ValueError("an episode has at least one reply")
    well_formed = sum(all((m := tag.search(r)) and m.group(1).strip() for tag in _SKYRL_TAG_RES) for r in replies)
    return 0.8 * float(bool(solved)) + 0.2 * well_formed / len(replies)

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
    """One episode on one maze. Each step consumes a turn, whether the action was valid or not.

    style "ours" (default): our instructions, texts, strict parser and 32 px cells. style "visgym":
    VisGym's prompt (`instructions`), its texts, parser and drawing at 25 px cells, as its harness
    runs it with feedback on (`verbalize` adds its <think>/<answer> request and reads the first
    <answer> block). Either way the first user turn is `instructions + "\n" + obs.text`, later
    ones `obs.text`; the reward is 1.0 only for stopping on the target.
    """

    def __init__(self, maze: Maze, max_turns: int = 15, cell_px: int | None = None,
                 style: str = "ours", verbalize: bool = False):
        self.maze = maze
        self.max_turns = max_turns
        self.style = _check_style(style)
        if verbalize and style != "visgym":
            raise ValueError("verbalize is a VisGym-style option")
        self.verbalize = verbalize
        self.cell_px = cell_px_of(style, cell_px)
        self.instructions = visgym_prompt(maze.size, verbalize) if style == "visgym" else INSTRUCTIONS
        self.reset()

    def first_text(self, first: Observation) -> str:
        """The first user turn's text: the task's instructions, then the first observation."""
        return self.instructions + "\n" + first.text

    def reset(self) -> Observation:
        self.agent = self.maze.start
        self.left = set()  # cells the agent has moved off (VisGym's canvas keeps a mark there)
        self.turn = 0  # actions taken so far
        self.done = False
        self.solved = False
        self.end_reason = None  # "stop" or "turn_limit" once done
        return self._observe(reward=0.0, valid=True, feedback="")

    def restore(self, agent, turn: int, left=()) -> Observation:
        """Put the episode back into a state it passed through: the agent on `agent` after `turn`
        actions, having moved off the cells `left` (VisGym's canvas marks them). The next step
        then plays exactly as it did from that state (branch.py replays forks this way); the
        observation is the state's picture (its text carries no feedback)."""
        if not self.maze.is_open(agent) or not 0 <= turn < self.max_turns:
            raise ValueError(f"cannot restore to cell {agent} after {turn} turns: not an open cell, "
                             f"or not a turn before the limit {self.max_turns}")
        self.agent, self.turn, self.left = tuple(agent), turn, set(left)
        self.done, self.solved, self.end_reason = False, False, None
        return self._observe(reward=0.0, valid=True, feedback="")

    def step(self, action_text: str) -> Observation:
        if self.done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        self.turn += 1
        if self.style == "visgym":
            action, feedback = parse_action_visgym(action_text, self.verbalize)
        else:
            action = parse_action(action_text)
            feedback = INVALID_FEEDBACK
        reward, bumped = 0.0, False
        if action is None:
            pass  # feedback says why
        elif action[0] == "stop":
            # the only rewarded event: reaching the target without saying stop earns nothing
            self.solved = self.agent == self.maze.goal
            reward = 1.0 if self.solved else 0.0
            if self.style == "ours":
                feedback = "Reached the target." if self.solved else "Stopped off the target."
            self.done, self.end_reason = True, "stop"
        else:
            dr, dc = MOVE_DELTAS[action[1]]
            target = (self.agent[0] + dr, self.agent[1] + dc)
            if self.maze.is_open(target):
                self.left.add(self.agent)
                self.agent = target
                if self.style == "ours":
                    feedback = f"Moved {MOVE_NAMES[action[1]]}."
            else:
                feedback, bumped = WALL_FEEDBACK, True  # the same words in both styles
        if not self.done and self.turn >= self.max_turns:
            self.done, self.end_reason = True, "turn_limit"
        return self._observe(reward=reward, valid=action is not None, feedback=feedback, bumped=bumped)

    def _observe(self, reward, valid, feedback, bumped=False) -> Observation:
        if self.style == "visgym":
            image = render_visgym(self.maze, self.agent, self.cell_px, self.left)
            # no budget line once the episode is over: VisGym's harness asks nothing more
            if self.done:
                text = f"Environment feedback: {feedback}"
            else:
                text = visgym_step_text(self.turn, self.max_turns, feedback if self.turn else None)
        else:
            image = render(self.maze, self.agent, self.cell_px)
            text = observation_text(self.turn, feedback)
        return Observation(image=image, text=text, reward=reward, done=self.done, valid=valid, feedback=feedback,
                           bumped=bumped)

# -----------------------------------------------------------------------------
# evaluation and training mazes

TRAIN_SEED_OFFSET = 1_000_000  # training seeds start here, far from the evaluation seeds 0..n-1
MAX_CONSECUTIVE_SKIPS = 10_000


def _size_of(difficulty: str) -> int:
    if difficulty not in DIFFICULTY_SIZES:
        raise ValueError(f"unknown difficulty {difficulty!r}; choose one of {list(DIFFICULTY_SIZES)}")
    return DIFFICULTY_SIZES[difficulty]


def eval_mazes(difficulty: str, n: int = 64, style: str = "ours") -> list:
    """The fixed evaluation set: seeds 0..n-1. It may repeat layouts, small sizes especially."""
    generate = _GENERATORS[_check_style(style)]
    return [generate(_size_of(difficulty), seed) for seed in range(n)]


class TrainMazeStream:
    """An endless, resumable stream of training mazes, none with the layout of an evaluation maze.

    Seeds are disjoint from evaluation by construction, but layouts (wall patterns) are not:
    there are only 4 spanning trees of 2x2 rooms, so "tiny" (5x5) has just 4 layouts and the
    evaluation mazes cover them all (then next() raises; lower eval_n). "small" (7x7) has 192,
    of which 64 evaluation mazes take about a quarter; larger sizes have far too many to collide.
    """

    def __init__(self, difficulty: str, position: int = 0, eval_n: int = 64, pool: int = 0, style: str = "ours"):
        if eval_n > TRAIN_SEED_OFFSET:
            raise ValueError(f"eval_n must be at most {TRAIN_SEED_OFFSET} to keep seeds disjoint")
        if pool < 0:
            raise ValueError(f"pool must be >= 0 (0: endless), got {pool}")
        self.eval_n = eval_n
        self.difficulty = difficulty
        self.style = _check_style(style)  # which generator; the evaluation set is of the same style
        self.position = position  # seeds consumed so far, skipped ones included
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
            maze = _GENERATORS[self.style](_size_of(self.difficulty), TRAIN_SEED_OFFSET + position)
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
        state = {"difficulty": self.difficulty, "eval_n": self.eval_n, "pool": self.pool, "position": self.position}
        return state if self.style == "ours" else {**state, "style": self.style}

    def load_state_dict(self, state: dict) -> None:
        """Continue a saved stream; one built otherwise (other size, style, evaluation set or pool)
        is refused. (States saved before eval_n and pool were recorded are taken as this stream's.)"""
        built = {k: state.get(k, getattr(self, k)) for k in ("difficulty", "eval_n", "pool")}
        built["style"] = _check_style(state.get("style", "ours"))
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
    parser.add_argument("--style", default="ours", choices=list(MAZE_STYLES))
    parser.add_argument("--cell-px", type=int, default=None, help="default: 32 (ours) or 25 (visgym)")
    parser.add_argument("--out", default="maze_episode.gif", help="animated GIF; a PNG of the last frame goes next to it")
    args = parser.parse_args()

    maze = _GENERATORS[args.style](DIFFICULTY_SIZES[args.difficulty], args.seed)
    actions = solve(maze)
    env = MazeEnv(maze, max_turns=len(actions), cell_px=args.cell_px, style=args.style)
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
