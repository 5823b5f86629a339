"""The conformance check (task_check.py): every shipped task keeps env.Task's promises, and a task
that breaks one promise is caught by that rule. The broken tasks here are one-line changes of the
shipped ones, one per rule. (NoSolver is also the bad-input table's task without a solver.)"""

import itertools
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import env  # noqa: E402
import task_check  # noqa: E402
import tasks  # noqa: E402
from tasks.line import LineTask  # noqa: E402
from tasks.maze import ACTION_STRINGS, MazeTask  # noqa: E402
from tasks.sokoban import SokobanTask  # noqa: E402

LEVELS = {"maze": "small", "visgym-maze": "easy", "sokoban": "6x6", "line": "short"}


@pytest.mark.parametrize("name", sorted(tasks.TASKS))
def test_every_shipped_task_keeps_the_promises(name):
    assert set(LEVELS) == set(tasks.TASKS), "a new task: give it a level here"
    assert task_check.check(tasks.task_class(name), LEVELS[name]) == []


_instances = itertools.count()


class Unseeded(LineTask):  # a start that depends on how many puzzles were made before
    def start(self):
        self.agent = next(_instances) % self.length


class ForgetsTheBox(SokobanTask):  # set_state puts the player back but not the box
    def set_state(self, state):
        self.player = tuple(state[0])


class TurnInTheKey(MazeTask):  # the key holds the turn count: one state, many keys
    def state_key(self):
        return self.agent, self.turn


class PlayerOnlyKey(SokobanTask):  # the key leaves the box out: one key, several situations
    def state_key(self):
        return self.player


class WallsAreLegal(MazeTask):  # every move is "legal", into walls too
    def legal_actions(self):
        return list(ACTION_STRINGS[:4])


class MisreadReplies(LineTask):  # its replies for left and right are swapped when read back
    def parse(self, reply):
        action = super().parse(reply)
        return {"('move', 0)": "('move', 2)", "('move', 2)": "('move', 0)"}.get(action, action)


class ForgetsToStop(LineTask):  # the solver leaves out the final stop
    def solve(self):
        return super().solve()[:-1]


class Flickers(LineTask):  # each picture drawn differs from the last
    def render(self):
        image = super().render()
        image.putpixel((0, 0), (next(_instances) % 256, 0, 0))
        return image


class TakesAnything(LineTask):  # a reply it cannot read is a move right
    def parse(self, reply):
        return super().parse(reply) or "('move', 0)"


class UnpicklableState(LineTask):  # a snapshot holding a function
    def state(self):
        return self.agent, lambda: self.agent

    def set_state(self, state):
        self.agent = state[0]


class NoSolver(LineTask):  # the interface's solver left out: SFT cannot demonstrate it
    solve = env.Task.solve


class NoSnapshots(LineTask):  # the interface's snapshots left out: no branch rollouts
    state, set_state = env.Task.state, env.Task.set_state


@pytest.mark.parametrize("broken, level, rule", [
    (Unseeded, "long", "same_seed"), (ForgetsTheBox, "6x6", "restore"), (TurnInTheKey, "small", "state_key"),
    (PlayerOnlyKey, "6x6", "state_key"), (WallsAreLegal, "small", "legal_actions"),
    (MisreadReplies, "short", "legal_actions"), (ForgetsToStop, "long", "solver"), (Flickers, "short", "render"),
    (TakesAnything, "short", "junk"), (UnpicklableState, "short", "plain_state"),
])
def test_each_broken_promise_is_caught_by_its_rule(broken, level, rule):
    problems = task_check.check(broken, level)
    assert any(p.startswith(f"{rule}: ") for p in problems), problems


def test_a_task_without_a_solver_or_snapshots_is_checked_for_the_rest():
    assert env.features(NoSolver) == {"snapshots": True, "solver": False}
    assert env.features(NoSnapshots) == {"snapshots": False, "solver": True}
    assert task_check.check(NoSolver, "short") == [] and task_check.check(NoSnapshots, "short") == []
    assert env.fits_turn_limit(NoSolver("short", 0)) is None
    assert env.is_optimal(NoSolver("short", 0), (0, 0), "('move', 0)") is None


def test_the_command_line_names_the_task_and_its_verdict():
    proc = subprocess.run([sys.executable, "task_check.py", "line", "short"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "line short: every rule holds" in proc.stdout, proc.stderr
    proc = subprocess.run([sys.executable, "task_check.py", "tests.test_task_check:TakesAnything", "short"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout.startswith("junk: "), proc.stdout + proc.stderr


def test_a_random_reply_never_raises_in_any_task():
    rng = random.Random(0)
    for name, level in LEVELS.items():
        task = tasks.make(name, level, seed=3)
        task.reset()
        for _ in range(200):
            if task.done:
                task.reset()
            task.step("".join(chr(rng.randrange(32, 127)) for _ in range(rng.randrange(0, 40))))
