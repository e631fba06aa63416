#!/bin/bash
# trainbox on one Slurm node: one torchrun with a worker per GPU (NPROC_PER_NODE on CPU-only nodes).
#
#   sbatch --gpus-per-node=4 --cpus-per-task=32 slurm/singlenode.sh [TRAINER ARGS]   (the CPUs for its workers)
#   NPROC_PER_NODE=2 sbatch slurm/singlenode.sh --preset debug
#
# The same knobs, preemption and requeue as slurm/multinode.sh, which this runs with one node.
# Two jobs on one node do not collide: each rendezvous port is derived from its job id.
#SBATCH --job-name=trainbox
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR2@120
#SBATCH --requeue
exec bash "${TRAINBOX_DIR:-${SLURM_SUBMIT_DIR:-.}}/slurm/multinode.sh" "$@"
