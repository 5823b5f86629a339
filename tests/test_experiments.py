"""Research tools in experiments/: a smoke test each (they are not part of the product)."""

import collections
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

import env
from tasks.maze import (ACTION_STRINGS, MOVE_DELTAS, STOP_ACTION, Maze, MazeTask, eval_mazes, generate_maze,
                        goal_distances, solve)
from tasks.visgym_maze import VisGymMazeTask


def TrainMazeStream(difficulty, **kwargs):
    """The maze's training stream."""
    return env.TrainingStream(MazeTask, difficulty, **kwargs)

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_eval_policy_plays_the_held_out_mazes_like_the_trainer(tmp_path, warm_start, engine):
    """experiments/eval_policy.py (the generalisation check) plays greedily through the same chat path
    as train.py's evaluation: its per-maze replies match evaluation.play_chat_episodes on an engine
    of our own. A path that is not an adapter is refused with a clear message."""
    import evaluation
    import rollout

    out = tmp_path / "gen" / "easy.json"
    proc = subprocess.run([sys.executable, "experiments/eval_policy.py", "--model", str(warm_start), "--difficulty", "easy",
                           "--n", "2", "--max-turns", "3", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["difficulty"] == "easy" and result["total"] == 2 and len(result["puzzles"]) == 2
    assert result["solved"] == sum(m["solved"] for m in result["puzzles"])
    chat = rollout.ChatFormat.for_model(str(warm_start))
    mine = evaluation.play_chat_episodes(env.held_out(MazeTask, "easy", 2, max_turns=3),
                                         evaluation.engine_replies(engine, None, 8, chat.banned_token_ids), progress=False)
    assert [m["replies"] for m in result["puzzles"]] == [e.replies for e in mine]
    assert not list(out.parent.glob("*.tmp-*"))  # written atomically

    bad = subprocess.run([sys.executable, "experiments/eval_policy.py", "--model", str(warm_start), "--adapter", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "not a PEFT adapter directory" in bad.stderr


@pytest.mark.slow
def test_branch_points_shows_one_group_and_its_branches_as_the_trainer_plays_them(warm_start):
    """experiments/branch_points.py: the group's members (where each went), then each point (a
    cell its member passed), the returns of its moves and the target: the best move where one
    branch returned most and more than 0, else none. A seed that is not a training maze: one line."""
    import ast
    import re

    pool = TrainMazeStream("small", pool=4)
    seed = pool.next().seed
    command = [sys.executable, "experiments/branch_points.py", "--model", str(warm_start), "--train-pool", "4",
               "--group-size", "2", "--max-turns", "6", "--points", "1"]
    proc = subprocess.run(command + ["--maze-seed", str(seed)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()  # with vLLM's own log lines among them
    assert [line for line in lines if line.startswith("maze ")][0].startswith(f"maze {seed}: ")
    members = {int(m[1]): ast.literal_eval(m[2]) for m in
               (re.match(r"member (\d+): .* cells (\[.*\])$", line) for line in lines) if m}
    assert sorted(members) == [0, 1]
    points = [re.match(r"point: member (\d+), turn (\d+), cell \((\d+), (\d+)\): returns (\{.*\}), target (\S+)$",
                       line) for line in lines if line.startswith("point:")]
    assert len(points) <= 1 and all(points)
    for point in points:
        member, turn, cell = int(point[1]), int(point[2]), (int(point[3]), int(point[4]))
        assert members[member][turn] == cell  # the state that member was in at that turn
        returns = ast.literal_eval(point[5])
        assert returns and all(0 <= r <= 1 for r in returns.values())
        best = max(returns.values())
        expected = (next(m for m, r in returns.items() if r == best)
                    if best > 0 and list(returns.values()).count(best) == 1 else "none")
        assert point[6] == expected

    bad = subprocess.run(command + ["--maze-seed", "7"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "no training maze with seed 7 among the first 4" in bad.stderr


@pytest.mark.slow
def test_diagnose_replays_the_greedy_policy_with_oracle_rules(tmp_path, tiny_model):
    from experiments.diagnose import VARIANTS, blocked

    maze = generate_maze(7, seed=0)
    start = maze.start
    for move, (dr, dc) in MOVE_DELTAS.items():
        action = ACTION_STRINGS[move]
        assert blocked(maze, start, action) == (not maze.is_open((start[0] + dr, start[1] + dc)))
    assert not blocked(maze, start, STOP_ACTION) and not blocked(maze, start, "garbage")

    proc = subprocess.run([sys.executable, "experiments/diagnose.py", "--model", str(tiny_model), "--n", "2", "--max-turns", "3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import re

    rows = [m.groups() for line in proc.stdout.splitlines() if (m := re.fullmatch(r"\s*(\S+): solved (\d)/2", line))]
    assert [name for name, _ in rows] == list(VARIANTS), proc.stdout


def test_failures_classifies_wrong_turns_towards_the_goal_and_two_cell_loops(tmp_path):
    from experiments.failures import classify

    mazes = eval_mazes("small", 3)
    # the first evaluation maze with a fork on its shortest path: another open move that also
    # brings the agent closer to the goal
    def fork(maze):
        cell = maze.start
        for i, best in enumerate(solve(maze)[:-1]):
            for move, (dr, dc) in MOVE_DELTAS.items():
                nxt = (cell[0] + dr, cell[1] + dc)
                closer = abs(nxt[0] - maze.goal[0]) + abs(nxt[1] - maze.goal[1]) < \
                    abs(cell[0] - maze.goal[0]) + abs(cell[1] - maze.goal[1])
                if ACTION_STRINGS[move] != best and maze.is_open(nxt) and closer:
                    return i, move
            dr, dc = MOVE_DELTAS[ACTION_STRINGS.index(best)]
            cell = (cell[0] + dr, cell[1] + dc)
        return None

    index = next(i for i, m in enumerate(mazes) if fork(m))
    steps, wrong = fork(mazes[index])
    path = solve(mazes[index])
    back = ACTION_STRINGS[(wrong + 2) % 4]
    bounce = path[:steps] + [ACTION_STRINGS[wrong], back] * 8  # in and out, in and out
    rows = [{"index": i, "solved": i != index, "replies": [f"<answer>{a}</answer>" for a in
                                                                   (bounce[:15] if i == index else solve(m))]}
            for i, m in enumerate(mazes)]
    result = {"difficulty": "small", "total": 3, "puzzles": rows}
    counts = classify(result)
    assert counts["failed"] == 1 and counts["first_wrong_towards_goal"] == 1 and counts["two_cell_loop"] == 1
    assert counts["mazes"] == 3 and 0 <= counts["monotone_shortest_path"] <= 3

    # an unreadable first reply is a wrong move, but not one towards the goal; a stop off the goal no loop
    rows[index]["replies"] = ["no idea", f"<answer>{STOP_ACTION}</answer>"]
    start_distance = goal_distances(mazes[index])[mazes[index].start]
    assert classify(result) == {**counts, "first_wrong_towards_goal": 0, "two_cell_loop": 0,
                                "end_distances": [start_distance]}

    # a VisGym result is replayed by VisGym's env: k right moves of 12 leave 12 - k cells, and each
    # reply into a wall is a bump (k: the last cell of the path beside a wall, past where the styles agree)
    visgym_mazes, our_mazes = eval_mazes("easy", 8, VisGymMazeTask), eval_mazes("easy", 8)
    i = next(i for i in range(8) if solve(visgym_mazes[i]) != solve(our_mazes[i]))  # the styles differ
    visgym_maze = visgym_mazes[i]
    path, cell = solve(visgym_maze), visgym_maze.start
    for j, move in enumerate(path[:-2], start=1):
        dr, dc = MOVE_DELTAS[ACTION_STRINGS.index(move)]
        cell = (cell[0] + dr, cell[1] + dc)
        beside = [a for a, (dr, dc) in zip(ACTION_STRINGS, MOVE_DELTAS.values())
                  if not visgym_maze.is_open((cell[0] + dr, cell[1] + dc))]
        if beside:
            k, walls = j, beside
    visgym_result = {"difficulty": "easy", "task": "visgym-maze", "total": 8, "puzzles": [
        {"index": i, "solved": False, "replies": [f"<answer>{a}</answer>" for a in path[:k] + walls[:1] * 2]}]}
    counts_visgym = classify(visgym_result)
    assert counts_visgym["end_distances"] == [len(path) - 1 - k] and counts_visgym["bumps"] == 2

    # the training mazes of `eval_policy.py --training-mazes` are replayed as such; a wrong maze is refused
    stream = TrainMazeStream("small")
    training = {"difficulty": "small", "total": 1, "mazes_played": "training", "puzzles": [
        {"index": 0, "seed": stream.next().seed, "solved": False, "replies": ["no idea"]}]}
    assert classify(training)["failed"] == 1
    training["puzzles"][0]["seed"] = mazes[0].seed
    with pytest.raises(SystemExit, match="not the mazes"):
        classify(training)

    out = tmp_path / "step_0.json"
    out.write_text(json.dumps(result))
    proc = subprocess.run([sys.executable, "experiments/failures.py", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "failed 1/3; first wrong move towards the goal 0" in proc.stdout, proc.stderr


@pytest.mark.slow
def test_forks_sorts_the_shortest_path_turns_by_how_deep_the_wrong_branch_goes(tmp_path, tiny_model):
    from experiments.forks import branch_depth, turn_kinds

    # A perfect 7x7 maze (nine rooms, eight passages), start top-left, goal bottom-right. From the
    # start, right leads into a one-room dead end (2 cells) and down is the way; at (3, 1) the route
    # turns right while a 4-cell branch goes on down and along the bottom row; at (3, 5) it turns
    # down while a 2-cell branch goes up to the top-right room.
    rows = ["#######",
            "#...#.#",
            "#.###.#",
            "#.....#",
            "#.###.#",
            "#...#.#",
            "#######"]
    walls = tuple(tuple(ch == "#" for ch in row) for row in rows)
    maze = Maze(walls=walls, start=(1, 1), goal=(5, 5), seed=-1)
    assert solve(maze) == [ACTION_STRINGS[d] for d in (3, 3, 0, 0, 0, 0, 3, 3)] + [STOP_ACTION]
    assert branch_depth(maze, (1, 2), (1, 1)) == 2
    assert branch_depth(maze, (4, 1), (3, 1)) == 4
    assert turn_kinds(maze) == ["fork d2", "corridor", "fork d4", "corridor", "corridor", "corridor", "fork d2",
                                "corridor", "stop"]

    # with a model: one score per turn, every kind accounted for
    proc = subprocess.run([sys.executable, "experiments/forks.py", "--model", str(tiny_model), "--n", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import re

    scored = {kind: (int(r), int(t)) for kind, r, t in re.findall(r"(\w+(?: d\d+)?): (\d+)/(\d+)", proc.stdout)}
    census = subprocess.run([sys.executable, "experiments/forks.py", "--census", "--n", "2"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    counts = {kind: int(n) for kind, n in re.findall(r"(\w+(?: d\d+)?): (\d+)\n", census.stdout)}
    expected = collections.Counter(k for m in eval_mazes("small", 2) for k in turn_kinds(m))
    assert counts == dict(expected) and {k: t for k, (_, t) in scored.items()} == dict(expected), proc.stdout
    assert all(0 <= r <= t for r, t in scored.values())

    # a directory that is not an adapter is refused
    refused = subprocess.run([sys.executable, "experiments/forks.py", "--model", str(tiny_model), "--n", "2",
                              "--adapter", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "not a PEFT adapter directory" in refused.stderr


def test_gradient_probe_estimators_are_what_their_equations_say():
    """experiments/gradient_probe.py's estimator algebra, without a model: the oracle ranks the
    solver's move first; the enumerated expectation of the 8-sample GRPO estimator is the mean of
    its draws; with a 0/1 oracle the exact on-policy gradient is p * grad log pi(right) (the
    p(1 - p) scaling of the issue: the SFT direction, p times as long)."""
    import numpy as np

    from experiments.gradient_probe import estimator_coefficients, grpo_coefficients, oracle_values, path_states

    maze = TrainMazeStream("small").next().maze
    states = path_states(maze)
    for s in states:
        q = oracle_values(maze, s["cell"], s["turn"], 15, 0.95)
        assert np.argmax(q) == s["right"] and q[s["right"]] > np.delete(q, s["right"]).max()
    assert oracle_values(maze, maze.goal, 0, 15, 0.95)[-1] == 1.0 and oracle_values(maze, maze.start, 0, 15, 0.95)[-1] == 0
    assert not oracle_values(maze, maze.start, 14, 15, 0.95)[:4].any()  # no turn left to get there

    rng = np.random.default_rng(0)
    pi = np.array([0.55, 0.25, 0.12, 0.05, 0.03])
    q = np.array([0.9, 0.0, 0.8, 0.5, 0.0])
    exact = estimator_coefficients(q, pi, 0, [0, 2, 3], 0.5, 8, rng)
    draws = np.mean([grpo_coefficients(rng.multinomial(8, pi), q, 0.5) for _ in range(20000)], axis=0)
    assert np.abs(draws - exact["grpo8_exact"]).max() < 0.02 * np.abs(exact["grpo8_exact"]).max()

    basis = rng.normal(size=(7, 50))
    basis[5] = pi @ basis[:5]  # grad E_pi_T[z] when the five actions hold all the mass
    indicator = (np.arange(5) == 3).astype(float)
    c = estimator_coefficients(indicator, pi, 3, [0, 3], 0.5, 8, rng)
    from experiments.gradient_probe import grad_log_pi

    np.testing.assert_allclose(c["pg_exact"] @ basis, pi[3] * grad_log_pi(3, 0.5) @ basis, atol=1e-12)


def test_gradient_probe_gradients_match_autograd_on_the_warm_start(warm_start):
    """On a real shortest path, a state's SFT gradient assembled from the probe's seven vectors is
    the gradient autograd gives log pi_1(right) directly, only LoRA parameters carry it, and the
    probe's sets add up (wrong forks are the forks greedy play gets wrong)."""
    import numpy as np
    import torch

    import policy
    import rollout
    import sft
    from experiments.gradient_probe import grad_log_pi, lora_policy, path_states, probe, state_vectors

    chat = rollout.ChatFormat.for_model(str(warm_start))
    model = lora_policy(str(warm_start))
    maze = TrainMazeStream("small").next().maze
    states, vectors = path_states(maze), state_vectors(model, chat, maze, 0.5, 15)
    assert len(states) == len(vectors)
    i = next(k for k, s in enumerate(states) if s["kind"].startswith("fork"))
    assembled = grad_log_pi(states[i]["right"], 1.0) @ vectors[i]["basis"]

    task = MazeTask.of(maze, max_turns=15)
    answer_id = chat.action_prefix(task)[-1]
    sequences = sft.demonstration(task, chat, random.Random(0), max_images=None, noise=0.0)
    inputs, mask, _ = policy.Batch(sequences, chat.processor).micro([0], torch.device("cpu"))
    logits = model(**inputs).logits[0, :-1]
    position = ((mask[0] > 0) & (inputs["input_ids"][0, :-1] == answer_id)).nonzero().flatten()[i]
    torch.log_softmax(logits[position], -1)[inputs["input_ids"][0, position + 1]].backward()
    direct = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad]).double().numpy()
    assert all(p.grad is None for n, p in model.named_parameters() if "lora" not in n)
    assert np.abs(direct).max() > 0
    np.testing.assert_allclose(assembled, direct, rtol=1e-4, atol=1e-6 * np.abs(direct).max())

    report = probe(model, chat, [maze])
    sets = report["sets"]
    assert sets["all"]["states"] == len(states)
    assert sets["fork"]["states"] == sum(s["kind"].startswith("fork") for s in states)
    assert sets["wrong_fork"]["states"] == sets["fork"]["states"] - sets["fork"]["greedy_right"]
    assert sets["all"]["kinds"]["sft"]["summed_cos_to_sft"] == pytest.approx(1.0)


def test_average_adapters_is_the_exact_mean_of_their_deltas_at_a_rank_vllm_takes(tmp_path):
    """experiments/average_adapters.py: three rank-4 adapters become one rank-16 adapter (12 padded
    to a vLLM rank) whose output through PEFT is the mean of the three adapted outputs; adapters of
    different ranks are refused in one line."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model

    from experiments.average_adapters import average

    def base():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 5))

    x = torch.randn(3, 6)
    paths, outputs = [], []
    for i, r in enumerate((4, 4, 4, 8)):
        model = get_peft_model(base(), LoraConfig(r=r, lora_alpha=3 * r, target_modules=["0"]))
        torch.manual_seed(i + 1)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data.normal_()
        model.save_pretrained(tmp_path / f"a{i}")
        (tmp_path / f"a{i}" / "base_model.json").write_text('{"fingerprint": "x"}')
        paths.append(tmp_path / f"a{i}")
        with torch.no_grad():
            outputs.append(model(x))
    assert average(paths[:3], tmp_path / "mean") == 16
    averaged = PeftModel.from_pretrained(base(), tmp_path / "mean")
    with torch.no_grad():
        assert torch.allclose(averaged(x), sum(outputs[:3]) / 3, atol=1e-5)
    assert (tmp_path / "mean" / "base_model.json").exists()
    assert json.loads((tmp_path / "mean" / "adapter_config.json").read_text())["lora_alpha"] == 48  # 3 / 4 * 16
    with pytest.raises(SystemExit, match="differ in rank"):
        average(paths[2:], tmp_path / "bad")
    # the factor-wise mean: rank r, its output is NOT the mean output, and its stated error is its
    # delta's distance from the exact mean's (0 for copies of one adapter); --scale c: c x the delta
    from experiments.average_adapters import factorwise, scaled

    error = factorwise(paths[:3], tmp_path / "fw")
    fw = PeftModel.from_pretrained(base(), tmp_path / "fw")
    with torch.no_grad():
        exact, approx, plain = sum(outputs[:3]) / 3, fw(x), base()(x)
    assert json.loads((tmp_path / "fw" / "adapter_config.json").read_text())["r"] == 4
    measured = float((approx - plain - (exact - plain)).norm() / (exact - plain).norm())
    assert error > 0.05 and measured > 0.01  # cross terms: far from exact for unrelated adapters
    assert factorwise([paths[0]] * 3, tmp_path / "same") < 1e-6
    scaled(paths[0], 0.5, tmp_path / "half")
    half = PeftModel.from_pretrained(base(), tmp_path / "half")
    with torch.no_grad():
        assert torch.allclose(half(x) - plain, 0.5 * (outputs[0] - plain), atol=1e-5)


def test_churn_counts_always_never_and_flips_from_the_runs_own_evaluations(tmp_path):
    from experiments.churn import churn

    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"run_id": "r"}))
    solved = {0: [1, 0, 0, 1], 25: [1, 1, 0, 0], 50: [1, 0, 0, 1]}  # maze 0 always, 2 never, 1 and 3 flip
    for step, row in solved.items():
        (run / "eval" / f"step_{step}.json").write_text(json.dumps(
            {"step": step, "solved": sum(row), "total": 4, "run_id": "r",
             "puzzles": [{"index": i, "solved": bool(s)} for i, s in enumerate(row)]}))
    (run / "eval" / "step_75.json").write_text(json.dumps(  # another run's file: not counted
        {"step": 75, "solved": 4, "total": 4, "run_id": "other", "puzzles": [{"index": i, "solved": True}
                                                                           for i in range(4)]}))
    c = churn(run)
    assert (c["always"], c["never"], c["sometimes"], c["flips"], c["counts"]) == (1, 1, 2, [2, 2], [2, 2, 2])
    assert c["count_sd"] == 0.0 and churn(run, from_step=25)["flips"] == [2]


def test_point_reach_calls_a_move_winnable_only_if_the_solver_finishes_in_the_turns_left():
    """experiments/point_reach.py's verdict: at a maze's start with exactly the solver's turns left,
    only the solver's first move can still win; with one turn fewer, none can."""
    from experiments.point_reach import winnable_moves

    task = MazeTask("small", seed=1000003, max_turns=15)
    task.reset()
    plan, actions = task.solve(), task.legal_actions()
    assert len(actions) > 1
    assert winnable_moves(task, actions, len(plan)) == [a == plan[0] for a in actions]
    assert winnable_moves(task, actions, len(plan) - 1) == [False] * len(actions)


@pytest.mark.slow
def test_point_reach_tallies_the_points_a_step_branches_at(warm_start):
    """experiments/point_reach.py end to end: every point is counted once, and a point that no move
    can still win has no winning branch and no target."""
    import re

    command = [sys.executable, "experiments/point_reach.py", "--model", str(warm_start), "--puzzles", "2",
               "--group-size", "2"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    total = int(re.search(r"(\d+) points, 1 continuation\(s\) a move", proc.stdout)[1])
    rows = {m[1]: tuple(map(int, m.groups()[1:])) for m in re.finditer(
        r"^(some|no) move can still win: (\d+) points, (\d+) with a winning branch, (\d+) with a target$",
        proc.stdout, re.M)}
    assert set(rows) == {"some", "no"} and rows["some"][0] + rows["no"][0] == total > 0
    assert rows["no"][1:] == (0, 0) and rows["some"][2] <= rows["some"][1] <= rows["some"][0]
