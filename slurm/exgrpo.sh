#!/bin/bash
# ExGRPO on a Slurm GPU cluster: a dry run on one rank, then one srun with one process per GPU.
#
#   sbatch slurm/exgrpo.sh --config-name exgrpo_1_5b [hydra overrides ...]
#   PRESET=exgrpo_llama8b sbatch --nodes=2 slurm/exgrpo.sh trainer.total_steps=300
#   sbatch slurm/exgrpo.sh --max-staleness 1 --config-name exgrpo_1_5b   # generate one step ahead
#   sbatch slurm/exgrpo_7b.sh                     # the paper's recipe (PRESET=exgrpo_7b)
#
# Submit from the repository root: Slurm runs a copy of this file from its spool directory, so the
# repository is found through $SLURM_SUBMIT_DIR (or REPO_DIR). Arguments after the optional
# `--config-name NAME` are Hydra overrides, passed unchanged to the dry run and to training (they
# come after this script's own overrides, so they win).
#
# Generating ahead: `--max-staleness N` (before --config-name, or MAX_STALENESS=N; N > 0) passes
# rollout.max_staleness=N and algo.fresh_is_cap=2.0 (a user override of the cap comes later and wins) and
# starts GPUS_PER_NODE-1 training tasks per node: the generator process, which the trainer's global rank 0
# starts on node 0 (rollout.generator.device=auto = cuda:<LOCAL_WORLD_SIZE>, exported here), gets node 0's
# last GPU. Every task sees all the node's GPUs (--gpus-per-node, no per-task binding). This release runs
# one generator: the last GPU of every other node stays idle. The training world is NNODES x
# (GPUS_PER_NODE-1) ranks, which the dry run validates: it must divide by TP x PP x CP and the batch sizes
# by DP (exgrpo_7b at TP=2 needs an even node count and e.g. trainer.train_batch_size=112
# trainer.ppo_mini_batch_size=56 on 2 nodes). Requeue and resume are unchanged: the checkpoint holds the
# rollouts in flight, and the staleness itself may not change on resume.
#
# Optional environment:
#   PRESET           conf/<PRESET>.yaml when no --config-name is given (default exgrpo_7b)
#   RUN_NAME         run directory name; default <PRESET>-<job id>. The job id survives a requeue,
#                    so the requeued job finds its checkpoints; set RUN_NAME to continue an older run
#   RUN_ROOT         parent of run directories (default $REPO_DIR/runs)
#   GPUS_PER_NODE    default 8 (keep equal to --ntasks-per-node / --gpus-per-node below)
#   MAX_STALENESS    as --max-staleness (default 0: generate, then train, on every GPU)
#   VENV             a virtualenv to activate first (e.g. $REPO_DIR/.venv)
#   PYTHON           the interpreter (default: python on PATH, after VENV activation)
#   CONTAINER_IMAGE  run every srun step in this pyxis/enroot image; the repository is mounted at the
#                    same path; CONTAINER_MOUNTS adds comma-separated src:dst mounts (data, models)
#   EXGRPO_MASTER_ADDR / EXGRPO_MASTER_PORT   override the rendezvous (slurm/env.sh)
#   REQUEUE_EXIT_CODE  override the trainer's save-and-requeue exit code
#
# Time limit and requeue: Slurm sends SIGUSR1 to every training process 300 s before the limit
# (--signal=USR1@300, no B: so the tasks get it); the trainer saves a checkpoint at the next step
# boundary and exits with REQUEUE_EXIT_CODE (exgrpo_megatron/distributed/preemption.py); this script
# then runs `scontrol requeue`, and the requeued job (same job id, so same RUN_NAME) resumes with
# checkpoint.resume=auto. Preemption is requeued by Slurm (--requeue) and resumes the same way.
# Save-and-requeue by hand: `scancel --signal=USR1 <job id>`; stop for good: `scancel <job id>`.
#
#SBATCH --job-name=exgrpo
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
#SBATCH --error=%x-%j.err

set -euo pipefail

: "${SLURM_JOB_ID:?submit this script with sbatch (SLURM_JOB_ID is not set)}"
REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$REPO_DIR"
# shellcheck source-path=SCRIPTDIR source=env.sh disable=SC1091
source "$REPO_DIR/slurm/env.sh"

PRESET=${PRESET:-exgrpo_7b}
MAX_STALENESS=${MAX_STALENESS:-0}
while true; do
  case ${1:-} in
    --config-name) PRESET=${2:?--config-name needs a preset name}; shift 2 ;;
    --config-name=*) PRESET=${1#--config-name=}; shift ;;
    --max-staleness) MAX_STALENESS=${2:?--max-staleness needs a number of steps}; shift 2 ;;
    --max-staleness=*) MAX_STALENESS=${1#--max-staleness=}; shift ;;
    *) break ;;
  esac
done
if ! [[ $MAX_STALENESS =~ ^[0-9]+$ ]]; then
  echo "[exgrpo] --max-staleness / MAX_STALENESS: '$MAX_STALENESS' is not a non-negative integer" >&2
  exit 2
