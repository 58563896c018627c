#!/bin/bash
# ExGRPO on Qwen3-8B-Base with LoRA adapters, 4x H100 80GB: half a node (conf/exgrpo_qwen3_8b_lora.yaml; the dry run
# fits it from 2 GPUs: GPUS_PER_NODE=2 sbatch --ntasks-per-node=2 --gpus-per-node=2). Usage, the one-step-off mode, requeue and resume
# are exgrpo_7b.sh's (slurm/exgrpo.sh holds the logic); only this header differs:
#
#   sbatch slurm/exgrpo_qwen3_8b_lora.sh [hydra overrides]     # from the repository root
#
#SBATCH --job-name=exgrpo_qwen3_8b_lora
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=12
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
#SBATCH --error=%x-%j.err

set -euo pipefail
REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
PRESET=exgrpo_qwen3_8b_lora
GPUS_PER_NODE=${GPUS_PER_NODE:-4}   # = --ntasks-per-node / --gpus-per-node above
export REPO_DIR PRESET GPUS_PER_NODE
exec bash "$REPO_DIR/slurm/exgrpo.sh" "$@"
