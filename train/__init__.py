"""trainbox: one PyTorch DDP trainer for a laptop CPU, a multi-GPU workstation and a Slurm cluster."""
