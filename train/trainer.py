"""The Trainer: one rank's run. Read `Trainer.train()` first: it is the whole loop, top to bottom.

  run(cfg)                  a worker's life: runtime, process group, the Trainer, leaving together
  Trainer(cfg, ...)         builds data, model, optimizer; resumes from the newest checkpoint; wraps in DDP
  Trainer.train()           step, log, then a stop, an evaluation or a checkpoint when one is due
  Trainer.train_step()      forward, backward, clip, optimizer step: nothing else
  Trainer.state_dict()      the checkpoint's layout, in one place (load_state_dict reads it back)
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from train import checkpoint as ckpt
from train import runfiles
from train.config import Config, launch_run_dir, process_start_time
from train.data import (build_datasets, build_train_loader, build_val_loader, class_names, packed_with,
                        origin, prepare_inputs)
from train.distributed import (StopSignal, announce_unrecoverable, broadcast_from_main, gather, identity, init,
                               is_main, on_main, peer_unrecoverable, ordered_allreduce_hook, teardown, watch_limit,
                               wrap)
from train.errors import EXIT_BAD_INPUT, EXIT_DONE, EXIT_STOPPED, ConfigError, PeerGaveUp, one_line
from train.memory import is_out_of_memory, out_of_memory
from train.metrics import GpuTelemetry, LogWindow, MetricsWriter, build_manifest, setup_logging
from train.models import build_model
from train.augment import BatchAugment, batch_seed
from train.ema import ModelEma
from train.health import Diverged, DivergenceGuard
from train.optim import build_optimizer, build_scheduler, schedule_at, schedule_lengths
from train.plan import make_plan, precision_name
from train.resume import (Layout, changed_settings, continue_layout, refusal, relayout_line, resume_record,
                          saved_length, spliced_lr)
from train.runtime import configure_runtime, pick_device, resolve_precision
from train.evaluate import evaluate
from train.tracking import catch_up_tracking, start_tracking
from train.watchdog import watchdog
from train.weights import fitted, freeze, frozen_names, read_weights

log = logging.getLogger("train")


def run(cfg: Config) -> int:
    """Train according to cfg as the rank the environment says this process is. Returns the exit code."""
    ident = identity()
    watchdog.begin(f"rank {ident.global_rank}", end_limit_s=watch_limit(cfg.launch.timeout_s))
    configure_runtime(cfg)
    device = pick_device(cfg.launch.device, ident)
    init(device, cfg.launch.timeout_s)
    stop = StopSignal()
    clean, code, tracker, trainer, run_dir = False, None, None, None, None
    try:
        run_dir = resolve_run_dir(cfg)
        if already_finished(run_dir, cfg):
            tracker = catch_up_tracking(cfg, run_dir)
            code = EXIT_DONE
        else:
            trainer = Trainer(cfg, run_dir, device, stop)
            tracker = trainer.tracker
            code = trainer.train()
            trainer.release()
        clean = True
        return code
    except Exception as e:
        error = unrecoverable(e, trainer, device, cfg)
        if error is None:
            raise
        end_unrecoverable(error, run_dir, trainer)
        raise error from None
    finally:
        try:
            stop.close(wait=clean)
            teardown(clean, cfg.launch.timeout_s)
        finally:
            watchdog.pause()
            if tracker is not None:  # after the group is gone: no rank waits for rank 0's uploads
                outcome = {EXIT_DONE: "FINISHED", EXIT_STOPPED: "KILLED"}.get(code, "FAILED")
                # A stop or a failure leaves within the launchers' grace periods (torchrun's, compose's).
                tracker.close(outcome, cfg.launch.timeout_s if outcome == "FINISHED" else min(cfg.launch.timeout_s, 30))
            # This frame's objects (the trainer, its loaders and their workers) are freed as it returns, after the
            # peers have left: bounded too. The caller ends the phase once it has them back (launch.run_worker).
            watchdog.enter("the end of the run (freeing the trainer)", watchdog.end_limit_s,
                           cause="freeing the trainer's objects (its loaders' workers, what the process group left) "
                                 "did not end")


class Trainer:
    """One rank's run: its data, model, optimizer and position (step, epoch, step in epoch)."""

    def __init__(self, cfg: Config, run_dir: Path, device: torch.device, stop: StopSignal):
        ident = identity()
        self.run_dir, self.device, self.stop = run_dir, device, stop
        self.rank, self.world, self.launcher = ident.global_rank, ident.world_size, ident.launcher
        self.limit = watch_limit(cfg.launch.timeout_s)
        self.step = self.epoch = self.step_in_epoch = 0
        self.resumed_from: int | None = None
        self.last_eval, self.eval_owed, self.first_step_logged = -1, False, False
        self.settle_s = 0.0  # this attempt's settling pass (settle_buckets), in seconds
        self.best: dict | None = None  # the evaluation best.pt holds: its step and figures
        self.best_ema: dict | None = None  # best_ema.pt's, with --model-ema
        self.weights: dict = {"weights": cfg.model.weights} if cfg.model.weights else {}  # what the manifest records
        # The newest checkpoint that verifies, read before anything is written: a resume that would change what the
        # run is stops here, and one on another number of workers takes the --grad-accum that keeps its global batch.
        state, self.source = self._newest_checkpoint()
        self.layout = Layout(self.world, cfg.optimisation.batch_size, cfg.optimisation.grad_accum)
        self.relaid = ""  # said once logging is up: how a resume on other workers keeps the run
        if state is not None:
            cfg = self._continue(cfg, state)
        self.cfg = cfg
        self.autocast_dtype = resolve_precision(cfg, device)
        # Starting weights, read (named ones fetched once per node) before anything is written; not for a resume
        initial = read_weights(cfg.model) if cfg.model.weights and state is None else None
        self._prepare_run_dir()
        # Data and model: identical on every rank (the seed drives both); DDP also broadcasts rank 0's weights.
        torch.manual_seed(cfg.run.seed)
        train_set, val_set, self.num_classes = build_datasets(cfg, run_dir=run_dir)
        self.class_names = class_names(train_set)
        self.raw_model = self._model()
        # What the run derives from its config, once: the same function --dry-run prints it with (train/plan.py).
        self.plan = make_plan(cfg, self.world, device.type, precision_name(self.autocast_dtype), train_set, val_set,
                              self.num_classes, self.raw_model, str(run_dir), layout=self.layout)
        if state is not None:
            self._check_same_data()
        self.max_steps, self.steps_per_epoch = self.plan.max_steps, self.plan.steps_per_epoch
        self.norm = tuple(torch.tensor(self.plan.normalize[k], device=device).view(1, 3, 1, 1) for k in ("mean", "std"))
        self.train_loader, self.sampler, self.val_loader = self._loaders(train_set, val_set)
        self.optimizer, self.scheduler, self.scaler, self.ema = self._optimisation(self.raw_model)
        self.guard = DivergenceGuard(device, fp16=self.scaler.is_enabled())
        self._resume(state, initial)
        self.model = self._wrap(self.raw_model)
        self._write_run_files()
        self.last_saved = self.step if self.resumed_from is not None else -1
        self.tracker = start_tracking(cfg.tracking, run_dir, self.step) if is_main() else None
        self.metrics = MetricsWriter(run_dir if is_main() else None, cfg.checkpoints.tensorboard, resume_step=self.step,
                                     tracker=self.tracker)
        self.telemetry = GpuTelemetry(device)
        self.window = LogWindow(device, self.world * cfg.optimisation.batch_size * cfg.optimisation.grad_accum)
        self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg.regularisation.label_smoothing)
        aug = cfg.augmentation
        self.augment = BatchAugment(aug, self.num_classes) if BatchAugment.wanted(aug) else None

    def release(self) -> None:
        """The end of a clean run (done or stopped): drop the DDP wrapper, its reducer and, under --compile,
        the compiled module it wraps, while every peer is still in the group. Freed only when run()'s frame
        ends, after the peers have left, they were torn down without them, and a finished run's last rank
        hung there (distributed.teardown now refuses to leave before they are gone)."""
        watchdog.enter("the end of the run (freeing the DDP wrapper)", self.limit)
        self.model = self.raw_model
        watchdog.pause()

    # ------------------------------------------------------------ the loop

    def train(self) -> int:
        """The run from where it stands to max_steps. Returns the exit code (0 done, 75 stopped)."""
        cfg = self.cfg
        watchdog.enter("training", self.limit)
        try:
            if self.eval_owed:  # stopped at an evaluation step before evaluating
                self.evaluate()
            if cfg.run.stop_at and self.resumed_from is not None and cfg.run.stop_at <= self.step < self.max_steps:
                return self.stop_here(f"--stop-at {cfg.run.stop_at}: already at step {self.step}", save=False)
            self.model.train()
            self.settle_s = self.settle_buckets()
            batches = self.batches()
            while self.step < self.max_steps:
                lr = self.optimizer.param_groups[0]["lr"]  # the rate this step trains at
                losses = self.train_step(batches)
                self.guard.observe(self.step, losses, lr)
                self.after_step(losses)
                if self.stop.agreed() or self.step == cfg.run.stop_at:
                    return self.stop_here("--stop-at" if self.step == cfg.run.stop_at else
                                          self.stop.received or "a stop signal on another rank")
                if self.is_eval_step(self.step):
                    self.evaluate()
                if self.step % cfg.checkpoints.save_every == 0 and self.step < self.max_steps:
                    self.save(f"every {cfg.checkpoints.save_every} steps")
            return self.finish()
        finally:
            self.metrics.close()

    def train_step(self, batches: Iterator) -> list[torch.Tensor]:
        """One optimizer step: forward and backward over --grad-accum micro-batches (gradients synchronised
        on the last only), clip, optimizer and schedule. Returns the micro-batches' losses."""
        cfg, model, scaler = self.cfg, self.model, self.scaler
        losses = []
        for micro in range(cfg.optimisation.grad_accum):
            x, y = next(batches)
            if self.augment is not None:  # random erasing, Mixup/CutMix: seeded by the position, not the stream
                rank0, micro0 = origin(self.rank, micro, self.world, self.sampler.layout)  # the laid-out run's
                x, y = self.augment(x, y, batch_seed(cfg.run.seed, self.step, micro0, rank0))
                x = x.contiguous(memory_format=torch.channels_last) if cfg.model.channels_last else x
            last = micro == cfg.optimisation.grad_accum - 1
            with contextlib.nullcontext() if last or not isinstance(model, DDP) else model.no_sync():
                with torch.autocast(self.device.type, dtype=self.autocast_dtype,
                                    enabled=self.autocast_dtype is not None):
                    loss = self.criterion(model(x), y) / cfg.optimisation.grad_accum
                scaler.scale(loss).backward()
            losses.append(loss.detach())
        if cfg.optimisation.grad_clip > 0:
            scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), cfg.optimisation.grad_clip)
        scaler.step(self.optimizer)
        scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.update_ema()
        epoch_ended = self.advance()
        if cfg.schedule.schedule_unit == "step" or epoch_ended:
            self.scheduler.step()
        return losses

    def advance(self) -> bool:
        """The position after an optimizer step, the one place it moves forward (a resume sets it from the
        checkpoint). Returns whether the step ended an epoch (the position is then the next epoch's start)."""
        self.step += 1
        self.step_in_epoch += 1
        if self.step_in_epoch < self.steps_per_epoch:
            return False
        self.epoch, self.step_in_epoch = self.epoch + 1, 0
        return True

    def update_ema(self) -> None:
        """The reference's EMA rule: every --model-ema-steps optimizer steps of an epoch (counted from its
        first), restarted from the weights while the warm-up lasts."""
        if self.ema is None or self.step_in_epoch % self.cfg.regularisation.model_ema_steps:
            return
        self.ema.update_parameters(self.raw_model)
        if self.in_warmup():
            self.ema.restart()

    def in_warmup(self) -> bool:
        """Whether the optimizer step just taken was in the warm-up (an epoch of it, with --schedule-unit epoch)."""
        if self.cfg.schedule.schedule_unit == "epoch":
            return self.epoch < self.cfg.schedule.warmup_epochs
        return self.step < self.plan.warmup_steps

    def settle_buckets(self) -> float:
        """DDP runs its first backward with every gradient in one bucket, then lays its buckets out anew in the
        order the gradients became ready; with more than 2 ranks the all-reduce's summation order depends on
        where a value sits in its bucket. So every attempt (a fresh start, a resume, a restart) makes that
        first backward here, on a batch of zeros, and leaves no trace: the gradients dropped, the parameters
        untouched (no optimizer step), the buffers (BatchNorm statistics) and every RNG stream restored. Its
        first real step then runs with the rebuilt layout, as an uninterrupted run's every step does. Returns
        the seconds it took (make bench reports them against a step)."""
        if not isinstance(self.model, DDP):
            return 0.0
        cfg, started = self.cfg, time.perf_counter()
        buffers = [b.detach().clone() for b in self.raw_model.buffers()]
        rng = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None)
        x = torch.zeros(cfg.optimisation.batch_size, 3, cfg.data.image_size, cfg.data.image_size, device=self.device)
        x = x.contiguous(memory_format=torch.channels_last) if cfg.model.channels_last else x
        for _ in range(2 if cfg.model.static_graph else 1):  # static_graph: its layout settles a pass later (measured)
            with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
                y = torch.zeros(cfg.optimisation.batch_size, dtype=torch.long, device=self.device)
                loss = self.criterion(self.model(x), y)
            loss.backward()
            self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for buffer, saved in zip(self.raw_model.buffers(), buffers, strict=True):
                buffer.copy_(saved)
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1], self.device)
            torch.cuda.synchronize(self.device)  # once per attempt: the time is the pass's, not its launch's
        return time.perf_counter() - started

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Micro-batches on the device, epoch after epoch from the position the run resumed at; the time
        spent waiting for each goes into the logging window."""
        opt, channels_last = self.cfg.optimisation, self.cfg.model.channels_last
        while True:
            epoch = self.epoch
            self.sampler.set_epoch(epoch, start=self.step_in_epoch * opt.grad_accum * opt.batch_size)
            loader = iter(self.train_loader)
            while self.epoch == epoch:  # until advance() has moved into the next epoch
                waiting = time.perf_counter()
                x, y = next(loader)
                self.window.wait += time.perf_counter() - waiting
                x = prepare_inputs(x, self.device, channels_last, *self.norm)
                yield x, y.to(self.device, non_blocking=True)

    def after_step(self, losses: list[torch.Tensor]) -> None:
        """The watchdog, the logging window and, once, the time from launch to the first step."""
        watchdog.progress()
        self.window.add(losses)
        if not self.first_step_logged:  # launch to first optimizer step, start-up included (no sync)
            self.first_step_logged = True
            self.metrics.write(self.step, "first_step", {"since_start_s": time.time() - process_start_time(),
                                                         "settle_s": self.settle_s})
        if self.step % self.cfg.checkpoints.log_every == 0 or self.step == self.max_steps:
            self.log_window()
            self.check_health()

    def log_window(self) -> None:
        """One log line and metrics record: the window's means over every rank, with GPU telemetry."""
        window = self.window.report(self.world)
        values = {"loss": window["loss"], "lr": self.scheduler.get_last_lr()[0],
                  **{k: window[k] for k in ("samples_per_s", "step_time_s", "data_wait_frac")},
                  "epoch": self.epoch - (self.step_in_epoch == 0)}  # the epoch of the step just taken
        for r, reading in enumerate(gather(self.telemetry.read()) if self.device.type == "cuda" else []):
            # A rank without NVML reads {}: it adds nothing; a MIG slice has no utilisation.
            values.update({f"gpu{r}_{k}": v for k, v in reading.items()})
        log.info("step %d/%d  loss %.4f  lr %.2e  %.0f samples/s  data wait %.1f%%", self.step, self.max_steps,
                 values["loss"], values["lr"], values["samples_per_s"], 100 * values["data_wait_frac"])
        self.metrics.write(self.step, "train", values)
        self.write_status("running")  # alive: the step and the time, at every log line

    def check_health(self, models: tuple = ()) -> None:
        """Every rank at once: stop a diverged run (train/health.py) before it writes anything; models: weights about
        to be written, checked too. Exit code 2 and one line: what happened, what to try, where to start again."""
        why = self.guard.check(self.step, self.scaler, models)
        if why is None:
            return
        newest = ckpt.list_checkpoints(self.run_dir)[-1:] if is_main() else []
        kept = broadcast_from_main(str(newest[0]) if newest else None)
        opt, precision = self.cfg.optimisation, precision_name(self.autocast_dtype)
        clip = "--grad-clip 1.0" if not opt.grad_clip else f"a --grad-clip below {opt.grad_clip:g}"
        other = {"fp16": ", --precision bf16 or fp32", "bf16": ", --precision fp32"}.get(precision, "")
        start = (f"--weights {kept} starts it from this run's newest checkpoint, which is finite" if kept else
                 "this run saved no checkpoint")
        raise Diverged(f"{why}; a restart cannot mend that: try a lower --lr, {clip}{other}, in a new --run-dir "
                       f"({start})")

    def is_eval_step(self, step: int) -> bool:
        every = self.cfg.checkpoints.eval_every
        return bool(every) and step % every == 0 and step < self.max_steps

    def evaluate(self) -> dict:
        self.check_health()  # a diverged model is neither evaluated nor kept as best.pt
        watchdog.enter(f"evaluation at step {self.step}", self.limit)
        self.last_eval = self.step
        models = {"": self.raw_model, **({"EMA ": self.ema.module} if self.ema is not None else {})}
        results = {name: evaluate(model, self.val_loader, self.device, self.autocast_dtype,
                                  self.cfg.model.channels_last, watchdog.progress, top5=self.num_classes > 5,
                                  norm=self.norm)
                   for name, model in models.items()}
        watchdog.enter("training", self.limit)
        for name, figures in results.items():
            top5 = f", top-5 {100 * figures['top5']:.2f}%" if "top5" in figures else ""
            log.info("eval step %d: %sloss %.4f, accuracy %.2f%%%s over %d samples",
                     self.step, name, figures["loss"], 100 * figures["accuracy"], top5, figures["samples"])
        result = {**results[""], **{f"ema_{k}": v for k, v in results.get("EMA ", {}).items() if k != "samples"}}
        self.metrics.write(self.step, "eval", result)
        self.keep_best(results[""])
        if self.ema is not None:
            self.keep_best(results["EMA "], ema=True)
        return result

    def keep_best(self, result: dict, ema: bool = False) -> None:
        """best.pt: the model of the evaluation with the highest top-1 so far (a tie keeps the earlier), apart
        from the newest-K checkpoints, written atomically; status.json names it. ema: best_ema.pt, the EMA's."""
        best = self.best_ema if ema else self.best
        if best is not None and result["accuracy"] <= best["val_accuracy"]:
            return
        best = {"step": self.step, **{f"val_{k}": v for k, v in result.items()}}
        if ema:
            self.best_ema, model, path = best, self.ema.module, self.run_dir / "best_ema.pt"
        else:
            self.best, model, path = best, self.raw_model, self.run_dir / "best.pt"

        def write() -> None:
            state = {"model": model.state_dict(), **best, "config": self.cfg.to_dict()}
            runfiles.atomic_write(path, ckpt.serialise(state))
            if self.tracker:
                self.tracker.upload(path)

        on_main(write, lambda e: f"could not write {path.name}: {runfiles.write_problem(self.run_dir, e)}")

    def stop_here(self, reason: str, save: bool = True) -> int:
        """A stop signal (agreed by every rank), or --stop-at: checkpoint, status 'stopped', exit 75."""
        if save:
            log.info("%s: saving at step %d and exiting with code %d (run again to resume)",
                     reason, self.step, EXIT_STOPPED)
            self.save(reason)
        else:
            log.info("%s, nothing to train (exit %d)", reason, EXIT_STOPPED)
        self.write_status("stopped", exit_code=EXIT_STOPPED)
        return EXIT_STOPPED

    def finish(self) -> int:
        """At max_steps: the last checkpoint, the final evaluation, model.pt and status 'done'."""
        if self.last_saved != self.step:
            self.save("end of run")
        final = self.evaluate()
        self.check_health((self.raw_model, *([self.ema.module] if self.ema is not None else [])))
        if is_main():
            runfiles.atomic_write(self.run_dir / "model.pt", ckpt.serialise(self.raw_model.state_dict()))
            if self.ema is not None:  # the average's weights, as model.pt's: make evaluate/export WEIGHTS=ema
                runfiles.atomic_write(self.run_dir / "model_ema.pt", ckpt.serialise(self.ema.module.state_dict()))
            self.write_status("done", **{f"val_{k}": v for k, v in final.items()})
            log.info("done: %s", self.run_dir / "model.pt")
            if self.tracker:
                for name in ("model.pt", "manifest.json"):
                    self.tracker.upload(self.run_dir / name)
        return EXIT_DONE

    def write_status(self, state: str, **extra) -> None:
        if is_main():
            best = {"best": {"path": "best.pt", **self.best}} if self.best else {}
            if self.best_ema:
                best["best_ema"] = {"path": "best_ema.pt", **self.best_ema}
            runfiles.write_status(self.run_dir, state, self.step, **run_length(self.cfg, self.max_steps), **best,
                                  **extra)

    # ------------------------------------------------------------ checkpoints

    def save(self, reason: str) -> None:
        """Every rank's RNG state to rank 0, which writes the checkpoint; every rank learns if that failed."""
        self.check_health((self.raw_model, *([self.ema.module] if self.ema is not None else [])))
        watchdog.enter(f"the checkpoint save of step {self.step}", self.limit)
        rng = gather({"cpu": torch.get_rng_state(),
                      "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None})

        def write() -> None:
            path = ckpt.save_checkpoint(self.run_dir, self.step, self.state_dict(rng),
                                        self.cfg.checkpoints.keep_checkpoints)
            log.info("saved %s (%s)", path, reason)
            if self.tracker and self.cfg.tracking.mlflow_checkpoints:
                for file in (path, ckpt.sidecar_of(path)):
                    self.tracker.upload(file, "checkpoints")

        on_main(write, self._save_failed)
        self.last_saved = self.step
        watchdog.enter("training", self.limit)

    def _save_failed(self, e: OSError) -> str:
        previous = ckpt.list_checkpoints(self.run_dir)[-1:]
        error = (f"could not save the checkpoint of step {self.step} in {self.run_dir} ({e.strerror or e}); "
                 f"{'kept ' + previous[0].name if previous else 'no earlier checkpoint'}: "
                 f"free space or fix permissions, then run the same command to resume")
        with contextlib.suppress(OSError):  # best effort: the disk may be full
            runfiles.write_status(self.run_dir, "failed", self.step, error=error, needed_bytes=getattr(e, "needed", 0))
        return error

    def state_dict(self, rng: list[dict]) -> dict:
        """A checkpoint: the unwrapped model, optimizer, schedule, grad scaler, the position, every rank's
        RNG state (`rng`, gathered), the layout the position counts in, and the config."""
        cfg = self.cfg
        return {"model": self.raw_model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "step": self.step, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                "world_size": self.world, "batch_size": cfg.optimisation.batch_size,
                "grad_accum": cfg.optimisation.grad_accum, "layout": self.layout.to_dict(),
                "max_steps": self.max_steps, "rng": rng,
                "config": cfg.to_dict(), "eval_owed": self.is_eval_step(self.step) and self.last_eval != self.step,
                "best": self.best, "ema": self.ema.state_dict() if self.ema is not None else None,
                "best_ema": self.best_ema}

    def load_state_dict(self, state: dict, source: Path) -> None:
        """Back to where `state` (from the checkpoint `source`) left off, this rank's RNG included. A run made longer
        or shorter (another --max-steps or --epochs) continues on the schedule of its new length, as plan.json shows
        it: the schedule is that of the new length, stepped to this step."""
        cfg = self.cfg
        try:
            self.raw_model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise ConfigError(f"{source} does not fit this model ({str(e).splitlines()[0][:160]}): "
                              f"use a new --run-dir, or the code that made the checkpoint") from None
        self.step, self.epoch, self.step_in_epoch = state["step"], state["epoch"], state["step_in_epoch"]
        if self.step > self.max_steps:
            longer = f"--epochs above {cfg.run.epochs}" if cfg.run.epochs else f"--max-steps of {self.step} or more"
            raise ConfigError(f"{source} is at step {self.step}, past this run's {self.max_steps} steps: give "
                              f"{longer}, or start a new --run-dir")
        self.resumed["max_steps"] = saved_length(state, self.steps_per_epoch)
        if self.resumed["max_steps"] == self.max_steps:
            self.scheduler.load_state_dict(state["scheduler"])
        else:
            self.scheduler = schedule_at(cfg.schedule, self.optimizer,
                                         *schedule_lengths(cfg, self.plan.max_steps, self.plan.warmup_steps),
                                         self.step if cfg.schedule.schedule_unit == "step" else self.epoch)
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])
        if state["scaler"] and self.scaler.is_enabled():  # empty unless the checkpoint was made with fp16
            self.scaler.load_state_dict(state["scaler"])
        self.eval_owed = state.get("eval_owed", False) and self.step < self.max_steps  # older checkpoints: none
        self.best, self.best_ema = state.get("best"), state.get("best_ema")
        if self.step_in_epoch >= self.steps_per_epoch:  # saved at an epoch's end: the next one's start
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        if state["world_size"] != self.world:  # per-rank RNG streams cannot carry over
            torch.manual_seed(cfg.run.seed * 7919 + self.rank + self.step)
        else:
            torch.set_rng_state(state["rng"][self.rank]["cpu"].cpu())
            if self.device.type == "cuda" and state["rng"][self.rank]["cuda"] is not None:
                torch.cuda.set_rng_state(state["rng"][self.rank]["cuda"].cpu(), self.device)

    # ------------------------------------------------------------ set-up

    def _prepare_run_dir(self) -> None:
        def prepare() -> None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            probe = self.run_dir / f".write-test-{os.getpid()}"
            probe.write_text("ok")
            probe.unlink()
            runfiles.write_status(self.run_dir, "starting", -1)  # a crash before training must not look "stopped"
            freed = ckpt.remove_partial(self.run_dir)
            if freed:
                print(f"removed {freed / 2**20:.1f} MiB of unfinished checkpoint files", file=sys.stderr)

        on_main(prepare, lambda e: runfiles.write_problem(self.run_dir, e))
        setup_logging(self.run_dir if is_main() else None)

    def _loaders(self, train_set, val_set) -> tuple:
        """(train loader, its sampler, validation loader)."""
        cfg, plan, pin = self.cfg, self.plan, self.device.type == "cuda"
        train_loader, sampler = build_train_loader(cfg, train_set, self.rank, self.world, pin, self.device,
                                                   layout=(self.layout.world_size, self.layout.grad_accum))
        val_loader = build_val_loader(cfg, val_set, self.rank, self.world, pin, self.device)
        if is_main() and cfg.run.epochs:  # the run's length in steps, from its length in epochs on this layout
            log.info("--epochs %d: %d steps (%d per epoch: %d images / (%d workers x batch %d x accumulation %d)), "
                     "warm-up %d steps", cfg.run.epochs, plan.max_steps, plan.steps_per_epoch, len(train_set),
                     self.world, cfg.optimisation.batch_size, cfg.optimisation.grad_accum, plan.warmup_steps)
        if is_main() and cfg.augmentation.ra_reps and self.world == 1:
            log.info("sampler: %s", plan.sampler)
        return train_loader, sampler, val_loader

    def _model(self) -> torch.nn.Module:
        """The model on its device, frozen where --freeze says, SyncBatchNorm where asked (not yet wrapped)."""
        cfg = self.cfg
        model = build_model(cfg.model, self.num_classes)
        freeze(model, frozen_names(cfg.model, model, self.num_classes))  # before the optimizer: no state for them
        if cfg.model.sync_bn and self.world > 1:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model.to(self.device)
        if cfg.model.channels_last:
            model.to(memory_format=torch.channels_last)
        return model

    def _optimisation(self, model: torch.nn.Module) -> tuple:
        """(optimizer, schedule, grad scaler, EMA or None) of the model."""
        cfg, plan = self.cfg, self.plan
        optimizer = build_optimizer(cfg.optimisation, model, plan.param_groups)
        scaler = torch.amp.GradScaler(self.device.type, enabled=self.autocast_dtype == torch.float16)
        ema = ModelEma(model, plan.ema["decay"], self.device) if plan.ema else None
        scheduler = build_scheduler(cfg.schedule, optimizer, *schedule_lengths(cfg, plan.max_steps, plan.warmup_steps))
        return optimizer, scheduler, scaler, ema

    def _newest_checkpoint(self) -> tuple[dict | None, Path | None]:
        """The newest checkpoint that verifies (rank 0 looks; every rank loads it), or (None, None) for a new run."""
        run_dir = self.run_dir
        newest = on_main(lambda: ckpt.newest_valid(run_dir) if run_dir.is_dir() else None,
                         lambda e: f"cannot read the checkpoints in {run_dir} ({e.strerror or e}): check the disk and "
                                   f"permissions")
        newest = broadcast_from_main(str(newest) if newest else None)
        if newest is None:
            return None, None
        state = ckpt.load_checkpoint(Path(newest), self.device)
        if not isinstance(state, dict) or not {"model", "optimizer", "step", "config"} <= state.keys():
            raise ConfigError(f"{newest} is not a trainbox checkpoint (no model/optimizer/step/config): move it out "
                              f"of the run directory")
        return state, Path(newest)

    def _continue(self, cfg: Config, state: dict) -> Config:
        """The config that continues the checkpoint `state`: the settings it fixes unchanged (else one line), and on
        another number of workers the --grad-accum that keeps the run's global batch and its steps' samples."""
        changes = changed_settings(state["config"], cfg.to_dict())
        self.resumed = {"config": state["config"], "world_size": state["world_size"]}
        if changes:
            raise ConfigError(refusal(self.run_dir, changes, self.source))
        self.layout = Layout(**state["layout"]) if "layout" in state else \
            Layout(state["world_size"], state["batch_size"], state["grad_accum"])
        accum = continue_layout(self.layout, self.world, cfg.optimisation.batch_size, cfg.optimisation.grad_accum,
                                cfg.optimisation.grad_accum != self.layout.grad_accum, self.run_dir)
        if self.world != self.layout.world_size:
            self.relaid = relayout_line(self.layout, self.world, accum)
        return cfg.replace(grad_accum=accum) if accum != cfg.optimisation.grad_accum else cfg

    def _check_same_data(self) -> None:
        """A resume trains on the data the run trained on, wherever --data-dir now points: the same number of images
        in each split and the same classes as plan.json and classes.json say (rank 0 reads them; all learn)."""
        def differences() -> list[str]:
            saved, classes = runfiles.read_json(self.run_dir / "plan.json"), runfiles.read_classes(self.run_dir)
            found = [f"{what} {saved[key]} -> {getattr(self.plan, key)}" for key, what in
                     (("train_samples", "training images"), ("val_samples", "validation images"),
                      ("num_classes", "classes")) if key in saved and saved[key] != getattr(self.plan, key)]
            if classes is not None and len(classes) == len(self.class_names) and classes != self.class_names:
                found.append("the class names differ")
            return found

        found = broadcast_from_main(differences() if is_main() else None)
        if found:
            raise ConfigError(f"{self.cfg.data.data_dir} is not the data {self.run_dir} trained on "
                              f"({', '.join(found)}): point --data-dir at that data, or start a new --run-dir")

    def _resume(self, state: dict | None, initial: tuple[dict, dict] | None) -> None:
        """Back to the checkpoint `state` (the newest that verifies). Without one, the starting --weights (initial:
        read before anything was written) and a fresh per-rank random stream (dropout and the like)."""
        if state is None:
            if self.cfg.model.weights:  # a new run: its starting weights (a resume has them in its checkpoint)
                state, self.weights = initial
                self.raw_model.load_state_dict(fitted(self.cfg.model, state, self.raw_model, self.num_classes))
            torch.manual_seed(self.cfg.run.seed * 7919 + self.rank)
            return
        self.load_state_dict(state, self.source)
        self.resumed_from = self.step
        log.info("resumed from %s (step %d of %d)", self.source, self.step, self.max_steps)
        if self.relaid:
            log.info("%s", self.relaid)

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        cfg = self.cfg
        if cfg.model.compile:
            model = torch.compile(model)
        if dist.is_initialized():
            model = wrap(model, self.device, gradient_as_bucket_view=True, bucket_cap_mb=cfg.model.bucket_cap_mb,
                         static_graph=cfg.model.static_graph)
            if cfg.run.deterministic and self.world > 1:
                model.register_comm_hook(None, ordered_allreduce_hook)
        return model

    def plan_as_trained(self) -> dict:
        """plan.json: this start's plan, with the run's resumes that changed something (at which step, what) and, for a
        run made longer or shorter, the learning rates each step trained at: the earlier length's before the resume."""
        plan = self.plan.to_dict()
        if self.resumed_from is None:
            return plan
        before = runfiles.read_json(self.run_dir / "plan.json")
        record = resume_record(self.step, self.resumed["config"], self.cfg.to_dict(), self.resumed["world_size"],
                               self.world)
        plan["resumes"] = before.get("resumes", []) + ([record] if record else [])
        if self.resumed["max_steps"] != self.max_steps:
            plan["lr"] = spliced_lr(before.get("lr"), plan["lr"], self.step, self.steps_per_epoch)
        elif before.get("lr"):  # the same length: the rates as trained so far, and on from there as planned
            plan["lr"] = before["lr"]
        return plan

    def _write_run_files(self) -> None:
        cfg, run_dir = self.cfg, self.run_dir
        hostnames = gather(socket.gethostname())

        def write() -> None:
            runfiles.write_run_files(run_dir, cfg.to_dict(), self.class_names, self.plan_as_trained())
            manifest = build_manifest(cfg, identity(), self.device, hostnames, self.resumed_from)
            runfiles.write_manifest(run_dir, {**manifest, **self.weights})
            self.write_status("running")

        on_main(write, lambda e: runfiles.write_problem(run_dir, e))
        if is_main():
            log.info("run %s: %d worker(s) via %s on %s, %d steps (%d per epoch), global batch %d, precision %s",
                     run_dir, self.world, self.launcher, self.device.type, self.max_steps, self.steps_per_epoch,
                     self.world * cfg.optimisation.batch_size * cfg.optimisation.grad_accum,
                     str(self.autocast_dtype or "fp32").replace("torch.", ""))
            if cfg.data.dataset == "shards":
                log.info("data: %s", packed_with(Path(cfg.data.data_dir)))
            if self.device.type == "cuda" and not cfg.run.deterministic:  # said once, where it applies
                log.info("note: on CUDA, a resumed or restarted run equals an uninterrupted one bit for bit only with "
                         "--deterministic (cuDNN and cuBLAS pick non-deterministic kernels otherwise, so even two "
                         "uninterrupted runs differ in rounding)")


