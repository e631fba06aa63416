"""What a resume may change. A run folder is one run: its checkpoint fixes what the run is (the data, the model, the
optimizer and its settings, the schedule, the augmentation, the seed, the precision), and a resume that asks for
something else is refused in one line before anything is written. What may change is how and how long it runs:

  FIXED            settings a checkpoint fixes; another value is refused (`changed_settings`, `refusal`)
  MAY_CHANGE       settings a resume may change (cadences, workers, timeouts, tracking, a longer run); each change is
                   recorded in plan.json's "resumes" (`resume_record`)
  Layout           the workers x --batch-size x --grad-accum the run's sample order was laid out for (its first
                   start); a resume on another number of workers keeps the global batch by raising or lowering
                   --grad-accum where it divides (`continue_layout`), and the samples of every step stay the same
  continued        the config, layout and line of a resume, from the checkpoint itself (each worker's start)
  data_differences what differs between the data a run trained on (plan.json, classes.json) and the data it finds
  plan_as_trained  plan.json of a resumed run: its resumes that changed something, the rates each step trained at

Standard library only: the checks run before any worker starts (train/run/preflight.py), and again in each worker against
the checkpoint itself (train/run/build.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from train.base.errors import ConfigError

if TYPE_CHECKING:
    from train.config.settings import Config

# What the run is. A setting added to the config must be placed in FIXED or MAY_CHANGE (tests/unit/test_resume.py).
FIXED = frozenset({
    "task", "task_settings", "seed", "dataset", "path_column", "label_column", "label_key", "image_column",
    "train_split", "val_split", "image_size", "train_samples", "val_samples",
    "normalize",
    "augment", "train_crop_size", "val_resize_size", "val_crop_size", "interpolation", "auto_augment", "ra_magnitude",
    "augmix_severity", "ra_reps", "random_erase", "mixup_alpha", "cutmix_alpha",
    "model", "weights", "freeze", "width", "sync_bn", "precision", "parallel",
    "batch_size", "optimizer", "lr", "weight_decay", "momentum", "nesterov", "norm_weight_decay", "bias_weight_decay",
    "transformer_embedding_decay", "grad_clip",
    "warmup_steps", "warmup_epochs", "lr_scheduler", "min_lr_ratio", "lr_step_size", "lr_gamma", "lr_milestones",
    "warmup_method", "warmup_decay", "schedule_unit",
    "label_smoothing", "model_ema", "model_ema_steps", "model_ema_decay",
})
# How and how long it runs. --grad-accum follows the workers (continue_layout); --data-dir may move (a container
# mounts the NAS elsewhere) while the worker checks the data itself is the same (same_data); --tokenizer may move too,
# its file's sha256 the run's (train/tasks/lm.py, same_tokenizer).
MAY_CHANGE = frozenset({
    "run_dir", "preset", "max_steps", "epochs", "stop_at", "dry_run", "deterministic",
    "spawn", "device", "timeout_s", "threads",
    "data_dir", "download", "num_workers", "decode", "tokenizer",
    "channels_last", "compile", "bucket_cap_mb", "static_graph", "activation_checkpointing",
    "grad_accum",
    "save_every", "keep_checkpoints", "checkpoint_format", "eval_every", "log_every", "tensorboard",
    "mlflow_uri", "mlflow_experiment", "mlflow_checkpoints",
})
# Not part of what a run did: never recorded as a change.
UNRECORDED = frozenset({"run_dir", "preset", "dry_run", "stop_at"})


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == "":
        return "unset"
    return str(value)


def changed_settings(saved: dict, current: dict, names=FIXED) -> list[tuple[str, object, object]]:
    """(name, saved value, current value) of each of `names` whose value differs; a name the saved config lacks (an
    older run's) is not compared."""
    return [(name, saved[name], current.get(name)) for name in sorted(names)
            if name in saved and saved[name] != current.get(name)]


def refusal(run_dir: Path | str, changes: list[tuple[str, object, object]], checkpoint: Path | str | None) -> str:
    """The one line that refuses a resume asking for other FIXED settings: each difference as --flag old -> new, and
    the two ways on."""
    listed = ", ".join(f"--{name.replace('_', '-')} {_shown(old)} -> {_shown(new)}" for name, old, new in changes)
    start_from = f" --weights {checkpoint}" if checkpoint else ""
    return (f"{run_dir} is a run of other settings, which its checkpoint fixes ({listed}): resume it with the "
            f"settings it was started with, or start a new run from its weights with a new --run-dir{start_from}")


@dataclass(frozen=True)
class Layout:
    """The workers x --batch-size x --grad-accum a run's sample order is laid out for: those of its first start. The
    global batch (workers x batch x accumulation) is the images of one optimizer step."""

    world_size: int
    batch_size: int
    grad_accum: int

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_size * self.grad_accum

    def __str__(self) -> str:
        return f"{self.world_size} workers x batch {self.batch_size} x accumulation {self.grad_accum}"

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "batch_size": self.batch_size, "grad_accum": self.grad_accum}


