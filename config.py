"""The training recipe: every setting of `train.py`, one dataclass per section, its defaults the main job.

    python train.py --model runs/main/sft/model     # the main job's GRPO (launch/run.sh) on a warm start
    python train.py --help                          # every flag, grouped by the sections below

Each field carries its own --help text and says whether it is *meaningful*: whether a different
value on resume would change what the run is (the learning rate, the group size, the maze size)
rather than only how it is carried out (the number of steps, intervals, paths, memory); --help
marks those "[fixed on resume]". A checkpoint refuses to resume with other meaningful settings
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

import env
import rollout


def setting(default, help: str, *, meaningful: bool = False):
    """A Config field: its default, its --help text, and whether changing it on resume changes the
    run's meaning (then a checkpoint refuses the change unless --resume-allow-changes true)."""
    return dataclasses.field(default=default, metadata={"help": help, "meaningful": meaningful})


# Model-dependent defaults (0 in the fields below, -1 for the branch points): the tiny model of
# tiny_model.py and the SFT warm starts built from it get the main job's values, a real Qwen3-VL
# the published recipe's.
TINY_HIDDEN_SIZE = 1024  # a language model narrower than this is a tiny one (the tiny model's: 128)
LORA_RANK = {"tiny": 32, "real": 32}  # tiny: 8 until 2026-12-03 (step 1a's ceiling table chose 32)
# Branch rollouts lift the tiny main job (docs/experiments.md, 2026-12-03: +6.8 points against a
# branch-free control's +1.0 on the same warm starts); they are untried on a real model and a GPU,
# so a real Qwen3-VL keeps the published recipe's plain GRPO unless asked.
BRANCH_POINTS = {"tiny": 2, "real": 0}
MAX_NEW_TOKENS = {"tiny": 8, "real": 32}  # a tiny-model reply is one move; a real model's is a sentence
# Mazes a step: the tiny main job's 4 (one process); a real model's 48, which divides among the
# 1, 2, 3, 4, 6 (the published run's), 8, 12, 16, 24 and 48 processes of common launches
# (tests/test_config.py starts every documented launch command at its world size).
PROMPTS_PER_STEP = {"tiny": 4, "real": 48}
# Tokens a micro-batch may hold (padded): none for the tiny model (its micro-batch is 16 short
# sequences); 16k for a real one, which fits the update of Qwen3-VL-8B (and 2B) on 80 and 141 GB
# GPUs in every engine-sleep mode that bench/sizing.py names (the same formula: its table).
MICRO_BATCH_TOKENS = {"tiny": 0, "real": 16384}


@dataclass
class TaskConfig:
    _argument_group_name = "task (the model and the mazes)"
    model: str = setting("", "any HF Qwen3-VL directory or hub id; empty: the tiny model, built on first use",
                         meaningful=True)
    difficulty: str = setting("small", "tiny 5x5 | small 7x7 | easy 9x9 (VisGym) | hard 11x11 (VisGym)",
                              meaningful=True)
    env_style: str = setting("ours", "ours | visgym: VisGym's maze for a seed, drawing, texts and parser (env.py)",
                             meaningful=True)
    cell_px: int = setting(0, "cell size in pixels; 0: the style's own (32 ours: one cell per merged visual "
                              "token; 25 visgym)", meaningful=True)
    max_turns: int = setting(15, "turns per episode, in training and evaluation", meaningful=True)
    max_new_tokens: int = setting(0, f"tokens per reply; 0: {MAX_NEW_TOKENS['tiny']} for the tiny model (a reply "
                                     f"is one move), {MAX_NEW_TOKENS['real']} for a real Qwen3-VL", meaningful=True)
    max_model_len: int = setting(4096, "the engine's context length (prompt, images and replies)")
    max_images: int = setting(0, "keep only the last k images in the conversation; 0: the full history",
                              meaningful=True)
    train_pool: int = setting(0, "0: an endless stream of new training mazes; N: the first N over and over",
                              meaningful=True)