# ---------------------------------------------------------------- pieces the Trainer uses

def unrecoverable(error: Exception, trainer: Trainer | None, device: torch.device,
                  cfg: Config) -> ConfigError | None:
    """The error as one a restart cannot mend (a user's mistake, a bad file, out of memory, or a peer's
    such error), or None: a crash or a lost peer, which a restart may mend. One that a DataLoader worker
    re-raised (a bad image) carries the worker's traceback in its message: its line alone goes on, to the peers
    and status.json."""
    if isinstance(error, ConfigError):
        return error if one_line(error) == str(error) else type(error)(one_line(error))
    if is_out_of_memory(error):
        if watchdog.phase == "training" and trainer is not None:
            where = f"training step {trainer.step + 1}"
        else:
            where = watchdog.phase if watchdog.phase != "start-up" else "start-up (the data and the model)"
        return out_of_memory(error, where, device, cfg)
    peer = peer_unrecoverable()
    if peer is None and trainer is not None:  # rank 0, the store's host, gave up: its status.json says why
        status = runfiles.read_status(trainer.run_dir)
        peer = status.get("error") if status.get("state") == "failed" and "exit_code" in status else None
    return PeerGaveUp(peer) if peer is not None else None


def end_unrecoverable(error: ConfigError, run_dir: Path | None, trainer: Trainer | None) -> None:
    """Every rank ends with exit code 2: this rank's line goes to its peers (a peer blocked in a collective with it
    reads it there once this rank has exited), rank 0 records it in status.json with the torchrun launch it
    happened in, whose restarts then refuse at once (runfiles.failed_in_this_launch). Nothing already saved is
    touched."""
    if not isinstance(error, PeerGaveUp):  # every rank may meet it: one of them prints it
        first = announce_unrecoverable(str(error))
        if first is None:  # rank 0 ended before this rank said it: its line was said if it recorded a failure
            first = run_dir is None or not runfiles.failed_since(run_dir, process_start_time())
        error.first = first
    if is_main() and run_dir is not None and run_dir.is_dir():
        last = runfiles.read_status(run_dir)
        kept = {k: v for k, v in last.items() if k not in ("state", "step", "slurm_job_id", "slurm_restart_count")} \
            if last.get("state") == "failed" else {}  # a failed save's own record (the space it needed) stays
        with contextlib.suppress(OSError):
            runfiles.write_status(run_dir, "failed", trainer.step if trainer else last.get("step", -1),
                                  **{"error": str(error), **kept, "exit_code": EXIT_BAD_INPUT},
                                  **({"launch": os.environ["TORCHELASTIC_RUN_ID"]}
                                     if "TORCHELASTIC_RUN_ID" in os.environ else {}))


