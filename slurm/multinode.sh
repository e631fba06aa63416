#!/bin/bash
# trainbox on Slurm: N nodes x G workers, one torchrun per node, c10d rendezvous on the first node.
#
#   sbatch slurm/multinode.sh                                   # 2 nodes, the default run
#   sbatch --nodes=4 --gpus-per-node=8 slurm/multinode.sh --model resnet50 --batch-size 128
#   NPROC_PER_NODE=2 sbatch slurm/multinode.sh --preset debug   # CPU-only nodes: 2 workers each
#   RUNTIME=pyxis IMAGE=/nas/trainbox.sqsh sbatch slurm/multinode.sh        # enroot image (make enroot)
#   RUNTIME=apptainer IMAGE=/nas/trainbox.sif sbatch slurm/multinode.sh     # Apptainer (make apptainer)
#
# Arguments go to the trainer. Knobs (environment, defaults below): RUNTIME, IMAGE, TRAINBOX_DIR,
# RUNS_DIR, DATA_DIR, RUN_NAME, NPROC_PER_NODE, MASTER_PORT, MAX_RESTARTS, MAX_REQUEUES, PYTHON, and
# TORCH_HOME (the cache of named --weights on the NAS: fetched once per node, or placed there for offline nodes).
# Submit from the checkout on the NAS (or set TRAINBOX_DIR); the log lands beside it.
#
# Preemption: Slurm sends USR2 to this script 120 s before the end (#SBATCH --signal below; USR1 is NCCL's).
# The script passes it to the training processes, which agree on a step, save a checkpoint and exit;
# the script then requeues the job, which resumes from that checkpoint in the same run directory.
# A finished run is not requeued; a crash is not requeued; at most MAX_REQUEUES requeues; a cancel
# (SIGTERM: scancel, the time limit) checkpoints but is not requeued.
#
#SBATCH --job-name=trainbox
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR2@120
#SBATCH --requeue

# NCCL knobs, set here or in the submitting shell (sbatch passes the environment on):
#   NCCL_SOCKET_IFNAME=ib0,eth0  the interface(s) for bootstrap and socket traffic across nodes
#   NCCL_IB_HCA=mlx5_0,mlx5_1    which InfiniBand adapters to use (NCCL_IB_DISABLE=1: none)
#   NCCL_P2P_DISABLE=1           if GPU peer-to-peer hangs (some PCIe switches, VMs)
#   NCCL_DEBUG=INFO              what NCCL chose, in this job's log
# A rank that stops participating fails the job after the trainer's --timeout-s (default 600 s).
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

set -uo pipefail
cd "${TRAINBOX_DIR:=${SLURM_SUBMIT_DIR:-.}}" || exit 2
export TRAINBOX_DIR
# NNODES NPROC_PER_NODE CPUS_PER_TASK MASTER_ADDR MASTER_PORT RUN_DIR RUN_DIR_ARG LAUNCH TORCHRUN TRAINER_ARGS,
# and the torchrun environment (the same as `make train` gets): every decision is in train/cluster/jobs.py. A
# --run-dir among the arguments is the run's folder (RUN_DIR), as RUNS_DIR=its parent RUN_NAME=its name.
job=$(python3 -m train.cluster job -- "$@") || exit 2
eval "$job"
echo "trainbox: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $NNODES node(s) x $NPROC_PER_NODE worker(s)," \
     "$CPUS_PER_TASK CPU(s) per node, rendezvous $MASTER_ADDR:$MASTER_PORT, runtime ${RUNTIME:-local}, run $RUN_DIR"

srun --kill-on-bad-exit=1 --ntasks-per-node=1 --nodes="$NNODES" --cpus-per-task="$CPUS_PER_TASK" \
    "${LAUNCH[@]}" "${TORCHRUN[@]}" -m train --run-dir "$RUN_DIR_ARG" "${TRAINER_ARGS[@]}" &
step=$!
# The signal reaches this shell only (B:); pass it to the step's processes on every node. USR2 is the
# preemption notice (requeue after the checkpoint); TERM is a cancel (`scancel`, a time limit): the run
# still checkpoints, but the job is not brought back.
preempted=
trap 'preempted=1; echo "trainbox: preemption signal: checkpointing"; scancel --signal=USR2 "$SLURM_JOB_ID"' USR2
trap 'echo "trainbox: cancelled: checkpointing, no requeue"; scancel --signal=USR2 "$SLURM_JOB_ID"' TERM
while kill -0 "$step" 2>/dev/null; do wait "$step"; done   # wait returns early when a trap runs
wait "$step"; code=$?                                       # the step's own exit code

read -r verdict recorded < <(python3 -m train.cluster after "$RUN_DIR" ${preempted:+--preempted})
case "$verdict" in
  done)    echo "trainbox: finished: $RUN_DIR/model.pt"; exit 0 ;;
  requeue) echo "trainbox: stopped at a checkpoint: requeueing job $SLURM_JOB_ID"
           scontrol requeue "$SLURM_JOB_ID"; exit 0 ;;
  stopped) echo "trainbox: stopped at a checkpoint, not requeued (not a preemption): resubmit to resume"
           exit 75 ;;
  *)       code=$(( ${recorded:-0} != 0 ? recorded : code == 0 ? 1 : code ))   # the run's own code first
           echo "trainbox: the run failed (exit code $code): not requeued; see the log above"
           exit "$code" ;;
esac
