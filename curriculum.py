"""Learnability sampling: spend the rollouts on the training mazes that GRPO can learn from.

A group whose episodes all succeed, or all fail, has the same reward everywhere, so its
group-relative advantages are zero and its rollouts teach nothing (with the strict reward the
step-level term is zero too). On 7x7 mazes at T = 0.5 that is half the groups at the start of the
main job and 85% of them 900 steps into the long run (zero_variance_group_frac in metrics.jsonl):
the policy becomes nearly deterministic on each maze it has seen. The training set is finite
(7x7 has ~540 (layout, start, goal) triples outside the evaluation layouts), so every triple comes
back, and what the last group on it did is a fair guess of what the next one will do.

With p the success rate of a maze's last group, the expected size of its learning signal is
proportional to p (1 - p), the variance of a Bernoulli reward (the "learnability" of Tzannetos et
al. 2023 and Rutherford et al. 2024). We keep a training maze drawn from the stream with
probability

    accept(p) = max(floor, 4 p (1 - p))       (1 for a maze not seen yet)

so a maze solved (or failed) by every episode of its last group comes back `floor` as often as an
even one; the floor keeps what is learnt rehearsed and gives a failed maze another chance. The
decision for the stream's n-th seed is a hash of (seed, n): the same on every rank and after a
resume, with no random state to carry.
"""

import dataclasses
import random

import env


class LearnabilitySampler:
    """A TrainMazeStream that skips the mazes whose last group taught nothing, most of the time."""

    MAX_DRAWS = 100_000  # candidates per accepted maze before we say the floor is too low

    def __init__(self, stream: env.TrainMazeStream, floor: float, seed: int = 0):
        if not 0 < floor <= 1:
            raise ValueError(f"floor must be in (0, 1], got {floor}")
        self.stream, self.floor, self.seed = stream, floor, seed
        self.success = {}  # maze key -> success rate of the last group played on it
        self.draws = 0  # candidates drawn since the last take_draws()

    @staticmethod
    def key(maze: env.Maze) -> str:
        # the walls, start and goal: what the policy sees (the seed that made them does not matter)
        return (maze.layout_key() + bytes(maze.start + maze.goal)).hex()

    def accept_probability(self, maze: env.Maze) -> float:
        p = self.success.get(self.key(maze))
        return 1.0 if p is None else max(self.floor, 4 * p * (1 - p))

    def next(self) -> env.Maze:
        for _ in range(self.MAX_DRAWS):
            maze = self.stream.next()
            self.draws += 1
            if random.Random(f"{self.seed}:{self.stream.position}").random() < self.accept_probability(maze):
                return maze
        raise RuntimeError(f"{self.MAX_DRAWS} training mazes in a row rejected; raise the learnability floor")

    def record(self, mazes: list, success_rates: list) -> None:
        """What each maze's group just did (success rate in [0, 1])."""
        for maze, p in zip(mazes, success_rates):
            self.success[self.key(maze)] = float(p)

    def take_draws(self) -> int:
        draws, self.draws = self.draws, 0
        return draws

    @property
    def position(self) -> int:
        return self.stream.position

    def state_dict(self) -> dict:
        # the stream's own state plus the table, so a stream-only loader reads it as before
        return {**self.stream.state_dict(), "success": dict(self.success)}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)
        self.success = {k: float(v) for k, v in state.get("success", {}).items()}


# ----------------------------------------------------------------------------- fork starts

def junctions(maze: env.Maze) -> list:
    """The open cells with three or more open neighbours: where a move is a choice of branch."""
    cells = []
    for r in range(maze.size):
        for c in range(maze.size):
            open_ways = sum(maze.is_open((r + dr, c + dc)) for dr, dc in env.MOVE_DELTAS.values())
            if maze.is_open((r, c)) and open_ways >= 3 and (r, c) != maze.goal:
                cells.append((r, c))
    return cells


def fork_start(maze: env.Maze, fraction: float, seed: int = 0) -> env.Maze:
    """With probability `fraction`, the same maze started on one of its junctions instead.

    Greedy play fails at forks (docs/experiments.md): a group of episodes started on a fork puts
    its branches side by side, so the group-relative advantage says which way was right there,
    the comparison a group from the corner only makes when its samples happen to part at the fork.
    The junctions are read off the walls alone (no solver): the policy learns to go on from any
    branching point, as it must after a wrong turn. The choice is a hash of (seed, maze seed)."""
    rng = random.Random(f"fork:{seed}:{maze.seed}")
    cells = junctions(maze)
    if not cells or rng.random() >= fraction:
        return maze
    return dataclasses.replace(maze, start=rng.choice(cells))
