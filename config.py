"""The training recipe: every setting of `train.py`, one dataclass per section, its defaults the main job.

    python train.py --model runs/main/sft/model     # the main job's GRPO (launch/run.sh) on a warm start
    python train.py --help                          # every flag, grouped by the sections below

Each field carries its own --help text and says whether it is *meaningful*: whether a different
value on resume would change what the run is (the learning rate, the group size, the task's level)
rather than only how it is carried out (the number of steps, intervals, paths, memory); --help
marks those "[fixed on resume]", and the switches the recipe leaves off "[inactive in the recipe]". A checkpoint refuses to resume with other meaningful settings
(checkpoint.config_changes, unless --resume-allow-changes true), and it learns which fields those
are from here: a field added with `meaningful=True` is guarded without editing a second list.

The command line is transformers' HfArgumentParser over the section dataclasses, as TRL builds
its own (`--prompts-per-step 4` or `--prompts_per_step 4`; booleans take true/false/yes/no/1/0,
and `--no-progress` is `--progress false`). `Config` inherits every section, so code reads
`cfg.lr` whatever section a field is in.
"""

import argparse
import dataclasses
from dataclasses import dataclass

from transformers import HfArgumentParser

import tasks
import vllm_engine


def setting(default, help: str, *, meaningful: bool = False, inactive: bool = False):
    """A Config field: its default, its --help text, whether changing it on resume changes the
    run's meaning (then a checkpoint refuses the change unless --resume-allow-changes true), and
    whether the recipe leaves it inactive (a switch for experiments: off, or one that never acts
    at the recipe's other settings); --help marks it so."""
    return dataclasses.field(default=default, metadata={"help": help, "meaningful": meaningful,
                                                        "inactive": inactive})


# The fields' defaults are the tiny main job's recipe (launch/run.sh). A real Qwen3-VL (a language
# model TINY_HIDDEN_SIZE wide or wider) runs the published recipe instead: QWEN3_VL_RECIPE's values
# replace the defaults of the fields a command line did not set (Config.apply_recipe; --recipe
# picks one by name, and --help lists both).
TINY_HIDDEN_SIZE = 1024  # a language model narrower than this is a tiny one (the tiny model's: 128)
QWEN3_VL_RECIPE = {
    # a real model's reply is a sentence, not one move
    "max_new_tokens": 32,
    # the published run's algorithm is plain GRPO: none of the additions that the tiny recipe measured
    # (branch rollouts, GiGPO's step term, the tail average, the probe), all untried on a real model;
    # TIS stays, since the engine's bf16 log-probs differ from the trainer's on a GPU (tis.py)
    "branch_points_per_group": 0,
    "step_adv_weight": 0.0,
    "average_frac": 0.0,
    "probe_states": 0,
    # the published run's intervals: evaluation every 10 steps, checkpoints and adapter exports every 20
    "eval_interval": 10,
    "ckpt_interval": 20,
    "export_interval": 20,
    # 48 puzzles a step divide among 1, 2, 3, 4, 6 (the published run's), 8, 12, 16, 24 and 48
    # processes (tests/test_config.py starts every documented launch command at its world size)
    "prompts_per_step": 48,
    # a micro-batch's tokens, padded: 16k fits the update of Qwen3-VL-8B (and 2B) on 80 and 141 GB
    # GPUs in every engine-sleep mode (bench/sizing.py's table uses this figure)
    "micro_batch_tokens": 16384,
}
RECIPES = {"tiny": {}, "qwen3-vl": QWEN3_VL_RECIPE}


@dataclass
class TaskConfig:
    _argument_group_name = "task (the model and what it plays)"
    model: str = setting("", "any HF Qwen3-VL directory or hub id; empty: the tiny model, built on first use",
                         meaningful=True)
    recipe: str = setting("auto", "the defaults to run with: tiny (the fields' own) | qwen3-vl (" +
                          ", ".join(f"{k} {v}" for k, v in QWEN3_VL_RECIPE.items()) + ", over the fields' "
                          "defaults; flags given win) | auto: qwen3-vl for a real Qwen3-VL, tiny for the tiny model")
    task: str = setting("maze", "the task played (tasks/): " + " | ".join(
        f"{name} ({', '.join(cls.levels)})" for name, cls in tasks.TASKS.items()) + " | module:Class, a task of "
        "your own (env.Task)", meaningful=True)
    difficulty: str = setting("small", "the task's level (its levels are listed with --task); the maze's: tiny 5x5, "
                                       "small 7x7, easy 9x9 and hard 11x11 (VisGym's two)", meaningful=True)
    max_turns: int = setting(15, "turns per episode, in training and evaluation", meaningful=True)
    max_new_tokens: int = setting(8, "tokens per reply (the tiny model's reply is one move)", meaningful=True)
    max_model_len: int = setting(4096, "the engine's context length (prompt, images and replies)")
    max_images: int = setting(0, "keep only the last k images in the conversation; 0: the full history",
                              meaningful=True)
    train_pool: int = setting(0, "0: an endless stream of new training puzzles; N: the first N over and over",
                              meaningful=True, inactive=True)


