"""The trainer's GPU code path on one GPU, without vLLM and without a network, then its speed.

    bash launch/gpu_check.sh --fetch-wheels  # here, with PyPI: the pinned transformers, peft (+ regex) into .whl/
    bash launch/gpu_check.sh                 # on a GPU machine, .whl/ carried: both shapes, then bench/gpu_mfu.py
    python launch/gpu_check.py --dry-run     # anywhere: the small shape on the CPU (tests run this)

Made for a bare one-GPU machine that has torch, transformers, peft, safetensors and tensorboard
but no vLLM and no hub access. It refuses to start, in one line, unless transformers and peft are
the versions requirements.txt pins (an older transformers has no precomputed image features, and
the check that compares them with the pixel path would compare that path with itself). Then it
checks, from package metadata alone, every requirement that the pinned transformers and peft
declare (and transformers checks at import): anything missing or too old is listed in the JSON
report and nothing else runs. Torch is whatever the machine has (the device machines have 2.11,
not the pinned 2.14): the report says which. The models are randomly initialised
Qwen3VLForConditionalGeneration built from a config (nothing downloaded), the tokenizer is
replaced by token ids drawn at random, the images are real maze renders. What runs is the
project's own code, in train.py's order, in one process (world size 1):

  process group     distributed.init_distributed (on a GPU: "cpu:gloo,cuda:nccl", bound to the
                    device), and every collective the trainer uses, on CPU and on CUDA tensors
                    (with one process NCCL carries nothing between GPUs)
  policy            small: the random model, with tied embeddings (as Qwen3-VL-2B and 4B have),
                    saved with save_pretrained, then policy.build_policy from that directory, as
                    train.py builds it (meta device, PEFT LoRA, bf16 FSDP2 on the 2-D mesh,
                    set_model_state_dict broadcast from rank 0, the rotary buffers copied from
                    rank 0, gradient checkpointing); every parameter and every buffer must equal
                    the saved source's (LoRA's init included). 8b: the same wrapping
                    (policy.wrap_policy) around a model built on the GPU, untied like Qwen3-VL-8B
                    (saving and reading 17 GB would not fit the time)
  forward           policy.Batch with precomputed image features vs the plain pixel path: the same
                    log-probs (to bf16 precision)
  log-probs         small: policy.sequence_logprobs at the recipe's T 0.5 with the engine's logit
                    bias against vision tokens (the processed path, chunked over the vocabulary)
                    equal log_softmax((logits + bias) / T) of the model's full logits
  update            update.grpo_update at T 0.5 on multi-turn sequences with images of several
                    lengths, packed into micro-batches by a token budget (small: one that splits
                    them; 8b: the qwen3-vl recipe's 16384): real gradients, TIS weights from
                    made-up rollout log-probs (the trainer's processed ones plus noise), the LoRA moves
  adapter           policy.gather_lora_state + checkpoint.write_adapter (a PEFT directory)
  checkpoint        checkpoint.save / publish / find / verify / load, and the LoRA and Adam state
                    come back equal
  speed             bench/gpu_mfu.py at the Qwen3-VL-8B shape (tokens/s, MFU, peak memory)

What it does not run, so what stays unproven on a GPU (the report lists it under "not_run"): vLLM
itself (its CUDA engine, its sampled log-probs and the bf16 trainer-vs-vLLM mismatch, the sleep
modes offload/kv/auto, loading an adapter into it, serve.py), more than one process (NCCL traffic
between GPUs, HSDP, the zero-weight filler micro-batches of a rank with fewer sequences), the
pinned torch 2.14 where the machine has another, real Qwen3-VL weights and tokenizer, and
bench/sizing.py's table (the engine's memory beside the trainer's).

"small" is a few-layer model for correctness; "8b" the Qwen3-VL-8B shape (bench/shapes.py) for
the same path at full size (memory, checkpointing). The JSON report (--out) is rewritten, whole
and atomically, after every check, so a run cut off leaves the checks it finished ("status":
"running" until the end). Exit status 1 if a check failed. A stage (small, 8b, bench) starts only
if enough of --budget-s (default 270 s) is left for it, else it is reported as skipped: expected
on an H100/H200 about 3-4 minutes for everything (not yet measured), so one device call of
6 minutes leaves room to run it again.
"""

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402

SMALL_TEXT = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=2048, max_position_embeddings=16384,
                  rms_norm_eps=1e-6, hidden_act="silu",
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True,
                                   "mrope_section": [16, 8, 8]})
SMALL_VISION = dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2, in_channels=3, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=256, num_position_embeddings=2304,
                    deepstack_visual_indexes=[1], hidden_act="gelu_pytorch_tanh")
