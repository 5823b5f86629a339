"""The process group and the few collectives the trainer uses outside FSDP.

    torchrun --nproc-per-node 8 train.py   # torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, ...
    python train.py                        # no torchrun: a world of one on this machine

The rule every collective follows: **a tensor travels on the backend of its own device.** On a
GPU the default group is created with a split backend, "cpu:gloo,cuda:nccl": a CUDA tensor goes
over NCCL, a CPU tensor (a token count, a metrics vector, a pickled object) over gloo. NCCL has
no CPU collectives at all, so with an NCCL-only group every all_reduce of a CPU tensor would die
("No backend type associated with device type cpu"), in a world of one too. With the split
backend no call site has to remember which device its tensor lives on. (vLLM's external_launcher
engines reuse this process group; they make their own NCCL and gloo subgroups, and their only
cross-rank collectives run while the engines are built, which every rank does at the same point.)
"""

import os
import socket
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm


def backend(on_gpu: bool) -> str:
    """The default group's backend: both devices covered on a GPU, gloo alone on a CPU."""
    return "cpu:gloo,cuda:nccl" if on_gpu else "gloo"


def init_distributed() -> tuple[int, int, int]:
    """torchrun sets RANK/WORLD_SIZE/...; plain `python train.py` becomes a world of one."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    check_restarts_can_meet()
    on_gpu = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    if on_gpu:
        torch.cuda.set_device(local_rank)
        # device_id binds the group to this GPU (NCCL set up now, not at the first collective)
        dist.init_process_group(backend(on_gpu), device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group(backend(on_gpu))
    return dist.get_rank(), dist.get_world_size(), local_rank


def check_restarts_can_meet():
    """Refuses a torchrun that restarts workers into the store it shares across attempts.

    By default torchrun's agent hosts one store for the whole job and hands every attempt the same
    MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True), and each attempt's process group writes the
    same keys into it (a rank's gloo address, NCCL's unique id). A restarted rank that looks before
    its peer has written reads the dead attempt's value and fails to connect, or hangs (issue 58).
    launch/torchrun.sh turns the sharing off, so that every attempt gets a store of its own."""
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(os.environ.get("WORLD_SIZE", "1")) > 1
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0):
        raise SystemExit("torchrun restarts workers here into the store its agent shares across attempts, where a "
                         "restarted rank can read a dead one's address and never connect: start it with "
                         "launch/torchrun.sh, or export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun")


DOWNLOAD_TIMEOUT_S = 4 * 3600  # how long the other ranks wait while local rank 0 downloads the model


def wait_on_cpu(timeout_s: float = DOWNLOAD_TIMEOUT_S):
    """A barrier over gloo with a stated timeout, for waits that are not GPU work (a download by
    one rank). A plain barrier on a GPU runs over NCCL, whose watchdog ends the job after its
    10-minute default: a first run on a node without the model cached would not survive it."""
    from datetime import timedelta

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    dist.barrier(group=group)
    dist.destroy_process_group(group)


def shard_group_size(requested: int = 0) -> int:
    """Processes that share one copy of the policy (FSDP shards within, replicas across groups).

    Default: the processes of one node (torchrun's LOCAL_WORLD_SIZE), i.e. HSDP: parameters are
    all-gathered over the fast links inside a node and only gradients cross between nodes.
    1 replicates the whole policy on every process (only gradients are all-reduced), which is
    what a model as small as the tiny one wants."""
    world = dist.get_world_size()
    size = requested or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if size < 1 or world % size:
        raise SystemExit(f"shard group size {size} must divide the number of processes ({world})")
    return size


def log0(*args):
    if dist.get_rank() == 0:
        tqdm.write(" ".join(str(a) for a in args))


def broadcast_object(obj):
    """Rank 0's `obj` on every rank (a pickled object: over gloo, per the rule above)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_rank0(fn, errors=(SystemExit,), prefix: str = ""):
    """`fn()` on rank 0 only, its result on every rank. If it raises one of `errors`, every rank
    stops with its one line (after `prefix`), not rank 0 alone while the others wait in the next
    collective. Collective."""
    result = error = None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except errors as e:
            error = f"{prefix}{e}"
    error, result = broadcast_object((error, result))
    if error:
        raise SystemExit(error)
    return result


def all_gather_objects(obj) -> list:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def sum_over_ranks(values: list[float]) -> list[float]:
    x = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(x)
    return x.tolist()


def max_over_ranks(value: float) -> float:
    x = torch.tensor(float(value), dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x.item()


def mean_over_ranks(metrics: dict) -> dict:
    """Average every metric over ranks (each rank holds the same number of episodes)."""
    keys = sorted(metrics)
    values = sum_over_ranks([float(metrics[k]) for k in keys])
    return {k: v / dist.get_world_size() for k, v in zip(keys, values)}


def check_shared_dir(shared: Path, write_text):
    """Rank 0 writes a fresh token; every rank must read it back, or the dir is not shared."""
    token = broadcast_object(uuid.uuid4().hex if dist.get_rank() == 0 else None)
    marker = shared / "shared_dir_check.txt"
    if dist.get_rank() == 0:
        write_text(marker, token)
    dist.barrier()
    ok = marker.exists() and marker.read_text() == token
    bad = [host for ok, host in all_gather_objects((ok, socket.gethostname())) if not ok]
    if bad:
        raise SystemExit(f"shared_dir {shared} is not shared: nodes {sorted(set(bad))} cannot see what "
                         "rank 0 wrote there. Point --shared-dir at a filesystem every node mounts.")
