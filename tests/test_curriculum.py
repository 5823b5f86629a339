"""Tests of curriculum.py: learnability sampling over the training maze stream."""

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from curriculum import LearnabilitySampler  # noqa: E402
from env import TrainMazeStream  # noqa: E402

POOL = 12  # a small replayed pool, so every maze comes back many times


def sampler(floor=0.1, seed=0):
    return LearnabilitySampler(TrainMazeStream("small", pool=POOL), floor, seed)


def pool_mazes():
    stream = TrainMazeStream("small", pool=POOL)
    return [stream.next() for _ in range(POOL)]


def test_unseen_mazes_are_all_taken_in_stream_order():
    s, plain = sampler(), TrainMazeStream("small", pool=POOL)
    assert [s.next() for _ in range(2 * POOL)] == [plain.next() for _ in range(2 * POOL)]
    assert s.take_draws() == 2 * POOL and s.take_draws() == 0


def test_mazes_that_taught_nothing_come_back_at_the_floor_rate():
    s, mazes = sampler(floor=0.1), pool_mazes()
    assert len({s.key(m) for m in mazes}) == POOL
    s.record(mazes, [1.0] * (POOL // 2) + [0.0] * (POOL // 2))  # all solved or all failed: no signal
    taken = [s.next() for _ in range(200)]
    candidates_per_maze = s.take_draws() / len(taken)
    assert 7 < candidates_per_maze < 14  # 1 / floor = 10


def test_even_mazes_are_preferred_to_settled_ones():
    s, mazes = sampler(floor=0.1), pool_mazes()
    even, settled = mazes[:POOL // 2], mazes[POOL // 2:]
    s.record(even, [0.5] * len(even))
    s.record(settled, [1.0] * len(settled))
    counts = Counter(s.key(s.next()) in {s.key(m) for m in even} for _ in range(300))
    # accepted in proportion 1 : 0.1, so ~91% of the draws are even mazes
    assert counts[True] / 300 > 0.8
    assert counts[False] > 0  # the floor still rehearses the settled ones
    assert s.accept_probability(even[0]) == 1.0
    s.record(even[:1], [1 / 8])
    assert s.accept_probability(even[0]) == pytest.approx(4 / 8 * 7 / 8)


def test_a_resumed_sampler_draws_what_the_original_would_have():
    s = sampler()
    mazes = pool_mazes()
    s.record(mazes, [i / POOL for i in range(POOL)])
    for _ in range(5):
        s.next()
    state = s.state_dict()
    resumed = sampler()
    resumed.load_state_dict(state)
    assert resumed.success == s.success and resumed.position == s.position
    assert [resumed.next() for _ in range(20)] == [s.next() for _ in range(20)]
    # a stream-only checkpoint (written without learnability sampling) reads as an empty table
    plain = TrainMazeStream("small", pool=POOL)
    plain.load_state_dict(state)
    assert plain.position == state["position"]
    fresh = sampler()
    fresh.load_state_dict(plain.state_dict())
    assert fresh.success == {} and fresh.position == plain.position


def test_a_floor_outside_the_unit_interval_is_refused():
    with pytest.raises(ValueError, match="floor"):
        sampler(floor=0.0)
    with pytest.raises(ValueError, match="floor"):
        sampler(floor=1.5)


# ----------------------------------------------------------------------------- fork starts

def test_junctions_are_the_cells_with_three_open_ways():
    from curriculum import junctions
    from env import MOVE_DELTAS, eval_mazes

    for maze in eval_mazes("small", 16):
        found = junctions(maze)
        for r in range(maze.size):
            for c in range(maze.size):
                ways = sum(maze.is_open((r + dr, c + dc)) for dr, dc in MOVE_DELTAS.values())
                expected = maze.is_open((r, c)) and ways >= 3 and (r, c) != maze.goal
                assert ((r, c) in found) == expected


def test_fork_start_moves_the_given_share_of_starts_onto_junctions():
    from curriculum import fork_start, junctions

    stream = TrainMazeStream("small")
    mazes = [stream.next() for _ in range(400)]
    moved = [fork_start(m, 0.5, seed=3) for m in mazes]
    changed = [(m, f) for m, f in zip(mazes, moved) if f.start != m.start]
    with_junctions = sum(bool(junctions(m)) for m in mazes)
    assert 0.4 < len(changed) / with_junctions < 0.6
    for m, f in changed:  # the same walls, goal and seed; the start on a junction
        assert (f.walls, f.goal, f.seed) == (m.walls, m.goal, m.seed) and f.start in junctions(m)
    assert [fork_start(m, 0.5, seed=3) for m in mazes] == moved  # the same choice every time
    assert all(fork_start(m, 0.0) == m for m in mazes)
    assert all(fork_start(m, 1.0).start in junctions(m) for m in mazes if junctions(m))
