"""The recipe (config.py): the command line, what a bad value says, and which fields a checkpoint
guards on resume, read from the fields themselves."""

import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import checkpoint
import config

ROOT = Path(__file__).resolve().parent.parent


def test_help_groups_every_flag_under_its_section(capsys):
    with pytest.raises(SystemExit) as done:
        config.parse_config(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    headings = [section._argument_group_name for section in config.SECTIONS]
    starts = [text.index(f"\n{heading}:\n") for heading in headings]
    assert starts == sorted(starts)  # task, GRPO, optimisation, LoRA/sharding, engine, evaluation/paths
    for section, start, end in zip(config.SECTIONS, starts, starts[1:] + [len(text)]):
        for f in dataclasses.fields(section):
            assert f"--{f.name}" in text[start:end], (f.name, section.__name__)
            assert f.metadata["help"].split()[0] in text[start:end], f.name  # its own help text


def test_flags_with_dashes_or_underscores_and_booleans():
    cfg = config.parse_config(["--prompts-per-step", "8", "--group_size", "4", "--scale-adv-by-std", "false",
                               "--lr", "5e-4", "--progress", "No", "--resume-allow-changes", "1"])
    assert (cfg.prompts_per_step, cfg.group_size, cfg.scale_adv_by_std, cfg.lr, cfg.progress,
            cfg.resume_allow_changes) == (8, 4, False, 5e-4, False, True)
    assert config.parse_config(["--no-progress"]).progress is False
    assert config.parse_config(["--scale-adv-by-std", "true"]).scale_adv_by_std is True
    assert config.parse_config([]) == config.Config()  # the defaults are the dataclass's


def test_the_defaults_are_the_main_jobs_recipe():
    """launch/run.sh passes only paths, the seed and the maze size: what it ran with its 18 flags
    before is the Config's own defaults, every one the value the run uses (the tiny recipe); since
    2026-12-03 with branch rollouts, in 150 steps."""
    recipe = config.parse_config(["--steps", "150", "--branch-weight", "8", "--prompts-per-step", "4",
                                  "--group-size", "8", "--lora-rank", "32", "--max-new-tokens", "8",
                                  "--branch-points-per-group", "2", "--micro-batch-tokens", "0",
                                  "--temperature", "0.5", "--lr", "1e-3", "--warmup-steps", "10",
                                  "--step-adv-weight", "1", "--micro-batch-size", "16", "--eval-interval", "25",
                                  "--sampled-eval-samples", "8", "--ckpt-interval", "50", "--export-interval", "50"])
    assert recipe == config.Config()
    run_sh = (ROOT / "launch" / "run.sh").read_text()
    line = run_sh[run_sh.index("train.py --model"):].split("\n.venv")[0]
    flags = [w for w in line.split() if w.startswith("--")]
    assert flags == ["--model", "--out-dir", "--difficulty", "--seed"], flags


def test_model_dependent_defaults(tiny_model, tmp_path):
    cfg = config.Config()
    cfg.resolve_model_defaults(str(tiny_model))
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.max_new_tokens, cfg.branch_points_per_group) == (32, 64, 8, 2)
    assert (cfg.prompts_per_step, cfg.micro_batch_tokens) == (4, 0)  # the main job's batch, no token budget
    real = tmp_path / "real"
    real.mkdir()  # a config as wide as a real Qwen3-VL's language model
    conf = json.loads((Path(tiny_model) / "config.json").read_text())
    conf["text_config"]["hidden_size"] = 4096
    (real / "config.json").write_text(json.dumps(conf))
    cfg = config.Config(max_new_tokens=12)
    cfg.resolve_model_defaults(str(real))
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.max_new_tokens) == (32, 64, 12)  # a value given stays
    assert cfg.branch_points_per_group == 0  # a real model: the published recipe runs without branch rollouts
    assert (cfg.prompts_per_step, cfg.micro_batch_tokens) == (48, 16384)
    cfg = config.Config(branch_points_per_group=0)
    cfg.resolve_model_defaults(str(tiny_model))
    assert cfg.branch_points_per_group == 0 and cfg.recipe == "tiny"  # off when asked, on the tiny model too
    # a flag given on the command line wins over the recipe, even at the tiny default's value
    cfg = config.parse_config(["--branch-points-per-group", "2", "--model", str(real)])
    cfg.resolve_model_defaults(str(real))
    assert (cfg.recipe, cfg.branch_points_per_group, cfg.prompts_per_step) == ("qwen3-vl", 2, 48)
    cfg = config.parse_config(["--recipe", "qwen3-vl"])  # asked for by name, on the tiny model
    cfg.resolve_model_defaults(str(tiny_model))
    assert (cfg.max_new_tokens, cfg.prompts_per_step) == (32, 48)