@dataclass
class GRPOConfig:
    _argument_group_name = "GRPO (rollouts, rewards and the loss)"
    steps: int = setting(150, "training steps (one rollout batch and its update each)")
    prompts_per_step: int = setting(4, "puzzles per step over all ranks; each is played group_size times",
                                    meaningful=True)
    group_size: int = setting(8, "episodes per puzzle: the group whose mean reward is the baseline", meaningful=True)
    temperature: float = setting(0.5, "rollout sampling temperature; the loss uses the same tempered policy",
                                 meaningful=True)
    scale_adv_by_std: bool = setting(True, "divide advantages by the group's std (false: Dr. GRPO)",
                                     meaningful=True)
    clip_eps_low: float = setting(0.2, "PPO clip: the ratio's lower bound is 1 - this (the clip acts only with "
                                       "num_mini_batches or ppo_epochs above 1)", meaningful=True, inactive=True)
    clip_eps_high: float = setting(0.2, "PPO clip: the upper bound is 1 + this (> clip_eps_low: DAPO's "
                                        "clip-higher)", meaningful=True, inactive=True)
    loss_aggregation: str = setting("token-mean", "token-mean | seq-mean", meaningful=True)
    kl_coef: float = setting(0.0, "k3 KL to the base model (LoRA disabled); 0 skips the reference pass",
                             meaningful=True, inactive=True)
    step_adv_weight: float = setting(1.0, "GiGPO: A_t = A_episode + w * A_step_t; 0: plain GRPO", meaningful=True)
    gamma: float = setting(0.95, "discount of the per-turn returns G_t = sum_k gamma^(k-t) r_k (step advantages)",
                           meaningful=True)
    tis_cap: float = setting(2.0, "truncated importance sampling against the engine's logprobs; 0: off",
                             meaningful=True)
    end_on_invalid: bool = setting(False, "an invalid reply (one the task cannot parse) ends the training episode "
                                          "unsolved instead of spending its turn; evaluation keeps the task's rule",
                                   meaningful=True, inactive=True)
    branch_points_per_group: int = setting(2, "branch rollouts (branch.py): per group, up to this many decision "
                                              "points its members passed are replayed with every open move forced and the "
                                              "policy finishing each; the best branch's move becomes a target, "
                                              "L = -w log pi_T(a* | s). 0: off", meaningful=True)
    branch_weight: float = setting(8.0, "w, the advantage on a branch target's reply tokens (8: a group's worth)",
                                   meaningful=True)
    branch_continuations: int = setting(1, "branch rollouts: the policy's continuations of each forced move; "
                                           "G(a) is their mean return (a Monte Carlo estimate, as VinePPO's)",
                                        meaningful=True, inactive=True)
    branch_tiebreak: str = setting("none", "where every branch of a point fails: none (no target) | progress (the "
                                           "action whose branch ended nearest success by the task's solver: a "
                                           "shaped signal the strict reward does not give)", meaningful=True,
                                   inactive=True)
    branch_winnable_only: bool = setting(False, "branch rollouts: choose points only among states from which the "
                                                "task's solver still reaches success in the turns left (a lost "
                                                "state never gives a target); needs the solver", meaningful=True,
                                         inactive=True)


