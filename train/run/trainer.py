"""The Trainer: one rank's run. Read `Trainer.train()` first: it is the whole loop, top to bottom, one call per concern.

  Trainer(parts, stop)                 over the run's parts (train/run/build.py), from where the newest checkpoint
                                       left off
  Trainer.train()                      a step, the EMA, the position, the schedule, the log; then a stop, an
                                       evaluation or a checkpoint when one is due
  Trainer.train_step(micro_batches)    forward and backward over the micro-batches, clip, optimizer step: nothing else
  Trainer.state_dict()                 the position, the one state the Trainer keeps itself: its checkpointer
                                       (train/run/checkpointer.py) holds the rest and writes every weights file

A worker's life around it (the runtime, the process group, the exit code) is train/run/worker.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from train.base.errors import EXIT_DONE, EXIT_STOPPED
from train.base.watchdog import watchdog
from train.cluster.distributed import StopSignal, broadcast_from_main, gather
from train.cluster.identity import identity, is_main
from train.cluster.sharding import held_mib
from train.components.augment import batch_seed
from train.files import checkpoint_io as ckpt
from train.files.rundir import process_start_time
from train.loading import origin
from train.run.exact import SlotZeroStatistics, settle_buckets
from train.run.health import Diverged, diverged_evaluation, diverged_line
from train.run.runtime import autocast
from train.run.validate import validate
from train.tasks.contract import checked_scores, fixed_count, loss_of

if TYPE_CHECKING:
    from train.run.build import Parts

log = logging.getLogger("train")


class Trainer:
    """One rank's run: the loop over its parts (`parts`, train/run/build.py) from its position (step, epoch, step in
    epoch)."""

    def __init__(self, parts: Parts, stop: StopSignal):
        self.parts, self.stop, self.checkpointer = parts, stop, parts.checkpointer
        self.loop, self.plan, self.run_dir, self.device = parts.loop, parts.plan, parts.run_dir, parts.device
        self.rank, self.world = identity().global_rank, identity().world_size
        self.step = self.epoch = self.step_in_epoch = 0  # the position
        self.eval_owed, self.last_eval, self.first_step_logged, self.settle_s = False, -1, False, 0.0
        self.held_mib: float | None = None  # the model's state this rank holds (measured at its first step's fullest)
        self.resumed_from = parts.resumed.step if parts.resumed else None
        if parts.resumed:
            self.load_state_dict(parts.resumed.position)

    def state_dict(self) -> dict:
        """The position (and whether the evaluation of its step is still owed): what a checkpoint holds of the
        Trainer."""
        return {"step": self.step, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                "eval_owed": self.is_eval_step(self.step) and self.last_eval != self.step}

    def load_state_dict(self, position: dict) -> None:
        self.step, self.epoch, self.step_in_epoch = position["step"], position["epoch"], position["step_in_epoch"]
        self.eval_owed = position["eval_owed"]

    def release(self) -> None:
        """The end of a clean run (done or stopped): drop the DDP wrapper, its reducer and, under --compile,
        the compiled module it wraps, while every peer is still in the group. Freed only when run()'s frame
        ends, after the peers have left, they were torn down without them, and a finished run's last rank
        hung there (distributed.teardown now refuses to leave before they are gone)."""
        watchdog.enter("the end of the run (freeing the DDP wrapper)")
        self.parts.model = self.parts.raw_model
        watchdog.pause()

    # ------------------------------------------------------------ the loop

    def train(self) -> int:
        """The run from where it stands to max_steps. Returns the exit code (0 done, 75 stopped)."""
        loop, parts, max_steps = self.loop, self.parts, self.plan.max_steps
        watchdog.enter("training")
        try:
            if self.eval_owed:  # stopped at an evaluation step before evaluating
                self.evaluate()
            if self.resumed_from is not None and self.stop_reached(self.step) and self.step < max_steps:
                return self.stop_here(f"--stop-at {loop.stop_at}: already at step {self.step}", save=False)
            parts.model.train()
            self.settle_s = settle_buckets(parts, loop, self.device)
            batches = self.batches()
            while self.step < max_steps:
                lr = parts.optimizer.param_groups[0]["lr"]  # the rate this step trains at
                sums, counts = self.train_step(self.micro_batches(batches))
                self.update_ema()
                self.step_schedule(epoch_ended=self.advance())
                parts.guard.observe(self.step, sums, lr)
                self.after_step(sums, counts)
                if self.stop.agreed() or self.stop_reached(self.step):
                    return self.stop_here("--stop-at" if self.stop_reached(self.step) else
                                          self.stop.received or "a stop signal on another rank")
                if self.is_eval_step(self.step):
                    self.evaluate()
                if self.is_save_step(self.step):
                    self.save(f"every {loop.save_every} steps")
            return self.finish()
        finally:
            parts.metrics.close()

    def train_step(self, micro_batches: Iterator[tuple]) -> tuple[list[torch.Tensor], list]:
        """One optimizer step: forward and backward over the --grad-accum micro-batches (gradients synchronised on
        the last only), clip, optimizer and grad scaler. The task gives each micro-batch's loss as a sum and a count;
        each sum is divided by the count of the whole step, every micro-batch on every rank (DDP then averages over
        the ranks, hence the world size above it; FSDP, its division turned off, sums): the gradient of the step's
        mean, as one large batch gives it, whatever the accumulation, the workers and the spread. Returns the
        micro-batches' loss sums and counts."""
        parts, task, loop = self.parts, self.parts.task, self.loop
        model, scaler, spread = parts.model, parts.scaler, parts.spread
        averaged = self.world if spread.averages else 1  # what the gradients' reduction divides by
        steps = list(micro_batches) if task.variable_count else micro_batches  # counted before the first backward
        counting = self.step_count(steps) if task.variable_count else None  # summed over the ranks during the
        scale, sums, counts = None, [], []  # first forward: the ranks meet before its backward, not before it
        statistics = SlotZeroStatistics(parts.raw_model, self.rank == 0 and loop.grad_accum > 1)
        for micro, (x, target) in enumerate(steps):
            with spread.micro_batch(model, last=micro == loop.grad_accum - 1):
                with autocast(self.device, parts.precision):
                    total, count = loss_of(task, task.loss(task.forward(model, x, target), target))
                if scale is None and counting is not None:  # a step that counts nothing (every pixel ignored)
                    scale = averaged / counting().clamp(min=1)  # has a gradient of nothing, 0: divided by 1, not 0
                elif scale is None:  # every micro-batch of every rank counts alike (a number from its shape)
                    scale = 1 / (loop.grad_accum * fixed_count(task, target) * (self.world // averaged))
                scaler.scale(total * scale).backward()
            statistics.after(micro)  # after the backward, which reads them
            sums.append(total.detach())
            counts.append(count)
        if loop.grad_clip > 0:
            scaler.unscale_(parts.optimizer)
            torch.nn.utils.clip_grad_norm_(parts.raw_model.parameters(), loop.grad_clip)
        scaler.step(parts.optimizer)
        scaler.update()
        if self.held_mib is None:  # parameters, gradients and the optimizer's state, all there: once
            self.held_mib = held_mib(parts.raw_model, parts.optimizer)
        parts.optimizer.zero_grad(set_to_none=True)
        return sums, counts

    def step_count(self, micro_batches: list[tuple]) -> Callable[[], torch.Tensor]:
        """The items the loss of this step sums over, on every rank: an all-reduce of one number on the device,
        started here; the function returned waits for it (no wait for the host)."""
        total = sum(torch.as_tensor(self.parts.task.count(target), device=self.device, dtype=torch.float64)
                    for _, target in micro_batches)
        work = dist.all_reduce(total, async_op=True) if dist.is_initialized() else None

        def summed() -> torch.Tensor:
            if work is not None:
                work.wait()
            return total

        return summed

    def micro_batches(self, batches: Iterator) -> Iterator[tuple]:
        """This step's --grad-accum micro-batches, each augmented as the recipe asks (random erasing, Mixup/CutMix),
        seeded by its position in the run (the laid-out run's rank and micro-batch), not by a random stream."""
        loop, augment = self.loop, self.parts.augment
        for micro in range(loop.grad_accum):
            x, y = next(batches)
            if augment is not None:
                rank0, micro0 = origin(self.rank, micro, self.world, self.parts.sampler.layout)
                x, y = augment(x, y, batch_seed(loop.seed, self.step, micro0, rank0))
                x = x.contiguous(memory_format=torch.channels_last) if loop.channels_last else x
            yield x, y

    def update_ema(self) -> None:
        """The reference's EMA rule: every --model-ema-steps optimizer steps of an epoch (counted from its
        first), restarted from the weights while the warm-up lasts."""
        ema = self.parts.ema
        if ema is None or self.step_in_epoch % self.loop.ema_every:
            return
        ema.update_parameters(self.parts.raw_model)
        if self.in_warmup():
            ema.restart()

    def in_warmup(self) -> bool:
        """Whether the optimizer step just taken was in the warm-up (an epoch of it, with --schedule-unit epoch)."""
        if not self.loop.per_step:
            return self.epoch < self.loop.warmup_epochs
        return self.step < self.plan.warmup_steps

    def advance(self) -> bool:
        """The position after an optimizer step, the one place it moves forward (a resume sets it from the
        checkpoint). Returns whether the step ended an epoch (the position is then the next epoch's start)."""
        self.step += 1
        self.step_in_epoch += 1
        if self.step_in_epoch < self.plan.steps_per_epoch:
            return False
        self.epoch, self.step_in_epoch = self.epoch + 1, 0
        return True

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Micro-batches on the device, epoch after epoch from the position the run resumed at; the time
        spent waiting for each goes into the logging window."""
        parts, loop = self.parts, self.loop
        while True:
            epoch = self.epoch
            parts.sampler.set_epoch(epoch, start=self.step_in_epoch * loop.grad_accum * loop.batch_size)
            loader = iter(parts.train_loader)
            while self.epoch == epoch:  # until advance() has moved into the next epoch
                waiting = time.perf_counter()
                batch = next(loader)
                parts.window.wait += time.perf_counter() - waiting
                yield parts.task.inputs(batch, self.device)

    # ------------------------------------------------------------ after a step

    def after_step(self, sums: list[torch.Tensor], counts: list) -> None:
        """The watchdog, the logging window and, once, the time from launch to the first step."""
        watchdog.progress()
        self.parts.window.add(sums, counts)
        if not self.first_step_logged:  # launch to first optimizer step, start-up included (no sync)
            self.first_step_logged = True
            held = max(gather(self.held_mib))  # the fullest rank's
            self.parts.metrics.write(self.step, "first_step", {"since_start_s": time.time() - process_start_time(),
                                                               "settle_s": self.settle_s, "model_state_mib": held})
        if self.step % self.loop.log_every == 0 or self.step == self.plan.max_steps:
            self.log_window()
            self.check_health()

    def log_window(self) -> None:
        """One log line and metrics record: the window's means over every rank, with GPU telemetry."""
        parts = self.parts
        window = parts.window.report(self.world)
        values = {"loss": window["loss"], "lr": parts.scheduler.get_last_lr()[0],
                  **{k: window[k] for k in ("samples_per_s", "step_time_s", "data_wait_frac")},
                  "epoch": self.epoch - (self.step_in_epoch == 0),  # the epoch of the step just taken
                  **({"empty_batches": window["empty_batches"]} if window["empty_batches"] else {})}
        rate, unit = parts.task.throughput(values["samples_per_s"])  # a sequence task counts its tokens
        if unit != "samples":
            values[f"{unit}_per_s"] = rate
        for r, reading in enumerate(gather(parts.telemetry.read()) if self.device.type == "cuda" else []):
            # A rank without NVML reads {}: it adds nothing; a MIG slice has no utilisation.
            values.update({f"gpu{r}_{k}": v for k, v in reading.items()})
        shown = "-" if values["loss"] is None else f"{values['loss']:.4f}"
        empty = f"  ({values['empty_batches']} micro-batches counted nothing)" if "empty_batches" in values else ""
        log.info("step %d/%d  loss %s  lr %.2e  %.0f %s/s  data wait %.1f%%%s", self.step, self.plan.max_steps,
                 shown, values["lr"], rate, unit, 100 * values["data_wait_frac"], empty)
        parts.metrics.write(self.step, "train", values)
        self.checkpointer.record("running", self.step)  # alive: the step and the time, at every log line

    def check_health(self, models: tuple = ()) -> None:
        """Every rank at once: stop a diverged run (train/run/health.py) before it writes anything; models: weights
        about to be written, checked too. Exit code 2 and one line: what happened, what to try, where to start again."""
        why = self.parts.guard.check(self.step, self.parts.scaler, models)
        if why is not None:
            self.diverged(why)

    def diverged(self, why: str) -> None:
        """Raise the one line of a diverged run (every rank at once): `why`, what to try, where to start again."""
        newest = ckpt.list_checkpoints(self.run_dir)[-1:] if is_main() else []
        kept = broadcast_from_main(str(newest[0]) if newest else None)
        raise Diverged(diverged_line(why, self.loop.grad_clip, self.plan.precision, kept))

    def weights(self) -> tuple[torch.nn.Module, ...]:
        """The weights a save writes: the model's, and the EMA's with --model-ema."""
        return (self.parts.raw_model, *([self.parts.ema.module] if self.parts.ema is not None else []))

    def is_eval_step(self, step: int) -> bool:
        every = self.loop.eval_every
        return bool(every) and step % every == 0 and step < self.plan.max_steps

    def is_save_step(self, step: int) -> bool:
        """A checkpoint every --save-every steps; the last step's is the end of the run's (finish)."""
        return step % self.loop.save_every == 0 and step < self.plan.max_steps

    def stop_reached(self, step: int) -> bool:
        """--stop-at: the run stops after this step (or, resumed past it, at once)."""
        return bool(self.loop.stop_at) and step >= self.loop.stop_at

    def step_schedule(self, epoch_ended: bool) -> None:
        """The learning rate's schedule moves every optimizer step, or with --schedule-unit epoch at an epoch's end."""
        if epoch_ended or self.loop.per_step:
            self.parts.scheduler.step()

    def evaluate(self) -> dict:
        """The model (and its EMA) on the validation set; the best so far kept as best.pt (best_ema.pt). A diverged
        model is neither evaluated (its weights are checked first) nor kept: a loss that is not finite stops the run."""
        parts = self.parts
        self.check_health(self.weights())
        with watchdog.during(f"evaluation at step {self.step}"):
            self.last_eval = self.step
            models = {"": parts.raw_model, **({"EMA ": parts.ema.module} if parts.ema is not None else {})}
            results = {name: validate(model, parts.val_loader, parts.task, self.device, parts.precision,
                                      watchdog.progress, lockstep=parts.spread.lockstep)
                       for name, model in models.items()}
        for name, figures in results.items():
            checked_scores(parts.task, figures)  # before anything of it is said or kept
            log.info("eval step %d: %s%s over %d samples", self.step, name, parts.task.summary(figures),
                     figures["samples"])
        result = {**results[""], **{f"ema_{k}": v for k, v in results.get("EMA ", {}).items() if k != "samples"}}
        parts.metrics.write(self.step, "eval", {**result, "criterion": self.plan.loss})
        why = diverged_evaluation(self.step, results, parts.task.metric)
        if why is not None:
            self.diverged(why)
        self.checkpointer.keep_best(self.step, results[""])
        if parts.ema is not None:
            self.checkpointer.keep_best(self.step, results["EMA "], ema=True)
        return result

    def save(self, reason: str) -> None:
        """The checkpoint of this step, once every rank knows the weights are finite."""
        self.check_health(self.weights())
        self.checkpointer.save(self.state_dict(), reason)

    def stop_here(self, reason: str, save: bool = True) -> int:
        """A stop signal (agreed by every rank), or --stop-at: checkpoint, status 'stopped', exit 75."""
        if save:
            log.info("%s: saving at step %d and exiting with code %d (run again to resume)",
                     reason, self.step, EXIT_STOPPED)
            self.save(reason)
        else:
            log.info("%s, nothing to train (exit %d)", reason, EXIT_STOPPED)
        self.checkpointer.record("stopped", self.step, exit_code=EXIT_STOPPED)
        return EXIT_STOPPED

    def finish(self) -> int:
        """At max_steps: the last checkpoint, the final evaluation, model.pt and status 'done'."""
        if self.checkpointer.saved_step != self.step:
            self.save("end of run")
        final = self.evaluate()
        self.check_health(self.weights())
        self.checkpointer.save_final()
        if is_main():
            self.checkpointer.record("done", self.step, **{f"val_{k}": v for k, v in final.items()})
            log.info("done: %s", self.run_dir / "model.pt")
            if self.parts.tracker:
                self.parts.tracker.upload(self.run_dir / "manifest.json")
        return EXIT_DONE
