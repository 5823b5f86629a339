"""VisGym's maze_2d as its harness runs it (--task visgym-maze): the drawing, texts and reply parsing.

`VisGymMazeTask` is tasks.maze.MazeTask with VisGym's presentation: 25 px cells drawn the way pygame draws
them (the canvas leaves a white hole in the target once the agent has left it), VisGym's prompt,
feedback and per-step budget text, and its parser (the last Python-literal tuple anywhere in the
reply). The rules and the strict reward stay MazeTask's, and so does the maze core:
tasks.maze.generate_maze_visgym gives VisGym's maze for a seed. Everything is checked against facts
recorded from VisGym's own code (tests/data/visgym_maze2d.json, tests/test_visgym.py).

The 25 px cells do not line up with the default tiny model's 32 px merged patches (16 px patch x
spatial merge 2): its processor resizes to a multiple of 32 px first (225 -> 224, 275 -> 288), so a
9x9 maze arrives as 7x7 visual tokens for 81 cells, each token mixing parts of up to four cells at
varying offsets, and its eyes are pretrained on 32 px drawings only. The tiny build for this style
(`python tiny_model.py --task visgym`, .cache/tiny-qwen3-vl-visgym) upscales a 225 px frame to
288 px instead, one 25 px cell per token, and pretrains its eyes on this module's drawings of
VisGym's mazes. It lines up for easy (9x9) only.

SkyRL's shaped reward for its VisGym recipe is here too, for comparison only.
"""

import ast
import re
from PIL import Image

from tasks.maze import (AGENT_RGB, CELL_PX_VISGYM, PATH_RGB, Maze, MazeTask, action_string, draw_board,
                        generate_maze_visgym)


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


def render_visgym(maze: Maze, agent, cell_px: int = CELL_PX_VISGYM, vacated=()) -> Image.Image:
    """The frame VisGym shows: `render` in VisGym's drawing, `vacated` the cells the agent has moved off.

    VisGym paints onto one canvas per episode and, after each move, covers the old circle with a
    white one instead of redrawing the cell. On white paths that changes nothing; on the target it
    leaves a white hole once the agent has stood there and moved on. Replaying those white
    circles on a fresh drawing gives the same pixels.
    """
    if cell_px < 8:
        raise ValueError(f"VisGym-style cells need cell_px >= 8 (a circle of radius >= 2), got {cell_px}")
    image, draw = draw_board(maze, cell_px)
    for cell in set(map(tuple, vacated)) - {tuple(agent)}:
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
# the environment in VisGym's style

class VisGymMazeTask(MazeTask):
    """MazeTask with VisGym's mazes and presentation (see the module docstring); `verbalize` adds
    its <think>/<answer> request to the prompt and reads the first <answer> block."""

    name = "visgym-maze"
    cell_px = CELL_PX_VISGYM
    generate = staticmethod(generate_maze_visgym)

    def __init__(self, level: str, seed: int, max_turns: int = 15, maze: Maze | None = None, verbalize: bool = False):
        super().__init__(level, seed, max_turns, maze=maze)
        self.verbalize = verbalize
        self.instructions = visgym_prompt(self.maze.size, verbalize)

    def parse(self, reply: str):
        action = parse_action_visgym(reply, self.verbalize)[0]
        return None if action is None else action_string(action)

    def invalid_feedback(self, reply: str) -> str:
        return parse_action_visgym(reply, self.verbalize)[1]

    def describe(self, outcome: str) -> str:
        return VISGYM_DONE  # VisGym says this for every executed move and stop

    def render(self) -> Image.Image:
        return render_visgym(self.maze, self.agent, self.cell_px, self.vacated)

    def text(self, feedback: str) -> str:
        if self.done:  # no budget line once the episode is over: VisGym's harness asks nothing more
            return f"Environment feedback: {feedback}"
        return visgym_step_text(self.turn, self.max_turns, feedback if self.turn else None)


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

