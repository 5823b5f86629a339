"""The trainer's policy: exact shortcuts in its forward pass, the sync proof, and updates that are
the same whatever the number of ranks."""

import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import env
import policy
import update
import train
from tasks.maze import MazeTask, generate_maze

ROOT = Path(__file__).resolve().parent.parent


def in_fresh_process(target, *args, timeout: int = 300):
    """Run target(*args, results) in a spawned process (its own world of one); return what it put."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, results))
    proc.start()
    out = None
    for _ in range(timeout // 5):  # bounded wait, and fail fast if the child died
        try:
            out = results.get(timeout=5)
            break
        except Exception:
            assert proc.is_alive(), f"{target.__name__} died (exit code {proc.exitcode})"
    proc.join(timeout=60)
    assert out is not None, f"{target.__name__} timed out"
    return out


def perturbed_policy(cfg, model_path):
    """The FSDP + LoRA policy with LoRA B moved off its zero init, so the adapter's A matrices get
    gradients too and the adapter changes the model."""
    model = policy.build_policy(cfg, model_path)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in policy.lora_parameters(model):
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(0.05 * torch.randn(local.shape, generator=gen))
    return model


# ----------------------------------------------------------------------------- exact shortcuts

def _features_check(model_dir: str, results):
    import distributed
    import rollout
    import sft

    distributed.init_distributed()
    cfg = train.Config(lora_rank=8, lora_alpha=16, seed=0)
    model = perturbed_policy(cfg, model_dir)
    chat = rollout.ChatFormat.for_model(model_dir)
    seqs = sft.demonstrations(chat, 3, max_turns=6)
    seqs.append(rollout.Sequence(list(seqs[0].token_ids), list(seqs[0].response_mask),  # shares every image
                                 list(seqs[0].rollout_logprobs), list(seqs[0].images)))
    idx = list(range(len(seqs)))
    model.eval()
    with torch.no_grad():
        # the reference: pixels through the model's own forward, with a padding mask
        plain = policy.Batch(seqs, chat.processor)
        inputs, mask, _ = plain.micro(idx, torch.device("cpu"))
        assert "pixel_values" in inputs
        lengths = torch.tensor([len(s.token_ids) for s in seqs])
        inputs["attention_mask"] = (torch.arange(inputs["input_ids"].shape[1]) < lengths[:, None]).long()
        reference = policy.sequence_logprobs(model, inputs)
        # the trainer's: each distinct image encoded once, no padding mask (causal + right padding)
        cached = policy.Batch(seqs, chat.processor, model)
        calls = []
        inner = policy.qwen3_vl_model(model)
        original = inner.get_image_features
        inner.get_image_features = lambda pixels, grid, **kw: calls.append(len(grid)) or original(pixels, grid, **kw)
        got = [policy.sequence_logprobs(model, cached.micro(part, torch.device("cpu"))[0]) for part in ([0, 1], [2, 3])]
    diff = max(((g - reference[rows, :g.shape[1]]).abs() * mask[rows, :g.shape[1]]).max().item()
               for g, rows in zip(got, ([0, 1], [2, 3])))
    distinct = len({rollout.image_digest(image) for s in seqs for image in s.images})
    results.put({"diff": diff, "encoded": sum(calls), "distinct": distinct,
                 "images": sum(len(s.images) for s in seqs)})


def test_precomputed_image_features_and_no_padding_mask_change_nothing(tiny_model):
    out = in_fresh_process(_features_check, str(tiny_model))
    print("features check:", out)
    assert out["diff"] < 1e-6  # the same log-probs on every trained token
    # each distinct image went through the vision tower once, the shared ones not again
    assert out["encoded"] == out["distinct"] < out["images"]


# ----------------------------------------------------------------------------- the sync proof

TEMPERATURE = 0.5  # the main job's: the engine reports the log-probs of what it sampled from, after its logit bias


def _sync_check(shared: str, model_dir: str, results):
    """Update the policy, then compare what the engine samples with what the trainer computes, at
    the main job's temperature."""
    import checkpoint
    import distributed
    import grpo
    import rollout
    import vllm_engine

    distributed.init_distributed()
    cfg = train.Config(lora_rank=8, lora_alpha=16)
    model = policy.build_policy(cfg, model_dir)
    base = checkpoint.base_model_record(model_dir)
    engine = vllm_engine.build_engine(model_dir, max_model_len=4096, max_lora_rank=8, seed=0, external_launcher=True,
                                  logprobs_mode=vllm_engine.logprobs_mode(TEMPERATURE))
    chat = rollout.ChatFormat.for_model(model_dir)
    tasks = [MazeTask.of(generate_maze(7, seed=s), max_turns=3) for s in (5, 6)]

    def play(request, group_offset):
        return rollout.play_episodes(engine, chat, tasks, [group_offset, group_offset + 1],
                                     rollout.Sampling(TEMPERATURE, 0, 6, 4096), samples_per_task=2,
                                     lora_request=request, progress=False)

    def trainer_mismatch(episodes, with_engine_bias=True):
        batch = policy.Batch([e.sequences[0] for e in episodes], chat.processor, model)
        with torch.no_grad():
            inputs, mask, rollout_lp = batch.micro(list(range(len(episodes))), torch.device("cpu"))
            lp = policy.sequence_logprobs(model, inputs, TEMPERATURE, batch.banned_token_ids if with_engine_bias else ())
            return grpo.logprob_mismatch(lp, rollout_lp, mask)["mismatch_abs_mean"]

    out = {}
    def sync(step):  # what train.sync does: the LoRA to shared storage, then into the engine
        path, _, nbytes = policy.publish_adapter(model, Path(shared), step, 5, base)
        return vllm_engine.load_adapter(engine, path, step), nbytes

    request0, _ = sync(0)
    episodes = play(request0, 0)
    out["before_update"] = trainer_mismatch(episodes)
    # the tiny model puts some mass on the vision tokens: without the engine's bias the trainer's
    # tempered policy is not the one the engine sampled from
    out["before_update_without_bias"] = trainer_mismatch(episodes, with_engine_bias=False)

    # one real optimizer step with a big learning rate and made-up advantages
    optimizer = torch.optim.AdamW([p for _, p in policy.lora_parameters(model)], lr=5e-2)
    batch = policy.Batch([e.sequences[0] for e in episodes], chat.processor, model)
    inputs, mask, rollout_lp = batch.micro(list(range(len(episodes))), torch.device("cpu"))
    loss, _ = grpo.policy_loss(policy.sequence_logprobs(model, inputs, TEMPERATURE, batch.banned_token_ids), rollout_lp,
                               torch.tensor([1.0, -1.0] * (len(episodes) // 2)), mask)
    loss.backward()
    optimizer.step()
    out["old_samples_after_update"] = trainer_mismatch(episodes)  # the policy really moved

    # a fresh rollout through a NEW adapter id and path: the engine runs the updated policy
    request1, out["sync_bytes"] = sync(1)
    out["after_sync"] = trainer_mismatch(play(request1, 10))

    # the pitfall: new weights written under a new path but the OLD id -> vLLM keeps the old weights
    from vllm.lora.request import LoRARequest

    checkpoint.write_adapter(model, policy.gather_lora_state(model), Path(shared) / "sync" / "reused", base)
    stale = LoRARequest("reused-id", request0.lora_int_id, str(Path(shared) / "sync" / "reused"))
    engine.llm_engine.add_lora(request0)  # the old adapter is still cached under that id
    out["reused_id"] = trainer_mismatch(play(stale, 20))
    results.put(out)
    import torch.distributed as dist
    dist.barrier()
    del engine


@pytest.mark.slow
def test_engine_runs_the_current_policy_after_every_sync(tmp_path, tiny_model):
    out = in_fresh_process(_sync_check, str(tmp_path), str(tiny_model), timeout=600)
    print("sync check:", out)
    assert out["before_update"] < 1e-5  # T = 0.5: the trainer applies the engine's logit bias too
    assert out["before_update_without_bias"] > 100 * out["before_update"]  # which is needed: vLLM's are after it
    assert out["old_samples_after_update"] > 1e-2  # the update changed the policy
    assert out["after_sync"] < 1e-3  # ... and after the sync vLLM samples from the new one
    assert out["reused_id"] > 1e-2  # re-using an id would have kept the stale adapter
    assert out["sync_bytes"] > 0


# ----------------------------------------------------------------------------- the update's shortcuts

class GradientRecorder:
    """Stands in for the optimizer and scheduler: keeps the gradient of each step."""

    def __init__(self, params):
        self.param_groups = [{"params": params}]
        self.grads = []

    def zero_grad(self, set_to_none=True):
        for p in self.param_groups[0]["params"]:
            p.grad = None

    def step(self):
        self.grads.append([p.grad.full_tensor().clone() if p.grad is not None else torch.zeros(p.shape)
                           for p in self.param_groups[0]["params"]])

    def get_last_lr(self):
        return [0.0]


def _update_check(model_dir: str, results):
    """The single-pass update that skips zero-advantage sequences computes the same LoRA gradient
    as running every sequence against separately computed old logprobs, and as the loss by hand."""
    import distributed
    import grpo
    import rollout
    import sft

    distributed.init_distributed()
    cfg = train.Config(lora_rank=8, lora_alpha=16, micro_batch_size=2, max_grad_norm=1e9, tis_cap=0, temperature=1.0)
    model = perturbed_policy(cfg, model_dir)
    chat = rollout.ChatFormat.for_model(model_dir)
    sequences = sft.demonstrations(chat, 4, max_turns=4)
    batch = policy.Batch(sequences, chat.processor, model)
    advantages = [1.0, 0.0, -0.5, 0.0]

    def experiences():
        return [grpo.Experience(s, a * torch.tensor(s.response_mask[1:], dtype=torch.float32), i)
                for i, (s, a) in enumerate(zip(sequences, advantages))]

    rec = GradientRecorder([p for _, p in policy.lora_parameters(model)])
    stats = update.grpo_update(cfg, model, rec, rec, batch, experiences(), 4, torch.device("cpu"))
    two_pass = experiences()
    update.fill_old_logprobs(model, update.Lockstep(cfg, batch, torch.device("cpu")), two_pass, with_ref=False)
    update.grpo_update(cfg, model, rec, rec, batch, two_pass, 4, torch.device("cpu"))
    rec.zero_grad()  # by hand: every sequence, normalised by all response tokens
    inputs, mask, _ = batch.micro([0, 1, 2, 3], torch.device("cpu"))
    lp = policy.sequence_logprobs(model, inputs)
    loss, _ = grpo.policy_loss(lp, lp.detach(), torch.tensor(advantages), mask)
    loss.backward()
    rec.step()
    g = rec.grads
    results.put({"trained_sequence_frac": stats["trained_sequence_frac"],
                 "grad_norm": sum(x.norm() ** 2 for x in g[2]).sqrt().item(),
                 "single_vs_two_pass": max((a - b).abs().max().item() for a, b in zip(g[0], g[1])),
                 "single_vs_by_hand": max((a - b).abs().max().item() for a, b in zip(g[0], g[2]))})


def test_single_pass_update_that_skips_zero_advantages_has_the_full_gradient(tiny_model):
    out = in_fresh_process(_update_check, str(tiny_model))
    print("update check:", out)
    assert out["trained_sequence_frac"] == 0.5  # the two zero-advantage sequences were not run
    assert out["grad_norm"] > 1e-4  # a real gradient, not zeros everywhere
    assert out["single_vs_two_pass"] < 1e-6 * max(1.0, out["grad_norm"])
    assert out["single_vs_by_hand"] < 1e-6 * max(1.0, out["grad_norm"])


@pytest.mark.slow
def test_two_ranks_match_one_rank(tmp_path, tiny_model):
    """One GRPO update on a fixed batch of 8 episodes: split over two ranks (each holding two whole
    groups of unequal lengths, as a rank plays every member of its groups) it gives the same
    gradient as one rank holding all 8. Loss normalisation over all ranks' tokens and FSDP's averaging together;
    and the model build: only rank 0 reads the checkpoint, rank 1 gets its shard (and the LoRA
    init) from rank 0, and the gradients still agree."""
    worker = ROOT / "tests" / "update_worker.py"
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    runs = [[sys.executable, str(worker), str(tiny_model), str(one)],
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(worker),
             str(tiny_model), str(two)]]
    for cmd in runs:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    a, b = torch.load(one), torch.load(two)
    assert a["sequences"] == b["sequences"] == 8 and a["world"] == 1 and b["world"] == 2
    assert a["checkpoint_reads"] == [1] and b["checkpoint_reads"] == [1, 0]  # rank 0 reads, rank 1 receives
    assert a["advantages"] == pytest.approx(b["advantages"])
    norm = sum(g.norm() ** 2 for g in a["grads"].values()).sqrt().item()
    assert norm > 1e-5  # a real gradient
    worst = max((a["grads"][k] - b["grads"][k]).abs().max().item() for k in a["grads"])
    print(f"two ranks vs one: gradient norm {norm:.4g}, largest difference {worst:.3g}")
    assert worst < 1e-5 * norm


# ----------------------------------------------------------------------------- bad models

def test_model_mistakes_are_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub id cannot be fetched: as on an offline node
    (tmp_path / "empty").mkdir()
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    cases = [(str(tmp_path / "missing" / "model"), "no such directory"),
             (str(tmp_path / "empty"), "not a model directory (no config.json)"),
             (str(tmp_path / "llama"), "a 'llama' model; this trainer needs a Qwen3-VL one"),
             (str(tmp_path / "broken"), "config.json: unreadable"),
             ("nobody/no-such-model", "not a local directory, and the hub copy could not be had")]
    for model, message in cases:
        with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)")):
            policy.resolve_model(model, collective=False)


# ----------------------------------------------------------------------------- the PPO clip

def _clip_check(model_dir: str, settings: list, results):
    """A real update (AdamW at the recipe's rate) of 4 demonstrations, advantages +1/-1, split into
    mini-batches or passed over more than once: every optimizer step after the first runs on a
    policy that has moved away from the one that computed the old logprobs."""
    import distributed
    import grpo
    import rollout
    import sft

    distributed.init_distributed()
    chat = rollout.ChatFormat.for_model(model_dir)
    sequences = sft.demonstrations(chat, 4, max_turns=4)
    out = {}
    for num_mini_batches, ppo_epochs in settings:  # each from the same perturbed start
        cfg = train.Config(lora_rank=8, lora_alpha=16, micro_batch_size=4, tis_cap=0, warmup_steps=0,
                           num_mini_batches=num_mini_batches, ppo_epochs=ppo_epochs)
        model = perturbed_policy(cfg, model_dir)
        batch = policy.Batch(sequences, chat.processor, model)
        experiences = [grpo.Experience(s, a * torch.tensor(s.response_mask[1:], dtype=torch.float32), i)
                       for i, (s, a) in enumerate(zip(sequences, [1.0, -1.0, 1.0, -1.0]))]
        optimizer = update.make_optimizer(model, cfg.lr)  # grpo_update computes pi_old first (not single-pass)
        out[num_mini_batches, ppo_epochs] = update.grpo_update(cfg, model, optimizer, update.make_scheduler(optimizer, cfg),
                                                               batch, experiences, 4, torch.device("cpu"))
    results.put(out)


def test_the_clip_acts_with_mini_batches_or_epochs(tiny_model):
    """With one optimizer step per rollout batch the ratio is 1 and the clip never acts; with two
    mini-batches (or two epochs) the later step sees a moved policy and clips some of its tokens.
    This is what --num-mini-batches and --ppo-epochs are kept for (PPO-style sample reuse)."""
    settings = [(1, 1), (2, 1), (1, 2)]  # (mini-batches, epochs)
    out = in_fresh_process(_clip_check, str(tiny_model), settings)
    for (num_mini_batches, ppo_epochs), stats in out.items():
        print(f"mini-batches {num_mini_batches}, epochs {ppo_epochs}:", {k: stats[k] for k in ("clip_frac", "ratio_mean")})
    assert out[1, 1]["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and out[1, 1]["clip_frac"] == 0
    for reused in settings[1:]:
        assert out[reused]["ratio_mean"] != 1.0 and out[reused]["clip_frac"] > 0, reused


def test_the_stale_policy_bound_is_the_stacks_measured_noise():
    """On a GPU the bound comes from the noise measured at a fresh run's first step (the LoRA is
    PEFT's init there, so nothing but the stack's numerics is in it), not a fixed 0.1. A stand-in
    engine that goes stale (it keeps the policy of one step while the trainer moves on, so the
    mismatch grows ~5e-3 a step over bf16's ~4e-3 noise) is stopped within a few steps; the old
    fixed bound let it run for ~20. A step that measured nothing neither counts nor breaks a
    streak; a resumed run keeps its checkpoint's bound."""
    import math

    def steps_until_stopped(guard, mismatches, start=2, tokens=None):
        for k, m in enumerate(mismatches):
            try:
                guard.check(start + k, m, 500 if tokens is None else tokens[k])
            except SystemExit:
                return k + 1
        return None

    guard = update.StalePolicyGuard(steps=3, on_gpu=True)
    assert guard.calibrating
    guard.check(1, 4e-3, tokens=900)
    assert not guard.calibrating and guard.bound == pytest.approx(2e-2)
    in_sync = [4e-3 * (1 + 0.5 * math.sin(k)) for k in range(40)]
    assert steps_until_stopped(guard, in_sync) is None  # bf16 noise never stops a run
    stale = [4e-3 + 5e-3 * k for k in range(1, 30)]
    assert steps_until_stopped(guard, stale) <= 6
    assert steps_until_stopped(update.StalePolicyGuard(0.1, 3, on_gpu=True, start_step=5), stale) >= 20

    guard = update.StalePolicyGuard(steps=3, on_gpu=True, start_step=0)
    guard.check(1, 4e-3, tokens=0)  # nothing measured: not a calibration either
    assert guard.calibrating
    guard.check(2, 4e-3, tokens=700)
    assert steps_until_stopped(guard, [0.5, 0.5, 0.0, 0.5], tokens=[500, 500, 0, 500]) == 4
    resumed = update.StalePolicyGuard(steps=3, on_gpu=True, start_step=40, saved_bound=guard.bound)
    assert resumed.bound == guard.bound and not resumed.calibrating
    assert update.StalePolicyGuard(on_gpu=True, start_step=40).bound == 0.1  # an older checkpoint
    assert update.StalePolicyGuard(0.05, on_gpu=True).bound == 0.05  # given: fixed
    assert update.StalePolicyGuard(steps=3).calibrating and update.StalePolicyGuard.FLOOR["cpu"] == 1e-3


def test_ranks_wait_for_a_download_on_gloo_with_a_long_timeout(monkeypatch, tiny_model):
    """While local rank 0 fetches the model the other ranks wait in a gloo barrier with an hours-long
    timeout: on a GPU a plain barrier runs over NCCL, whose watchdog ends the job after 10 minutes."""
    import torch.distributed as dist

    from stand_ins import called_as

    calls = []  # each stand-in takes only the arguments torch 2.13's function takes
    monkeypatch.setattr(dist, "new_group", called_as(dist.new_group,
                                                     lambda **kw: calls.append(("new_group", kw)) or "gloo-group"))
    monkeypatch.setattr(dist, "barrier", called_as(dist.barrier, lambda group=None, **kw: calls.append(("barrier", group))))
    monkeypatch.setattr(dist, "destroy_process_group",
                        called_as(dist.destroy_process_group, lambda group=None: calls.append(("destroy", group))))
    assert policy.resolve_model("") == str(tiny_model)
    [(_, created), barrier, destroyed] = calls
    assert created["backend"] == "gloo" and created["timeout"].total_seconds() >= 3600
    assert barrier == ("barrier", "gloo-group") and destroyed == ("destroy", "gloo-group")


def test_micro_batches_hold_at_most_the_token_budget(monkeypatch):
    """Sorted longest first; a micro-batch holds at most micro_batch_size sequences and, with a
    token budget, at most that many tokens padded to its longest (a longer sequence goes alone);
    every sequence in exactly one. The memory of the update follows the budget, not the batch."""
    import distributed

    from stand_ins import ranks_worst

    monkeypatch.setattr(distributed, "max_over_ranks", lambda x: x)  # a world of one
    lengths = {i: n for i, n in enumerate([900, 4000, 1200, 300, 2500, 2500, 700, 9000, 100, 1500])}
    batches = update.synced_micro_batches(list(lengths), 16, lengths.get, max_tokens=5000)
    assert sorted(i for b in batches for i in b) == list(lengths)
    for b in batches:
        assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)
        assert len(b) * lengths[b[0]] <= 5000 or len(b) == 1
    assert [len(b) for b in batches] == [1, 1, 2, 3, 3]  # 9000 alone; 4000; 2500 x 2; 1500,1200,900; 700,300,100
    assert [len(b) for b in update.synced_micro_batches(list(lengths), 4, lengths.get)] == [4, 4, 2]  # no budget
    assert [len(b) for b in update.synced_micro_batches(list(lengths), 4, lengths.get, max_tokens=-1)] == [4, 4, 2]
    # another rank with 7 micro-batches: every rank runs 7 (FSDP's forward and backward are
    # collectives), this one 2 zero-weight fillers (None) after its own 5
    monkeypatch.setattr(distributed, "max_over_ranks", ranks_worst(7))
    assert update.synced_micro_batches(list(lengths), 16, lengths.get, max_tokens=5000)[5:] == [None, None]
