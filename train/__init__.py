"""trainbox: one PyTorch DDP trainer for a laptop CPU, a multi-GPU workstation and a Slurm cluster."""

import os

# MKL's conditional numerical reproducibility, read once, at MKL's first call (so here, before any of trainbox's
# modules imports torch): without it, MKL's GEMM may take a code path that depends on a buffer's alignment and on
# thread timing, and two identical runs differ in the last bits (seen: a 1x1 convolution's backward at a per-worker
# batch of 1, a segmentation run's squeeze-and-excite). AUTO,STRICT: the fastest path this CPU has that sums the same
# way every time. train/run/runtime.py checks that it took effect.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