def run_length(cfg: Config, max_steps: int) -> dict:
    """What status.json says of the run's length: its steps (the plan's), and its epochs when given in --epochs."""
    return {"max_steps": max_steps, **({"epochs": cfg.run.epochs} if cfg.run.epochs else {})}


def resolve_run_dir(cfg: Config) -> Path:
    """The run directory (config.launch_run_dir), rank 0's on every rank: nodes' torchruns start apart."""
    return Path(broadcast_from_main(launch_run_dir(cfg) if is_main() else None))


def already_finished(run_dir: Path, cfg: Config) -> bool:
    """A restart after the run ended (a worker lost during shutdown), or the same command again: the run's
    figures stand, and nothing is evaluated or written again (rank 0 decides for all)."""
    status = runfiles.read_status(run_dir) if is_main() else {}
    finished = is_main() and ckpt.finished(status, cfg.run.max_steps, (run_dir / "model.pt").is_file(), cfg.run.epochs)
    done = broadcast_from_main(finished if is_main() else None)
    if done and is_main():
        longer = "--epochs" if cfg.run.epochs else "--max-steps"
        print(f"trainbox: {run_dir} already finished at step {status['step']} (model.pt written): nothing to "
              f"do; pass a larger {longer} to train on, or a new --run-dir", file=sys.stderr)
    return done
