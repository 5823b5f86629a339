"""Tests of tasks/maze.py: maze generation, solving, parsing, rendering, episodes, and its held-out split."""

import sys
from collections import deque
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import env  # noqa: E402
import tasks.maze as maze_task  # noqa: E402
from tasks.maze import (  # noqa: E402
    ACTION_STRINGS, DIFFICULTY_SIZES, Maze, MazeTask,
    eval_mazes, generate_maze, parse_action, render, solve, training_mazes,
)


def MazeEnv(maze, max_turns=15):
    """The maze task on a given maze, reset (what the episode tests play)."""
    game = MazeTask.of(maze, max_turns=max_turns)
    game.reset()
    return game


class TrainMazeStream(env.TrainingStream):
    """The maze's training stream, giving its Maze objects (env.TrainingStream gives tasks)."""

    def __init__(self, difficulty, **kwargs):
        super().__init__(MazeTask, difficulty, **kwargs)

    def next(self):
        return super().next().maze


def bfs_distances(maze, source):
    """Independent BFS over open cells, for checking the solver and connectivity."""
    dist = {source: 0}
    queue = deque([source])
    while queue:
        r, c = queue.popleft()
        for nxt in [(r, c + 1), (r - 1, c), (r, c - 1), (r + 1, c)]:
            if maze.is_open(nxt) and nxt not in dist:
                dist[nxt] = dist[(r, c)] + 1
                queue.append(nxt)
    return dist


def open_cells(maze):
    return {(r, c) for r in range(maze.size) for c in range(maze.size) if not maze.walls[r][c]}


# -----------------------------------------------------------------------------
# generation

@pytest.mark.parametrize("difficulty", list(DIFFICULTY_SIZES))
def test_every_difficulty_generates_a_perfect_maze(difficulty):
    size = DIFFICULTY_SIZES[difficulty]
    rooms_per_side = (size - 1) // 2
    n_rooms = rooms_per_side ** 2
    for seed in range(30):
        maze = generate_maze(size, seed)
        assert maze.size == size and maze.seed == seed
        assert all(len(row) == size for row in maze.walls)
        cells = open_cells(maze)
        rooms = {(r, c) for (r, c) in cells if r % 2 == 1 and c % 2 == 1}
        passages = cells - rooms
        assert len(rooms) == n_rooms  # every room is carved
        # the outer ring is wall, and so is every "post" at even/even coordinates
        assert all(r % 2 != c % 2 for (r, c) in passages)
        assert all(0 < r < size - 1 and 0 < c < size - 1 for (r, c) in cells)
        # each passage joins two rooms: connected with rooms-1 edges means a spanning tree,
        # i.e. exactly one path between any two rooms
        assert len(passages) == n_rooms - 1
        assert set(bfs_distances(maze, maze.start)) == cells


@pytest.mark.parametrize("difficulty", list(DIFFICULTY_SIZES))
def test_start_and_goal_at_opposite_interior_corners(difficulty):
    size = DIFFICULTY_SIZES[difficulty]
    corners = {(1, 1), (1, size - 2), (size - 2, 1), (size - 2, size - 2)}
    seen_starts = set()
    for seed in range(40):
        maze = generate_maze(size, seed)
        assert maze.start in corners and maze.goal in corners
        assert maze.goal == (size - 1 - maze.start[0], size - 1 - maze.start[1])
        seen_starts.add(maze.start)
    assert len(seen_starts) > 1  # the seed picks the corner


@pytest.mark.parametrize("bad_size", [3, 4, 8, 0, -5, 7.0, "9"])
def test_bad_sizes_are_rejected(bad_size):
    with pytest.raises(ValueError, match="odd integer >= 5"):
        generate_maze(bad_size, 0)


def test_determinism_per_seed():
    a, b = generate_maze(9, 123), generate_maze(9, 123)
    assert a == b and hash(a) == hash(b) and a.layout_key() == b.layout_key()
    assert render(a, a.start).tobytes() == render(b, b.start).tobytes()
    keys = {generate_maze(9, seed).layout_key() for seed in range(50)}
    assert len(keys) > 45  # different seeds usually give different mazes


def test_layout_key_is_the_walls_alone():
    a = generate_maze(7, 5)
    twin = Maze(walls=a.walls, start=a.start, goal=a.goal, seed=999)
    assert twin.layout_key() == a.layout_key()
    # the same walls with the corners swapped is the same layout: training on it would teach
    # the evaluation maze's paths
    flipped = Maze(walls=a.walls, start=a.goal, goal=a.start, seed=a.seed)
    assert flipped.layout_key() == a.layout_key()
    other = next(m for m in (generate_maze(7, s) for s in range(100)) if m.walls != a.walls)
    assert other.layout_key() != a.layout_key()


