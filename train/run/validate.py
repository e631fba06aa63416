"""A model scored on a validation set by its task, every sample counted once across ranks: validate(). The trainer calls
it at its evaluation steps (Trainer.evaluate), and `python -m train.evaluate`'s ranks (train/run/scoring.py) on a
finished run."""

from __future__ import annotations

import torch
import torch.distributed as dist

from train.run.runtime import autocast
from train.tasks.contract import checked_state
from train.tasks.task import Task


def validate(model, loader, task: Task, device, autocast_dtype, progress=lambda: None, detail: bool = False,
             lockstep: bool = False) -> dict:
    """The task's scores over the whole validation set (task.scores: the loss, its metric, the samples; with detail
    what its report needs too). Every rank adds its share of the data to the task's state (task.update), the state is
    all-reduced by SUM once, and the figures are computed from it once: no mean of per-batch or per-rank means, and no
    sample twice (each rank's loader holds its own samples, no padding).

    Every rank evaluates with rank 0's buffers (BatchNorm statistics), those the checkpoint and model.pt
    hold: a rank's own differ after its last training batch, and the figures would then depend on
    whether the run was resumed. The next training step broadcasts rank 0's buffers anyway (DDP).

    lockstep (a sharded model: each forward gathers parameters from every rank): every rank runs as many forwards,
    a rank out of batches passing the task's example of one item, which adds nothing to the state; under no_grad, not
    inference_mode, whose tensors FSDP's gathered parameters would become, unusable for the next training step."""
    with torch.no_grad() if lockstep else torch.inference_mode():
        return _validate(model, loader, task, device, autocast_dtype, progress, detail, lockstep)


def _validate(model, loader, task: Task, device, autocast_dtype, progress, detail: bool, lockstep: bool) -> dict:
    if dist.is_initialized():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
    model.eval()
    state = checked_state(task, task.metric_state(device, detail))
    batches = iter(loader)
    while True:
        batch = next(batches, None)
        if not (any_rank_has(batch is not None, device) if lockstep else batch is not None):
            break
        x, target = task.inputs(batch, device) if batch is not None else task.example(1, device)
        with autocast(device, autocast_dtype):
            output = task.forward(model, x, target)
        if batch is not None:
            task.update(state, output, target)
        progress()
    if dist.is_initialized():
        dist.all_reduce(state)
    model.train()
    return task.scores(state, detail)


def any_rank_has(mine: bool, device) -> bool:
    """Whether any rank (this one: mine) still has a batch to evaluate."""
    flag = torch.tensor(int(mine), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag)
