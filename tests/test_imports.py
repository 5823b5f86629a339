"""Imports run one way: the top-level modules never import from launch/ or experiments/, and the
core (env -> rollout -> grpo -> policy -> checkpoint/rundir -> train) never imports what comes after it;
config.py (the recipe) imports nothing of the trainer's, and serve.py nothing of train.py's."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# each module may import only the project modules listed for it (plus the standard library and packages)
ALLOWED = {
    "env": set(),
    "grpo": set(),
    "distributed": set(),
    "tiny_model": {"env", "rollout"},
    "visgym": {"env"},
    "rollout": {"env", "visgym"},
    "config": {"env", "rollout"},
    "checkpoint": {"config", "distributed"},
    "rundir": {"checkpoint", "distributed"},
    "policy": {"checkpoint", "distributed", "grpo", "rollout", "tiny_model"},
    "branch": {"env", "grpo", "rollout", "sft", "visgym"},
    "train": {"branch", "checkpoint", "config", "distributed", "env", "grpo", "policy", "rollout", "rundir", "visgym"},
    "sft": {"env", "grpo", "policy", "rollout", "rundir", "visgym"},
    "serve": {"checkpoint", "config", "env", "policy", "rollout", "visgym"},
}


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_imports_run_one_way():
    project = {p.stem for p in ROOT.glob("*.py")} | {"launch", "experiments", "bench", "tests"}
    assert set(ALLOWED) == {p.stem for p in ROOT.glob("*.py")}, "a new top-level module: say what it may import"
    for name, allowed in ALLOWED.items():
        uses = imported(ROOT / f"{name}.py") & project
        assert not uses & {"launch", "experiments", "bench", "tests"}, f"{name}.py imports {uses}"
        assert uses <= allowed, f"{name}.py imports {sorted(uses - allowed)}, which it may not"
