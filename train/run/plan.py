"""The plan: what a run derives from its config, once, before it trains.

  python -m train --dry-run ...           prints it as JSON and exits: no run folder, no download, no training
  make train ARGS="--config train/recipes/resnet50.toml --data-dir /nas/imagenet --dry-run"   (GPUS=8: 8 workers)

The Trainer builds it where it starts (make_plan, from its own datasets and model) and trains from it: the steps,
the warm-up, the weight-decay groups, the normalisation, the learning rates, the EMA's decay. The run folder keeps
it as plan.json. A dry run builds it with the same function from the same config, on a model on the meta device
(no memory, no weights), for the workers the launch would start.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from train.base.errors import ConfigError
from train.base.vision import backbone_weights
from train.cluster.sharding import planned
from train.components.ema import adjusted_decay
from train.components.optim import build_optimizer, build_scheduler, decay_groups, schedule_lengths
from train.components.weights import cached_file, resolve
from train.config.resume import Layout
from train.config.settings import Config, Data, Model, Optimisation, Regularisation, Run, Schedule
from train.data import check_cifar
from train.files.rundir import launch_run_dir
from train.loading import describe_sampler
from train.run.preflight import check_steps
from train.run.runtime import precision_of
from train.tasks.factory import build_task
from train.tasks.task import Task

# Runs of at most this many steps list every step's learning rate; longer ones the rate at each epoch's start.
LR_EVERY_STEP = 1000


@dataclass(frozen=True)
class Plan:
    run_dir: str  # where the run writes (a dry run writes nothing there)
    world_size: int  # workers, all nodes together
    device: str  # cuda or cpu
    precision: str  # fp32, bf16 or fp16 (a GradScaler with fp16)
    task: dict  # what the run trains for (--task): its name, loss and the metric that picks best.pt (train/tasks/)
    source: dict  # what the run reads: the kind, each split's files, the order of the samples, whence the classes
    train_samples: int
    val_samples: int
    num_classes: int
    classes: list  # the class names, in label order (classes.json keeps them too)
    steps_per_epoch: int  # optimizer steps per pass over the training set, on this layout
    max_steps: int  # the run's optimizer steps (from --epochs, or --max-steps)
    warmup_steps: int  # in optimizer steps (an epoch schedule's warm-up is whole epochs: lr says which)
    epochs: float
    global_batch: int  # workers x --batch-size x --grad-accum: images per optimizer step
    sampler: str
    running_statistics: str | None  # which micro-batch of a step updates BatchNorm's running statistics; None: none
    normalize: dict | None  # mean and std per channel, of images scaled to [0, 1] (a task of images)
    train_size: int | None  # the side of a training image in pixels: a micro-batch is batch x 3 x this x this
    train_transform: str  # per image, in the loader (uint8 in, uint8 out)
    batch_transform: str  # per batch, on the training device after the normalisation
    eval_transform: str
    loss: str
    optimizer: dict  # its class and settings (the learning rate and weight decay are below), the gradient clipping
    param_groups: list  # each: its weight_decay and its parameters' names
    lr: dict  # per: epoch or step; values: the learning rate of each epoch's (or step's) optimizer steps
    ema: dict | None  # decay per update (after the reference's adjustment), every_steps, restarted in the warm-up
    weights: dict | None  # the starting weights
    parallel: dict  # how the model is spread over the workers (--parallel), each one's share of its state (MiB)
    layout: dict  # the workers x batch x accumulation the sample order is laid out for (its first start: a resume on
    # other workers keeps it, with the --grad-accum that keeps the global batch)
    resumes: list  # each resume that changed something: its step and the changes, [before, after]
    # (train/config/resume.py)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def make_plan(cfg: Config, world: int, device: str, precision: str, train_set, val_set, task: Task,
              model: torch.nn.Module, run_dir: str, layout: Layout | None = None) -> Plan:
    """The plan of cfg on `world` workers, from the datasets and the model (frozen where --freeze says) the run
    trains; a setting that has no effect on them is one line (ConfigError). layout: the one a resumed run's samples
    are laid out for, else this start's."""
    layout = layout or Layout(world, cfg.optimisation.batch_size, cfg.optimisation.grad_accum)
    steps_per_epoch = check_steps(len(train_set), layout.world_size, cfg.optimisation, cfg.augmentation.ra_reps,
                                  layout.grad_accum)
    max_steps, warmup_steps = steps_for_epochs(cfg.run, cfg.schedule, steps_per_epoch)
    epochs = cfg.run.epochs or max_steps / steps_per_epoch
    batch, described = task.augment(), task.facts()
    global_batch = world * cfg.optimisation.batch_size * cfg.optimisation.grad_accum
    return Plan(
        run_dir=run_dir, world_size=world, device=device, precision=precision, task=described,
        source=task.source(train_set, val_set), train_samples=len(train_set), val_samples=len(val_set),
        num_classes=len(task.classes), classes=task.classes, steps_per_epoch=steps_per_epoch, max_steps=max_steps,
        warmup_steps=warmup_steps, epochs=epochs, global_batch=global_batch,
        sampler=describe_sampler(cfg.augmentation.ra_reps, layout.world_size),
        running_statistics=running_statistics(model, cfg.model.sync_bn), **task.input_steps(train_set, val_set),
        batch_transform=repr(batch) if batch else "none",
        loss=described["loss"], optimizer=_optimizer(cfg.optimisation),
        param_groups=decay_groups(cfg.optimisation, model, cfg.model.model),
        lr=learning_rates(cfg.optimisation, cfg.schedule, cfg.run.epochs, max_steps, warmup_steps, steps_per_epoch),
        ema=_ema(cfg.regularisation, cfg.schedule, global_batch, epochs, warmup_steps), weights=_weights(cfg.model),
        parallel=planned(cfg.model.parallel, model, task.blocks(model), world, _states(cfg.optimisation), precision),
        layout=layout.to_dict(), resumes=[])