IDS = dict(image_token_id=6, video_token_id=7, vision_start_token_id=3, vision_end_token_id=4)
# The stages after the process group, and the time each needs left (of --budget-s) to start:
# rough guesses for an H100 (small: its 15-turn update; 8b: build, 4 sequences of ~5k tokens, a
# 1 GB checkpoint; bench: a second 8B build and 5 steps of 4 x 8k tokens).
STAGE_NEEDS_S = {"small": 30, "8b": 120, "bench": 75}
DEFAULT_BUDGET_S = 270
# transformers and peft must be the versions requirements.txt pins (read from there)
PINNED = ("transformers", "peft")
REQUIREMENTS_TXT = ROOT / "requirements.txt"
# the report: rewritten whole after every check (write_report), so a run cut off leaves what it finished
REPORT = {"checks": []}
REPORT_PATH = None
START = time.time()
# What this check imports, and whose declared requirements must hold on the machine: transformers
# checks some of them when it is imported (transformers/dependency_versions_check.py), and a miss
# there (the device image's regex may be older than 5.19's regex>=2025.10.22) would end the run
# before any report is written.
CHECKED_DISTRIBUTIONS = ("torch", "transformers", "peft", "safetensors", "tensorboard")


def requirements(extra: list[str]) -> list[dict]:
    """Every distribution this check needs and every requirement they declare (extras left out),
    each with the version installed here and whether it satisfies the requirement. Reads package
    metadata only: nothing is imported, so it works where an import would fail."""
    from importlib.metadata import PackageNotFoundError, requires, version

    from packaging.requirements import Requirement

    def have(name: str):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    rows, seen = [], set()
    wanted = [(None, Requirement(name)) for name in CHECKED_DISTRIBUTIONS] + [(None, Requirement(r)) for r in extra]
    for dist in ("transformers", "peft"):
        if have(dist):
            wanted += [(dist, Requirement(r)) for r in requires(dist) or []]
    for by, req in wanted:
        if (req.marker and not req.marker.evaluate({"extra": ""})) or (req.name, str(req.specifier)) in seen:
            continue
        seen.add((req.name, str(req.specifier)))
        installed = have(req.name)
        ok = installed is not None and req.specifier.contains(installed, prereleases=True)
        rows.append({"name": req.name, "need": str(req.specifier) or "any", "by": by or "gpu_check",
                     "have": installed, "ok": ok})
    return rows


def pins_of(names, path: Path = REQUIREMENTS_TXT) -> dict[str, str]:
    """The versions `path` pins with == for `names` (name -> version; a name pinned otherwise is left out)."""
    from packaging.requirements import Requirement

    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and (req := Requirement(line)).name in names:
            specs = list(req.specifier)
            if len(specs) == 1 and specs[0].operator == "==":
                found[req.name] = specs[0].version
    return found


def pins(path: Path = REQUIREMENTS_TXT) -> dict[str, str]:
    """The versions `path` pins with == for transformers and peft (name -> version)."""
    from packaging.requirements import Requirement

    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and (req := Requirement(line)).name in PINNED:
            specs = list(req.specifier)
            if len(specs) != 1 or specs[0].operator != "==":
                raise SystemExit(f"gpu_check: {path.name} must pin {req.name} with == (it says {line!r})")
            found[req.name] = specs[0].version
    if set(found) != set(PINNED):
        raise SystemExit(f"gpu_check: {path.name} pins no {', '.join(sorted(set(PINNED) - set(found)))}")
    return found


