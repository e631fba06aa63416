"""The trainer's evaluation: a model scored on a validation set, every sample counted once across ranks. The trainer
calls evaluate() at its evaluation steps, and `python -m train.evaluate` (train/evaluate.py) on a finished run."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from train.data import prepare_inputs
from train.recipe.weights import MEAN, STD
from train.run.runtime import autocast


def criterion_of(label_smoothing: float) -> str:
    """The loss a run trains with and its evaluations report (plan.json's "loss", the evaluation records' criterion)."""
    return f"CrossEntropyLoss(label_smoothing={label_smoothing})"


@torch.inference_mode()
def evaluate(model, loader, device, autocast_dtype, channels_last: bool, progress=lambda: None, top5: bool = False,
             confusion_of: int = 0, norm: tuple = (MEAN, STD), label_smoothing: float = 0.0) -> dict:
    """Loss, accuracy (top-1) and, with top5 (more than 5 classes), top-5 accuracy over the whole validation
    set, each sample counted once across ranks; with confusion_of=C classes, the C x C confusion matrix too
    (rows: the true class, columns: the predicted one). The loss is the training criterion's (criterion_of: its
    label smoothing too, as torchvision's reference evaluates with its criterion), averaged over the samples.

    Every rank evaluates with rank 0's buffers (BatchNorm statistics), those the checkpoint and model.pt
    hold: a rank's own differ after its last training batch, and the figures would then depend on
    whether the run was resumed. The next training step broadcasts rank 0's buffers anyway (DDP)."""
    if dist.is_initialized():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, correct, count, correct in the top 5
    confusion = torch.zeros(confusion_of, confusion_of, dtype=torch.int64, device=device)
    for x, y in loader:
        x, y = prepare_inputs(x, device, channels_last, *norm), y.to(device, non_blocking=True)
        with autocast(device, autocast_dtype):
            logits = model(x)
        totals[0] += F.cross_entropy(logits.float(), y, reduction="sum", label_smoothing=label_smoothing)
        totals[1] += (logits.argmax(1) == y).sum()
        totals[2] += y.numel()
        if top5:
            totals[3] += (logits.topk(5, dim=1).indices == y[:, None]).any(1).sum()
        if confusion_of:
            confusion.index_put_((y, logits.argmax(1)), torch.ones_like(y), accumulate=True)
        progress()
    if dist.is_initialized():
        dist.all_reduce(totals)
        if confusion_of:
            dist.all_reduce(confusion)
    loss, correct, count, in_top5 = totals.tolist()
    model.train()
    return {"loss": loss / count, "accuracy": correct / count, **({"top5": in_top5 / count} if top5 else {}),
            "samples": int(count), **({"confusion": confusion.cpu().tolist()} if confusion_of else {})}
