"""Who runs where: identity from every launcher, Slurm hostlists and plans, the process group, how the model is spread
over it (replicated or sharded), local workers and their fork server.

Standard library only at this level: `python3 -m train.cluster` runs on a bare python3 (slurm/multinode.sh,
slurm/skypilot.yaml)."""
