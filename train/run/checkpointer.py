"""Every file a run's weights go to, and what a checkpoint holds. The file format beneath it (atomic, CRC32, the newest
that verifies) is train/files/checkpoint_io.py.

  newest_checkpoint(run_dir, device)  the checkpoint a start resumes from, read before anything is written
  saved_length(state, steps_per_epoch) the steps a checkpoint's run was to train for
  Checkpointer                        one per run: rank 0 writes, every rank takes part
    .restore(state, source)           back to where `state` left off (or a fresh start's random streams)
    .save(position, reason)           RUN_DIR/checkpoints/step_N.pt (sharded: step_N.dcp/), every rank's RNG state in it
    .keep_best(step, result, ema)     best.pt (best_ema.pt): the weights of the best evaluation so far
    .save_final()                     model.pt (model_ema.pt): the weights the run ends with
    .state_dict() / load_state_dict() a checkpoint's layout, in one place
    .record(state, step)              status.json: the run's state, step and length, and the best files it names
  capture_rng / restore_rng           one rank's random streams (the CPU's, and the GPU's on one)

A checkpoint holds the model (unwrapped), the optimizer, the schedule, the grad scaler, the EMA, the best evaluations,
every rank's RNG state, the layout its position counts in, the config, and the position itself: the Trainer's
(Trainer.state_dict: step, epoch, step in epoch, whether that step's evaluation is owed), the one state the Trainer
keeps, given to `save` and given back by `restore`. With --checkpoint-format sharded the model and the optimizer are
each rank's shards in a folder beside the rest (train/files/shards.py), and a run may resume from either kind.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from train.base.errors import ConfigError
from train.base.watchdog import watchdog
from train.cluster.distributed import broadcast_from_main, gather, on_main
from train.cluster.identity import identity, is_main
from train.cluster.sharding import Replicated
from train.components.optim import schedule_at, schedule_lengths
from train.config.resume import Layout, Resumed
from train.config.settings import Config, Schedule
from train.files import checkpoint_io as ckpt
from train.files import rundir, shards, writable
from train.tasks.task import Task

log = logging.getLogger("train")


def capture_rng(device: torch.device) -> dict:
    """This rank's random streams: the CPU's, and the GPU's on one (else None)."""
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def restore_rng(rng: dict, device: torch.device) -> None:
    """Back to the streams capture_rng took (a checkpoint loaded onto a GPU holds them there: they go back on the
    CPU first, as torch asks)."""
    torch.set_rng_state(rng["cpu"].cpu())
    if device.type == "cuda" and rng["cuda"] is not None:
        torch.cuda.set_rng_state(rng["cuda"].cpu(), device)


def newest_checkpoint(run_dir: Path, device: torch.device) -> tuple[dict | None, Path | None]:
    """The newest checkpoint that verifies (rank 0 looks; every rank loads it), or (None, None) for a new run."""
    newest = on_main(lambda: ckpt.newest_valid(run_dir) if run_dir.is_dir() else None,
                     lambda e: f"cannot read the checkpoints in {run_dir} ({e.strerror or e}): check the disk and "
                               f"permissions")
    newest = broadcast_from_main(str(newest) if newest else None)
    if newest is None:
        return None, None
    newest = Path(newest)
    state = ckpt.load_checkpoint(newest, device)
    parts = {"param_groups"} if newest.is_dir() else {"model", "optimizer"}  # a sharded folder's are in its shards
    if not isinstance(state, dict) or not parts | {"step", "config"} <= state.keys():
        raise ConfigError(f"{newest} is not a trainbox checkpoint (no {'/'.join(sorted(parts))}/step/config): move "
                          f"it out of the run directory")
    return state, Path(newest)


def saved_length(state: dict, steps_per_epoch: int) -> int:
    """The steps a checkpoint's run was to train for (checkpoints of older versions: from their config)."""
    if "max_steps" in state:
        return state["max_steps"]
    config = state["config"]
    return config["epochs"] * steps_per_epoch if config.get("epochs") else config["max_steps"]


