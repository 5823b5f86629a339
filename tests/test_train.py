"""The trainer end to end on the tiny model: sync proof, world of one and two, checkpoints, resume."""

import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest

import train

ROOT = Path(__file__).resolve().parent.parent
TINY_RUN = ["--prompts-per-step", "2", "--group-size", "4", "--max-turns", "4", "--max-new-tokens", "8",
            "--eval-mazes", "8", "--progress", "false"]


def run_train(out: Path, *args: str, nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    if nproc == 1:
        cmd = [sys.executable, "train.py"]
    else:
        # --standalone: a private rendezvous on a free local port (parallel runs cannot collide)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "train.py"]
    cmd += ["--out-dir", str(out), *TINY_RUN, *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- the sync proof

def _sync_check(shared: str, results):
    """Runs in a fresh process (its own world of one): update the policy, then compare engines."""
    import torch
    from transformers import AutoProcessor, GenerationConfig

    import env
    import grpo
    import rollout
    from launch.make_tiny_model import ensure_tiny_model

    train.init_distributed()
    model_path = str(ensure_tiny_model())
    cfg = train.Config(lora_rank=8, lora_alpha=16)
    model = train.build_policy(cfg, model_path, world_size=1)
    engine = rollout.build_engine(model_path, max_model_len=4096, max_lora_rank=8, seed=0, external_launcher=True)
    processor = AutoProcessor.from_pretrained(model_path)
    chat = rollout.ChatFormat(processor, GenerationConfig.from_pretrained(model_path).eos_token_id)
    mazes = [env.generate_maze(7, seed=s) for s in (5, 6)]

    def play(request, group_offset):
        return rollout.play_episodes(engine, chat, mazes, [group_offset, group_offset + 1], samples_per_maze=2,
                                     max_turns=3, max_new_tokens=6, max_model_len=4096, temperature=1.0,
                                     seed=0, lora_request=request, progress=False)

    def trainer_mismatch(episodes):
        batch = train.Batch([e.sequences[0] for e in episodes], processor)
        with torch.no_grad():
            inputs, mask, rollout_lp = batch.micro(list(range(len(episodes))), torch.device("cpu"))
            return grpo.logprob_mismatch(train.sequence_logprobs(model, inputs), rollout_lp, mask)["mismatch_abs_mean"]

    out = {}
    request0, _, _ = train.sync_adapter(model, engine, Path(shared), 0, keep=5)
    episodes = play(request0, 0)
    out["before_update"] = trainer_mismatch(episodes)

    # one real optimizer step with a big learning rate and made-up advantages
    params = [p for _, p in train.lora_parameters(model)]
    optimizer = torch.optim.AdamW(params, lr=5e-2)
    batch = train.Batch([e.sequences[0] for e in episodes], processor)
    inputs, mask, rollout_lp = batch.micro(list(range(len(episodes))), torch.device("cpu"))
    advantages = torch.tensor([1.0, -1.0] * (len(episodes) // 2))
    loss, _ = grpo.policy_loss(train.sequence_logprobs(model, inputs), rollout_lp, advantages, mask)
    loss.backward()
    optimizer.step()
    out["old_samples_after_update"] = trainer_mismatch(episodes)  # the policy really moved

    # a fresh rollout through a NEW adapter id and path: the engine runs the updated policy
    request1, _, stats = train.sync_adapter(model, engine, Path(shared), 1, keep=5)
    out["after_sync"] = trainer_mismatch(play(request1, 10))
    out["sync_bytes"] = stats["sync_bytes"]

    # the pitfall: new weights written under a new path but the OLD id -> vLLM keeps the old weights
    from vllm.lora.request import LoRARequest

    state = train.gather_lora_state(model)
    train.write_adapter(model, state, Path(shared) / "sync" / "reused")
    stale = LoRARequest("reused-id", request0.lora_int_id, str(Path(shared) / "sync" / "reused"))
    engine.llm_engine.add_lora(request0)  # the old adapter is still cached under that id
    out["reused_id"] = trainer_mismatch(play(stale, 20))
    results.put(out)
    import torch.distributed as dist
    dist.barrier()
    del engine


def test_engine_runs_the_current_policy_after_every_sync(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_sync_check, args=(str(tmp_path), results))
    proc.start()
    out = None
    for _ in range(120):  # bounded wait, and fail fast if the child died
        try:
            out = results.get(timeout=5)
            break
        except Exception:
            assert proc.is_alive(), f"sync check process died (exit code {proc.exitcode})"
    proc.join(timeout=60)
    assert out is not None, "sync check timed out"
    print("sync check:", out)
    assert out["before_update"] < 1e-3
    assert out["old_samples_after_update"] > 1e-2  # the update changed the policy
    assert out["after_sync"] < 1e-3  # ... and after the sync vLLM samples from the new one
    assert out["reused_id"] > 1e-2  # re-using an id would have kept the stale adapter
    assert out["sync_bytes"] > 0


# ----------------------------------------------------------------------------- end to end

def test_world_of_one_runs_logs_evaluates_checkpoints_exports(tmp_path):
    out = tmp_path / "run"
    # training rollouts with a tighter turn limit (2) than evaluation's (4)
    run_train(out, "--steps", "2", "--eval-interval", "2", "--ckpt-interval", "1", "--export-interval", "2",
              "--train-max-turns", "2")
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0 < m["episode_turns"] <= 2 for m in metrics)
    for key in ("reward_mean", "solve_rate", "episode_turns", "generated_tokens", "invalid_action_rate",
                "end_turn_limit", "zero_variance_group_frac", "clip_frac", "mismatch_abs_mean", "mismatch_k3",
                "grad_norm", "lr", "rollout_s", "logprobs_s", "update_s", "sync_s", "eval_s", "checkpoint_s",
                "tokens_per_s", "process_hours", "sync_bytes"):
        assert key in metrics[-1], key
    assert all(m["mismatch_abs_mean"] < 1e-3 for m in metrics)
    evals = json.loads((out / "eval" / "step_2.json").read_text())
    assert evals["total"] == 8 and len(evals["mazes"]) == 8 and "solve_rate" in evals
    assert max(m["turns"] for m in evals["mazes"]) > 2  # evaluation keeps its own limit
    assert (out / "eval" / "step_0.json").exists()
    assert (out / "checkpoints" / "latest").read_text() == "step_2"
    assert (out / "checkpoints" / "step_2" / "trainer_state.pt").exists()
    assert (out / "adapters" / "step_2" / "adapter_model.safetensors").exists()
    assert list((out / "tb").glob("events.out.tfevents.*"))
    # the export is an ordinary PEFT adapter
    from peft import PeftConfig

    assert PeftConfig.from_pretrained(str(out / "adapters" / "step_2")).r == 8


def test_two_processes(tmp_path):
    out = tmp_path / "run"
    # with GiGPO's step-level advantages, which stay on each rank (a group never spans ranks)
    run_train(out, "--steps", "2", "--eval-interval", "2", "--ckpt-interval", "2", "--step-adv-weight", "1",
              nproc=2)
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    assert metrics[-1]["num_groups"] == 2  # both ranks' groups in the global statistics
    assert all("step_adv_nonzero_frac" in m for m in metrics)
    assert all(m["mismatch_abs_mean"] < 1e-3 for m in metrics)
    assert json.loads((out / "eval" / "step_2.json").read_text())["total"] == 8
    assert (out / "checkpoints" / "step_2" / "meta.json").exists()
    assert (out / "adapters" / "step_2" / "adapter_config.json").exists()


def test_resume_gives_the_same_run(tmp_path):
    common = ["--eval-interval", "100", "--ckpt-interval", "2", "--temperature", "1.0"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_train(straight, "--steps", "4", *common)
    run_train(split, "--steps", "2", *common)
    proc = run_train(split, "--steps", "4", *common)
    assert "resumed from" in proc.stdout + proc.stderr
    a, b = read_metrics(straight), read_metrics(split)
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        assert x["maze_seeds"] == y["maze_seeds"]
        for key in ("reward_mean", "generated_tokens", "episode_turns", "invalid_action_rate", "mismatch_abs_mean"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-6), key


def test_half_written_checkpoints_are_never_loaded(tmp_path):
    root = tmp_path / "checkpoints"
    for name, complete in [("step_2", True), ("step_4", False), (".step_6.tmp-abc", True)]:
        (root / name).mkdir(parents=True)
        if complete:
            (root / name / "meta.json").write_text("{}")
    cfg = train.Config(out_dir=str(tmp_path))
    # no pointer: the newest COMPLETE checkpoint (temp dirs and dirs without meta.json are ignored)
    assert train.find_checkpoint(cfg, tmp_path) == root / "step_2"
    (root / "latest").write_text("step_4")  # a pointer to something incomplete is not trusted
    assert train.find_checkpoint(cfg, tmp_path) == root / "step_2"
    cfg.resume = "none"
    assert train.find_checkpoint(cfg, tmp_path) is None
    cfg.resume = str(root / "step_4")
    with pytest.raises(SystemExit, match="not a complete checkpoint"):
        train.find_checkpoint(cfg, tmp_path)


def test_bad_config_is_a_clear_error():
    with pytest.raises(SystemExit, match="prompts_per_step"):
        train.Config(prompts_per_step=3).validate(world_size=2)
    with pytest.raises(SystemExit, match="difficulty"):
        train.Config(difficulty="impossible").validate(world_size=1)
    with pytest.raises(SystemExit, match="train_max_turns"):
        train.Config(max_turns=15, train_max_turns=16).validate(world_size=1)
    with pytest.raises(SystemExit, match="train_pool"):
        train.Config(train_pool=-1).validate(world_size=1)
    cfg = train.parse_config(["--steps", "7", "--scale-adv-by-std", "false", "--lr", "0.5"])
    assert (cfg.steps, cfg.scale_adv_by_std, cfg.lr) == (7, False, 0.5)


# ----------------------------------------------------------------------------- per-turn advantages

def _fake_episode(group_id, reward, states, size=7):
    from types import SimpleNamespace

    return SimpleNamespace(group_id=group_id, reward=reward, num_turns=len(states), states=states,
                           maze=SimpleNamespace(size=size))


def test_turn_advantages_give_each_reply_its_turns_value():
    import torch

    import rollout

    # group 0: two episodes that both start on (1, 1). The first solves the maze in 2 turns, the
    # second bumps a wall on its first turn (stays on (1, 1)) and solves it in 3.
    episodes = [_fake_episode(0, 1.0, [(1, 1), (1, 2)]), _fake_episode(0, 1.0, [(1, 1), (1, 1), (1, 2)])]
    cfg = train.Config(step_adv_weight=0.5, gamma=0.5, scale_adv_by_std=False)
    # returns: episode 0: [0.5, 1]; episode 1: [0.25, 0.5, 1]. Anchors: (1, 1) holds 0.5, 0.25, 0.5
    # (mean 5/12), (1, 2) holds 1 and 1 (all equal: 0). Episode advantages (both solved): 0.
    step = {(0, 0): 0.5 - 5 / 12, (1, 0): 0.25 - 5 / 12, (1, 1): 0.5 - 5 / 12}
    # episode 0 as one full-history sequence: prompt, reply, prompt, reply (the mask shows them)
    full = rollout.Sequence([9] * 10, [0, 0, 1, 1, 0, 0, 0, 1, 1, 1], [0.0] * 10, [])
    # episode 1 with one sequence per turn
    per_turn = [rollout.Sequence([9] * 4, [0, 0, 1, 1], [0.0] * 4, []) for _ in range(3)]
    rows, stats = train.turn_advantages(cfg, episodes, torch.tensor([0.0, 0.0]), [full, *per_turn], [0, 1, 1, 1])
    w = cfg.step_adv_weight
    expected_full = [0, 1, 1, 0, 0, 0, 0, 0, 0]  # targets are shifted: token j sits at position j - 1
    expected_full = [w * step[(0, 0)] if x else 0.0 for x in expected_full]  # turn 1's anchor is all-equal
    torch.testing.assert_close(rows[0], torch.tensor(expected_full), atol=1e-6, rtol=0)
    for turn, row in enumerate(rows[1:]):
        value = w * step.get((1, turn), 0.0)
        torch.testing.assert_close(row, torch.tensor([0.0, value, value]), atol=1e-6, rtol=0)
    assert stats["step_adv_nonzero_frac"] == 3 / 5
    # the bump (episode 1, turn 0) is worse than moving on from the same cell
    assert rows[1][1] < 0 < rows[0][1]


def test_turn_advantages_add_the_episode_advantage():
    import torch

    import rollout

    episodes = [_fake_episode(3, 1.0, [(1, 1)]), _fake_episode(3, 0.0, [(5, 5)])]  # no shared state
    cfg = train.Config(step_adv_weight=1.0)
    seqs = [rollout.Sequence([9] * 3, [0, 1, 1], [0.0] * 3, []) for _ in episodes]
    rows, stats = train.turn_advantages(cfg, episodes, torch.tensor([0.7, -0.7]), seqs, [0, 1])
    torch.testing.assert_close(torch.stack(rows), torch.tensor([[0.7, 0.7], [-0.7, -0.7]]))
    assert stats["step_adv_nonzero_frac"] == 0.0


# ----------------------------------------------------------------------------- the update's shortcuts

def _update_check(results):
    """In a fresh process: the single-pass update that skips zero-advantage sequences computes
    the same LoRA gradient as running every sequence against separately computed old logprobs."""
    import random

    import torch
    from transformers import AutoProcessor, GenerationConfig

    import env
    import grpo
    import rollout
    import sft
    from launch.make_tiny_model import ensure_tiny_model

    train.init_distributed()
    model_path = str(ensure_tiny_model())
    cfg = train.Config(lora_rank=8, lora_alpha=16, micro_batch_size=2, max_grad_norm=1e9)
    torch.manual_seed(0)
    model = train.build_policy(cfg, model_path, world_size=1)
    params = [p for _, p in train.lora_parameters(model)]
    with torch.no_grad():  # move off the B = 0 init, so the adapter's A matrices get gradients too
        for p in params:
            p.add_(0.05 * torch.randn_like(p))
    processor = AutoProcessor.from_pretrained(model_path)
    eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    chat = rollout.ChatFormat(processor, eos)
    replies = {a: chat._ids(f"<answer>{a}</answer>") + [eos[0]] for a in env.ACTION_STRINGS}
    sequences = [sft.demonstration(env.generate_maze(7, seed=1_000_000 + i), chat, replies, random.Random(i),
                                   max_turns=4, max_images=None, cell_px=32, noise=0.5)[0] for i in range(4)]
    batch = train.Batch(sequences, processor)
    advantages = torch.tensor([1.0, 0.0, -0.5, 0.0])

    class Recorder:  # stands in for the optimizer and scheduler: keeps the gradient of each step
        grads = []

        def zero_grad(self, set_to_none=True):
            for p in params:
                p.grad = None

        def step(self):
            self.grads.append([p.grad.full_tensor().clone() if p.grad is not None else torch.zeros(p.shape)
                               for p in params])

        def get_last_lr(self):
            return [0.0]

    rec = Recorder()
    stats = train.grpo_update(cfg, model, rec, rec, params, batch, advantages, [0, 1, 2, 3], None, {}, 4,
                              torch.device("cpu"))
    old, _, _ = train.old_logprobs(cfg, model, batch, torch.device("cpu"))
    train.grpo_update(cfg, model, rec, rec, params, batch, advantages, [0, 1, 2, 3], old, {}, 4, torch.device("cpu"))
    # by hand: every sequence, normalised by all response tokens
    rec.zero_grad()
    inputs, mask, _ = batch.micro([0, 1, 2, 3], torch.device("cpu"))
    lp = train.sequence_logprobs(model, inputs)
    loss, _ = grpo.policy_loss(lp, lp.detach(), advantages, mask)
    loss.backward()
    rec.step()
    out = {"trained_sequence_frac": stats["trained_sequence_frac"],
           "grad_norm": sum(g.norm() ** 2 for g in rec.grads[2]).sqrt().item(),
           "single_vs_two_pass": max((a - b).abs().max().item() for a, b in zip(rec.grads[0], rec.grads[1])),
           "single_vs_by_hand": max((a - b).abs().max().item() for a, b in zip(rec.grads[0], rec.grads[2]))}
    results.put(out)


def test_single_pass_update_that_skips_zero_advantages_has_the_full_gradient():
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_update_check, args=(results,))
    proc.start()
    out = results.get(timeout=240)
    proc.join(timeout=60)
    print("update check:", out)
    assert out["trained_sequence_frac"] == 0.5  # the two zero-advantage sequences were not run
    assert out["grad_norm"] > 1e-4  # a real gradient, not zeros everywhere
    assert out["single_vs_two_pass"] < 1e-6 * max(1.0, out["grad_norm"])
    assert out["single_vs_by_hand"] < 1e-6 * max(1.0, out["grad_norm"])
