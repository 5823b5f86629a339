"""Imports run one way: the top-level modules never import from launch/ or experiments/, and the
core (env -> vllm_engine -> rollout -> grpo -> policy -> update -> storage/checkpoint/rundir -> train) never imports
what comes after it; the tasks (tasks/) build on env.py alone, and the trainer names none of them;
config.py (the recipe) imports nothing of the trainer's, and serve.py nothing of train.py's."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# each module may import only the project modules listed for it (plus the standard library and packages)
ALLOWED = {
    "env": set(),
    "grpo": set(),
    "gigpo": {"grpo"},
    "tis": {"grpo"},
    "distributed": set(),
    "vllm_engine": set(),
    "task_check": {"env", "tasks"},
    "tiny_model": {"env", "tasks", "vllm_engine"},  # the VisGym build draws with tasks/visgym_maze.py
    "rollout": {"env", "vllm_engine"},
    "config": {"tasks", "vllm_engine"},
    "storage": set(),
    "checkpoint": {"config", "distributed", "storage"},
    "rundir": {"checkpoint", "distributed", "storage"},
    "policy": {"checkpoint", "distributed", "grpo", "rollout", "storage", "tiny_model", "vllm_engine"},
    "update": {"distributed", "grpo", "policy"},
    "branch": {"env", "grpo", "rollout"},
    "average": set(),
    "evaluation": {"average", "distributed", "env", "policy", "rollout", "rundir", "vllm_engine"},
    "probe": {"rollout", "vllm_engine"},
    "train": {"average", "branch", "checkpoint", "config", "distributed", "env", "evaluation", "gigpo", "grpo",
              "policy", "probe", "rollout", "rundir", "storage", "tasks", "tis", "update", "vllm_engine"},
    "sft": {"config", "env", "grpo", "policy", "rollout", "rundir", "storage", "tasks"},
    "serve": {"checkpoint", "config", "env", "evaluation", "policy", "rollout", "tasks", "vllm_engine"},
}
# The trainer knows a task only through env.py's interface: these modules name no task's things.
TRAINER = ("train", "rollout", "grpo", "gigpo", "tis", "update", "policy", "branch", "evaluation", "probe",
           "vllm_engine", "average", "checkpoint", "rundir")


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_imports_run_one_way():
    project = {p.stem for p in ROOT.glob("*.py")} | {"launch", "experiments", "bench", "tests", "tasks"}
    assert set(ALLOWED) == {p.stem for p in ROOT.glob("*.py")}, "a new top-level module: say what it may import"
    for name, allowed in ALLOWED.items():
        uses = imported(ROOT / f"{name}.py") & project
        assert not uses & {"launch", "experiments", "bench", "tests"}, f"{name}.py imports {uses}"
        assert uses <= allowed, f"{name}.py imports {sorted(uses - allowed)}, which it may not"
    for path in ROOT.glob("tasks/*.py"):  # a task builds on the interface (and on another task) only
        uses = imported(path) & project
        assert uses <= {"env", "tasks"}, f"tasks/{path.name} imports {sorted(uses - {'env', 'tasks'})}"


def test_the_trainer_knows_no_task():
    """No maze vocabulary in the trainer's modules: a task is one module behind env.py."""
    import re

    for name in TRAINER:
        hits = [line for line in (ROOT / f"{name}.py").read_text().splitlines()
                if re.search(r"maze|cell|wall", line, re.IGNORECASE)]
        assert not hits, f"{name}.py: {hits[:3]}"


def test_vllm_is_imported_only_inside_functions():
    """vllm_engine.py sets vLLM's environment in its module body; vllm itself is imported only inside
    functions, so it always comes after that, whatever order modules are imported in."""
    for path in [*ROOT.glob("*.py"), *ROOT.glob("experiments/*.py"), *ROOT.glob("launch/*.py"),
                 *ROOT.glob("bench/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("tasks/*.py")]:
        for node in ast.parse(path.read_text()).body:  # the module's top-level statements
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "vllm" for n in names), f"{path.name}:{node.lineno} imports vllm at its top"
