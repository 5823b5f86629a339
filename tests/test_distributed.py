"""The process group's rule: every collective's tensor travels on the backend of its own device."""

import multiprocessing

import pytest
import torch
import torch.distributed as dist

import distributed


def test_the_gpu_group_covers_both_devices_and_the_cpu_group_its_own():
    gpu = dict(dist.BackendConfig(distributed.backend(True)).get_device_backend_map())
    assert gpu == {"cpu": "gloo", "cuda": "nccl"}  # CPU tensors over gloo, CUDA ones over NCCL
    assert dict(dist.BackendConfig(distributed.backend(False)).get_device_backend_map())["cpu"] == "gloo"
    # what an NCCL-only group would be: nothing for CPU tensors, which the trainer all-reduces
    assert "cpu" not in dict(dist.BackendConfig("nccl").get_device_backend_map())


def test_on_a_gpu_the_group_is_made_split_and_bound_to_the_device(monkeypatch):
    """torch.distributed stood in for (this machine has no GPU), each stand-in taking only the
    arguments torch 2.13's function takes; the backend string is parsed as init_process_group
    parses it (dist.BackendConfig, distributed_c10d.py), which refuses a malformed one."""
    from stand_ins import called_as

    calls = {}

    def init_process_group(backend=None, **kw):
        dist.BackendConfig(backend)
        calls.update(backend=backend, **kw)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", called_as(torch.cuda.set_device, lambda i: calls.setdefault("device", i)))
    monkeypatch.setattr(dist, "init_process_group", called_as(dist.init_process_group, init_process_group))
    monkeypatch.setattr(dist, "get_rank", called_as(dist.get_rank, lambda: 3))
    monkeypatch.setattr(dist, "get_world_size", called_as(dist.get_world_size, lambda: 4))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.init_distributed() == (3, 4, 1)
    assert calls == {"device": 1, "backend": "cpu:gloo,cuda:nccl", "device_id": torch.device("cuda", 1)}


def _record_collectives(model_dir: str, results):
    """A world of one running the trainer's own code paths with every collective recorded."""
    import grpo
    import policy
    import update
    import rollout
    import tis
    import sft
    import train

    distributed.init_distributed()
    seen = []

    def recording(name, fn):
        def wrapper(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
            seen.append((name, sorted({t.device.type for t in tensors}) or ["object"]))
            return fn(*args, **kwargs)
        return wrapper

    for name in ("all_reduce", "all_gather", "broadcast", "barrier", "all_gather_object", "broadcast_object_list"):
        setattr(dist, name, recording(name, getattr(dist, name)))
    cfg = train.Config(lora_rank=8, lora_alpha=16, micro_batch_size=2)
    model = policy.build_policy(cfg, model_dir)
    chat = rollout.ChatFormat.for_model(model_dir)
    seqs = sft.demonstrations(chat, 3, max_turns=4)
    experiences = [grpo.Experience(s, torch.tensor(s.response_mask[1:], dtype=torch.float32) * (1 - i), i)
                   for i, s in enumerate(seqs)]
    optimizer = update.make_optimizer(model, 1e-3)
    update.grpo_update(cfg, model, optimizer, update.make_scheduler(optimizer, cfg),
                       policy.Batch(seqs, chat.processor, model), experiences, 3, torch.device("cpu"),
                       reweight=tis.TruncatedIS(cfg.tis_cap))
    distributed.mean_over_ranks({"a": 1.0})
    distributed.broadcast_object("x")
    distributed.all_gather_objects(1)
    results.put({"seen": seen, "routes": dict(dist.BackendConfig(dist.get_backend()).get_device_backend_map())})


@pytest.mark.slow
def test_every_collective_of_an_update_goes_where_its_backend_is(tiny_model):
    """The trainer's update and metrics issue collectives on CPU tensors (counts, sums, maxima)
    and objects; each one's device has a backend in the group (on a GPU: gloo for these, NCCL for
    FSDP's CUDA tensors)."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_record_collectives, args=(str(tiny_model), results))
    proc.start()
    out = results.get(timeout=300)
    proc.join(timeout=60)
    seen, routes = out["seen"], out["routes"]
    names = {name for name, _ in seen}
    assert {"all_reduce", "broadcast_object_list", "all_gather_object"} <= names, seen
    devices = {d for _, ds in seen for d in ds if d != "object"}
    assert devices == {"cpu"}  # the trainer's own collectives: CPU tensors only, whatever the machine
    assert all(d in routes for d in devices)
    gpu_routes = dict(dist.BackendConfig(distributed.backend(True)).get_device_backend_map())
    assert all(d in gpu_routes for d in devices), "on a GPU these would have no backend"
    with pytest.raises(AssertionError):  # the counter-example: an NCCL-only group leaves them stranded
        assert all(d in dict(dist.BackendConfig("nccl").get_device_backend_map()) for d in devices)
