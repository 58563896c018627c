# shellcheck shell=bash
# Rendezvous for a one-process-per-GPU `srun` launch; sourced by slurm/exgrpo.sh (and by the tests).
#
# Every task learns its own rank, world size and local rank from Slurm (SLURM_PROCID, SLURM_NTASKS,
# SLURM_LOCALID, read by exgrpo_megatron/distributed/launch_env.py). What the batch script must
# give all tasks alike is the rendezvous: MASTER_ADDR (the first host of the allocation) and
# MASTER_PORT (one port per job, so two jobs sharing a node do not collide).

# First hostname of a Slurm node list: 'gpu[003-005,9],cpu1' -> 'gpu003'.
# Asks `scontrol show hostnames`; without scontrol (or if it fails) parses the compressed form.
exgrpo_first_host() {
  local nodelist=$1 host="" prefix rest ranges
  if command -v scontrol >/dev/null 2>&1; then
    host=$(scontrol show hostnames "$nodelist" 2>/dev/null) || host=""
    host=${host%%$'\n'*}
  fi
  if [[ -z $host ]]; then
    prefix=${nodelist%%[\[,]*}
    rest=${nodelist#"$prefix"}
    if [[ $rest == \[* ]]; then
      ranges=${rest#\[}
      ranges=${ranges%%\]*}
      host=$prefix${ranges%%[,-]*}
    else
      host=$prefix
    fi
  fi
  [[ -n $host ]] || return 1
  printf '%s\n' "$host"
}

# Rendezvous port of a job: 20000 + job id mod 20000 (stable across requeues: the job id is kept).
exgrpo_master_port() {
  local job_id=$1
  printf '%s\n' $((20000 + job_id % 20000))
}

# Export MASTER_ADDR / MASTER_PORT for every task of the coming srun (srun passes the environment
# on). EXGRPO_MASTER_ADDR / EXGRPO_MASTER_PORT override them; a MASTER_ADDR inherited from the
# submitting shell is deliberately ignored. torchrun's RANK/WORLD_SIZE/LOCAL_RANK are unset because
# launch_env() would prefer them over Slurm's per-task variables.
exgrpo_export_dist_env() {
  : "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set (not inside a Slurm allocation?)}"
  MASTER_ADDR=${EXGRPO_MASTER_ADDR:-$(exgrpo_first_host "$SLURM_JOB_NODELIST")}
  MASTER_PORT=${EXGRPO_MASTER_PORT:-$(exgrpo_master_port "${SLURM_JOB_ID:-0}")}
  export MASTER_ADDR MASTER_PORT
  unset RANK WORLD_SIZE LOCAL_RANK
}

# The exit code with which the trainer says "checkpoint saved after SIGUSR1/SIGTERM, requeue me":
# REQUEUE_EXIT_CODE in exgrpo_megatron/distributed/preemption.py, read from the source (no Python needed
# on the batch host, which may lack the container's environment); 75 (EX_TEMPFAIL) if unreadable.
exgrpo_requeue_exit_code() {
  local signals_py=${1:-.}/exgrpo_megatron/distributed/preemption.py code=""
  if [[ -r $signals_py ]]; then
    code=$(sed -n 's/^REQUEUE_EXIT_CODE[[:space:]]*=[[:space:]]*\([0-9][0-9]*\).*/\1/p' "$signals_py")
  fi
  [[ $code =~ ^[0-9]+$ ]] || code=75
  printf '%s\n' "$code"
}