@dataclass
class GRPOConfig:
    _argument_group_name = "GRPO (rollouts, rewards and the loss)"
    steps: int = setting(150, "training steps (one rollout batch and its update each)")
    prompts_per_step: int = setting(0, "mazes per step over all ranks; each is played group_size times; 0: "
                                       f"{PROMPTS_PER_STEP['tiny']} for the tiny model, {PROMPTS_PER_STEP['real']} "
                                       "for a real Qwen3-VL (it divides among 1, 6, 8 or 16 processes)",
                                    meaningful=True)
    group_size: int = setting(8, "episodes per maze: the group whose mean reward is the baseline", meaningful=True)
    temperature: float = setting(0.5, "rollout sampling temperature; the loss uses the same tempered policy",
                                 meaningful=True)
    scale_adv_by_std: bool = setting(True, "divide advantages by the group's std (false: Dr. GRPO)",
                                     meaningful=True)
    clip_eps_low: float = setting(0.2, "PPO clip: the ratio's lower bound is 1 - this", meaningful=True)
    clip_eps_high: float = setting(0.2, "PPO clip: the upper bound is 1 + this (> clip_eps_low: DAPO's "
                                        "clip-higher)", meaningful=True)
    loss_aggregation: str = setting("token-mean", "token-mean | seq-mean", meaningful=True)
    kl_coef: float = setting(0.0, "k3 KL to the base model (LoRA disabled); 0 skips the reference pass",
                             meaningful=True)
    step_adv_weight: float = setting(1.0, "GiGPO: A_t = A_episode + w * A_step_t; 0: plain GRPO", meaningful=True)
    gamma: float = setting(0.95, "discount of the per-turn returns G_t = sum_k gamma^(k-t) r_k (step advantages)",
                           meaningful=True)
    tis_cap: float = setting(2.0, "truncated importance sampling against the engine's logprobs; 0: off",
                             meaningful=True)
    branch_points_per_group: int = setting(-1, "branch rollouts (branch.py): per group, up to this many forks its "
                                               "members passed are replayed with every open move forced and the "
                                               "policy finishing each; the best branch's move becomes a target, "
                                               "L = -w log pi_T(a* | s). 0: off; -1: "
                                               f"{BRANCH_POINTS['tiny']} for the tiny model, {BRANCH_POINTS['real']} "
                                               "for a real Qwen3-VL", meaningful=True)
    branch_weight: float = setting(8.0, "w, the advantage on a branch target's reply tokens (8: a group's worth)",
                                   meaningful=True)


@dataclass
class OptimConfig:
    _argument_group_name = "optimisation"
    lr: float = setting(1e-3, "peak learning rate (AdamW over the LoRA weights)", meaningful=True)
    weight_decay: float = setting(0.0, "AdamW weight decay", meaningful=True)
    warmup_steps: int = setting(10, "linear warm-up from 0, in optimizer steps", meaningful=True)
    lr_schedule: str = setting("wsd", "after the warm-up: wsd (constant, then a cosine decay to 0 over the last "
                                      "decay_frac of the steps) | cosine (a decay to 0 over all of them) | constant "
                                      "(transformers.get_scheduler); a decaying one fixes `steps` on resume",
                               meaningful=True)
    decay_frac: float = setting(0.3, "wsd: the share of the steps over which the rate decays to 0", meaningful=True)
    max_grad_norm: float = setting(1.0, "gradient clipping", meaningful=True)
    num_mini_batches: int = setting(1, "optimizer steps per pass over the rollout batch; > 1: the PPO clip acts",
                                    meaningful=True)
    ppo_epochs: int = setting(1, "passes over each rollout batch (PPO's sample reuse; the clip bounds the drift)",
                              meaningful=True)
    micro_batch_size: int = setting(16, "sequences per forward/backward (memory only: the gradient is the same)")
    micro_batch_tokens: int = setting(-1, "and at most this many tokens, padded, per forward/backward (memory "
                                          f"only); -1: {MICRO_BATCH_TOKENS['real']} for a real Qwen3-VL, no limit "
                                          "(0) for the tiny model")


@dataclass
class LoRAConfig:
    _argument_group_name = "LoRA and sharding"
    lora_rank: int = setting(0, f"0: {LORA_RANK['tiny']} for the tiny model, {LORA_RANK['real']} (the published "
                                f"recipe) for a real Qwen3-VL; vLLM takes {list(rollout.VLLM_LORA_RANKS)}",
                             meaningful=True)
    lora_alpha: int = setting(0, "0: 2 * rank", meaningful=True)
    lora_dropout: float = setting(0.0, "dropout on the LoRA input", meaningful=True)
    lora_targets: str = setting(rollout.LORA_TARGET_REGEX, "the modules that get a LoRA (a regex)", meaningful=True)
    shard_group_size: int = setting(0, "processes that shard one copy of the policy; 0: one node (HSDP)")


@dataclass
class EngineConfig:
    _argument_group_name = "engine (the in-process vLLM)"
    gpu_memory_utilization: float = setting(0.45, "the engine's share of GPU memory")
    engine_sleep: str = setting("offload", "how the engine frees the GPU for the update: offload (weights to "
                                           "host RAM) | kv (drop only the KV cache) | none | auto (decides after "
                                           "the first step; rollout.EngineSleep). CPU: always none")
    mismatch_bound: float = setting(0.0, "stop when the trainer-vs-engine logprob mismatch stays above this for "
                                         "mismatch_steps steps in a row (a stale adapter in the engine); 0: 5x the "
                                         "stack's noise, measured at the first step (policy.StalePolicyGuard)")
    mismatch_steps: int = setting(3, "steps in a row over the bound before stopping; 0: never stop")