def test_an_unknown_recipe_is_one_line_before_the_model_is_read(tiny_model):
    with pytest.raises(SystemExit, match=r"^bad config: recipe must be auto or one of \['tiny', 'qwen3-vl'\], not 'bogus'$"):
        config.parse_config(["--recipe", "bogus"]).resolve_model_defaults(str(tiny_model))


def test_help_shows_the_values_a_run_uses(capsys):
    """No placeholder defaults: --help shows the tiny recipe's values in the fields and the qwen3-vl
    recipe's beside --recipe."""
    with pytest.raises(SystemExit):
        config.parse_config(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "prompts_per_step 48" in text and "micro_batch_tokens 16384" in text and "branch_points_per_group 0" in text
    for f in dataclasses.fields(config.Config):  # 0 or -1 stands for a value only where its help says what
        if f.default in (0, -1) and f.type in (int, "int") and f.name != "seed":
            assert f"{f.default}:" in f.metadata["help"], f.name


def test_a_bad_value_is_one_bad_config_line():
    for argv, message in ((["--lr", "fast"], "bad config: argument --lr: invalid float value: 'fast'"),
                          (["--group-size", "1"], "bad config: group_size must be >= 2"),
                          (["--branch-tiebreak", "nearest"], "bad config: branch_tiebreak must be none or progress"),
                          (["--branch-continuations", "0"], "bad config: branch_points_per_group must be >= 0, "
                                                            "branch_weight > 0 and branch_continuations >= 1"),
                          (["--lora-plus-ratio", "16"], "bad config: unrecognized arguments: --lora-plus-ratio 16")):
        proc = subprocess.run([sys.executable, "-c", "import sys, config; "
                               "config.parse_config(sys.argv[1:]).validate(world_size=1)", *argv],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith(message), (argv, proc.stderr)


def test_meaningful_fields_come_from_the_fields_themselves(monkeypatch):
    names = config.meaningful_fields()
    assert {"lr", "group_size", "temperature", "seed", "difficulty", "lora_rank"} <= set(names)
    assert not {"steps", "out_dir", "micro_batch_size", "eval_interval", "progress"} & set(names)

    @dataclass
    class WithANewKnob(config.Config):  # a field added to the recipe, declared meaningful where it is defined
        new_knob: float = config.setting(1.0, "a new setting", meaningful=True)
        new_path: str = config.setting("a", "a new harmless setting")

    monkeypatch.setattr(config, "Config", WithANewKnob)
    saved = dataclasses.asdict(WithANewKnob())
    assert checkpoint.config_changes(saved, dataclasses.asdict(WithANewKnob(new_knob=2.0, new_path="b"))) == \
        ["new_knob: 1.0 -> 2.0"]


def test_an_old_checkpoint_with_a_removed_field(tmp_path):
    """A removed field saved at its old default resumes (nothing differs); saved at another value,
    the checkpoint is refused in one line that says where the field's result is recorded."""
    old = {**dataclasses.asdict(config.Config()), **{name: default for name, (default, _) in
                                                     config.REMOVED_FIELDS.items()}}
    assert config.removed_settings(old) == []
    assert checkpoint.config_changes(old, dataclasses.asdict(config.Config())) == []
    (tmp_path / "meta.json").write_text(json.dumps({"step": 4, "config": {**old, "progress_reward": 0.1}}))
    with pytest.raises(SystemExit) as refused:
        checkpoint.load(tmp_path, config.Config(), None, None, None, None)
    message = str(refused.value)
    assert "progress_reward = 0.1 (removed; its result: docs/experiments.md" in message and "\n" not in message
    assert "new --out-dir" in message


def documented_launches() -> list[tuple[str, list[str], int]]:
    """(where, train.py's arguments, the world size it implies) of every launch command that the
    README, launch/slurm.sbatch and launch/k8s/job.yaml show. A node is 8 GPUs where the
    command does not say (torchrun.sh's and Slurm's default: every GPU of the node)."""
    import re
    import shlex

    import yaml

    launches = []
    readme = (ROOT / "README.md").read_text()
    for line in readme.splitlines():
        if not line.startswith(("torchrun ", "NNODES=", "sbatch ")):
            continue
        words = shlex.split(line.split("#")[0])
        if "train.py" in words and words[0] == "torchrun":
            world = int(words[words.index("--nproc-per-node") + 1])
            launches.append((line, words[words.index("train.py") + 1:], world))
        elif "launch/torchrun.sh" in words:
            nodes = int(next(w.split("=")[1] for w in words if w.startswith("NNODES=")))
            launches.append((line, words[words.index("launch/torchrun.sh") + 1:], nodes * 8))
        elif words[:2] == ["sbatch", "launch/slurm.sbatch"]:
            launches.append((line, words[2:], None))
    sbatch = (ROOT / "launch" / "slurm.sbatch").read_text()
    nodes = int(re.search(r"#SBATCH --nodes=(\d+)", sbatch).group(1))
    gpus = int(re.search(r"#SBATCH --gpus-per-node=(\d+)", sbatch).group(1))
    launches = [(w, a, nodes * gpus if n is None else n) for w, a, n in launches]
    for line in sbatch.splitlines():
        if line.startswith("#   sbatch launch/slurm.sbatch"):
            words = shlex.split(line[1:].split("#")[0])
            launches.append((line, words[2:], nodes * gpus))
    job = next(d for d in yaml.safe_load_all((ROOT / "launch" / "k8s" / "job.yaml").read_text()) if d["kind"] == "Job")
    [container] = job["spec"]["template"]["spec"]["containers"]
    environ = {e["name"]: e["value"] for e in container["env"]}
    words = shlex.split(" ".join(container["args"]))
    launches.append(("launch/k8s/job.yaml", words[words.index("launch/torchrun.sh") + 1:],
                     int(environ["NNODES"]) * int(environ["NPROC_PER_NODE"])))
    return launches


def test_every_documented_launch_command_starts_at_its_world_size():
    """The settings of each launch command the docs show pass the start-up check at the number of
    processes the command starts (a real Qwen3-VL's defaults filled in where it names one), and the
    real-model recipe divides among 1, 6 (the published run's), 8 and 16 processes. Before: the
    README's first GPU line stopped with 'prompts_per_step (4) must be a multiple of ... (8)'."""
    launches = documented_launches()
    assert len(launches) >= 5 and {16, 8} <= {world for _, _, world in launches}
    for where, args, world in launches:
        cfg = config.parse_config(args)
        cfg.apply_recipe("qwen3-vl" if cfg.model.startswith("Qwen/") else "tiny")
        cfg.validate(world)  # SystemExit("bad config: ...") fails the test, naming the command
    for world in (1, 2, 4, 6, 8, 12, 16, 24, 48):
        cfg = config.Config(model="Qwen/Qwen3-VL-8B-Instruct", difficulty="easy")
        cfg.apply_recipe("qwen3-vl")
        cfg.validate(world)


def test_help_marks_the_switches_the_recipe_leaves_inactive(capsys):
    with pytest.raises(SystemExit):
        config.parse_config(["--help"])
    # each flag's entry: from its line "  --name ..." to the next one
    entries = {entry.split()[0]: " ".join(entry.split()) for entry in capsys.readouterr().out.split("\n  --")[1:]}

    def help_of(flag):
        return entries[flag]

    for flag in ("kl_coef", "ppo_epochs", "num_mini_batches", "clip_eps_high", "train_pool"):
        assert "[inactive in the recipe]" in help_of(flag), flag
    for flag in ("lr", "group_size", "branch_points_per_group", "average_frac"):
        assert "inactive" not in help_of(flag), flag


def test_defaults_that_follow_another_field():
    """LoRA alpha follows the rank (2 x r), unless given."""
    cfg = config.Config(lora_rank=8)
    cfg.apply_recipe("tiny")
    assert cfg.lora_alpha == 16
    cfg = config.parse_config(["--lora-alpha", "64", "--lora-rank", "16"])
    cfg.apply_recipe("tiny")
    assert cfg.lora_alpha == 64  # alpha given
    cfg = config.parse_config([])
    cfg.apply_recipe("tiny")
    assert cfg.lora_alpha == 64  # the default is the value the recipe runs with