@dataclass
class OptimConfig:
    _argument_group_name = "optimisation"
    lr: float = setting(1e-3, "peak learning rate (AdamW over the LoRA weights)", meaningful=True)
    weight_decay: float = setting(0.0, "AdamW weight decay", meaningful=True, inactive=True)
    warmup_steps: int = setting(10, "linear warm-up from 0, in optimizer steps", meaningful=True)
    lr_schedule: str = setting("wsd", "after the warm-up: wsd (constant, then a cosine decay to 0 over the last "
                                      "decay_frac of the steps) | cosine (a decay to 0 over all of them) | constant "
                                      "(transformers.get_scheduler); a decaying one fixes `steps` on resume",
                               meaningful=True)
    decay_frac: float = setting(0.3, "wsd: the share of the steps over which the rate decays to 0", meaningful=True)
    average_frac: float = setting(0.3, "the policy the run evaluates, exports and serves is the mean of its LoRA "
                                       "after each of the last average_frac of the steps (average.py; rollouts "
                                       "stay on the current one); 0: the last step's; fixes `steps` on resume",
                                  meaningful=True)
    max_grad_norm: float = setting(1.0, "gradient clipping", meaningful=True)
    num_mini_batches: int = setting(1, "optimizer steps per pass over the rollout batch; > 1: the PPO clip acts",
                                    meaningful=True, inactive=True)
    ppo_epochs: int = setting(1, "passes over each rollout batch (PPO's sample reuse; the clip bounds the drift)",
                              meaningful=True, inactive=True)
    micro_batch_size: int = setting(16, "sequences per forward/backward (memory only: the gradient is the same)")
    micro_batch_tokens: int = setting(0, "and at most this many tokens, padded, per forward/backward (memory "
                                         "only); 0: no limit")


@dataclass
class LoRAConfig:
    _argument_group_name = "LoRA and sharding"
    lora_rank: int = setting(32, f"LoRA rank (the published recipe's); vLLM takes {list(vllm_engine.VLLM_LORA_RANKS)}",
                             meaningful=True)
    lora_alpha: int = setting(64, "LoRA alpha; with --lora-rank r and no --lora-alpha, 2 x r (PEFT's scale "
                                  "alpha / rank is then 2)", meaningful=True)
    lora_dropout: float = setting(0.0, "dropout on the LoRA input", meaningful=True, inactive=True)
    lora_targets: str = setting(vllm_engine.LORA_TARGET_REGEX, "the modules that get a LoRA (a regex)", meaningful=True)
    shard_group_size: int = setting(0, "processes that shard one copy of the policy; 0: one node (HSDP)")


@dataclass
class EngineConfig:
    _argument_group_name = "engine (the in-process vLLM)"
    gpu_memory_utilization: float = setting(0.45, "the engine's share of GPU memory")
    engine_sleep: str = setting("offload", "how the engine frees the GPU for the update: offload (weights to "
                                           "host RAM) | kv (drop only the KV cache) | none | auto (decides after "
                                           "the first step; vllm_engine.EngineSleep). CPU: always none")
    mismatch_bound: float = setting(0.0, "stop when the trainer-vs-engine logprob mismatch stays above this for "
                                         "mismatch_steps steps in a row (a stale adapter in the engine); 0: 5x the "
                                         "stack's noise, measured at the first step (update.StalePolicyGuard)")
    mismatch_steps: int = setting(3, "steps in a row over the bound before stopping; 0: never stop")


@dataclass
class RunConfig:
    _argument_group_name = "evaluation, checkpoints and paths"
    eval_interval: int = setting(25, "greedy held-out evaluation every N steps (and at the start and end)")
    eval_puzzles: int = setting(64, "held-out evaluation puzzles (each evaluation also plays as many of the first "
                                    "training puzzles, or the pool's)", meaningful=True)
    sampled_eval_samples: int = setting(8, "> 0: also the sampled solve rate, this many episodes a puzzle, at the "
                                           "start and the end")
    sampled_eval_temperature: float = setting(1.0, "the sampled evaluation's temperature (1: the policy itself)")
    probe_states: int = setting(32, "held-out first turns on which each step measures how far the update moved "
                                    "the policy (probe_kl, probe_flip_frac; probe.PolicyProbe), at least one per "
                                    "process; 0: off")
    ckpt_interval: int = setting(50, "checkpoint every N steps (and at the end)")
    export_interval: int = setting(50, "write a servable adapter to <out_dir>/adapters every N steps (and at the end)")
    keep_checkpoints: int = setting(3, "checkpoints kept")
    keep_syncs: int = setting(3, "adapter syncs kept in the shared dir")
    resume: str = setting("latest", "latest | none | <checkpoint dir>")
    resume_allow_changes: bool = setting(False, "resume although meaningful settings differ (they take effect)")
    archive_old_run: bool = setting(False, "a fresh start into a used --out-dir moves the old run into "
                                           "<out>/archive/")
    take_over_lock: bool = setting(False, "take the run lock although its holder (on another host) may still run")
    out_dir: str = setting("runs/default", "the run directory")
    shared_dir: str = setting("", "visible to every node (the adapter sync); empty: <out_dir>/shared")
    seed: int = setting(0, "the LoRA init, the rollouts' sampling", meaningful=True)
    progress: bool = setting(True, "progress bars")