fi
MAX_STALENESS=$((10#$MAX_STALENESS))
for arg in "$@"; do
  if [[ $arg =~ ^\+{0,2}rollout\.max_staleness= ]]; then
    echo "[exgrpo] $arg: use --max-staleness N (or MAX_STALENESS=N), which also leaves the generator a GPU" >&2
    exit 2
  fi
done

if [[ -n ${VENV:-} ]]; then
  # shellcheck disable=SC1091  # the virtualenv exists only on the cluster
  source "$VENV/bin/activate"
fi
PYTHON=${PYTHON:-python}

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${SLURM_NNODES:-1}
TASKS_PER_NODE=$GPUS_PER_NODE
staleness_overrides=()
if ((MAX_STALENESS > 0)); then
  TASKS_PER_NODE=$((GPUS_PER_NODE - 1))   # node 0's last GPU: the generator (auto device); elsewhere idle
  if ((TASKS_PER_NODE < 1)); then
    echo "[exgrpo] --max-staleness needs GPUS_PER_NODE >= 2 (one for the generator)" >&2
    exit 2
  fi
  export LOCAL_WORLD_SIZE=$TASKS_PER_NODE
  staleness_overrides=("rollout.max_staleness=$MAX_STALENESS" "algo.fresh_is_cap=2.0")
fi
NUM_TASKS=$((NNODES * TASKS_PER_NODE))
RUN_NAME=${RUN_NAME:-${PRESET}-${SLURM_JOB_ID}}
RUN_ROOT=${RUN_ROOT:-$REPO_DIR/runs}
RUN_DIR=$RUN_ROOT/$RUN_NAME
JOB_LOG_DIR=$RUN_DIR/slurm/job-${SLURM_JOB_ID}-restart-${SLURM_RESTART_COUNT:-0}
mkdir -p "$JOB_LOG_DIR"

# --- rendezvous: MASTER_ADDR = first node, MASTER_PORT per job (slurm/env.sh) ---------------------
exgrpo_export_dist_env

# --- GPU / NCCL environment -------------------------------------------------------------------
# One hardware work queue per GPU, so megatron's tensor/sequence-parallel communication kernels run
# in the order they are issued (megatron requires it for sequence parallelism with comm overlap).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# A failed or timed-out collective aborts the process instead of hanging until the time limit;
# srun --kill-on-bad-exit then ends the whole step.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# Let NCCL free its buffers when the stream is done with them (less fragmentation next to vLLM).
export TORCH_NCCL_AVOID_RECORD_STREAMS=${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}
# WARN by default; NCCL_DEBUG=INFO prints the rings/transports chosen (IB vs sockets) for debugging.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# Cluster-specific and left to the site environment: NCCL_SOCKET_IFNAME (bootstrap NIC),
# NCCL_IB_HCA (InfiniBand adapters). PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is NOT set:
# vLLM's sleep mode (its own CUDA memory pool) refuses to run with expandable segments.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}    # CPU threads per rank (reward workers are processes)
export TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}      # compute nodes read local files only
export PYTHONUNBUFFERED=1

srun_container=()
if [[ -n ${CONTAINER_IMAGE:-} ]]; then
  srun_container=(--container-image="$CONTAINER_IMAGE" --container-workdir="$REPO_DIR"
    --container-mounts="$REPO_DIR:$REPO_DIR${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}")
fi

overrides=("logging.run_dir=$RUN_DIR" "checkpoint.resume=auto" "${staleness_overrides[@]}" "$@")
REQUEUE_EXIT_CODE=${REQUEUE_EXIT_CODE:-$(exgrpo_requeue_exit_code "$REPO_DIR")}

{
  echo "[exgrpo] job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: preset $PRESET on $NNODES node(s) x $GPUS_PER_NODE GPUs, $TASKS_PER_NODE training task(s) per node (max staleness $MAX_STALENESS)"
  echo "[exgrpo] run dir $RUN_DIR; master $MASTER_ADDR:$MASTER_PORT; requeue exit code $REQUEUE_EXIT_CODE"
  echo "[exgrpo] overrides: ${overrides[*]}"
} | tee "$JOB_LOG_DIR/launch.txt"

# --- 1. dry run on one rank: validate the config at the real world size, print the plan ----------
dry_rc=0
srun --nodes=1 --ntasks=1 --ntasks-per-node=1 "${srun_container[@]}" \
  "$PYTHON" -m exgrpo_megatron.train --config-name "$PRESET" --dry-run --world-size "$NUM_TASKS" \
  "${overrides[@]}" | tee "$JOB_LOG_DIR/dry_run.txt" || dry_rc=$?
if ((dry_rc == 3)); then
  echo "[exgrpo] dry run: the memory plan does not fit one GPU (exit 3, the WARNING lines above): training not started" >&2
  exit "$dry_rc"
elif ((dry_rc != 0)); then
  echo "[exgrpo] dry run failed (exit $dry_rc): invalid configuration, training not started" >&2
  exit "$dry_rc"
fi

# --- 2. training: one task per GPU (the generator's excepted); ranks from SLURM_PROCID/NTASKS/LOCALID ---
srun --nodes="$NNODES" --ntasks="$NUM_TASKS" --ntasks-per-node="$TASKS_PER_NODE" --kill-on-bad-exit=1 --label \
  "${srun_container[@]}" \
  "$PYTHON" -m exgrpo_megatron.train --config-name "$PRESET" "${overrides[@]}" &
srun_pid=$!

# A signal sent to this batch shell is passed on to srun, which forwards it to every task. TERM
# reaches the batch shell only on scancel, preemption or the hard time limit: then the job is not
# requeued by this script (Slurm itself requeues preempted jobs, --requeue).
terminated=0
# shellcheck disable=SC2317,SC2329  # reached through the traps below
forward_signal() { kill -s "$1" "$srun_pid" 2>/dev/null || true; }
trap 'forward_signal USR1' USR1
trap 'terminated=1; forward_signal TERM' TERM

train_rc=0
while true; do
  wait "$srun_pid" && train_rc=0 || train_rc=$?
  kill -0 "$srun_pid" 2>/dev/null || break   # wait returned because of a trapped signal: keep waiting
done

if ((train_rc == REQUEUE_EXIT_CODE && terminated == 0)); then
  echo "[exgrpo] checkpoint saved before the time limit: requeueing job $SLURM_JOB_ID (resumes $RUN_DIR)"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
echo "[exgrpo] training finished with exit code $train_rc"
exit "$train_rc"
