"""Does a task keep env.Task's promises? A conformance check in the spirit of gymnasium's env checker.

    python task_check.py sokoban 6x6                 # or any --task value, e.g. my_module:MyTask
    problems = task_check.check(SokobanTask, "6x6")  # [] when every rule holds

Each rule is played out on a few puzzles of the level, along random walks (every action, legal or
not, and replies that name none), and a broken rule is reported by its name with the first case
that breaks it. The rules, and the trainer feature that relies on each:

    same_seed       the same seed gives the same episode: pictures, texts, rewards (held-out sets,
                    resumed runs)
    restore         restoring a snapshot, then playing on, equals playing on from where it was
                    taken (branch rollouts)
    state_key       equal snapshots give equal keys, and equal keys the same situation: the same
                    legal actions, each with the same outcome, and as far from success by the
                    solver (GiGPO's anchors, branch points)
    legal_actions   every action is read back from its own reply, and a legal action changes the
                    state or ends the episode (forced replies, branch rollouts)
    solver          the solver's actions, from the start or from any state it can reach, succeed
                    (SFT demonstrations, the fits-the-turn-limit count)
    render          the picture is a function of the state (evaluation replays, the image cache)
    junk            a reply that names no action is invalid, changes nothing and spends its turn
    plain_state     a snapshot is plain data: pickled and read back, it restores the same state

A rule whose feature the task does not have (no snapshots, no solver: env.features) is skipped
and named as such.
"""

import pickle
import random
import sys

import env

JUNK = ["", "garbage", "<answer></answer>", "(((", "\x00", "x" * 20_000, "<answer>('fly', 9)</answer>", "0" * 50]
RULES = ("same_seed", "restore", "state_key", "legal_actions", "solver", "render", "junk", "plain_state")


def check(task_class, level: str, seeds=range(4), walk: int = 24, max_turns: int = 60) -> list[str]:
    """The broken rules, each as 'rule: the first case that breaks it' ([] if none is)."""
    has = env.features(task_class)
    problems = {}

    def fail(rule: str, why: str):
        problems.setdefault(rule, f"{rule}: {why}")

    for seed in seeds:
        rng = random.Random(seed)
        task, twin = task_class(level, seed, max_turns), task_class(level, seed, max_turns)
        trace = _walk(task, rng, walk)
        if _walk(twin, random.Random(seed), walk) != trace:
            fail("same_seed", f"seed {seed}: two copies played the same replies differently")
        for action in task.actions:
            if task.parse(task.reply(action)) != action:
                fail("legal_actions", f"seed {seed}: {action!r} reads back as {task.parse(task.reply(action))!r}")
        _check_junk(task_class(level, seed, max_turns), seed, fail)
        if not has["snapshots"]:
            continue
        states = _states(task_class(level, seed, max_turns), random.Random(seed + 1), walk)
        for i, (snapshot, picture, walked) in enumerate(states):
            game = task_class(level, seed, max_turns)
            game.reset()
            game.restore(snapshot)
            if game.render().tobytes() != picture:
                fail("render", f"seed {seed}: state {i} restored draws another picture")
            try:
                copy = pickle.loads(pickle.dumps(snapshot))
            except Exception as e:  # noqa: BLE001  (whatever pickling raises, the rule is broken)
                fail("plain_state", f"seed {seed}: state {i} cannot be pickled ({type(e).__name__})")
                continue
            other = task_class(level, seed, max_turns)
            other.reset()
            other.restore(copy)
            if other.state_key() != game.state_key() or other.render().tobytes() != picture:
                fail("plain_state", f"seed {seed}: state {i} does not survive pickling")
            _check_restore(walked, game.clone(), seed, rng, fail)
            _check_legal(game, seed, i, fail)
            if has["solver"]:
                _check_solver(game, seed, i, fail)
        _check_keys(task_class, level, seed, max_turns, states, fail)
    if has["solver"]:
        for seed in seeds:
            game = task_class(level, seed, max_turns)
            game.reset()
            _check_solver(game, seed, "start", fail)
    return list(problems.values())