def running_statistics(model: torch.nn.Module, sync_bn: bool) -> str | None:
    """The rule the running statistics of the model's normalisation layers follow (exact.SlotZeroStatistics), for the
    plan; None for a model that keeps none."""
    if not any(getattr(m, "track_running_stats", False) and getattr(m, "running_mean", None) is not None
               for m in model.modules()):
        return None
    together = (" (SyncBatchNorm: that micro-batch of every worker together, so a resume keeps the workers)"
                if sync_bn else "")
    return (f"each step's micro-batch of laid-out slot 0 (rank 0's first) alone updates them, whichever worker "
            f"trains it: the same at any world size and accumulation{together}")


def steps_for_epochs(run: Run, schedule: Schedule, steps_per_epoch: int) -> tuple[int, int]:
    """(max_steps, warmup_steps) of a run given in --epochs (and --warmup-epochs), or as given."""
    if not run.epochs:
        return run.max_steps, schedule.warmup_steps
    warmup = round(schedule.warmup_epochs * steps_per_epoch) if schedule.warmup_epochs else schedule.warmup_steps
    return run.epochs * steps_per_epoch, warmup


def _ema(reg: Regularisation, schedule: Schedule, global_batch: int, epochs: float, warmup_steps: int) -> dict | None:
    """--model-ema's adjusted decay, its period and when it restarts from the weights; None without it."""
    if not reg.model_ema:
        return None
    warmup = (f"{schedule.warmup_epochs:g} epochs" if schedule.schedule_unit == "epoch"
              else f"{warmup_steps} steps")
    return {"decay": adjusted_decay(reg, global_batch, epochs), "given_decay": reg.model_ema_decay,
            "every_steps": reg.model_ema_steps, "restarted_during": f"the warm-up ({warmup})"}