@dataclass(frozen=True)
class Keeping:
    """What the Checkpointer reads of the run's settings, and nothing else (Keeping.of)."""

    keep: int  # --keep-checkpoints: the newest K step_N.pt
    sharded: bool  # --checkpoint-format sharded: each rank's shards into step_N.dcp/
    upload: bool  # --mlflow-checkpoints: every checkpoint to MLflow too
    seed: int  # a fresh start's per-rank random streams, and a resume's on another world size
    epochs: int  # --epochs (0: the run is --max-steps long), as status.json and a refusal name the length
    batch_size: int  # per rank, and
    grad_accum: int  # the micro-batches of a step, as a checkpoint records them (its layout: Layout)
    schedule: Schedule  # the learning-rate schedule, rebuilt for a run made longer or shorter
    settings: dict  # the config, as every checkpoint and best.pt hold it

    @classmethod
    def of(cls, cfg: Config) -> Keeping:
        return cls(cfg.checkpoints.keep_checkpoints, cfg.checkpoints.checkpoint_format == "sharded",
                   cfg.tracking.mlflow_checkpoints, cfg.run.seed, cfg.run.epochs,
                   cfg.optimisation.batch_size, cfg.optimisation.grad_accum, cfg.schedule, cfg.to_dict())


class Checkpointer:
    """The run's weights files and its checkpoints' contents, over the parts a checkpoint holds."""

    def __init__(self, run_dir: Path, device: torch.device, keeping: Keeping, plan, layout: Layout, *,
                 model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, scaler: torch.amp.GradScaler,
                 ema: torch.nn.Module | None, task: Task, spread: Replicated | None = None):
        self.run_dir, self.device, self.keeping, self.plan, self.layout = run_dir, device, keeping, plan, layout
        self.spread = spread or Replicated()  # the whole state of a sharded model is gathered by every rank together
        self.task = task  # its metric picks best.pt; its state goes into every checkpoint
        self.model, self.optimizer, self.scheduler, self.scaler, self.ema = model, optimizer, scheduler, scaler, ema
        self.rank, self.world = identity().global_rank, identity().world_size
        self.tracker = None  # MLflow (train/report/tracker.py): what is written goes there too, once tracking started
        self.best: dict | None = None  # the evaluation best.pt holds: its step and figures
        self.best_ema: dict | None = None  # best_ema.pt's, with --model-ema
        self.saved_step = -1  # the step of this attempt's newest checkpoint (the one it resumed from, at first)

    # ------------------------------------------------------------ the files

    def save(self, position: dict, reason: str) -> None:
        """The checkpoint at `position` (the Trainer's): every rank's RNG state to rank 0, which writes it; every rank
        learns if that failed."""
        step = position["step"]
        with watchdog.during(f"the checkpoint save of step {step}"):
            rng = gather(capture_rng(self.device))
            if self.keeping.sharded:
                self._save_shards(position, rng, reason)
                return
            state = self.state_dict(position, rng)  # every rank: a sharded model's state is gathered together

            def write() -> None:
                path = ckpt.save_checkpoint(self.run_dir, step, state, self.keeping.keep)
                log.info("saved %s (%s)", path, reason)
                if self.tracker and self.keeping.upload:
                    for file in (path, ckpt.sidecar_of(path)):
                        self.tracker.upload(file, "checkpoints")

            on_main(write, lambda e: self._save_failed(step, e))
            self.saved_step = step

    def _save_shards(self, position: dict, rng: list[dict], reason: str) -> None:
        """--checkpoint-format sharded: every rank writes its shards into the step's folder (under its temporary
        name) and checksums its share of the files; rank 0 adds the rest of the state and the checksums and renames
        the folder into place. A failure on any rank is the same one line on every rank; what was saved before
        stays."""
        step = position["step"]
        folder = ckpt.checkpoint_dir(self.run_dir) / f"step_{step:08d}{shards.SUFFIX}"
        temp = shards.temp_of(folder)
        on_main(lambda: ckpt.prepare(self.run_dir), lambda e: self._save_failed(step, e))
        try:
            written = self.spread.save_shards(self.model, self.optimizer, temp)
            share: list | str = shards.checksum_share(temp, written, self.rank, self.world)
        except OSError as e:  # DCP's failure on any rank is raised on every rank; a checksum's on its own
            share = e.strerror or str(e)
        sums = gather(share)
        problem = next((s for s in sums if isinstance(s, str)), None)
        if problem is not None:  # every rank alike: the one line, rank 0's status.json failed

            def failed() -> None:
                raise OSError(None, problem)

            on_main(failed, lambda e: self._save_failed(step, e))
        rest = ckpt.serialise(self.state_dict(position, rng, whole=False))

        def write() -> None:
            path = shards.finish(temp, rest, sums)
            ckpt.prune(self.run_dir, path, self.keeping.keep)
            log.info("saved %s (%s)", path, reason)

        on_main(write, lambda e: self._save_failed(step, e))
        self.saved_step = step

    def _save_failed(self, step: int, e: OSError) -> str:
        previous = ckpt.list_checkpoints(self.run_dir)[-1:]
        error = (f"could not save the checkpoint of step {step} in {self.run_dir} ({e.strerror or e}); "
                 f"{'kept ' + previous[0].name if previous else 'no earlier checkpoint'}: "
                 f"free space or fix permissions, then run the same command to resume")
        with contextlib.suppress(OSError):  # best effort: the disk may be full
            rundir.write_status(self.run_dir, "failed", step, error=error, needed_bytes=getattr(e, "needed", 0))
        return error

    def keep_best(self, step: int, result: dict, ema: bool = False) -> None:
        """best.pt: the model of the evaluation (at `step`) with the best score of the task's metric so far (the
        highest top-1 for classification; a tie keeps the earlier), apart from the newest-K checkpoints, written
        atomically; status.json names it. ema: best_ema.pt, the EMA's."""
        best, metric = self.best_ema if ema else self.best, self.task.metric
        if best is not None and not (result[metric] > best[f"val_{metric}"] if self.task.higher_is_better else
                                     result[metric] < best[f"val_{metric}"]):
            return
        best = {"step": step, **{f"val_{k}": v for k, v in result.items()}}
        if ema:
            self.best_ema, model, path = best, self.ema.module, self.run_dir / "best_ema.pt"
        else:
            self.best, model, path = best, self.model, self.run_dir / "best.pt"

        weights = self.spread.model_state(model) if model is self.model else model.state_dict()  # every rank

        def write() -> None:
            state = {"model": weights, **best, "config": self.keeping.settings}
            rundir.atomic_write(path, ckpt.serialise(state))
            if self.tracker:
                self.tracker.upload(path)

        on_main(write, lambda e: f"could not write {path.name}: {writable.write_problem(self.run_dir, e)}")

    def save_final(self) -> None:
        """model.pt, and with --model-ema model_ema.pt (the average's weights, as model.pt's: make evaluate/export
        WEIGHTS=ema), written atomically by rank 0; model.pt goes to MLflow too."""
        weights = self.spread.model_state(self.model)  # every rank: a sharded model's is gathered together
        if not is_main():
            return
        rundir.atomic_write(self.run_dir / "model.pt", ckpt.serialise(weights))
        if self.ema is not None:
            rundir.atomic_write(self.run_dir / "model_ema.pt", ckpt.serialise(self.ema.module.state_dict()))
        if self.tracker:
            self.tracker.upload(self.run_dir / "model.pt")

    def record(self, state: str, step: int, **extra) -> None:
        """status.json (rank 0, rundir.write_status): the run's state at `step`, its length, the best files it
        has."""
        if not is_main():
            return
        epochs, best = self.keeping.epochs, {"best": {"path": "best.pt", **self.best}} if self.best else {}
        if self.best_ema:
            best["best_ema"] = {"path": "best_ema.pt", **self.best_ema}
        length = {"max_steps": self.plan.max_steps, **({"epochs": epochs} if epochs else {})}
        rundir.write_status(self.run_dir, state, step, **length, **best, **extra)

    # ------------------------------------------------------------ what a checkpoint holds

    def state_dict(self, position: dict, rng: list[dict], whole: bool = True) -> dict:
        """A checkpoint: the unwrapped model, optimizer, schedule, grad scaler, the position (the Trainer's), every
        rank's RNG state (`rng`, gathered), the layout the position counts in, and the config. whole=False: the rest
        of a sharded checkpoint, the optimizer's groups in place of the model and the optimizer (in the shards)."""
        keeping = self.keeping
        parts = {"model": self.spread.model_state(self.model),
                 "optimizer": self.spread.optimizer_state(self.model, self.optimizer)} if whole else \
            {"param_groups": self.optimizer.state_dict()["param_groups"]}
        return {**parts,
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "step": position["step"], "epoch": position["epoch"], "step_in_epoch": position["step_in_epoch"],
                "world_size": self.world, "batch_size": keeping.batch_size,
                "grad_accum": keeping.grad_accum, "layout": self.layout.to_dict(),
                "max_steps": self.plan.max_steps, "rng": rng,
                "config": keeping.settings, "eval_owed": position["eval_owed"],
                "best": self.best, "ema": self.ema.state_dict() if self.ema is not None else None,
                "best_ema": self.best_ema, "task": {"name": self.task.name, "state": self.task.state_dict()}}

    def restore(self, state: dict | None, source: Path | None) -> Resumed | None:
        """Back to the checkpoint `state` (the newest that verifies, `source`): what it resumed, the Trainer's position
        among it. Without one, a fresh per-rank random stream (dropout and the like), and None."""
        if state is None:
            torch.manual_seed(self.keeping.seed * 7919 + self.rank)
            return None
        resumed = self.load_state_dict(state, source)
        self.saved_step = resumed.step
        log.info("resumed from %s (step %d of %d)", source, resumed.step, self.plan.max_steps)
        return resumed

    def load_state_dict(self, state: dict, source: Path) -> Resumed:
        """Back to where `state` (from the checkpoint `source`) left off, this rank's RNG included. A run made longer
        or shorter (another --max-steps or --epochs) continues on the schedule of its new length, as plan.json shows
        it: the schedule is that of the new length, stepped to this step."""
        keeping, plan = self.keeping, self.plan
        try:
            if source.is_dir():  # a sharded checkpoint: each rank reads its shards, at any number of workers
                self.spread.load_shards(self.model, self.optimizer, source, state["param_groups"])
            else:
                self.spread.load_model(self.model, state["model"])
                self.spread.load_optimizer(self.model, self.optimizer, state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise ConfigError(f"{source} does not fit this model ({str(e).splitlines()[0][:160]}): "
                              f"use a new --run-dir, or the code that made the checkpoint") from None
        step, epoch, step_in_epoch = state["step"], state["epoch"], state["step_in_epoch"]
        if step > plan.max_steps:
            longer = f"--epochs above {keeping.epochs}" if keeping.epochs else f"--max-steps of {step} or more"
            raise ConfigError(f"{source} is at step {step}, past this run's {plan.max_steps} steps: give "
                              f"{longer}, or start a new --run-dir")
        saved_max_steps = saved_length(state, plan.steps_per_epoch)
        if saved_max_steps == plan.max_steps:
            self.scheduler.load_state_dict(state["scheduler"])
        else:
            self.scheduler = schedule_at(keeping.schedule, self.optimizer,
                                         *schedule_lengths(keeping.schedule, keeping.epochs, plan.max_steps,
                                                           plan.warmup_steps),
                                         step if keeping.schedule.schedule_unit == "step" else epoch)
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])
        if state["scaler"] and self.scaler.is_enabled():  # empty unless the checkpoint was made with fp16
            self.scaler.load_state_dict(state["scaler"])
        task = state.get("task", {"name": "classification", "state": {}})  # older checkpoints: classification's
        if task["name"] != self.task.name:
            raise ConfigError(f"{source} is a checkpoint of --task {task['name']}: resume it with --task "
                              f"{task['name']}, or start a new --run-dir")
        self.task.load_state_dict(task["state"])
        eval_owed = state.get("eval_owed", False) and step < plan.max_steps  # older checkpoints: none
        self.best, self.best_ema = state.get("best"), state.get("best_ema")
        if step_in_epoch >= plan.steps_per_epoch:  # saved at an epoch's end: the next one's start
            epoch, step_in_epoch = epoch + 1, 0
        position = {"step": step, "epoch": epoch, "step_in_epoch": step_in_epoch, "eval_owed": eval_owed}
        if state["world_size"] != self.world:  # per-rank RNG streams cannot carry over
            torch.manual_seed(keeping.seed * 7919 + self.rank + step)
        else:
            restore_rng(state["rng"][self.rank], self.device)
        return Resumed(source, position, state["config"], state["world_size"], saved_max_steps)
