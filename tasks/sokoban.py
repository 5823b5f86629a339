"""Sokoban, one box (--task sokoban): push the box onto its target, one move a turn, from pictures.

The visual multi-turn task of the GiGPO / RAGEN / verl-agent line, at the size a tiny model can
take: a 6x6 room (its outer ring is wall, so 4x4 inside, with up to two more wall cells), one box,
one target. A move walks the player (the blue circle) one cell; walking into the box pushes it one
cell if the cell beyond is free, and nothing moves otherwise (the turn is spent). The episode ends
with reward 1.0 the moment the box stands on its target; a box pushed into a corner can never
leave it, and such an episode runs out of turns with 0.

Puzzles are made by playing backwards from the solved state, the usual way to make Sokoban
levels that can be solved: the box starts on its target and the player walks at random, pulling
the box when it stands right behind it; a breadth-first solver then measures the puzzle, and one
whose shortest solution is shorter than MIN_SOLUTION or longer than MAX_SOLUTION is drawn again.

    python -m tasks.sokoban --seed 0 --out sokoban.gif     # a puzzle and its solution, animated

Pictures: 32 px cells (one merged visual token of the tiny model), wall gray, floor white, the
target red, the box a brown square inset in its cell (on the target, red shows around it), the
player a blue circle (tiny_model.py --task sokoban teaches the tiny model's eyes these tiles).
"""

import random
import re
from collections import deque
from pathlib import Path

from PIL import Image, ImageDraw

import env

SIZE = 6  # cells a side, the outer walls included
CELL_PX = 32
WALL_RGB, FLOOR_RGB, TARGET_RGB, BOX_RGB, PLAYER_RGB = (169, 169, 169), (255, 255, 255), (255, 0, 0), (139, 69, 19), \
    (0, 0, 255)
BOX_INSET = 5  # pixels of the cell around the box: on the target, a red frame
MIN_SOLUTION, MAX_SOLUTION = 3, 12  # a puzzle's shortest solution, in moves (15 turns leave slack)
EXTRA_WALLS = (0, 1, 2)  # wall cells added inside the room, one of these counts per puzzle

MOVES = {"('move', 0)": (0, 1), "('move', 1)": (-1, 0), "('move', 2)": (0, -1), "('move', 3)": (1, 0)}
MOVE_NAMES = {"('move', 0)": "right", "('move', 1)": "up", "('move', 2)": "left", "('move', 3)": "down"}
_ANSWER = re.compile(r"""\(\s*(['"])move\1\s*,\s*([0-3])\s*\)""")

INSTRUCTIONS = (
    "You are the blue circle in a room shown as an image: gray cells are walls, white cells are floor, "
    "the brown square is a box and the red square is its target. Push the box onto the target. "
    "Each turn, reply with exactly one action: <answer>('move', d)</answer> with d 0=right, 1=up, 2=left, "
    "3=down. Walking into the box pushes it one cell if the cell beyond it is free. "
    "You succeed once the box is on the target."
)


def _add(cell, delta):
    return cell[0] + delta[0], cell[1] + delta[1]


def shortest_solution(walls: frozenset, player, box, target, limit: int = 10_000) -> list | None:
    """The fewest moves that put the box on the target (breadth-first over (player, box)); None if
    no sequence does."""
    start = (player, box)
    parents, frontier = {start: None}, deque([start])
    while frontier:
        state = frontier.popleft()
        if state[1] == target:
            moves = []
            while parents[state] is not None:
                state, move = parents[state]
                moves.append(move)
            return moves[::-1]
        for move, delta in MOVES.items():
            nxt = push(walls, *state, delta)
            if nxt != state and nxt not in parents:
                parents[nxt] = (state, move)
                frontier.append(nxt)
        if len(parents) > limit:
            break
    return None


def push(walls: frozenset, player, box, delta) -> tuple:
    """(player, box) after the player tries to move by `delta` (the same pair if nothing moves)."""
    to = _add(player, delta)
    if to in walls:
        return player, box
    if to == box:
        beyond = _add(box, delta)
        return (player, box) if beyond in walls else (to, beyond)
    return to, box


