"""What keeps a run exact whatever its layout and its attempts, beside the sampler's order and the seeds by slot
(train/loading/samplers.py):

  settle_buckets(parts, loop, device)   every attempt's first backward, on a batch of zeros, leaving no trace: DDP's
                                        buckets laid out as an uninterrupted run's before its first real step
  SlotZeroStatistics(model, keeping)    the running statistics of a step updated by laid-out slot 0's micro-batch
                                        alone, whichever worker trains it
"""

from __future__ import annotations

import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from train.run.checkpointer import capture_rng, restore_rng
from train.run.runtime import autocast
from train.tasks.contract import loss_of


def settle_buckets(parts, loop, device: torch.device) -> float:
    """DDP runs its first backward with every gradient in one bucket, then lays its buckets out anew in the
    order the gradients became ready; with more than 2 ranks the all-reduce's summation order depends on
    where a value sits in its bucket. So every attempt (a fresh start, a resume, a restart) makes that
    first backward here, on a batch of zeros, and leaves no trace: the gradients dropped, the parameters
    untouched (no optimizer step), the buffers (BatchNorm statistics) and every RNG stream restored. Its
    first real step then runs with the rebuilt layout, as an uninterrupted run's every step does. Returns
    the seconds it took (make bench reports them against a step)."""
    if not isinstance(parts.model, DDP):
        return 0.0
    started = time.perf_counter()
    buffers = [b.detach().clone() for b in parts.raw_model.buffers()]
    rng = capture_rng(device)
    # the task's batch of a training step's shape: no more memory than one, no compile for another
    x, target = parts.task.example(loop.batch_size, device)
    for _ in range(2 if loop.static_graph else 1):  # static_graph: its layout settles a pass later (measured)
        with autocast(device, parts.precision):
            total, count = loss_of(parts.task, parts.task.loss(parts.task.forward(parts.model, x, target), target))
        (total / max(count, 1)).backward()  # the example's count: all that matters is that a backward runs
        parts.optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for buffer, saved in zip(parts.raw_model.buffers(), buffers, strict=True):
            buffer.copy_(saved)
    restore_rng(rng, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # once per attempt: the time is the pass's, not its launch's
    return time.perf_counter() - started


class SlotZeroStatistics:
    """The running statistics (BatchNorm's and its kin's: the buffers a forward pass updates) follow one rule at every
    world size and accumulation: each step updates them from the micro-batch of laid-out slot 0 alone, which is always
    rank 0's first (slot = micro-batch x world + rank, in any layout), the one DDP keeps when every slot has its own
    worker (DDP broadcasts rank 0's buffers at every forward). Rank 0's later micro-batches of the step normalise with
    their own batch's statistics but leave the running ones as slot 0 left them: a run resumed on fewer workers, whose
    rank 0 now trains more slots, keeps the uninterrupted run's statistics. One per step; `keeping` False (another
    rank, or one micro-batch a step): nothing to do."""

    def __init__(self, model: torch.nn.Module, keeping: bool):
        self.model, self.keeping, self.kept = model, keeping, []

    def after(self, micro: int) -> None:
        """After micro-batch `micro`'s forward and backward: slot 0's statistics kept, or put back."""
        if not self.keeping:
            return
        if micro == 0:
            self.kept = [b.detach().clone() for b in self.model.buffers()]
            return
        with torch.no_grad():
            for buffer, kept in zip(self.model.buffers(), self.kept, strict=True):
                buffer.copy_(kept)
