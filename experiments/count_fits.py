"""How many mazes can be solved within a turn limit at all? Exact for 9x9, counted for the eval seeds.

A 9x9 maze is a spanning tree of its 4x4 grid of rooms, and Wilson's algorithm (both styles use
it) draws every spanning tree with the same probability; start and goal are opposite corners.
So the share of 9x9 mazes whose shortest solution (its moves plus the final stop) fits in T
turns is exact if we enumerate all spanning trees and measure the corner-to-corner path in each.
Both diagonals are counted (they are mirror images, so they give the same share).
Beside it, how many of the 64 evaluation mazes (seeds 0..63) of each style and size fit.

    .venv/bin/python experiments/count_fits.py            # ~10-30 s on one core
"""

import argparse
import sys
from collections import deque
from fractions import Fraction
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tasks.maze import DIFFICULTY_SIZES, MazeTask, eval_mazes, solve  # noqa: E402
from tasks.visgym_maze import VisGymMazeTask  # noqa: E402


def grid_edges(n: int) -> list:
    """The edges between neighbouring rooms of an n x n grid, rooms numbered row by row."""
    edges = []
    for r in range(n):
        for c in range(n):
            if c + 1 < n:
                edges.append((r * n + c, r * n + c + 1))
            if r + 1 < n:
                edges.append((r * n + c, (r + 1) * n + c))
    return edges


def spanning_trees(n: int):
    """Yield every spanning tree of the n x n room grid, each as a list of edges.

    Backtracking over the edges in order: an edge is either left out, or taken if it joins two
    components (a union-find without path compression, so a union can be undone). A branch ends
    early once the edges left cannot bring the count up to n*n - 1.
    """
    edges = grid_edges(n)
    nodes = n * n
    parent = list(range(nodes))
    chosen = []

    def root(x):
        while parent[x] != x:
            x = parent[x]
        return x

    def extend(i):
        if len(chosen) == nodes - 1:
            yield list(chosen)
            return
        if len(edges) - i < nodes - 1 - len(chosen):
            return
        a, b = root(edges[i][0]), root(edges[i][1])
        if a != b:
            parent[a] = b
            chosen.append(edges[i])
            yield from extend(i + 1)
            chosen.pop()
            parent[a] = a
        yield from extend(i + 1)

    yield from extend(0)


def kirchhoff_count(n: int) -> int:
    """The number of spanning trees by the matrix-tree theorem, to check the enumeration."""
    nodes = n * n
    laplacian = np.zeros((nodes, nodes))
    for a, b in grid_edges(n):
        laplacian[a, a] += 1
        laplacian[b, b] += 1
        laplacian[a, b] -= 1
        laplacian[b, a] -= 1
    return int(round(np.linalg.det(laplacian[1:, 1:])))


def tree_distance(n: int, tree, source: int, target: int) -> int:
    """Rooms-to-rooms steps between two rooms in a tree (each is 2 moves in the maze)."""
    neighbours = [[] for _ in range(n * n)]
    for a, b in tree:
        neighbours[a].append(b)
        neighbours[b].append(a)
    dist = {source: 0}
    queue = deque([source])
    while queue:
        x = queue.popleft()
        for y in neighbours[x]:
            if y not in dist:
                dist[y] = dist[x] + 1
                queue.append(y)
    return dist[target]


def turns_histogram(n: int) -> dict:
    """{turns needed: number of (tree, diagonal) pairs}: turns = 2 * room distance + 1 (the stop)."""
    counts = {}
    corners = [(0, n * n - 1), (n - 1, n * (n - 1))]  # the two diagonals
    for tree in spanning_trees(n):
        for a, b in corners:
            turns = 2 * tree_distance(n, tree, a, b) + 1
            counts[turns] = counts.get(turns, 0) + 1
    return counts


def share_fitting(histogram: dict, max_turns: int) -> Fraction:
    return Fraction(sum(v for t, v in histogram.items() if t <= max_turns), sum(histogram.values()))


def eval_fits(difficulty: str, task_class, limits, n: int = 64) -> list:
    needed = [len(solve(m)) for m in eval_mazes(difficulty, n, task_class)]
    return [sum(t <= limit for t in needed) for limit in limits]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limits", type=int, nargs="+", default=[15, 20, 30])
    args = parser.parse_args()

    rooms = 4  # a 9x9 maze
    histogram = turns_histogram(rooms)
    trees = sum(histogram.values()) // 2
    assert trees == kirchhoff_count(rooms), "enumeration missed or repeated trees"
    cols = "".join(f"{f'<= {t} turns':>14}" for t in args.limits)
    print(f"{'mazes':36}{cols}")
    exact = "".join(f"{float(share_fitting(histogram, t)):>14.1%}" for t in args.limits)
    print(f"{f'all 9x9 (exact, {trees} layouts)':36}{exact}")
    for difficulty in ("easy", "hard"):
        size = DIFFICULTY_SIZES[difficulty]
        for style, task_class in (("ours", MazeTask), ("visgym", VisGymMazeTask)):
            fits = eval_fits(difficulty, task_class, args.limits)
            print(f"{f'{style} {difficulty} ({size}x{size}), seeds 0-63':36}" + "".join(f"{f'{k}/64':>14}" for k in fits))
    mean = sum(t * v for t, v in histogram.items()) / sum(histogram.values())
    print(f"\n9x9 turns needed (moves + stop): mean {mean:.2f}, range {min(histogram)}-{max(histogram)}")


if __name__ == "__main__":
    main()
