"""Tests of VisGym's maze (tasks/visgym_maze.py, tasks.maze.generate_maze_visgym) against facts recorded from VisGym's own code.

tests/data/visgym_maze2d.json was written by running visgym/VisGym (commit in its "source"):
mazes by seed, the texts of scripted episodes, what its parser and maze make of many replies,
and pixels of its frames. Nothing here runs VisGym.
"""

import hashlib
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import env  # noqa: E402
import tasks.maze as maze_task  # noqa: E402
import tasks.visgym_maze as visgym  # noqa: E402
from tasks.maze import MazeTask, generate_maze_visgym  # noqa: E402
from tasks.visgym_maze import VisGymMazeTask, parse_action_visgym, render_visgym, skyrl_shaped_reward  # noqa: E402


def VisGymMazeEnv(maze, max_turns=15, verbalize=False):
    """VisGym's maze task on a given maze, reset."""
    game = VisGymMazeTask.of(maze, max_turns=max_turns, verbalize=verbalize)
    game.reset()
    return game

FACTS = json.loads((ROOT / "tests" / "data" / "visgym_maze2d.json").read_text())
SIZES = {"easy": 9, "hard": 11}
PALETTE = {maze_task.WALL_RGB: "#", maze_task.PATH_RGB: ".", maze_task.GOAL_RGB: "R", maze_task.AGENT_RGB: "B"}


def as_rows(maze):
    return ["".join("#" if wall else "." for wall in row) for row in maze.walls]


def comparable(text: str) -> str:
    """A feedback text with object addresses masked; Python's own parse errors are compared only
    under the Python minor version the facts were recorded with."""
    text = re.sub(r"0x[0-9a-f]+", "0x?", text)
    if text.startswith("Cannot parse action string") and sys.version_info[:2] != (3, 11):
        return "Cannot parse action string ..."
    return text


# -----------------------------------------------------------------------------
# generation

@pytest.mark.parametrize("difficulty", ["easy", "hard"])
def test_every_recorded_seed_gives_visgyms_maze(difficulty):
    for fact in FACTS["mazes"][difficulty]:
        maze = generate_maze_visgym(SIZES[difficulty], fact["seed"])
        assert as_rows(maze) == fact["walls"], f"seed {fact['seed']}"
        assert list(maze.start) == fact["start"] and list(maze.goal) == fact["goal"], f"seed {fact['seed']}"


def test_visgym_task_plumbing():
    # its held-out set and training stream use its generator; the maze task stays ours
    assert [t.maze for t in env.held_out(VisGymMazeTask, "easy", 3)] == [generate_maze_visgym(9, s) for s in range(3)]
    assert [t.maze for t in env.held_out(MazeTask, "easy", 3)] == [maze_task.generate_maze(9, s) for s in range(3)]
    stream = env.TrainingStream(VisGymMazeTask, "small")
    first = stream.next().maze
    assert first.seed >= env.TRAIN_SEED_OFFSET and first == generate_maze_visgym(7, first.seed)
    state = stream.state_dict()
    assert state["task"] == "visgym-maze"
    following = [stream.next().maze for _ in range(5)]
    loaded = env.TrainingStream(VisGymMazeTask, "small")
    loaded.load_state_dict(state)
    assert [loaded.next().maze for _ in range(5)] == following
    with pytest.raises(ValueError, match="built with"):  # a stream of the other task does not take it
        env.TrainingStream(MazeTask, "small").load_state_dict(state)
    with pytest.raises(ValueError, match="odd integer"):
        generate_maze_visgym(8, 0)


# -----------------------------------------------------------------------------
# texts: whole scripted episodes, turn by turn

@pytest.mark.parametrize("difficulty", ["easy", "hard"])
def test_prompt_is_visgyms(difficulty):
    maze = generate_maze_visgym(SIZES[difficulty], 0)
    assert visgym.visgym_prompt(SIZES[difficulty]) == FACTS["prompt"][difficulty]
    assert VisGymMazeEnv(maze).instructions == FACTS["prompt"][difficulty]