# -----------------------------------------------------------------------------
# solving

@pytest.mark.parametrize("difficulty", list(DIFFICULTY_SIZES))
def test_solver_path_is_shortest_and_reaches_the_goal(difficulty):
    for maze in eval_mazes(difficulty, 20):
        actions = solve(maze)
        assert actions[-1] == "('stop', 'stop')"
        assert all(a in ACTION_STRINGS[:4] for a in actions[:-1])
        assert len(actions) - 1 == bfs_distances(maze, maze.start)[maze.goal]
        game = MazeEnv(maze, max_turns=len(actions))
        for a in actions:
            obs = game.step(a)
            assert obs.valid and not obs.no_effect and obs.feedback != maze_task.WALL_FEEDBACK
        assert obs.done and obs.reward == 1.0 and game.solved and game.end_reason == "stop"


def test_solver_from_another_cell():
    maze = generate_maze(9, 7)
    assert solve(maze, start=maze.goal) == ["('stop', 'stop')"]
    cell = next(c for c in sorted(open_cells(maze)) if c not in (maze.start, maze.goal))
    assert len(solve(maze, start=cell)) - 1 == bfs_distances(maze, cell)[maze.goal]
    with pytest.raises(ValueError):
        solve(maze, start=(0, 0))  # a wall


def test_goal_distances_match_the_solver_from_every_cell():
    maze = generate_maze(7, 3)
    distances = maze_task.goal_distances(maze)
    assert set(distances) == set(open_cells(maze))  # a perfect maze: every open cell reaches the goal
    for cell, d in distances.items():
        assert d == len(solve(maze, start=cell)) - 1


# -----------------------------------------------------------------------------
# parsing

def test_canonical_action_strings():
    assert ACTION_STRINGS == ["('move', 0)", "('move', 1)", "('move', 2)", "('move', 3)", "('stop', 'stop')"]
    assert [parse_action(a) for a in ACTION_STRINGS] == [("move", 0), ("move", 1), ("move", 2), ("move", 3), ("stop", "stop")]


@pytest.mark.parametrize("text, expected", [
    ("<think>go right</think><answer>('move', 0)</answer>", ("move", 0)),
    ("<answer>('stop', 'stop')</answer>", ("stop", "stop")),
    ("('move', 3)", ("move", 3)),
    ('  ("move",2)  ', ("move", 2)),
    ("<answer>\n ( 'move' , 1 ) \n</answer>", ("move", 1)),
    ('<answer>("stop", "stop")</answer>', ("stop", "stop")),
    ("<answer>('move', 0)</answer> then <answer>('move', 2)</answer>", ("move", 2)),  # last block wins
    ("<think>maybe <answer>('move', 1)</answer>?</think><answer>('move', 3)</answer>", ("move", 3)),
    ("<think>hmm</think>\n<answer>('move', 1)", ("move", 1)),  # stopped on "</answer>"
    ("<answer>`('move', 0)`</answer>", ("move", 0)),
    ("('move', 2)</answer>", ("move", 2)),  # the prompt ended with "<answer>"
])
def test_valid_replies_parse(text, expected):
    assert parse_action(text) == expected


@pytest.mark.parametrize("text", [
    "", "hello", "move right", "<answer></answer>", "<answer>right</answer>",
    "('move', 4)", "('move', -1)", "('move', 10)", "('move', 1.0)", "('move', '1')", "('move', 0, 1)",
    "['move', 0]", "('stop', 'go')", "('stop')", "('move', 0", "('move', 0) ('move', 1)",
    "<answer>('jump', 0)</answer>", "<answer>('move', 0)</answer> <answer>nonsense</answer>",
    "<think><answer>('move', 0)</answer></think>", "('move\", 0)", "('move', 0)</answer> ('move', 1)</answer>",
    "__import__('os').system('true')", "<answer>" * 1000, "(" * 3000,
    "<answer>('move', 0)</answer>" + " " * 10**6, "x" * 10**6,
    None, 3, ("move", 0), b"('move', 0)",
])
def test_invalid_replies_return_none(text):
    assert parse_action(text) is None


# -----------------------------------------------------------------------------
# rendering