def continue_layout(layout: Layout, world: int, batch_size: int, grad_accum: int, given_accum: bool,
                    run_dir: Path | str, sync_bn: bool = False) -> int:
    """The --grad-accum that continues a run laid out as `layout` on `world` workers at the same global batch.
    given_accum: the command's --grad-accum is not the run's (a value of its own, or none where the run had one),
    so it must keep the global batch itself. A global batch the workers cannot share evenly is one line with the
    choices; so is a --sync-bn run on another number of workers, whose micro-batches are normalised together, so
    many at a time."""
    if sync_bn and world != layout.world_size:
        raise ConfigError(f"{run_dir} trains with --sync-bn on {layout.world_size} workers: SyncBatchNorm normalises "
                          f"their micro-batches together, and {world} workers would normalise others together (not "
                          f"the run it was): resume on {layout.world_size} workers, or start a new --run-dir with "
                          f"--weights of its newest checkpoint")
    if world * batch_size * grad_accum == layout.global_batch:
        return grad_accum
    if given_accum:
        raise ConfigError(f"{run_dir} trains at a global batch of {layout.global_batch} ({layout}); {world} workers "
                          f"x batch {batch_size} x accumulation {grad_accum} make {world * batch_size * grad_accum}: "
                          f"pass the run's --grad-accum {layout.grad_accum} (the workers then share its batch) or "
                          f"one that keeps {layout.global_batch}, or start a new --run-dir")
    micro_batches = layout.world_size * layout.grad_accum  # per optimizer step, of --batch-size images each
    if micro_batches % world:
        fits = [n for n in range(1, micro_batches + 1) if micro_batches % n == 0]
        raise ConfigError(f"{run_dir} trains at a global batch of {layout.global_batch} ({layout}), "
                          f"{micro_batches} micro-batches of {layout.batch_size} a step, which {world} workers "
                          f"cannot share evenly: resume on {', '.join(map(str, fits))} "
                          f"worker{'s' if fits != [1] else ''}, or start a new --run-dir")
    return micro_batches // world


def relayout_line(layout: Layout, world: int, grad_accum: int) -> str:
    """What a resume on another number of workers does, said once at its start."""
    return (f"resuming a run laid out for {layout} on {world} worker{'s' if world > 1 else ''}: accumulation "
            f"{grad_accum} keeps the global batch of {layout.global_batch}, every step's samples, the schedule and the "
            f"epoch position")


def resume_record(step: int, saved: dict, current: dict, saved_world: int | None, world: int) -> dict | None:
    """plan.json's record of a resume that changed something: the step it resumed at and each change as
    [before, after] (the workers among them); None when nothing changed."""
    changed = {name: [old, new] for name, old, new in changed_settings(saved, current, MAY_CHANGE - UNRECORDED)}
    if saved_world is not None and saved_world != world:
        changed["world_size"] = [saved_world, world]
    return {"step": step, "changed": changed} if changed else None


