"""A run that diverges stops: a loss that is not finite (NaN, Infinity) ends it with exit code 2 (a restart would
only meet it again) and one line, before anything of it is saved, so the newest checkpoint stays a finite one and no
model.pt, best.pt or EMA of a diverged model is ever written. An evaluation's loss and metric count too
(`diverged_evaluation`): finite weights can still overflow in a forward pass (BatchNorm statistics of 1e33, say), and
such a model never ranks as the best.

Each step adds a few operations on the device (no synchronisation): whether the step's loss is finite, and the first
step and loss that were not. The ranks agree on it at every log line and before every evaluation, checkpoint and the
final model (`DivergenceGuard.check`), where they synchronise anyway; before anything is written the weights themselves
are checked too (a finite loss can still be followed by an update that is not).

Under fp16 the GradScaler skips a step whose gradients overflow and halves its scale: such skips are normal, and the
weights stay finite. A run whose scale falls below FP16_SCALE_FLOOR (30 halvings from its start of 2**16: the
gradients overflow however small the loss is scaled) stops the same way.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from train.base.errors import ConfigError
from train.cluster.distributed import gather

FP16_SCALE_FLOOR = 2.0 ** -14


class Diverged(ConfigError):
    """The run's loss, or under fp16 its gradients, stopped being finite: one line, exit code 2."""


class DivergenceGuard:
    """The loss's health on one rank, kept on the device between checks."""

    def __init__(self, device: torch.device, fp16: bool):
        self.device, self.fp16 = device, fp16
        self.first_step = torch.full((), -1, dtype=torch.long, device=device)  # the first step whose loss was not
        # finite, and that loss
        self.first_loss = torch.zeros((), device=device)
        self.lrs: dict[int, float] = {}  # each step's learning rate since the last check (the line names it)

    def observe(self, step: int, losses: list[torch.Tensor], lr: float) -> None:
        """Step `step` (counted from 1) has been taken at learning rate `lr` with these micro-batch losses."""
        if self.fp16:  # the GradScaler skips such steps itself: check() reads its scale
            return
        total = losses[0] if len(losses) == 1 else torch.stack(losses).sum()
        first = ~torch.isfinite(total) & (self.first_step < 0)
        self.first_step = torch.where(first, step, self.first_step)
        self.first_loss = torch.where(first, total.detach().float(), self.first_loss)
        self.lrs[step] = lr

    def check(self, step: int, scaler: torch.amp.GradScaler, models=()) -> str | None:
        """Every rank at the same point: why the run diverged (the same line on every rank) if any rank met a loss that
        was not finite (or, under fp16, a scale under the floor), else None. models: weights about to be written,
        which must be finite too."""
        bad_loss = bool(self.first_step >= 0) if not self.fp16 else False
        bad_scale = self.fp16 and scaler.get_scale() < FP16_SCALE_FLOOR
        bad_weights = any(not all_finite(model) for model in models)
        flags = torch.tensor([bad_loss, bad_scale, bad_weights], dtype=torch.int32)
        if dist.is_initialized():  # on the device: NCCL reduces CUDA tensors only
            flags = flags.to(self.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad_loss, bad_scale, bad_weights = (bool(f) for f in flags.tolist())
        if not (bad_loss or bad_scale or bad_weights):
            self.lrs.clear()
            return None
        seen = (int(self.first_step), float(self.first_loss)) if int(self.first_step) >= 0 else None
        seen = [s for s in (gather(seen) if dist.is_initialized() else [seen]) if s is not None]
        return self._why(step, scaler, min(seen) if seen else None, bad_scale)

    def _why(self, step: int, scaler, first: tuple[int, float] | None, bad_scale: bool) -> str:
        if first is not None:
            at, loss = first
            lr = self.lrs.get(at)
            shown = "nan" if math.isnan(loss) else ("inf" if loss > 0 else "-inf")
            rate = f" at learning rate {lr:.3g}" if lr is not None else ""
            return f"the run diverged: the loss was {shown} at step {at}{rate}"
        if bad_scale:
            return (f"the run diverged: by step {step} fp16's GradScaler had skipped step after step (its scale fell "
                    f"to {scaler.get_scale():.3g}): the gradients overflow however small the loss is scaled")
        return f"the run diverged: by step {step} its weights (or their running statistics) were no longer finite"


def diverged_line(why: str, grad_clip: float, precision: str, kept: str | None) -> str:
    """The one line of a diverged run: `why`, what to try (a lower rate, clipping, a wider precision) and where to start
    again (kept: the run's newest checkpoint, which a save made only once every rank knew its weights finite)."""
    clip = "--grad-clip 1.0" if not grad_clip else f"a --grad-clip below {grad_clip:g}"
    other = {"fp16": ", --precision bf16 or fp32", "bf16": ", --precision fp32"}.get(precision, "")
    start = (f"--weights {kept} starts it from this run's newest checkpoint, which is finite" if kept else
             "this run saved no checkpoint")
    return f"{why}; a restart cannot mend that: try a lower --lr, {clip}{other}, in a new --run-dir ({start})"


def diverged_evaluation(step: int, results: dict[str, dict], metric: str) -> str | None:
    """Why an evaluation at `step` shows a diverged model (results: each evaluated model's scores, by its name in the
    log, "" or "EMA "), or None: a loss or a metric (the one that picks best.pt) that is not finite. Every rank holds
    the same all-reduced figures: all decide alike, with no collective."""
    for name, figures in results.items():
        for key in dict.fromkeys(("loss", metric)):
            if not math.isfinite(figures[key]):
                return f"the run diverged: the {name}evaluation at step {step} had a {key} of {figures[key]}"
    return None


def all_finite(model: torch.nn.Module) -> bool:
    """Whether every floating-point parameter and buffer (BatchNorm's statistics too) of `model` is finite; of a
    sharded one, this rank's shards (the check's flags are all-reduced)."""
    tensors = [t.to_local() if hasattr(t, "to_local") else t
               for t in (t.detach() for t in (*model.parameters(), *model.buffers())) if t.is_floating_point()]
    return not tensors or bool(torch.stack([t.isfinite().all() for t in tensors]).all())
