"""One GRPO update on a fixed batch, in a world of one or under torchrun (tests/test_policy.py).

    python tests/update_worker.py <model dir> <out.pt>
    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/update_worker.py <model dir> <out.pt>

Eight episodes in four groups of two (demonstrations of four training mazes, with detours, and
made-up rewards); with two ranks each rank holds two whole groups (as in training, where a rank
plays all of a group's members), rank 1 the longer ones. The update runs
through update.grpo_update exactly as in training; the gradient it hands the optimizer is saved.
"""

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import rollout  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import distributed  # noqa: E402
import env  # noqa: E402
import gigpo  # noqa: E402
import grpo  # noqa: E402
import policy  # noqa: E402
import update  # noqa: E402
import sft  # noqa: E402
import tis  # noqa: E402
import train  # noqa: E402
from tasks.maze import MazeTask  # noqa: E402


def main(model_dir: str, out: str):
    rank, world, _ = distributed.init_distributed()
    cfg = train.Config(lora_rank=8, lora_alpha=16, micro_batch_size=2, max_grad_norm=1e9, tis_cap=2.0,
                       step_adv_weight=0.0)
    from transformers import Qwen3VLForConditionalGeneration

    reads, read = [0], Qwen3VLForConditionalGeneration.from_pretrained  # who reads the checkpoint

    def counted(cls, *args, **kwargs):
        reads[0] += 1
        return read(*args, **kwargs)

    Qwen3VLForConditionalGeneration.from_pretrained = classmethod(counted)
    model = policy.build_policy(cfg, model_dir)
    checkpoint_reads = distributed.all_gather_objects(reads[0])
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # LoRA B off zero, the same on every rank (every rank draws all of it)
        for _, p in policy.lora_parameters(model):
            full = 0.05 * torch.randn(p.shape, generator=gen)
            if hasattr(p, "to_local"):
                from torch.distributed.tensor import distribute_tensor

                p.copy_(distribute_tensor(full, p.device_mesh, p.placements))
            else:
                p.add_(full)
    chat = rollout.ChatFormat.for_model(model_dir)
    stream = env.TrainingStream(MazeTask, "small")
    mazes = [stream.next().maze for _ in range(4)]
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]  # group 2 all solved: advantage 0
    episodes = []
    for i in range(8):  # episode i: group i // 2, member i % 2
        maze = mazes[i // 2]
        # lengths that differ between the ranks' halves (rank 0 gets groups 0 and 1), so that
        # normalising by a rank's own token count instead of the global one changes the gradient
        task = MazeTask.of(maze, max_turns=4 + 2 * (i % 2) + i // 2)
        e = rollout.Episode(task=task, group_id=i // 2, sample_id=i)
        e.sequences = sft.demonstration(task, chat, random.Random(i), max_images=None, noise=0.5)
        # a made-up sampling logprob per reply token, so truncated importance sampling has work to do
        lp = torch.Generator().manual_seed(100 + i)
        for s in e.sequences:
            s.rollout_logprobs = [(-0.1 * torch.rand(1, generator=lp).item()) if m else 0.0 for m in s.response_mask]
        e.turns = [rollout.Turn(text="", image=None, key=maze.start, reply_ids=[], reply="x")
                   for _ in range(grpo.reply_count(e.sequences[0].response_mask))]
        e.reward = rewards[i]
        episodes.append(e)
    mine = [e for e in episodes if e.group_id // (4 // world) == rank]  # whole groups per rank
    advantages, _ = grpo.group_advantages(torch.tensor([e.reward for e in mine]),  # reported below
                                          torch.tensor([e.group_id for e in mine]))
    turn_advantages, _ = grpo.episode_advantages(mine, scale_by_std=cfg.scale_adv_by_std)
    gigpo.add_step_term(turn_advantages, mine, cfg.step_adv_weight, cfg.gamma, cfg.scale_adv_by_std)
    experiences = grpo.to_experiences(mine, turn_advantages)
    batch = policy.Batch([x.sequence for x in experiences], chat.processor, model)

    names = [n for n, _ in policy.lora_parameters(model)]
    saved = {}

    class Recorder:  # the optimizer and scheduler: keep the gradient grpo_update produced
        param_groups = [{"params": [p for _, p in policy.lora_parameters(model)]}]

        def zero_grad(self, set_to_none=True):
            for p in self.param_groups[0]["params"]:
                p.grad = None

        def step(self):
            for n, p in zip(names, self.param_groups[0]["params"]):
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                saved[n] = g.detach().clone()

        def get_last_lr(self):
            return [0.0]

    rec = Recorder()
    update.grpo_update(cfg, model, rec, rec, batch, experiences, len(mine), torch.device("cpu"),
                       reweight=tis.TruncatedIS(cfg.tis_cap))
    all_adv = distributed.all_gather_objects([(e.sample_id, float(a)) for e, a in zip(mine, advantages)])
    sequences = int(distributed.sum_over_ranks([len(experiences)])[0])
    if rank == 0:
        torch.save({"grads": saved, "world": world, "sequences": sequences, "checkpoint_reads": checkpoint_reads,
                    "advantages": [a for _, a in sorted(p for part in all_adv for p in part)]}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