def _step_record(obs, task) -> tuple:
    return obs.text, obs.image.tobytes(), obs.reward, obs.done, obs.valid, obs.no_effect, task.state_key()


def _walk(task, rng: random.Random, n: int) -> list:
    """Random replies (an action's reply, or junk) from reset; the record of every observation."""
    obs = task.reset()
    trace = [_step_record(obs, task)]
    for _ in range(n):
        if task.done:
            break
        reply = task.reply(rng.choice(task.actions)) if rng.random() < 0.85 else rng.choice(JUNK)
        trace.append(_step_record(task.step(reply), task))
    return trace


def _states(task, rng: random.Random, n: int) -> list:
    """(snapshot, picture, a copy of the game then) of the states a random walk passes through."""
    obs, states = task.reset(), []
    for _ in range(n):
        states.append((task.snapshot(), obs.image.tobytes(), task.clone()))
        obs = task.step(task.reply(rng.choice(task.actions)))
        if task.done:
            break
    return states


def _check_restore(walked, restored, seed, rng, fail):
    """`walked` got to its state by playing, `restored` by restore(): they must play on alike."""
    for action in [rng.choice(walked.actions) for _ in range(4)]:
        if walked.done:
            break
        a, b = walked.step(walked.reply(action)), restored.step(restored.reply(action))
        if _step_record(a, walked) != _step_record(b, restored):
            fail("restore", f"seed {seed}: played on after a restore, {action!r} does something else")
            return


def _outcomes(game) -> tuple:
    """Each legal action's outcome from the game's state: (action, reward, done, next key)."""
    results = []
    for action in game.legal_actions():
        trial = game.clone()
        trial.max_turns = trial.turn + 2  # the turn limit plays no part
        obs = trial.step(trial.reply(action))
        results.append((action, obs.reward, obs.done, trial.state_key()))
    return tuple(results)


def _check_keys(task_class, level, seed, max_turns, states, fail):
    by_key, by_state = {}, {}
    for snapshot, _, _ in states:
        game = task_class(level, seed, max_turns)
        game.reset()
        game.restore(snapshot)
        key, state = game.state_key(), repr(snapshot[1])  # the task's state, without the turn count
        if by_state.setdefault(state, key) != key:
            fail("state_key", f"seed {seed}: one state, two keys {by_state[state]!r} and {key!r}")
        solution = game.solve() if env.features(task_class)["solver"] else None
        situation = (_outcomes(game), game.is_decision_point(), None if solution is None else len(solution))
        if by_key.setdefault(key, situation) != situation:
            fail("state_key", f"seed {seed}: key {key!r} stands for two situations")
        hash(key)


def _check_legal(game, seed, i, fail):
    for action, reward, done, key in _outcomes(game):
        if not done and key == game.state_key():
            fail("legal_actions", f"seed {seed}: state {i}: the legal {action!r} changes nothing")


def _check_solver(game, seed, where, fail):
    trial = game.clone()
    solution = trial.solve()
    if solution is None:
        return  # a state it cannot be solved from (a box in a corner): nothing to follow
    trial.max_turns = trial.turn + len(solution) + 1
    for action in solution:
        obs = trial.step(trial.reply(action))
        if obs.done:
            break
    if not (trial.solved and obs.reward > 0):
        fail("solver", f"seed {seed}: from state {where}, the solver's {len(solution)} actions do not succeed")


def _check_junk(game, seed, fail):
    game.reset()
    for reply in JUNK:
        if game.done:
            return
        before, turn = game.state_key(), game.turn
        obs = game.step(reply)
        if game.parse(reply) is not None or obs.valid or game.state_key() != before or game.turn != turn + 1:
            fail("junk", f"seed {seed}: the reply {reply[:30]!r} was taken for an action or changed the state")


if __name__ == "__main__":
    import tasks

    name, level = sys.argv[1], sys.argv[2]
    found = check(tasks.task_class(name), level)
    skipped = [f for f, ok in env.features(tasks.task_class(name)).items() if not ok]
    print("\n".join(found) or f"{name} {level}: every rule holds"
          + (f" (no {', '.join(skipped)}: their rules skipped)" if skipped else ""))
    sys.exit(1 if found else 0)
