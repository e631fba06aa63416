"""make bench: trainbox measured against plain PyTorch, side by side, on this machine.

  python -m train.bench                       every CPU row (and the GPU rows where CUDA is visible)
  python -m train.bench --out runs/bench-x    where bench.json, bench.txt and scaling.png go
  python -m train.bench --quick --rounds 1    tiny sizes, every row once: that each runs (numbers mean little)

Every figure is a ratio of two arms measured in this one run: the arms alternate (A B A B ...), the
first windows of each run are dropped as warm-up, and each row reports the median ratio and its spread
(lowest and highest of the per-round ratios). No figure is compared with a stored absolute time.

The "bare" arm is the canonical loop of the PyTorch DDP tutorial, written out below: zero_grad,
forward, loss, backward, step, on the same model, data, batch, threads and world size as the trainer,
with fused AdamW kernels as the trainer uses (one parameter group and no schedule, as in the tutorial).
"""

# The GPU rows' knobs (--gpu-knobs; train/bench/gpu.py measures them): here, so that the command line is read without
# torch
GPU_KNOBS = ("fp32", "no-channels-last", "compile", "bucket-cap-mb", "static-graph", "foreach-adamw", "no-pin-memory",
             "jpeg", "ema", "mixup")