def generate(seed: int) -> tuple:
    """(walls, player, box, target) of the puzzle for `seed` (see the module docstring)."""
    rng = random.Random(seed)
    ring = {(r, c) for r in range(SIZE) for c in range(SIZE) if r in (0, SIZE - 1) or c in (0, SIZE - 1)}
    inside = sorted({(r, c) for r in range(SIZE) for c in range(SIZE)} - ring)
    while True:
        walls = frozenset(ring | set(rng.sample(inside, rng.choice(EXTRA_WALLS))))
        floor = [cell for cell in inside if cell not in walls]
        target = rng.choice(floor)
        box, player = target, rng.choice([cell for cell in floor if cell != target])
        for _ in range(40):  # backwards: walk, pulling the box when it is right behind
            delta = rng.choice(list(MOVES.values()))
            to = _add(player, delta)
            if to in walls or to == box:
                continue
            if _add(player, (-delta[0], -delta[1])) == box and rng.random() < 0.7:
                box = player
            player = to
        solution = shortest_solution(walls, player, box, target)
        if solution is not None and MIN_SOLUTION <= len(solution) <= MAX_SOLUTION:
            return walls, player, box, target


class SokobanTask(env.Task):
    name = "sokoban"
    levels = ("6x6",)
    actions = tuple(MOVES)
    instructions = INSTRUCTIONS

    def __init__(self, level: str, seed: int, max_turns: int = 15):
        super().__init__(level, seed, max_turns)
        self.walls, self.first_player, self.first_box, self.target = generate(seed)
        self.player, self.box = self.first_player, self.first_box

    def start(self):
        self.player, self.box = self.first_player, self.first_box

    def parse(self, reply: str):
        """The last ('move', d) in the reply (after any </think>), else None."""
        if not isinstance(reply, str) or len(reply) > 4096:
            return None
        think_end = reply.rfind("</think>")
        found = _ANSWER.findall(reply[think_end + len("</think>"):] if think_end >= 0 else reply)
        return f"('move', {found[-1][1]})" if found else None

    def apply(self, action) -> tuple[float, bool, str]:
        player, box = push(self.walls, self.player, self.box, MOVES[action])
        if (player, box) == (self.player, self.box):
            return 0.0, False, "Cannot move there."
        pushed = box != self.box
        self.player, self.box = player, box
        if box == self.target:
            return 1.0, True, "The box is on the target."
        return 0.0, False, f"{'Pushed the box' if pushed else 'Moved'} {MOVE_NAMES[action]}."

    def render(self) -> Image.Image:
        image = Image.new("RGB", (SIZE * CELL_PX, SIZE * CELL_PX), FLOOR_RGB)
        draw = ImageDraw.Draw(image)

        def square(cell, rgb, inset=0):
            x0, y0 = cell[1] * CELL_PX + inset, cell[0] * CELL_PX + inset
            draw.rectangle([x0, y0, x0 + CELL_PX - 1 - 2 * inset, y0 + CELL_PX - 1 - 2 * inset], fill=rgb)

        for cell in self.walls:
            square(cell, WALL_RGB)
        square(self.target, TARGET_RGB)
        square(self.box, BOX_RGB, BOX_INSET)
        cx, cy, r = (self.player[1] + 0.5) * CELL_PX, (self.player[0] + 0.5) * CELL_PX, CELL_PX / 4
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=PLAYER_RGB)
        return image

    def state_key(self):
        return self.player, self.box

    def state(self):
        return self.player, self.box

    def set_state(self, state):
        self.player, self.box = (tuple(cell) for cell in state)

    def legal_actions(self) -> list:
        """The moves that move something."""
        return [a for a, d in MOVES.items() if push(self.walls, self.player, self.box, d) != (self.player, self.box)]

    def solve(self) -> list | None:
        return shortest_solution(self.walls, self.player, self.box, self.target)

    def held_out_key(self):
        return tuple(sorted(self.walls)), self.first_player, self.first_box, self.target


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Render one puzzle's shortest solution as an animation.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="sokoban.gif")
    args = parser.parse_args()
    game = SokobanTask("6x6", args.seed)
    frames, solution = [game.reset().image], game.solve()
    for action in solution:
        frames.append(game.step(game.reply(action)).image)
    frames[0].save(args.out, save_all=True, append_images=frames[1:], duration=400, loop=0)
    print(f"seed {args.seed}: {len(solution)} moves, solved {game.solved}, wrote {Path(args.out)}")
