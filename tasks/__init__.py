"""The tasks the trainer can play, by name (--task): each is one module with one env.Task subclass.

    task = tasks.make("sokoban", level="6x6", seed=0, max_turns=15)
    cls = tasks.task_class("my_package.my_module:MyTask")    # a task of your own, by import path

A task of your own needs no change here: name it by its import path (`module:Class`), or add a
line to TASKS to give it a short name. tasks/line.py is the smallest whole example.
"""

import importlib

from tasks.line import LineTask
from tasks.maze import MazeTask
from tasks.sokoban import SokobanTask
from tasks.visgym_maze import VisGymMazeTask

TASKS = {cls.name: cls for cls in (MazeTask, VisGymMazeTask, SokobanTask, LineTask)}


def task_class(name: str):
    """The task class a --task value names: a short name from TASKS, or `module:Class`."""
    if name in TASKS:
        return TASKS[name]
    module, _, attribute = name.partition(":")
    if not attribute:
        raise ValueError(f"unknown task {name!r}: one of {sorted(TASKS)}, or module:Class for your own")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"task {name!r} cannot be loaded: {e}") from None


def make(name: str, level: str, seed: int, max_turns: int = 15):
    """One puzzle of a task: its name, its level and its seed say which."""
    return task_class(name)(level, seed, max_turns)