@pytest.mark.parametrize("cell_px", [maze_task.CELL_PX_TINY, maze_task.CELL_PX_VISGYM])
def test_render_colours_at_known_pixels(cell_px):
    maze = generate_maze(9, 1)
    image = render(maze, maze.start, cell_px)
    assert image.mode == "RGB" and image.size == (9 * cell_px, 9 * cell_px)

    def centre(cell):
        return (int((cell[1] + 0.5) * cell_px), int((cell[0] + 0.5) * cell_px))

    path_cell = next(c for c in sorted(open_cells(maze)) if c not in (maze.start, maze.goal))
    assert image.getpixel((0, 0)) == (169, 169, 169)  # the outer wall
    assert image.getpixel(centre(path_cell)) == (255, 255, 255)
    assert image.getpixel(centre(maze.goal)) == (255, 0, 0)
    assert image.getpixel(centre(maze.start)) == (0, 0, 255)
    # the start cell's corner is not covered by the circle of radius cell_px / 4
    x0, y0 = maze.start[1] * cell_px, maze.start[0] * cell_px
    assert image.getpixel((x0 + 1, y0 + 1)) == (255, 255, 255)
    # on the target, the agent covers the centre while the corners stay red
    on_goal = render(maze, maze.goal, cell_px)
    assert on_goal.getpixel(centre(maze.goal)) == (0, 0, 255)
    gx0, gy0 = maze.goal[1] * cell_px, maze.goal[0] * cell_px
    assert on_goal.getpixel((gx0, gy0)) == (255, 0, 0)
    assert on_goal.getpixel((gx0 + cell_px - 1, gy0 + cell_px - 1)) == (255, 0, 0)
    # the circle's radius is a quarter cell: the pixel a third of a cell right of centre is red
    cx, cy = centre(maze.goal)
    assert on_goal.getpixel((cx + cell_px // 3, cy)) == (255, 0, 0)
    assert on_goal.getpixel((cx + cell_px // 5, cy)) == (0, 0, 255)


# -----------------------------------------------------------------------------
# episodes

def test_reward_only_for_stopping_on_the_goal():
    maze = generate_maze(7, 3)
    path = solve(maze)
    # walking onto the goal does not end the episode nor pay anything
    game = MazeEnv(maze, max_turns=50)
    rewards = [game.step(a).reward for a in path[:-1]]
    assert game.agent == maze.goal and not game.done and rewards == [0.0] * len(rewards)
    obs = game.step("<answer>('stop', 'stop')</answer>")
    assert obs.done and obs.reward == 1.0 and obs.feedback == "Reached the target."
    # stopping anywhere else ends the episode with nothing
    game = MazeEnv(maze)
    obs = game.step(path[0])
    obs = game.step("('stop', 'stop')")
    assert obs.done and obs.reward == 0.0 and not game.solved and game.end_reason == "stop"
    assert obs.feedback == "Stopped off the target."
    with pytest.raises(RuntimeError):
        game.step("('move', 0)")


def test_wall_feedback_and_no_movement():
    maze = generate_maze(9, 0)
    game = MazeEnv(maze)
    r, c = maze.start
    blocked = next(d for d, (dr, dc) in maze_task.MOVE_DELTAS.items() if maze.walls[r + dr][c + dc])
    obs = game.step(f"<answer>('move', {blocked})</answer>")
    assert obs.feedback == "Cannot move into a wall." and obs.valid and obs.no_effect
    assert game.agent == maze.start and game.turn == 1 and not obs.done
    assert obs.text == "This is step 1. Cannot move into a wall."


def test_valid_move_feedback_and_observation_text():
    maze = generate_maze(9, 0)
    game = MazeEnv(maze)
    first = game.reset()
    assert first.text == "This is step 0." and first.valid and not first.done and first.feedback == ""
    first_action = solve(maze)[0]
    obs = game.step(first_action)
    name = maze_task.MOVE_NAMES[parse_action(first_action)[1]]
    assert obs.feedback == f"Moved {name}." and obs.text == f"This is step 1. Moved {name}."
    assert game.agent != maze.start


def test_invalid_actions_consume_a_turn_and_never_raise():
    maze = generate_maze(7, 0)
    game = MazeEnv(maze, max_turns=4)
    for text in ["garbage", "x" * 10**6, "<answer>('move', 7)</answer>"]:
        obs = game.step(text)
        assert not obs.valid and obs.reward == 0.0 and obs.feedback == maze_task.INVALID_FEEDBACK
        assert game.agent == maze.start
    assert game.turn == 3 and not game.done


def test_turn_limit_ends_the_episode():
    maze = generate_maze(9, 2)
    game = MazeEnv(maze, max_turns=5)
    for turn in range(1, 6):
        obs = game.step("('move', 1)" if turn % 2 else "nonsense")
        assert obs.done == (turn == 5)
    assert game.end_reason == "turn_limit" and obs.reward == 0.0 and not game.solved
    # even standing on the goal at the limit pays nothing without stop
    path = solve(maze)
    game = MazeEnv(maze, max_turns=len(path) - 1)
    for a in path[:-1]:
        obs = game.step(a)
    assert game.agent == maze.goal and obs.done and obs.reward == 0.0 and game.end_reason == "turn_limit"
    # a stop on the last turn is a stop
    game = MazeEnv(maze, max_turns=len(path))
    for a in path:
        obs = game.step(a)
    assert game.end_reason == "stop" and obs.reward == 1.0


def test_reset_restarts_the_episode():
    maze = generate_maze(7, 9)
    game = MazeEnv(maze)
    for a in solve(maze):
        game.step(a)
    assert game.done and game.solved
    obs = game.reset()
    assert game.agent == maze.start and game.turn == 0 and not game.done and not game.solved
    assert game.end_reason is None and obs.image.tobytes() == render(maze, maze.start).tobytes()


# -----------------------------------------------------------------------------
# evaluation and training mazes

def test_eval_mazes_are_seeds_zero_to_n():
    mazes = eval_mazes("easy", 8)
    assert [m.seed for m in mazes] == list(range(8))
    assert mazes == [generate_maze(9, s) for s in range(8)]
    with pytest.raises(ValueError, match="unknown level"):
        eval_mazes("impossible")


@pytest.mark.parametrize("difficulty", ["small", "easy"])
def test_no_training_layout_is_an_eval_layout(difficulty):
    eval_walls = {m.walls for m in eval_mazes(difficulty)}
    eval_seeds = {m.seed for m in eval_mazes(difficulty)}
    stream = TrainMazeStream(difficulty)
    for _ in range(3000):
        maze = stream.next()
        assert maze.walls not in eval_walls and maze.seed not in eval_seeds
    assert stream.position >= 3000


def test_stream_resumes_exactly():
    stream = TrainMazeStream("small")
    for _ in range(100):
        stream.next()
    state = stream.state_dict()
    assert state == {"task": "maze", "level": "small", "eval_n": 64, "pool": 0, "position": stream.position, "seed": 0}
    following = [stream.next() for _ in range(20)]
    resumed = TrainMazeStream("small", position=state["position"])
    assert [resumed.next() for _ in range(20)] == following
    loaded = TrainMazeStream("small")
    loaded.load_state_dict(state)
    assert [loaded.next() for _ in range(20)] == following
    # a stream built otherwise (another size, evaluation set, pool or seed) does not take the state
    for other in (TrainMazeStream("easy"), TrainMazeStream("small", eval_n=8), TrainMazeStream("small", pool=4),
                  TrainMazeStream("small", seed=1)):
        with pytest.raises(ValueError, match="built with"):
            other.load_state_dict(state)


def test_each_seed_trains_on_its_own_mazes_and_none_is_an_eval_layout():
    """--seed picks the training stream (seed 0's is the stream from before seeds did): three seeds
    share no training maze; the evaluation mazes are the same for every seed."""
    firsts = {seed: [m.seed for m in training_mazes("small", 200, seed=seed)] for seed in (0, 1, 2)}
    assert firsts[0][:3] == [m.seed for m in (lambda s: [s.next() for _ in range(3)])(TrainMazeStream("small"))]
    assert not set(firsts[0]) & set(firsts[1]) and not set(firsts[1]) & set(firsts[2])
    eval_walls = {m.walls for m in eval_mazes("small")}
    stream = TrainMazeStream("small", seed=2)
    assert all(stream.next().walls not in eval_walls for _ in range(300))


def test_pool_replays_the_first_training_mazes_in_order_and_resumes():
    endless = TrainMazeStream("small")
    first_five = [endless.next() for _ in range(5)]
    pool = TrainMazeStream("small", pool=5)
    played = [pool.next() for _ in range(12)]
    assert played == first_five + first_five + first_five[:2]
    resumed = TrainMazeStream("small", pool=5, position=pool.state_dict()["position"])
    assert [resumed.next() for _ in range(4)] == first_five[2:] + first_five[:1]
    with pytest.raises(ValueError, match="pool"):
        TrainMazeStream("small", pool=-1)


def test_tiny_stream_fails_loudly_when_eval_covers_every_layout():
    all_tiny_layouts = {m.layout_key() for m in eval_mazes("tiny", 500)}
    assert len(all_tiny_layouts) == 4  # the 4 spanning trees of 2x2 rooms
    stream = TrainMazeStream("tiny", eval_n=500)
    with pytest.raises(RuntimeError, match="lower eval_n"):
        stream.next()
    # with a small evaluation set, the stream works
    few = TrainMazeStream("tiny", eval_n=2)
    eval_keys = {m.layout_key() for m in eval_mazes("tiny", 2)}
    assert all(few.next().layout_key() not in eval_keys for _ in range(50))