@dataclass
class RunConfig:
    _argument_group_name = "evaluation, checkpoints and paths"
    eval_interval: int = setting(25, "greedy held-out evaluation every N steps (and at the start and end)")
    eval_mazes: int = setting(64, "held-out evaluation mazes (each evaluation also plays as many of the first "
                                    "training mazes, or the pool's)", meaningful=True)
    sampled_eval_samples: int = setting(8, "> 0: also the sampled solve rate, this many episodes a maze, at the "
                                           "start and the end")
    sampled_eval_temperature: float = setting(1.0, "the sampled evaluation's temperature (1: the policy itself)")
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
        if self.difficulty not in env.DIFFICULTY_SIZES:
            problems.append(f"difficulty must be one of {list(env.DIFFICULTY_SIZES)}")
        if self.env_style not in env.MAZE_STYLES:
            problems.append(f"env_style must be one of {list(env.MAZE_STYLES)}")
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
        if self.branch_points_per_group < -1 or self.branch_weight <= 0:
            problems.append("branch_points_per_group must be >= 0 (-1: the model's default) and branch_weight > 0")
        if self.tis_cap < 0 or self.train_pool < 0 or self.sampled_eval_samples < 0 or self.max_new_tokens < 0 \
                or self.prompts_per_step < 0 or self.micro_batch_tokens < -1:
            problems.append("tis_cap, train_pool, sampled_eval_samples, max_new_tokens, prompts_per_step and "
                            "micro_batch_tokens must be >= 0 (-1: the model's default for the last)")
        for name in ("steps", "ppo_epochs", "max_turns", "micro_batch_size", "eval_interval",
                     "ckpt_interval", "export_interval", "keep_checkpoints", "keep_syncs"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if self.engine_sleep not in rollout.ENGINE_SLEEP_MODES:
            problems.append(f"engine_sleep must be one of {list(rollout.ENGINE_SLEEP_MODES)}")
        if self.mismatch_bound < 0 or self.mismatch_steps < 0:
            problems.append("mismatch_bound and mismatch_steps must be >= 0")
        if self.lora_rank and self.lora_rank not in rollout.VLLM_LORA_RANKS:
            problems.append(f"lora_rank {self.lora_rank}: the engine (vLLM) takes only {list(rollout.VLLM_LORA_RANKS)}")
        if problems:
            raise SystemExit("bad config: " + "; ".join(problems))

    def resolve_model_defaults(self, model_path: str):
        """Fill the model-dependent defaults (the fields left at 0, the branch points at -1) from the
        model's own config: the tiny model's values for a language model narrower than
        TINY_HIDDEN_SIZE, else a real Qwen3-VL's. Before the run directory is opened: config.json and checkpoints hold the values used."""
        from transformers import AutoConfig

        kind = "tiny" if AutoConfig.from_pretrained(model_path).text_config.hidden_size < TINY_HIDDEN_SIZE else "real"
        self.resolve_defaults_for(kind)

    def resolve_defaults_for(self, kind: str):
        """The model-dependent defaults of a "tiny" or a "real" model (resolve_model_defaults)."""
        self.prompts_per_step = self.prompts_per_step or PROMPTS_PER_STEP[kind]
        if self.micro_batch_tokens == -1:
            self.micro_batch_tokens = MICRO_BATCH_TOKENS[kind]
        self.lora_rank = self.lora_rank or LORA_RANK[kind]
        self.lora_alpha = self.lora_alpha or 2 * self.lora_rank
        self.max_new_tokens = self.max_new_tokens or MAX_NEW_TOKENS[kind]
        if self.branch_points_per_group == -1:
            self.branch_points_per_group = BRANCH_POINTS[kind]


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
    """HfArgumentParser that keeps our own metadata key out of argparse (saying in the help which
    fields are meaningful), and reports a bad flag or value in one line ('bad config: ...')
    instead of argparse's usage text and exit 2."""

    @staticmethod
    def _parse_dataclass_field(parser, field: dataclasses.Field):
        help = field.metadata["help"] + (" [fixed on resume]" if field.metadata["meaningful"] else "")
        plain = dataclasses.field(default=field.default, metadata={"help": help})
        plain.name, plain.type = field.name, field.type
        HfArgumentParser._parse_dataclass_field(parser, plain)

    def error(self, message):
        raise SystemExit(f"bad config: {message} (train.py --help lists the flags)")


def parse_config(argv=None, description: str = __doc__) -> Config:
    """A Config from command-line flags (sys.argv when argv is None): --prompts-per-step 8, --lr 5e-4, ..."""
    parser = ConfigParser(SECTIONS, description=description, formatter_class=HelpFormatter,
                          usage="%(prog)s [--flag value ...]  (the flags by section below)")
    return Config(**vars(parser.parse_args(argv)))

