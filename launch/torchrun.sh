#!/usr/bin/env bash
# Start train.py on THIS node with torchrun: one process per GPU (or one CPU slice each).
# Every argument goes to train.py. Run it once per node; the nodes find each other through a
# c10d rendezvous (a TCP store hosted by one node's torchrun), so no Ray and no operator.
#
#   bash launch/torchrun.sh --steps 40                       # one node, all its GPUs (CPU: 1 process)
#   NNODES=2 NODE_RANK=0 RDZV_ENDPOINT=node0:29400 bash launch/torchrun.sh --out-dir /nfs/run --shared-dir /nfs/run/shared
#   NNODES=2 NODE_RANK=1 RDZV_ENDPOINT=node0:29400 bash launch/torchrun.sh --out-dir /nfs/run --shared-dir /nfs/run/shared
#
# Settings, from the environment (launch/slurm.sbatch and launch/k8s/ fill them in):
#   NNODES          nodes in the job (default 1: a private rendezvous, torchrun --standalone)
#   NPROC_PER_NODE  processes on this node (default: every GPU torchrun sees; without a GPU, 1)
#   RDZV_ENDPOINT   host:port every node can reach, normally the first node (needed if NNODES > 1)
#   RDZV_ID         the job's id, the same on every node (default grpo-maze)
#   NODE_RANK       0 on the node named in RDZV_ENDPOINT: it hosts the rendezvous store (torchrun
#                   ranks the nodes itself). Unset: torchrun guesses from the endpoint's host name.
#   MAX_RESTARTS    worker restarts after a failure (default 0: fail fast); the restarted
#                   train.py resumes from <out-dir>/checkpoints/latest, so a crash costs the
#                   steps since the last checkpoint (--ckpt-interval) plus one start-up
#   GRACE_S         seconds torchrun gives its workers after a stop signal before SIGKILL (default
#                   30, torchrun's own). On SIGTERM, SIGINT or SIGUSR1 (forwarded to every worker)
#                   train.py checkpoints its last completed step and exits (rundir.StopRequest);
#                   set this, and the scheduler's grace period above it, longer than a step
#   PYTHON          interpreter (default .venv/bin/python, else python3)
#   DRY_RUN=1       print the command instead of running it
# It runs from the repository root: relative paths in the arguments are relative to that.
set -euo pipefail
cd "$(dirname "$0")/.."

NNODES="${NNODES:-1}"
RDZV_ENDPOINT="${RDZV_ENDPOINT:-}"
RDZV_ID="${RDZV_ID:-grpo-maze}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

# grep -c reads all of nvidia-smi's output (grep -q could exit early, and pipefail would see SIGPIPE)
gpus="$( (nvidia-smi -L 2>/dev/null || true) | grep -c "^GPU" || true)"
if [ "$gpus" -gt 0 ]; then
  # GPU: one process per visible GPU (torchrun's "gpu" counts them, CUDA_VISIBLE_DEVICES included);
  # NCCL and vLLM need nothing from us here. Each process gets its share of the cores for its
  # CPU work (image preprocessing, the env); torchrun alone would give each one thread.
  NPROC_PER_NODE="${NPROC_PER_NODE:-gpu}"
  per_node="$([ "$NPROC_PER_NODE" = gpu ] && echo "$gpus" || echo "$NPROC_PER_NODE")"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / per_node > 0 ? $(nproc) / per_node : 1 ))}"
else
  # CPU: the processes share the cores, so split them instead of each taking all of them
  # (torchrun alone would set 1 thread per process). vLLM's CPU backend sizes its KV cache from
  # VLLM_CPU_KVCACHE_SPACE (GiB, per process) and must not pin its threads to cores that the
  # other processes on this node use.
  NPROC_PER_NODE="${NPROC_PER_NODE:-1}"
  cores="$(nproc)"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores / NPROC_PER_NODE > 0 ? cores / NPROC_PER_NODE : 1 ))}"
  export VLLM_TARGET_DEVICE="${VLLM_TARGET_DEVICE:-cpu}"
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
  export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}"
fi

# torchrun forwards the signals it handles to its workers, then waits GRACE_S before SIGKILL.
# SIGUSR1 (Slurm's --signal=USR1@<s>, launch/slurm.sbatch) is not among its defaults: without
# it, torchrun itself would die of it and leave the workers no time. It goes in as a flag:
# torchrun overwrites TORCHELASTIC_SIGNALS_TO_HANDLE with its --signals-to-handle, default or not.
signals="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${GRACE_S:-${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-30}}"
# A store of its own for every torchrun attempt. By default torchrun's agent hosts one store for
# the whole job and gives every restart of the workers the same MASTER_PORT; their process groups
# write the same keys into it each time (a rank's gloo address, NCCL's unique id), so a restarted
# rank that looks before its peer has written reads the dead attempt's value: "Gloo
# connectFullMesh failed ... Connection refused", or a hang (issue 58; torch's env:// handler
# assumes a new store per attempt, rendezvous.py, which the agent does not make). With sharing
# off, every rendezvous round publishes a fresh port to every node and global rank 0 hosts a new
# store there. (A prefix per TORCHELASTIC_RESTART_COUNT would not do: each node's agent counts
# only its own failures, so after one node's failure the nodes would disagree.)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

# torchrun itself, through launch/torchrun_main.py: a stop signal ends it with status 128 + signal
# (what Slurm and Kubernetes read), not with torchrun's SignalException traceback and status 1
cmd=("$PYTHON" launch/torchrun_main.py --nproc-per-node "$NPROC_PER_NODE" --max-restarts "$MAX_RESTARTS"
     --signals-to-handle "$signals")
if [ "$NNODES" = 1 ] && [ -z "$RDZV_ENDPOINT" ]; then
  cmd+=(--standalone)  # a rendezvous on a free local port (torchrun's --master-port 0 hangs)
else
  if [ -z "$RDZV_ENDPOINT" ]; then
    echo "launch/torchrun.sh: NNODES=$NNODES needs RDZV_ENDPOINT=host:port (a host every node reaches)" >&2
    exit 2
  fi
  cmd+=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID")
  if [ -n "${NODE_RANK:-}" ]; then
    # Say which node hosts the store rather than have every node guess from host names
    # (a guess fails behind aliases and load balancers).
    cmd+=(--rdzv-conf "is_host=$([ "$NODE_RANK" = 0 ] && echo 1 || echo 0)")
  fi
fi
cmd+=(train.py "$@")

if [ "${DRY_RUN:-0}" = 1 ]; then
  [ -n "${OMP_NUM_THREADS:-}" ] && echo "OMP_NUM_THREADS=$OMP_NUM_THREADS"
  echo "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=$TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
  echo "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=$TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
exec "${cmd[@]}"