def spliced_lr(before: dict | None, after: dict, step: int, steps_per_epoch: int) -> dict:
    """The learning rate of each step (or each epoch's first step) as a run that changed its length at `step` trained
    it: the earlier schedule's (`before`, plan.json's "lr") before that step, the new one's (`after`) from there.
    A table of each step stays one when both are; otherwise the epochs'."""
    if not before:
        return after
    if before["per"] == after["per"] == "step":
        return {"per": "step", "values": before["values"][:step] + after["values"][step:]}

    def at_epochs(table: dict) -> list:
        return table["values"] if table["per"] == "epoch" else table["values"][::steps_per_epoch]

    old, new = at_epochs(before), at_epochs(after)
    first_new = -(-step // steps_per_epoch)  # the epochs whose first step comes at or after `step`
    return {"per": "epoch", "values": old[:first_new] + new[first_new:]}


@dataclass(frozen=True)
class Resumed:
    """Where a start resumed: the checkpoint, the position it holds and what it recorded of the run until then."""

    source: Path
    position: dict  # the Trainer's: step, epoch, step_in_epoch, eval_owed (whether that step's evaluation is owed)
    config: dict  # the config it was saved under
    world_size: int  # the workers that saved it
    max_steps: int  # the run's length then (a resume may make it longer or shorter)

    @property
    def step(self) -> int:
        return self.position["step"]


def continued(cfg: Config, state: dict, world: int, run_dir: Path, source: Path) -> tuple[Config, Layout, str]:
    """The config that continues the checkpoint `state` on `world` workers, the layout its position counts in, and the
    line a resume on another number of workers says once ('' on as many): the settings it fixes unchanged (else one
    line), and on another number of workers the --grad-accum that keeps the run's global batch and its steps'
    samples."""
    changes = changed_settings(state["config"], cfg.to_dict())
    if changes:
        raise ConfigError(refusal(run_dir, changes, source))
    layout = Layout(**state["layout"]) if "layout" in state else \
        Layout(state["world_size"], state["batch_size"], state["grad_accum"])
    opt = cfg.optimisation
    accum = continue_layout(layout, world, opt.batch_size, opt.grad_accum, opt.grad_accum != layout.grad_accum, run_dir,
                            cfg.model.sync_bn)
    relaid = relayout_line(layout, world, accum) if world != layout.world_size else ""
    return (cfg.replace(grad_accum=accum) if accum != opt.grad_accum else cfg), layout, relaid


DATA_FIGURES = (("train_samples", "training images"), ("val_samples", "validation images"), ("num_classes", "classes"))


def data_differences(saved: dict, saved_classes: list[str] | None, plan, classes: list[str]) -> list[str]:
    """How the data a resume finds (its plan, its class names) differs from the data the run trained on (`saved`:
    plan.json, `saved_classes`: classes.json, either {} or None when missing): the same number of images in each
    split and the same classes, whatever --data-dir now points at."""
    found = [f"{what} {saved[key]} -> {getattr(plan, key)}" for key, what in DATA_FIGURES
             if key in saved and saved[key] != getattr(plan, key)]
    if saved_classes is not None and len(saved_classes) == len(classes) and saved_classes != classes:
        found.append("the class names differ")
    return found


def plan_as_trained(plan: dict, before: dict, resumed: Resumed | None, current: dict, world: int,
                    steps_per_epoch: int) -> dict:
    """plan.json: this start's plan (`plan`), with the run's resumes that changed something (at which step, what) and,
    for a run made longer or shorter, the learning rates each step trained at: the earlier length's (`before`, the
    plan.json it finds) before the resume. current: this start's config."""
    if resumed is None:
        return plan
    record = resume_record(resumed.step, resumed.config, current, resumed.world_size, world)
    plan["resumes"] = before.get("resumes", []) + ([record] if record else [])
    if resumed.max_steps != plan["max_steps"]:
        plan["lr"] = spliced_lr(before.get("lr"), plan["lr"], resumed.step, steps_per_epoch)
    elif before.get("lr"):  # the same length: the rates as trained so far, and on from there as planned
        plan["lr"] = before["lr"]
    return plan