@pytest.mark.parametrize("name", list(FACTS["episodes"]))
def test_recorded_episode_replays_with_the_same_texts(name):
    episode = FACTS["episodes"][name]
    maze = generate_maze_visgym(SIZES[episode["difficulty"]], episode["seed"])
    game = VisGymMazeEnv(maze, max_turns=episode["max_steps"],
                         verbalize="Verbalize your reasoning" in episode["prompts"][0])
    obs = game.reset()
    assert game.instructions + "\n" + obs.text == episode["prompts"][0]
    for k, step in enumerate(episode["steps"]):
        assert not obs.done
        obs = game.step(step["reply"])
        assert visgym.visgym_extract_action(step["reply"], game.verbalize) == step["parsed"]
        assert comparable(obs.feedback) == comparable(step["env_feedback"]), f"step {k + 1}"
        assert list(game.agent) == step["agent"] and obs.reward == step["reward"]
        if k + 1 < len(episode["prompts"]):
            assert comparable(obs.text) == comparable(episode["prompts"][k + 1]), f"text before step {k + 2}"
    assert obs.done and game.turn == episode["stats"]["step"]
    assert game.end_reason == ("stop" if episode["stats"]["terminated"] else "turn_limit")
    assert game.solved == (episode["stats"]["reward"] == 1.0)


def test_step_text_counts_the_budget_down():
    assert visgym.visgym_step_text(0, 20) == "This is step 1. You are allowed to take 19 more steps."
    assert visgym.visgym_step_text(19, 20, "Cannot move into a wall.") == (
        "Environment feedback: Cannot move into a wall.\n\nThis is step 20. You are allowed to take 0 more steps.")


# -----------------------------------------------------------------------------
# the parser: every recorded reply, on a fresh maze

@pytest.mark.parametrize("case", FACTS["parser_cases"], ids=lambda case: repr(case["reply"])[:40])
def test_parser_accepts_and_rejects_what_visgym_does(case):
    start = FACTS["parser_start"]
    maze = generate_maze_visgym(SIZES[start["difficulty"]], start["seed"])
    assert visgym.visgym_extract_action(case["reply"]) == case["parsed"]
    game = VisGymMazeEnv(maze)
    obs = game.step(case["reply"])
    assert comparable(obs.feedback) == comparable(case["env_feedback"])
    assert obs.done == case["terminated"] and obs.reward == case["reward"]
    assert (game.agent != maze.start) == case["moved"]
    action, _ = parse_action_visgym(case["reply"])
    assert obs.valid == (action is not None)


def test_parser_never_raises_on_odd_input():
    for reply in ["(" * 5000, ")" * 5000, "('move', 99999999999999999999)", "('move', " + "9" * 5000 + ")",
                  "(" * 300 + "('move', 0)" + ")" * 300, "\x00('stop', 'stop')"]:
        action, feedback = parse_action_visgym(reply)
        assert isinstance(feedback, str)
    # a huge move payload is out of range (VisGym itself raises OverflowError there)
    assert parse_action_visgym("('move', 99999999999999999999)")[0] is None


# -----------------------------------------------------------------------------
# rendering

@pytest.mark.parametrize("cell_px", sorted(FACTS["circle_masks"], key=int))
def test_agent_circle_is_pygames(cell_px):
    px = int(cell_px)
    inside = {(x - px, y - px) for x, y in visgym._visgym_disc((1, 1), px)}
    mask = ["".join("B" if (x, y) in inside else "." for x in range(px)) for y in range(px)]
    assert mask == FACTS["circle_masks"][cell_px]


def _cell_block(image, cell, px=25):
    r, c = cell
    return ["".join(PALETTE[image.getpixel((x, y))] for x in range(c * px, (c + 1) * px))
            for y in range(r * px, (r + 1) * px)]


