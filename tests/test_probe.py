"""The policy probe (probe.py) on the engine: how far an update moved the first action."""

import math

import pytest

import env
import rollout
from probe import PolicyProbe
from tasks.maze import MazeTask


def test_the_policy_probe_measures_how_far_the_first_move_moved(engine, warm_start, monkeypatch):
    """The engine's own distributions over the move on held-out first turns: the likeliest token
    is a move, not the reply's fixed opening; the top set holds nearly all the mass (so the KL is
    nearly exact), the same policy twice moved by 0, and a known change gives its KL and its
    flipped argmax."""
    chat = rollout.ChatFormat.for_model(str(warm_start))
    held_out = env.held_out(MazeTask, "small", 4)
    probe = PolicyProbe(chat, held_out, top=20)
    assert probe.measure(engine, None) == {}  # nothing before the first
    answer_id = chat.action_prefix(held_out[0])[-1]
    assert chat.tokenizer.decode([answer_id]) == "<answer>"  # where the maze's actions part
    reply_ids = [chat.reply_ids(held_out[0], a) for a in held_out[0].actions]
    moves = {ids[ids.index(answer_id) + 1] for ids in reply_ids}  # the token after <answer>
    assert all(max(d, key=d.get) in moves for d in probe.previous)
    assert all(sum(d.values()) > 0.99 for d in probe.previous)
    assert probe.measure(engine, None) == {"probe_kl": pytest.approx(0, abs=1e-9), "probe_flip_frac": 0}
    before = [{1: 0.7, 2: 0.3}, {1: 0.5, 2: 0.5}]
    after = [{1: 0.4, 2: 0.6}, {1: 0.5, 2: 0.5}]
    monkeypatch.setattr(probe, "distributions", lambda *_: after)
    probe.previous = before
    kl = 0.7 * math.log(0.7 / 0.4) + 0.3 * math.log(0.3 / 0.6)
    assert probe.measure(engine, None) == {"probe_kl": pytest.approx(kl / 2), "probe_flip_frac": 0.5}