SECTIONS = (TaskConfig, GRPOConfig, OptimConfig, LoRAConfig, EngineConfig, RunConfig)


# dataclasses collect inherited fields from the last base to the first: the sections are listed in
# reverse so that a Config's fields (config.json, asdict) come in the order of SECTIONS.
@dataclass
class Config(*reversed(SECTIONS)):
    """Every setting of a run (see the sections above)."""

    def validate(self, world_size: int):
        problems = []
        if self.recipe not in ("auto", *RECIPES):
            problems.append(f"recipe must be auto or one of {list(RECIPES)}")
        try:
            levels = tasks.task_class(self.task).levels
            if self.difficulty not in levels:
                problems.append(f"difficulty must be one of {self.task}'s levels {list(levels)}")
        except ValueError as e:
            problems.append(str(e))
        if self.prompts_per_step % world_size:
            problems.append(f"prompts_per_step ({self.prompts_per_step}) must be a multiple of the "
                            f"number of processes ({world_size}) so every rank does the same work")
        if self.group_size < 2:
            problems.append("group_size must be >= 2: a group of one has no baseline")
        if self.num_mini_batches < 1 or (self.prompts_per_step // world_size * self.group_size) % self.num_mini_batches:
            problems.append("episodes per rank must divide into num_mini_batches")
        if not (self.temperature > 0 and self.sampled_eval_temperature > 0):
            problems.append("temperature and sampled_eval_temperature must be > 0 (greedy evaluation is separate)")
        if self.step_adv_weight < 0 or not 0 < self.gamma <= 1:
            problems.append("step_adv_weight must be >= 0 and gamma in (0, 1]")
        if self.loss_aggregation not in ("token-mean", "seq-mean"):
            problems.append("loss_aggregation must be token-mean or seq-mean")
        if self.lr_schedule not in ("wsd", "cosine", "constant"):
            problems.append("lr_schedule must be wsd, cosine or constant")
        if not 0 < self.decay_frac <= 1:
            problems.append("decay_frac must be in (0, 1]")
        if not 0 <= self.average_frac <= 1:
            problems.append("average_frac must be in [0, 1]")
        if self.probe_states and self.eval_puzzles < world_size:
            problems.append(f"eval_puzzles ({self.eval_puzzles}) must be at least the number of processes "
                            f"({world_size}) for every rank to probe a state (or probe_states 0)")
        if self.branch_points_per_group < 0 or self.branch_weight <= 0 or self.branch_continuations < 1:
            problems.append("branch_points_per_group must be >= 0, branch_weight > 0 and branch_continuations >= 1")
        if self.branch_tiebreak not in ("none", "progress"):
            problems.append("branch_tiebreak must be none or progress")
        if self.tis_cap < 0 or self.train_pool < 0 or self.sampled_eval_samples < 0 or self.max_new_tokens < 0 \
                or self.micro_batch_tokens < 0:
            problems.append("tis_cap, train_pool, sampled_eval_samples, max_new_tokens and micro_batch_tokens must "
                            "be >= 0")
        for name in ("steps", "ppo_epochs", "max_turns", "micro_batch_size", "eval_interval",
                     "ckpt_interval", "export_interval", "keep_checkpoints", "keep_syncs"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if self.engine_sleep not in vllm_engine.ENGINE_SLEEP_MODES:
            problems.append(f"engine_sleep must be one of {list(vllm_engine.ENGINE_SLEEP_MODES)}")
        if self.mismatch_bound < 0 or self.mismatch_steps < 0:
            problems.append("mismatch_bound and mismatch_steps must be >= 0")
        if self.prompts_per_step < 1:
            problems.append("prompts_per_step must be >= 1")
        if self.lora_rank not in vllm_engine.VLLM_LORA_RANKS:
            problems.append(f"lora_rank {self.lora_rank}: the engine (vLLM) takes only {list(vllm_engine.VLLM_LORA_RANKS)}")
        if problems:
            raise SystemExit("bad config: " + "; ".join(problems))

    def resolve_model_defaults(self, model_path: str):
        """Apply the model's recipe (--recipe auto: qwen3-vl for a language model TINY_HIDDEN_SIZE
        wide or wider, tiny below) and fill LoRA alpha. Before the run directory is opened:
        config.json and checkpoints hold the values used."""
        from transformers import AutoConfig

        if self.recipe not in ("auto", *RECIPES):  # validate() runs after this, on the recipe's values
            raise SystemExit(f"bad config: recipe must be auto or one of {list(RECIPES)}, not {self.recipe!r}")
        if self.recipe == "auto":
            wide = AutoConfig.from_pretrained(model_path).text_config.hidden_size >= TINY_HIDDEN_SIZE
            self.recipe = "qwen3-vl" if wide else "tiny"
        self.apply_recipe(self.recipe)

    def apply_recipe(self, name: str):
        """RECIPES[name]'s values, for every field a command line did not set (parse_config records
        which it did; a Config built in code counts the fields that differ from their defaults);
        then the default that follows another field: LoRA alpha, the rank."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        given = getattr(self, "given", None)
        if given is None:
            given = {name for name, default in defaults.items() if getattr(self, name) != default}
        for field, value in RECIPES[name].items():
            if field not in given:
                setattr(self, field, value)
        self.recipe = name
        if "lora_alpha" not in given:
            self.lora_alpha = 2 * self.lora_rank


def meaningful_fields() -> list[str]:
    """The names of the fields declared meaningful, in Config order."""
    return [f.name for f in dataclasses.fields(Config) if f.metadata.get("meaningful")]


# Fields removed from the Config, each with the default it had and where its measured result is
# recorded. A checkpoint whose saved config holds one at that default resumes (the run never used
# it); one that holds another value is refused: the code that gave it its meaning is gone.
REMOVED_FIELDS = {
    "progress_reward": (0.0, "docs/experiments.md, 2026-12-01 (later): a dense progress reward, runs P1-P4"),
    "lora_plus_ratio": (0.0, "docs/experiments.md, 2026-12-01: fourteen variants, runs C-G and J"),
    "train_max_turns": (0, "docs/experiments.md, 2026-12-01: fourteen variants, run K, and 2026-11-29 .. "
                           "2026-12-01: two GRPO variants aimed at those failures"),
}


def removed_settings(saved: dict) -> list[str]:
    """'name = value (its result: where)' for each removed field a saved config holds at a value
    other than its old default."""
    return [f"{name} = {saved[name]!r} (removed; its result: {where})"
            for name, (default, where) in REMOVED_FIELDS.items() if name in saved and saved[name] != default]


# ----------------------------------------------------------------------------- the command line

class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, each flag with its default."""


class ConfigParser(HfArgumentParser):
    """HfArgumentParser that keeps our own metadata keys out of argparse (saying in the help which
    fields are meaningful and which inactive), and reports a bad flag or value in one line ('bad config: ...')
    instead of argparse's usage text and exit 2."""

    @staticmethod
    def _parse_dataclass_field(parser, field: dataclasses.Field):
        help = (field.metadata["help"] + (" [fixed on resume]" if field.metadata["meaningful"] else "")
                + (" [inactive in the recipe]" if field.metadata["inactive"] else ""))
        plain = dataclasses.field(default=field.default, metadata={"help": help})
        plain.name, plain.type = field.name, field.type
        HfArgumentParser._parse_dataclass_field(parser, plain)

    def error(self, message):
        raise SystemExit(f"bad config: {message} (train.py --help lists the flags)")


def parse_config(argv=None, description: str = __doc__) -> Config:
    """A Config from command-line flags (sys.argv when argv is None): --prompts-per-step 8, --lr 5e-4, ..."""
    parser = ConfigParser(SECTIONS, description=description, formatter_class=HelpFormatter,
                          usage="%(prog)s [--flag value ...]  (the flags by section below)")
    cfg = Config(**vars(parser.parse_args(argv)))
    # which fields the command line set, so that a recipe changes only the others (apply_recipe):
    # parsed again with every default replaced by a marker, a field still holding it was not given
    unset = object()
    parser.set_defaults(**{f.name: unset for f in dataclasses.fields(Config)})
    cfg.given = {name for name, value in vars(parser.parse_args(argv)).items() if value is not unset}
    return cfg