def unpinned(pinned: dict[str, str]) -> str | None:
    """One line saying which of the pinned distributions are not installed at their pin (from
    package metadata: nothing is imported), or None if all are."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    def installed(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    found = {name: installed(name) for name in pinned}
    if all(v is not None and Version(v) == Version(pinned[n]) for n, v in found.items()):
        return None
    need = " ".join(f"{n}=={v}" for n, v in pinned.items())
    have = ", ".join(f"{n} {v or 'none'}" for n, v in found.items())
    return (f"gpu_check: refusing to start: needs {need} (requirements.txt), found {have}; "
            "carry the pinned wheels: `bash launch/gpu_check.sh --fetch-wheels` on a machine with PyPI, then "
            "carry .whl/ and run `bash launch/gpu_check.sh`")


def write_report():
    """The report as it stands, replacing the last one whole (a temporary file renamed over it);
    rank 0 only."""
    if REPORT_PATH is None or os.environ.get("RANK", "0") != "0":
        return
    checks = REPORT["checks"]
    REPORT.update(passed=sum(c["ok"] is True for c in checks), failed=sum(c["ok"] is False for c in checks),
                  skipped=sum(c["ok"] is None for c in checks), seconds=round(time.time() - START, 1))
    REPORT_PATH.parent.mkdir(parents=True, exist_ok=True)
    tmp = REPORT_PATH.with_name(f".{REPORT_PATH.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(REPORT, indent=1))
    os.replace(tmp, REPORT_PATH)


def check(name: str, fn):
    t = time.time()
    try:
        detail, ok = fn(), True
    except Exception as e:  # the report says how it failed, and the next checks still run
        detail, ok = f"{type(e).__name__}: {e}".strip().splitlines()[0][:400], False
        traceback.print_exc(limit=3, file=sys.stderr)
    REPORT["checks"].append({"check": name, "ok": ok, "detail": detail, "seconds": round(time.time() - t, 2)})
    write_report()
    print(f"[{'ok' if ok else 'FAIL'}] {name} ({time.time() - t:.1f}s): {detail}", flush=True)
    return ok


def time_left(budget_s: float) -> float:
    return budget_s - (time.time() - START)


def within_budget(stage: str, budget_s: float) -> bool:
    """Whether `stage` may start: enough of the time budget left for it; if not, it is reported skipped."""
    left = time_left(budget_s)
    if left >= STAGE_NEEDS_S[stage]:
        return True
    why = f"skipped: {max(left, 0):.0f} s of the {budget_s:.0f} s budget left, it needs ~{STAGE_NEEDS_S[stage]} s"
    REPORT["checks"].append({"check": stage, "ok": None, "detail": why, "seconds": 0.0})
    write_report()
    print(f"[skip] {stage}: {why}", flush=True)
    return False


def random_model(text: dict, vision: dict, device, dtype=None, tied: bool = False):
    """A Qwen3-VL of the given shape with random weights, built where it will run (bf16 on a GPU);
    `tied`: the LM head is the token embedding (Qwen3-VL-2B and 4B), else a matrix of its own (8B)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tied, **IDS)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3VLForConditionalGeneration._from_config(config, dtype=dtype, attn_implementation="sdpa")


def build_from_saved(cfg, text: dict, vision: dict, tied: bool = False):
    """A random Qwen3-VL saved with save_pretrained into a temporary directory, then
    policy.build_policy(cfg, that directory), as train.py builds its policy. Returns the built
    policy and the source (in CPU RAM, with the LoRA init rank 0 gave the built one: add_lora seeds
    it). Collective."""
    import shutil

    import distributed
    import policy

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32  # what build_policy loads in
    source = random_model(text, vision, torch.device("cpu"), dtype, tied)
    directory = tempfile.mkdtemp(prefix="gpu-check-model-") if torch.distributed.get_rank() == 0 else None
    directory = distributed.broadcast_object(directory)  # (one machine: every rank reads rank 0's directory)
    try:
        if torch.distributed.get_rank() == 0:
            source.save_pretrained(directory)
        torch.distributed.barrier()
        model = policy.build_policy(cfg, directory)
        torch.distributed.barrier()
    finally:
        if torch.distributed.get_rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)
    return model, policy.add_lora(cfg, source)


