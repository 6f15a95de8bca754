#!/usr/bin/env bash
# SLURM batch script for GPU nodes: one process per node owning all of its GPUs.
#   sbatch --nodes=4 --gpus-per-node=8 launch/slurm_gpu.sh \
#     python -m gpt_oss_train.train --config=configs/gpu_h100.py --workdir=/shared/run
# jax.distributed.initialize() reads SLURM's environment; we export the coordinator
# explicitly as well so the same script works with srun --mpi=none.
#SBATCH --job-name=gpt_oss_train
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export JAX_COORDINATOR_ADDRESS="$head:${COORDINATOR_PORT:-12355}"
export JAX_PROCESS_COUNT="$SLURM_NNODES"
srun --ntasks-per-node=1 bash -c 'JAX_PROCESS_ID=$SLURM_PROCID exec "$@"' _ "$@"
