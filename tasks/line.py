"""Bring your own task, the smallest whole example: walk along a corridor to the target, then stop.

The picture is a square of wall with one row of open cells across its middle; the agent (blue)
moves left or right, one cell a turn, and earns 1.0 only for stopping on the target (red). It speaks the maze's
language (its replies, colours and instructions), so a maze policy can play it from the start.
Train it with `python train.py --task line --difficulty short`; tests/test_line.py does, and
task_check.py checks it keeps the interface's promises. Everything env.Task asks for is here
or is its default (`text`, `reply`).
"""

import random
import re

from PIL import Image, ImageDraw

import env
from tasks.maze import AGENT_RGB, GOAL_RGB, INSTRUCTIONS, PATH_RGB, WALL_RGB

CELL = 32  # pixels a cell: one merged visual token of the tiny model
LENGTHS = {"short": 5, "long": 9}  # open cells in the corridor
MOVES = {"('move', 0)": 1, "('move', 2)": -1}  # right, left; up and down walk into the wall
STOP = "('stop', 'stop')"
_ANSWER = re.compile(r"<answer>\s*(\('move', [0-3]\)|\('stop', 'stop'\))\s*(</answer>|$)")


class LineTask(env.Task):
    name = "line"
    levels = tuple(LENGTHS)
    actions = ("('move', 0)", "('move', 1)", "('move', 2)", "('move', 3)", STOP)
    instructions = INSTRUCTIONS  # the maze's words describe a corridor too

    def __init__(self, level: str, seed: int, max_turns: int = 15):
        super().__init__(level, seed, max_turns)
        self.length = LENGTHS[level]
        self.begin, self.target = random.Random(seed).sample(range(self.length), 2)
        self.agent = self.begin

    def start(self):
        self.agent = self.begin

    def parse(self, reply: str):
        found = _ANSWER.search(reply) if isinstance(reply, str) and len(reply) < 4096 else None
        return found.group(1) if found else None

    def apply(self, action) -> tuple[float, bool, str]:
        if action == STOP:
            on_target = self.agent == self.target
            return float(on_target), True, "Reached the target." if on_target else "Stopped off the target."
        to = self.agent + MOVES.get(action, 0)
        if action not in MOVES or not 0 <= to < self.length:
            return 0.0, False, "Cannot move into a wall."
        self.agent = to
        return 0.0, False, "Moved right." if MOVES[action] > 0 else "Moved left."

    def render(self) -> Image.Image:
        side = (self.length + 2) * CELL  # a square of wall, the corridor across its middle row
        image = Image.new("RGB", (side, side), WALL_RGB)
        draw, row = ImageDraw.Draw(image), (self.length + 1) // 2
        for x in range(self.length):
            colour = GOAL_RGB if x == self.target else PATH_RGB
            draw.rectangle([(x + 1) * CELL, row * CELL, (x + 2) * CELL - 1, (row + 1) * CELL - 1], fill=colour)
        cx, cy, r = (self.agent + 1.5) * CELL, (row + 0.5) * CELL, CELL / 4
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=AGENT_RGB)
        return image

    def state_key(self):
        return self.agent

    def state(self):
        return self.agent

    def set_state(self, state):
        self.agent = int(state)

    def legal_actions(self) -> list:
        moves = [a for a, d in MOVES.items() if 0 <= self.agent + d < self.length]
        return moves + [STOP] if self.agent == self.target else moves

    def solve(self) -> list:
        step = "('move', 0)" if self.target > self.agent else "('move', 2)"
        return [step] * abs(self.target - self.agent) + [STOP]