def differences(model, source) -> tuple[list[str], dict]:
    """Every parameter and buffer of the (sharded) `model` that differs from the whole `source`
    (a name missing on either side, or another shape, dtype or value), and what was compared.
    The buffers are compared on their own: the rotary embeddings' inv_freq are not in the state
    dict, so a state-dict comparison would not see them. Collective."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import distributed

    def differ(name, got, want):
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"{name}: {got.dtype} {tuple(got.shape)} vs {want.dtype} {tuple(want.shape)} in the source"
        got, want = got.detach().cpu(), want.detach().cpu()
        if not torch.equal(got, want):
            return f"{name}: differs by up to {(got.float() - want.float()).abs().max().item():.3g}"
        return None

    def compare(got: dict, want: dict, what: str) -> list[str]:
        bad = [f"{k}: no such {what} in the source" for k in sorted(got.keys() - want.keys())]
        bad += [f"{k}: {what} missing" for k in sorted(want.keys() - got.keys())]
        return bad + [why for k in sorted(got.keys() & want.keys()) if (why := differ(k, got[k], want[k]))]

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    bad = compare(full, source.state_dict(), "tensor") if dist.get_rank() == 0 else []
    buffers = dict(model.named_buffers())
    bad += compare(buffers, dict(source.named_buffers()), "buffer")
    bad = list(dict.fromkeys(b for rank in distributed.all_gather_objects(bad) for b in rank))
    in_state = set(model.state_dict())
    compared = {"tensors": len(source.state_dict()), "buffers": len(buffers),
                "buffers_outside_the_state_dict": sorted(n for n in buffers if n not in in_state)}
    return bad, compared


def maze_sequences(n: int, vocab: int, cell_px: int, difficulty: str, turns: int, processor, varied: bool = False):
    """n multi-turn sequences shaped like rollouts: per turn a rendered maze image (its placeholder
    expanded to one token per merged patch), some observation text and a reply of 8 tokens.
    `varied`: episodes of three lengths (`turns`, and a quarter and a half fewer), as a group's
    members end at different turns, so that a token budget packs them unevenly."""
    import rollout
    from tasks.maze import DIFFICULTY_SIZES, MazeTask, generate_maze

    rng = random.Random(0)
    special = set(IDS.values())
    sequences = []
    for i in range(n):
        maze = generate_maze(DIFFICULTY_SIZES[difficulty], seed=1_000_000 + i)
        game = MazeTask.of(maze, max_turns=turns + 1, cell_px=cell_px)
        images = [game.reset().image]
        ids, mask = [], []
        played = max(1, turns - (i % 3) * (turns // 4)) if varied else turns
        for t in range(played):
            grid = processor.image_processor(images=[images[-1]], return_tensors="pt")["image_grid_thw"][0]
            image = [IDS["vision_start_token_id"]] + [IDS["image_token_id"]] * (int(grid.prod()) // 4) + \
                [IDS["vision_end_token_id"]]
            text = [t for t in (rng.randrange(10, vocab) for _ in range(24)) if t not in special]
            reply = [rng.randrange(10, vocab) for _ in range(8)]
            ids += image + text + reply
            mask += [0] * (len(image) + len(text)) + [1] * len(reply)
            if t < played - 1:
                images.append(game.step(f"<answer>('move', {rng.randrange(4)})</answer>").image)
        # made-up sampling log-probs: TIS then has weights other than 1 to apply
        sequences.append(rollout.Sequence(ids, mask, [(-0.5 - 0.1 * rng.random()) if m else 0.0 for m in mask], images))
    return sequences


def shape_checks(shape: str, device, text: dict, vision: dict, cell_px: int, difficulty: str, turns: int,
                 n_sequences: int, from_saved: bool, tied: bool, micro_batch_tokens: int = 0) -> dict:
    """The trainer's path on one shape (from_saved: the policy built by policy.build_policy from a
    saved model, and checked equal to it; tied: tied embeddings; micro_batch_tokens: the update's
    token budget, 0 for one that splits this shape's sequences); returns figures for the report."""
    from transformers import Qwen2VLImageProcessor

    import checkpoint
    import config
    import env
    import grpo
    import policy
    import tis
    import update
    import vllm_engine
    from tasks.maze import MazeTask

    processor = SimpleNamespace(image_processor=Qwen2VLImageProcessor(patch_size=16, merge_size=2,
                                                                      temporal_patch_size=2),
                                tokenizer=SimpleNamespace(pad_token_id=0), **IDS)
    # the recipe's sampling (T 0.5: log-probs of the tempered distribution after the engine's logit
    # bias, vllm_engine.logprobs_mode) and its micro-batches packed by tokens (config.py)
    cfg = config.Config(lora_rank=32 if shape == "8b" else 8, lora_alpha=64 if shape == "8b" else 16,
                        tis_cap=2.0, lr=1e-3, temperature=0.5, warmup_steps=0, micro_batch_tokens=micro_batch_tokens)
    banned = vllm_engine.vision_token_ids(processor)
    figures = {"tied_embeddings": tied, "temperature": cfg.temperature, "logit_bias_token_ids": banned}
    state = {}

    def assert_tying(model):
        """The LM head is the embedding's very parameter when tied (after FSDP2 too), its own when not."""
        shared = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        assert shared == tied, f"tie_word_embeddings={tied}, but the LM head {'is' if shared else 'is not'} the embedding"

    def build():
        t = time.time()
        model = random_model(text, vision, device, tied=tied)
        state["model"] = policy.wrap_policy(cfg, model)
        trainable = sum(p.numel() for _, p in policy.lora_parameters(state["model"]))
        figures["build_s"] = round(time.time() - t, 1)
        assert_tying(state["model"])
        return f"{sum(p.numel() for p in state['model'].parameters()) / 1e6:.0f} M parameters, {trainable / 1e6:.2f} M LoRA"

    def build_saved():
        t = time.time()
        model, source = build_from_saved(cfg, text, vision, tied)
        figures["build_s"] = round(time.time() - t, 1)
        bad, compared = differences(model, source)
        del source
        figures["build_policy_compared"] = compared
        assert compared["buffers_outside_the_state_dict"], "no buffer outside the state dict was compared"
        assert not bad, f"{len(bad)} differ from the saved source: " + "; ".join(bad[:4])
        assert_tying(model)
        state["model"] = model
        return (f"{compared['tensors']} tensors and {compared['buffers']} buffers (outside the state dict: "
                f"{', '.join(compared['buffers_outside_the_state_dict'])}) equal the saved source's, LoRA init "
                f"included; built in {figures['build_s']} s")

    def forward_paths():
        model = state["model"]
        sequences = maze_sequences(2, text["vocab_size"], cell_px, difficulty, turns, processor)
        model.eval()
        with torch.no_grad():
            inputs, mask, _ = policy.Batch(sequences, processor).micro([0, 1], device)
            assert "pixel_values" in inputs
            plain = policy.sequence_logprobs(model, inputs)
            inputs, mask, _ = policy.Batch(sequences, processor, model).micro([0, 1], device)
            assert "mm_encoder_outputs" in inputs and "pixel_values" not in inputs, sorted(inputs)
            cached = policy.sequence_logprobs(model, inputs)
        diff = ((plain - cached).abs() * mask).max().item()
        tolerance = 0.05 if device.type == "cuda" else 1e-5  # bf16 kernels vs fp32
        assert diff < tolerance, f"log-probs differ by {diff} (> {tolerance})"
        figures["precomputed_vs_pixels_max_diff"] = diff
        return f"max |difference| {diff:.2e} on {int(mask.sum())} reply tokens, {inputs['input_ids'].shape[1]} positions"

    def processed_logprobs():
        """The chunked path at T 0.5 with the logit bias equals the plain formula on full logits."""
        model = state["model"]
        sequences = maze_sequences(2, text["vocab_size"], cell_px, difficulty, turns, processor)
        model.eval()
        with torch.no_grad():
            inputs, mask, _ = policy.Batch(sequences, processor, model).micro([0, 1], device)
            got = policy.sequence_logprobs(model, inputs, cfg.temperature, banned)
            logits = model(**inputs).logits[:, :-1].float()
            logits[..., banned] += vllm_engine.VISION_TOKEN_BIAS
            want = torch.log_softmax(logits / cfg.temperature, -1).gather(
                -1, inputs["input_ids"][:, 1:, None]).squeeze(-1)
        diff = ((got - want).abs() * mask).max().item()
        tolerance = 0.05 if device.type == "cuda" else 1e-4
        assert diff < tolerance, f"log-probs differ by {diff} (> {tolerance})"
        # the bias is in: a vision placeholder as the next token is all but impossible
        image_next = inputs["input_ids"][:, 1:] == IDS["image_token_id"]
        assert image_next.any() and got[image_next].max().item() < 0.5 * vllm_engine.VISION_TOKEN_BIAS / cfg.temperature
        figures["processed_vs_full_logits_max_diff"] = diff
        return (f"T {cfg.temperature}, bias {vllm_engine.VISION_TOKEN_BIAS} on {len(banned)} vision tokens: "
                f"max |difference| {diff:.2e} on {int(mask.sum())} reply tokens")

    def train_update():
        model = state["model"]
        sequences = maze_sequences(n_sequences, text["vocab_size"], cell_px, difficulty, turns, processor, varied=True)
        lengths = sorted(len(s.token_ids) for s in sequences)
        # the token budget: given, or one that holds two of the middle length, so that the longest
        # go alone and the shorter share a micro-batch
        cfg.micro_batch_tokens = micro_batch_tokens or 2 * lengths[len(lengths) // 2]
        packed = [b for b in update.synced_micro_batches(list(range(n_sequences)), cfg.micro_batch_size,
                                                         lambda i: len(sequences[i].token_ids), cfg.micro_batch_tokens)]
        assert all(len(b) == 1 or len(b) * len(sequences[b[0]].token_ids) <= cfg.micro_batch_tokens for b in packed)
        figures.update(micro_batch_tokens=cfg.micro_batch_tokens, micro_batches=[len(b) for b in packed],
                       sequence_tokens=lengths)
        # the engine's log-probs, as if it had sampled these replies at T 0.5: the trainer's processed
        # ones plus a bf16-sized disagreement (about 1e-2), so TIS has weights near 1 but not 1 to apply
        model.eval()
        noise = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for i, s in enumerate(sequences):
                inputs, _, _ = policy.Batch([s], processor, model).micro([0], device)
                lp = policy.sequence_logprobs(model, inputs, cfg.temperature, banned)[0].float().cpu()
                jitter = 0.01 * torch.randn(lp.shape, generator=noise)
                s.rollout_logprobs = [0.0] + [(lp[j] + jitter[j]).item() if s.response_mask[j + 1] else 0.0
                                              for j in range(len(lp))]
        advantages = [1.0 if i % 2 == 0 else -1.0 for i in range(n_sequences)]
        experiences = [grpo.Experience(s, a * torch.tensor(s.response_mask[1:], dtype=torch.float32), i)
                       for i, (s, a) in enumerate(zip(sequences, advantages))]
        optimizer = torch.optim.AdamW([p for _, p in policy.lora_parameters(model)], lr=cfg.lr)
        scheduler = update.make_scheduler(optimizer, cfg)
        before = policy.gather_lora_state(model)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.synchronize(device)
        t = time.time()
        stats = update.grpo_update(cfg, model, optimizer, scheduler, policy.Batch(sequences, processor, model),
                                   experiences, n_sequences, device, reweight=tis.TruncatedIS(cfg.tis_cap))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            figures["update_peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        figures["update_s"] = round(time.time() - t, 2)
        after = policy.gather_lora_state(model)
        moved = max((after[k] - before[k]).abs().max().item() for k in after)
        assert stats["grad_norm"] > 0 and moved > 0, stats
        assert stats["tis_weight_mean"] != 1.0 and abs(stats["tis_weight_mean"] - 1) < 0.05, stats
        figures.update(grad_norm=stats["grad_norm"], tis_weight_mean=stats["tis_weight_mean"],
                       tokens=sum(len(s.token_ids) for s in sequences))
        state.update(optimizer=optimizer, scheduler=scheduler, lora=after)
        return (f"{n_sequences} sequences of {lengths[0]}-{lengths[-1]} tokens in micro-batches of "
                f"{figures['micro_batches']} (budget {cfg.micro_batch_tokens} tokens), T {cfg.temperature}, "
                f"in {figures['update_s']} s, grad norm {stats['grad_norm']:.3g}, TIS weight "
                f"{stats['tis_weight_mean']:.4f}, LoRA moved {moved:.2e}")

    def adapter_and_checkpoint():
        model, optimizer, scheduler, lora = state["model"], state["optimizer"], state["scheduler"], state["lora"]
        base = {"path": f"random {shape}", "fingerprint": None}
        with tempfile.TemporaryDirectory() as out:
            out = Path(out)
            t = time.time()
            if torch.distributed.get_rank() == 0:
                checkpoint.write_adapter(model, lora, out / "adapters" / "step_1", base)
            stream = env.TrainingStream(MazeTask, "small", eval_n=8)
            tmp = checkpoint.save(cfg, model, optimizer, scheduler, lora, 1, stream, 0.0, out, base)
            if torch.distributed.get_rank() == 0:
                checkpoint.publish(out, tmp, 1, keep=2)
            torch.distributed.barrier()
            figures["checkpoint_write_s"] = round(time.time() - t, 2)
            found = checkpoint.find(out, "latest")
            assert checkpoint.verify(found) is None
            saved_moments = {k: v["exp_avg"].clone() for k, v in optimizer.state_dict()["state"].items()}
            with torch.no_grad():  # scramble, then load back
                for _, p in policy.lora_parameters(model):
                    p.zero_()
            checkpoint.load(found, cfg, model, optimizer, scheduler, stream)
            restored = policy.gather_lora_state(model)
            worst = max((restored[k] - lora[k]).abs().max().item() for k in lora)
            moments = optimizer.state_dict()["state"]
            worst_moment = max((moments[k]["exp_avg"].cpu() - saved_moments[k].cpu()).abs().max().item()
                               for k in saved_moments)
            assert worst == 0 and worst_moment == 0, (worst, worst_moment)
            size = sum(f.stat().st_size for f in found.iterdir())
            from peft import PeftConfig

            assert PeftConfig.from_pretrained(str(out / "adapters" / "step_1")).r == cfg.lora_rank
        return f"adapter + checkpoint ({size / 2**20:.0f} MiB) written in {figures['checkpoint_write_s']} s, restored exactly"

    if from_saved:
        ok = check(f"{shape}: policy.build_policy from a saved model (meta device, LoRA, FSDP2, broadcast from "
                   "rank 0) = the saved model, parameters and buffers", build_saved)
    else:
        ok = check(f"{shape}: policy (LoRA + bf16 FSDP2 on the 2-D mesh, gradient checkpointing)", build)
    if ok:
        check(f"{shape}: precomputed image features = pixel path", forward_paths)
        if shape == "small":  # the 8B's full-vocabulary logits (151,936 a token) would not fit beside it
            check(f"{shape}: processed log-probs (T {cfg.temperature}, logit bias) = log_softmax of the full logits",
                  processed_logprobs)
        if check(f"{shape}: update.grpo_update with TIS at T {cfg.temperature}, micro-batches packed by tokens, "
                 "on multi-turn image sequences", train_update):
            check(f"{shape}: adapter export, checkpoint save/verify/load round trip", adapter_and_checkpoint)
    state.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return figures


def scope(on_gpu: bool, world: int, shapes: list[str], bench: bool) -> dict:
    """What this run exercises ("ran") and what it leaves unproven ("not_run"), for the report:
    it claims no more than the checks below run."""
    torch_pin = pins_of(["torch"]).get("torch")
    ran = [f"world size {world} (distributed.init_distributed, backend {'cpu:gloo,cuda:nccl' if on_gpu else 'gloo'}), "
           "the trainer's collectives",
           *(f"{shape}: " + SHAPE_PATHS[shape] for shape in shapes if shape in SHAPE_PATHS),
           *(["bench/gpu_mfu.py at the Qwen3-VL-8B shape"] if bench and on_gpu else [])]
    not_run = ["vLLM: no engine runs (rollout log-probs are the trainer's own plus noise), so not its CUDA "
               "engine, its sampled log-probs, the bf16 trainer-vs-vLLM mismatch, the sleep modes offload/kv/auto, "
               "loading an adapter into it, nor serve.py",
               f"more than one process: NCCL traffic between GPUs, HSDP, filler micro-batches (world size {world})",
               "real Qwen3-VL weights and tokenizer (random weights, random token ids)",
               "bench/sizing.py's memory table (the engine's memory beside the trainer's)"]
    if not on_gpu:
        not_run.insert(0, "a GPU: this is the CPU dry run (fp32, no CUDA kernels, no NCCL)")
    if torch_pin and torch.__version__.split("+")[0] != torch_pin:
        not_run.append(f"the pinned torch {torch_pin} (requirements.txt): this ran torch {torch.__version__}")
    if on_gpu and "8b" not in shapes:
        not_run.append("the Qwen3-VL-8B shape (not asked for: --shapes)")
    return {"ran": ran, "not_run": not_run}


# What each shape's checks run (shape_checks), in words for the report.
SHAPE_PATHS = {
    "small": "policy.build_policy from a saved random model with tied embeddings (meta device, LoRA, FSDP2, "
             "broadcast from rank 0) equal to it; precomputed image features = pixel path; processed log-probs "
             "(T 0.5, logit bias) = log_softmax of the full logits; update.grpo_update with TIS at T 0.5, "
             "micro-batches packed by a token budget that splits them; adapter export and checkpoint round trip",
    "8b": "policy.wrap_policy (LoRA, FSDP2) of a random Qwen3-VL-8B shape, untied embeddings; precomputed image "
          "features = pixel path; update.grpo_update with TIS at T 0.5, micro-batches packed by the qwen3-vl "
          "recipe's 16384-token budget; adapter export and checkpoint round trip",
}


def collectives(device) -> str:
    """Every collective the trainer issues outside FSDP, on CPU tensors and (on a GPU) CUDA ones."""
    import torch.distributed as dist

    import distributed

    done = []
    distributed.mean_over_ranks({"a": 1.0, "b": 2.0})
    distributed.sum_over_ranks([1.0, 2.0])
    distributed.max_over_ranks(3.0)
    assert distributed.broadcast_object({"x": 1}) == {"x": 1}
    assert distributed.all_gather_objects(dist.get_rank())[0] == 0
    dist.barrier()
    done.append("cpu: mean/sum/max over ranks, broadcast/all_gather objects, barrier")
    for where in ["cpu"] + (["cuda"] if device.type == "cuda" else []):
        x = torch.ones(4, device=where)
        dist.all_reduce(x)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x)
        done.append(f"{where}: all_reduce + all_gather")
    routes = dict(dist.BackendConfig(dist.get_backend()).get_device_backend_map()) if "," in dist.get_backend() \
        else {"*": dist.get_backend()}
    return f"backend {dist.get_backend()!r} {routes}; " + "; ".join(done)


def main():
    global REPORT_PATH
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="the small shape on the CPU only (no GPU needed)")
    parser.add_argument("--shapes", default="small,8b", help="comma-separated: small, 8b")
    parser.add_argument("--no-bench", action="store_true", help="skip bench/gpu_mfu.py")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "gpu_check.json"))
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds for the whole check: a stage that would not fit in what is left is skipped")
    parser.add_argument("--require", action="append", default=[], metavar="SPEC",
                        help="one more requirement to check first, e.g. 'regex>=2025.10.22' (repeatable)")
    args = parser.parse_args()

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.dry_run:
        raise SystemExit("no GPU here: run with --dry-run for the small shape on the CPU")
    REPORT_PATH = Path(args.out)
    pinned = pins()
    REPORT.update(status="running", date=datetime.datetime.now().isoformat(timespec="minutes"),
                  command=" ".join(sys.argv), gpu=on_gpu, dry_run=args.dry_run, budget_s=args.budget_s,
                  versions={"python": platform.python_version(), "torch": torch.__version__}, pins=pinned,
                  requirements=requirements(args.require + [f"{n}=={v}" for n, v in pinned.items()]), shapes={})
    refusal = unpinned(pinned)
    if refusal:  # before anything imports them: the wrong transformers would run another model code
        REPORT.update(status="refused", refused=refusal)
        write_report()
        raise SystemExit(refusal)
    missing = [f"{r['name']} {r['need']} (have {r['have'] or 'none'}, for {r['by']})"
               for r in REPORT["requirements"] if not r["ok"]]
    if missing:  # before any import that would die of it: the report says what to carry
        REPORT.update(status="refused", missing=missing)
        write_report()
        raise SystemExit(f"missing or too old: {'; '.join(missing)}. Nothing was run; carry wheels for them "
                         f"(launch/gpu_check.sh --fetch-wheels). Report in {args.out}")

    import distributed
    import shapes
    from config import QWEN3_VL_RECIPE

    rank, world, local_rank = distributed.init_distributed()
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    import peft
    import transformers

    REPORT.update(device=torch.cuda.get_device_name(device) if on_gpu else f"CPU ({platform.processor() or '?'})",
                  world_size=world)
    REPORT["versions"].update(transformers=transformers.__version__, peft=peft.__version__)
    REPORT.update(scope(on_gpu, world, ["small"] if args.dry_run else args.shapes.split(","), not args.no_bench))
    write_report()
    check("process group and the trainer's collectives", lambda: collectives(device))
    wanted = ["small"] if args.dry_run else args.shapes.split(",")
    if "small" in wanted and within_budget("small", args.budget_s):
        REPORT["shapes"]["small"] = shape_checks("small", device, SMALL_TEXT, SMALL_VISION, cell_px=32,
                                                 difficulty="small", turns=4 if args.dry_run else 15, n_sequences=6,
                                                 from_saved=True, tied=True)
        write_report()
    if "8b" in wanted and on_gpu and within_budget("8b", args.budget_s):
        # 9x9 mazes at 64 px cells (576 px images, 324 image tokens a turn), up to 15 turns: ~5k
        # tokens; the qwen3-vl recipe's token budget
        REPORT["shapes"]["8b"] = shape_checks("8b", device, shapes.QWEN3_VL_8B_TEXT, shapes.QWEN3_VL_8B_VISION,
                                              cell_px=64, difficulty="easy", turns=15, n_sequences=4, from_saved=False,
                                              tied=False, micro_batch_tokens=QWEN3_VL_RECIPE["micro_batch_tokens"])
        write_report()
    if not args.no_bench and on_gpu and rank == 0 and within_budget("bench", args.budget_s):
        with tempfile.TemporaryDirectory() as tmp:
            bench_out = Path(tmp) / "gpu_mfu.json"

            def bench():
                proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_mfu.py"), "--out", str(bench_out)],
                                      cwd=ROOT, capture_output=True, text=True, timeout=max(time_left(args.budget_s), 30),
                                      env={**os.environ, "MASTER_PORT": str(29700 + os.getpid() % 200)})
                assert proc.returncode == 0, proc.stderr[-1500:]
                REPORT["gpu_mfu"] = r = json.loads(bench_out.read_text())
                return (f"{r['tokens_per_s']:.0f} tokens/s, MFU {100 * r['mfu_vs_measured_matmul']:.1f}% of a measured "
                        f"{r['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s, peak {r['peak_memory_allocated_gib']:.1f} GiB")

            check("bench/gpu_mfu.py at the Qwen3-VL-8B shape", bench)
    REPORT.update(status="done")
    write_report()
    if rank == 0:
        print(f"{REPORT['passed']} checks passed, {REPORT['failed']} failed, {REPORT['skipped']} skipped in "
              f"{REPORT['seconds']} s; report in {args.out}")
    torch.distributed.destroy_process_group()
    sys.exit(1 if REPORT["failed"] else 0)


if __name__ == "__main__":
    main()