def test_frames_match_visgyms_pixels_including_the_hole_in_the_target():
    facts = FACTS["render"]
    episode = FACTS["episodes"]["solve_with_detour"]
    maze = generate_maze_visgym(9, episode["seed"])
    game = VisGymMazeEnv(maze, max_turns=episode["max_steps"])
    frames = {"reset": game.reset().image}
    replies = [s["reply"] for s in episode["steps"]]
    for reply in replies[:-3]:
        frames["on_target"] = game.step(reply).image
    frames["left_target"] = game.step(replies[-3]).image
    frames["back_on_target"] = game.step(replies[-2]).image
    assert game.cell_px == 25 and frames["reset"].size == (225, 225)
    goal, start = tuple(facts["goal"]), tuple(facts["start"])
    assert _cell_block(frames["reset"], start) == facts["cell_blocks"]["start_at_reset"]
    assert _cell_block(frames["reset"], goal) == facts["cell_blocks"]["goal_at_reset"]
    assert _cell_block(frames["left_target"], goal) == facts["cell_blocks"]["goal_after_leaving"]
    assert _cell_block(frames["back_on_target"], goal) == facts["cell_blocks"]["goal_back_on"]
    assert _cell_block(frames["left_target"], start) == facts["cell_blocks"]["start_after_leaving"]
    for name, frame in frames.items():
        assert hashlib.sha256(frame.tobytes()).hexdigest() == facts["frame_sha256"][name], name
    centre = (goal[1] * 25 + 12, goal[0] * 25 + 12)
    assert list(frames["reset"].getpixel(centre)) == facts["pixels"]["reset"]["goal_centre"]
    assert list(frames["left_target"].getpixel(centre)) == facts["pixels"]["left_target"]["goal_centre"]
    assert list(frames["reset"].getpixel((start[1] * 25 + 12, start[0] * 25 + 12))) == facts["pixels"]["reset"]["agent_centre"]
    assert list(frames["reset"].getpixel((0, 0))) == facts["pixels"]["reset"]["wall_0_0"]
    # our own style redraws every frame: no hole
    ours = maze_task.render(maze, tuple(facts["cell_left_to"]), 25)
    assert ours.getpixel(centre) == maze_task.GOAL_RGB


def test_render_visgym_is_a_pure_function_of_the_cells_vacated():
    maze = generate_maze_visgym(9, 0)
    holed = render_visgym(maze, maze.start, vacated=[maze.goal])
    assert holed.getpixel((maze.goal[1] * 25 + 12, maze.goal[0] * 25 + 12)) == maze_task.PATH_RGB
    assert render_visgym(maze, maze.start).tobytes() == render_visgym(maze, maze.start, vacated=[maze.start]).tobytes()
    with pytest.raises(ValueError):
        render_visgym(maze, maze.start, cell_px=6)


# -----------------------------------------------------------------------------
# SkyRL's shaped reward

def test_skyrl_shaped_reward():
    good = "<observation>agent top left</observation><justification>goal is right</justification><action>('move', 0)</action>"
    bare = "('move', 0)"
    blank = "<observation> </observation><justification>x</justification><action>('move', 0)</action>"
    assert skyrl_shaped_reward([good, good], solved=True) == pytest.approx(1.0)
    assert skyrl_shaped_reward([bare, bare, bare], solved=True) == pytest.approx(0.8)
    assert skyrl_shaped_reward([good, bare, blank, bare], solved=False) == pytest.approx(0.05)
    # the first block of each tag counts, even if a later one is filled in
    assert skyrl_shaped_reward(["<observation></observation><observation>x</observation>"
                                "<justification>y</justification><action>z</action>"], solved=False) == 0.0
    with pytest.raises(ValueError):
        skyrl_shaped_reward([], solved=False)


# -----------------------------------------------------------------------------
# experiments/count_fits.py helpers (the script itself is not run here)

def test_count_fits_enumerates_all_spanning_trees_of_small_grids():
    spec = importlib.util.spec_from_file_location("count_fits", ROOT / "experiments" / "count_fits.py")
    count_fits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(count_fits)
    for n, expected in [(2, 4), (3, 192)]:
        trees = list(count_fits.spanning_trees(n))
        assert len(trees) == expected == count_fits.kirchhoff_count(n)
        assert len({frozenset(t) for t in trees}) == expected
    # 2x2 rooms (5x5 mazes): a tree drops one edge of the 4-cycle, so each diagonal stays 2 room
    # steps (4 moves + stop) in all 4 trees
    histogram = count_fits.turns_histogram(2)
    assert sum(histogram.values()) == 8 and histogram == {5: 8}
    assert count_fits.share_fitting(histogram, 4) == 0 and count_fits.share_fitting(histogram, 5) == 1
