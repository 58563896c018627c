#!/bin/bash
# ExGRPO on Qwen3-30B-A3B-Base (mixture of experts, EP=8) with LoRA adapters on one node of 8x H100 80GB
# (conf/exgrpo_qwen3_30b_a3b_lora.yaml; full fine-tuning needs 2 nodes: slurm/exgrpo_qwen3_30b_a3b.sh). Usage, the
# one-step-off mode, requeue and resume are exgrpo_7b.sh's (slurm/exgrpo.sh holds the logic); only this header differs:
#
#   sbatch slurm/exgrpo_qwen3_30b_a3b_lora.sh [hydra overrides]     # from the repository root
#
#SBATCH --job-name=exgrpo_qwen3_30b_a3b_lora
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
REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
PRESET=exgrpo_qwen3_30b_a3b_lora
export REPO_DIR PRESET
exec bash "$REPO_DIR/slurm/exgrpo.sh" "$@"