def learning_rates(opt: Optimisation, schedule: Schedule, epochs: int, max_steps: int, warmup_steps: int,
                   steps_per_epoch: int) -> dict:
    """The learning rate of each epoch's optimizer steps, or of each step for runs of up to LR_EVERY_STEP steps
    that step their schedule every optimizer step: the trainer's own scheduler, stepped as the trainer steps it.
    epochs: --epochs (0: the run is max_steps long)."""
    optimizer = _probe_optimizer(opt)
    lengths = schedule_lengths(schedule, epochs, max_steps, warmup_steps)
    scheduler = build_scheduler(schedule, optimizer, *lengths)
    every_step = schedule.schedule_unit == "step"
    per_step = every_step and max_steps <= LR_EVERY_STEP
    values = []
    with warnings.catch_warnings():  # the scheduler steps without an optimizer step: there is nothing to train
        warnings.simplefilter("ignore", UserWarning)
        for step in range(0, max_steps, 1 if every_step else steps_per_epoch):
            if per_step or step % steps_per_epoch == 0:
                values.append(optimizer.param_groups[0]["lr"])
            scheduler.step()
    return {"per": "step" if per_step else "epoch", "values": values}


def _probe_optimizer(opt: Optimisation) -> torch.optim.Optimizer:
    """The trainer's optimizer (build_optimizer) over one parameter of its own: its class and settings."""
    probe = torch.nn.Linear(1, 1, bias=False)
    return build_optimizer(opt, probe, [{"weight_decay": opt.weight_decay, "params": ["weight"]}])


def _optimizer(opt: Optimisation) -> dict:
    optimizer = _probe_optimizer(opt)
    keys = ("momentum", "dampening", "nesterov") if isinstance(optimizer, torch.optim.SGD) else ("betas", "eps")
    return {"name": type(optimizer).__name__, **{k: optimizer.defaults[k] for k in keys},
            "grad_clip": opt.grad_clip or None}


def _states(opt: Optimisation) -> int:
    """The optimizer's tensors per parameter: AdamW's two moments, SGD's momentum (none without it)."""
    return 2 if opt.optimizer == "adamw" else int(opt.momentum > 0)


def _weights(spec: Model) -> dict | None:
    if not spec.weights:
        return None
    entry = resolve(spec)
    if entry is None:
        return {"weights": spec.weights, "file": str(Path(spec.weights))}
    backbone = {"for": "the backbone"} if type(entry) is backbone_weights(spec.model) else {}
    return {"weights": spec.weights, "torchvision": f"{type(entry).__name__}.{entry.name}", **backbone,
            "file": str(cached_file(entry)), "transforms": repr(entry.transforms())}


def planned_device(requested: str, spec: Model, data: Data) -> str:
    """The device a dry run plans for: --device (requested), else CUDA where it is here or where the config needs it
    (--precision bf16/fp16, --decode gpu, --sync-bn: the run is meant for GPUs; bf16 under fsdp is its policy, which
    runs on the CPU too), else the CPU."""
    if requested != "auto":
        return requested
    needs_gpu = spec.precision == "fp16" or spec.precision == "bf16" and spec.parallel != "fsdp" or \
        data.decode == "gpu" or spec.sync_bn
    return "cuda" if torch.cuda.is_available() or needs_gpu else "cpu"


def planned_precision(spec: Model, device: str) -> str:
    """The precision a dry run plans for: the run's own (runtime.precision_of), or where it plans for a GPU this
    machine lacks with --precision auto, what that GPU decides."""
    if spec.precision == "auto" and device == "cuda" and not torch.cuda.is_available():
        return "bf16 on a GPU with bf16 (Ampere and newer), else fp32"
    return precision_of(spec, device)


def dry_run(cfg: Config, world: int) -> Plan:
    """The plan of cfg on `world` workers, without a process group, a run folder, a download or a weight."""
    if cfg.data.dataset == "cifar10":
        try:
            check_cifar(Path(cfg.data.data_dir), False)
        except ConfigError:
            raise ConfigError(f"--dry-run downloads nothing, and CIFAR-10 is not under {cfg.data.data_dir}: run once "
                              f"without --dry-run (with --download) first, or point --data-dir at it") from None
    task = build_task(cfg)
    train_set, val_set = task.datasets()
    with torch.device("meta"):
        model = task.model(cfg.model)
    device = planned_device(cfg.launch.device, cfg.model, cfg.data)
    return make_plan(cfg, world, device, planned_precision(cfg.model, device), train_set, val_set, task, model,
                     launch_run_dir(cfg.run.run_dir))
