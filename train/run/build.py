"""The run's parts, built once from its config: `build(cfg, run_dir, device, precision)` returns them, resumed where the
newest checkpoint left off (train/run/checkpointer.py; `Parts.resumed` holds the Trainer's position) or ready for a
fresh start. The device and the precision are the worker's runtime (train/run/runtime.py), set at its start.

The order is the run's contract: every rank makes the same random draws and collectives in the same order, and a
resumed run equals an uninterrupted one bit for bit only while it stays so. The checkpoint is read, and a dataset of
files listed and checked, before anything is written (a refused dataset leaves no run folder); the data and the model
are made right after torch.manual_seed(--seed), identical on every rank; the model is sharded (--parallel fsdp) before
the optimizer is made; the resume (or a fresh start's per-rank random stream) comes after the optimizer and before the
DDP wrap; the run's files, the metrics and the tracking come last, from the step the run starts at.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from train.base.errors import ConfigError
from train.cluster.distributed import broadcast_from_main, gather, on_main, ordered_allreduce_hook, wrap
from train.cluster.identity import identity, is_main
from train.cluster.sharding import Replicated, spread_over
from train.components.ema import ModelEma
from train.components.models import recompute_in_backward
from train.components.optim import build_optimizer, build_scheduler, schedule_lengths
from train.components.weights import read_weights
from train.config.resume import Layout, Resumed, continued, data_differences, plan_as_trained
from train.config.catalog import source
from train.config.settings import Config, Data, Model
from train.data import packed_with
from train.files import checkpoint_io as ckpt
from train.files import rundir, writable
from train.loading import Sampling, build_train_loader, build_val_loader, in_memory, sampling
from train.report.hardware import GpuTelemetry
from train.report.metrics import LogWindow, MetricsWriter, build_manifest, setup_logging
from train.report.tracker import Tracker, start_tracking
from train.run.checkpointer import Checkpointer, Keeping, newest_checkpoint
from train.run.health import DivergenceGuard
from train.run.plan import Plan, make_plan
from train.run.runtime import DTYPES
from train.tasks.contract import check_state_saves, check_task
from train.tasks.factory import build_task
from train.tasks.task import Task

log = logging.getLogger("train")


@dataclass(frozen=True)
class Loop:
    """What the Trainer reads of the run's settings, and nothing else (Loop.of): its step's shape, its cadences, its
    stop."""

    seed: int  # the batch augmentation's draws: seeded by their position in the run
    batch_size: int  # per rank and micro-batch
    grad_accum: int  # micro-batches per step
    grad_clip: float  # --grad-clip (0: none)
    channels_last: bool  # the augmented batch back in the model's memory format
    static_graph: bool  # DDP's static_graph: its buckets settle a pass later
    ema_every: int  # --model-ema-steps: the EMA's update every that many steps of an epoch
    per_step: bool  # --schedule-unit step (else epoch)
    warmup_epochs: float  # the EMA waits for the warm-up (--schedule-unit epoch)
    log_every: int
    eval_every: int  # 0: at the end only
    save_every: int
    stop_at: int  # --stop-at (0: none)

    @classmethod
    def of(cls, cfg: Config) -> Loop:
        opt = cfg.optimisation
        return cls(cfg.run.seed, opt.batch_size, opt.grad_accum, opt.grad_clip, cfg.model.channels_last,
                   cfg.model.static_graph, cfg.regularisation.model_ema_steps, cfg.schedule.schedule_unit == "step",
                   cfg.schedule.warmup_epochs, cfg.checkpoints.log_every, cfg.checkpoints.eval_every,
                   cfg.checkpoints.save_every, cfg.run.stop_at)


@dataclass(eq=False)
class Parts:
    """What a run trains with, each part made once."""

    cfg: Config  # as given, or as it continues its checkpoint (--grad-accum may follow the workers)
    loop: Loop  # what the Trainer reads of it
    run_dir: Path
    device: torch.device
    plan: Plan  # what the run derives from its config (train/run/plan.py)
    precision: torch.dtype | None  # autocast's dtype; None: fp32
    task: Task  # what the run trains for: its data, model, loss, metric (train/tasks/)
    train_loader: object  # micro-batches of --batch-size, in the sampler's order
    sampler: object  # which samples this rank trains on, from which position (train/loading/samplers.py)
    val_loader: object  # this rank's share of the validation set, each sample once across ranks
    raw_model: torch.nn.Module  # the model itself (sharded in place under --parallel fsdp): saved and evaluated
    model: torch.nn.Module  # what trains: raw_model, compiled and DDP-wrapped where asked
    spread: Replicated  # how the model is spread over the workers (--parallel: train/cluster/sharding.py)
    augment: object | None  # the task's batch augmentation on the device (classification: random erasing, Mixup/CutMix)
    optimizer: torch.optim.Optimizer
    scheduler: object  # torch's LRScheduler over the optimizer
    scaler: torch.amp.GradScaler  # enabled under fp16 only
    ema: ModelEma | None  # --model-ema
    guard: DivergenceGuard  # a loss that is not finite stops the run (train/run/health.py)
    checkpointer: Checkpointer  # every file the weights go to, and what a checkpoint holds
    tracker: Tracker | None  # MLflow, on rank 0 of a tracked run
    metrics: MetricsWriter  # metrics.jsonl, TensorBoard, MLflow (rank 0; a no-op elsewhere)
    telemetry: GpuTelemetry
    window: LogWindow  # the figures between two log lines
    resumed: Resumed | None  # where this start resumed from, the Trainer's position among it; None for a fresh start


def build(cfg: Config, run_dir: Path, device: torch.device, precision: str, task: Task | None = None) -> Parts:
    """The run's parts on this rank, on `device` in `precision` (the worker's runtime: train/run/runtime.py), for
    `task` (the preflight's, where this process ran it; else built here)."""
    world = identity().world_size
    task = task if task is not None else build_task(cfg)
    # The newest checkpoint that verifies, read before anything is written: a resume that would change what the run
    # is stops here, and one on another number of workers takes the --grad-accum that keeps its global batch.
    # (a sharded model's on the CPU: every rank takes its shards from there, never the whole state on its GPU)
    state, source = newest_checkpoint(run_dir, torch.device("cpu") if cfg.model.parallel == "fsdp" else device)
    layout, relaid = Layout(world, cfg.optimisation.batch_size, cfg.optimisation.grad_accum), ""
    if state is not None:
        cfg, layout, relaid = continued(cfg, state, world, run_dir, source)
    # Starting weights, read (named ones fetched once per node) before anything is written; not for a resume
    initial = read_weights(cfg.model) if cfg.model.weights and state is None else None
    # Data and model: identical on every rank (the seed drives both); DDP also broadcasts rank 0's weights.
    torch.manual_seed(cfg.run.seed)
    train_set, val_set = data_then_folder(task, run_dir, cfg.run.task, cfg.data, cfg.model,
                                          cfg.optimisation.batch_size)
    raw_model = model_on(cfg.model, task, device, world)
    weights = {"weights": cfg.model.weights} if cfg.model.weights else {}  # what the manifest records
    if initial is not None:  # a new run's starting weights, in the whole model before it is sharded (a resume has
        initial_state, weights = initial  # them in its checkpoint)
        raw_model.load_state_dict(task.start_from(initial_state, raw_model))
    # What the run derives from its config, once: the same function --dry-run prints it with (train/run/plan.py).
    plan = make_plan(cfg, world, device.type, precision, train_set, val_set, task, raw_model, str(run_dir),
                     layout=layout)
    # plan.json as this start finds it (rank 0's): the data the run trained on, and its plan until now
    saved_plan = rundir.read_json(run_dir / "plan.json") if state is not None and is_main() else {}
    if state is not None:
        check_same_data(cfg.data.data_dir, run_dir, plan, task.classes, saved_plan)
    train_loader, sampler, val_loader = loaders(sampling(cfg), cfg.data, cfg.run.epochs, plan, layout, task, train_set,
                                                val_set, device)
    spread = spread_over(cfg.model.parallel, world, device, precision)  # fsdp: sharded before the optimizer has state
    raw_model = spread.shard(raw_model, task.blocks(raw_model))
    optimizer = build_optimizer(cfg.optimisation, raw_model, plan.param_groups)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    ema = ModelEma(raw_model, plan.ema["decay"], device) if plan.ema else None
    scheduler = build_scheduler(cfg.schedule, optimizer, *schedule_lengths(cfg.schedule, cfg.run.epochs, plan.max_steps,
                                                                         plan.warmup_steps))
    guard = DivergenceGuard(device, fp16=scaler.is_enabled())
    checkpointer = Checkpointer(run_dir, device, Keeping.of(cfg), plan, layout, model=raw_model, optimizer=optimizer,
                                scheduler=scheduler, scaler=scaler, ema=ema, task=task, spread=spread)
    resumed = checkpointer.restore(state, source)
    if relaid:
        log.info("%s", relaid)
    model = for_training(raw_model, cfg.model, cfg.run.deterministic, device, world)
    step = resumed.step if resumed else 0
    record_start(cfg, run_dir, device, plan, task.classes, saved_plan, resumed, weights, checkpointer)
    metrics = MetricsWriter(run_dir if is_main() else None, cfg.checkpoints.tensorboard, resume_step=step)
    telemetry = GpuTelemetry(device)
    window = LogWindow(device, plan.global_batch)
    # The MLflow run starts last, with nothing after it that can fail: the worker holds it from here (Parts.tracker)
    # and ends it, FAILED too; a failure before leaves none RUNNING.
    tracker = start_tracking(cfg.tracking, run_dir, step) if is_main() else None
    checkpointer.tracker = metrics.tracker = tracker
    return Parts(cfg=cfg, loop=Loop.of(cfg), run_dir=run_dir, device=device, plan=plan, task=task, ema=ema,
                 precision=spread.autocast(DTYPES[precision]), train_loader=train_loader, sampler=sampler, guard=guard,
                 val_loader=val_loader, raw_model=raw_model, model=model, spread=spread, augment=task.augment(),
                 optimizer=optimizer, scheduler=checkpointer.scheduler, scaler=scaler, checkpointer=checkpointer,
                 tracker=tracker, metrics=metrics, telemetry=telemetry, window=window, resumed=resumed)


def data_then_folder(task: Task, run_dir: Path, task_name: str, data: Data, spec: Model, batch_size: int) -> tuple:
    """(training set, validation set), and the run folder made between: a dataset of files, and a task of the user's
    (task_name: --task) with its answers (train/tasks/contract.py), are listed and checked before the folder is made, so
    that a refused one leaves no folder behind. The built-in sets, made in memory, can meet only a lack of memory,
    which the run folder then records (restarts refuse at once)."""
    own = ":" in task_name
    sets = None if source(data.dataset).in_memory and not own else task.datasets(run_dir)
    if own:
        check_task(task, spec, *sets, batch_size)
        if data.num_workers > 0 and task.collate is None and in_memory(sets[0]) is not None:
            raise ConfigError(f"--num-workers {data.num_workers} has no effect with --task {task_name}: its "
                              f"datasets are tensors held in memory, cut into batches on the device: drop it")
    check_state_saves(task)
    prepare_run_dir(run_dir)
    return sets or task.datasets(run_dir)


def prepare_run_dir(run_dir: Path) -> None:
    """The run directory, made and written (a status that says the run is starting) by rank 0, with what a killed save
    left removed; every rank learns rank 0's line where that fails. Then the log, to train.log there too."""
    def prepare() -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
        rundir.write_status(run_dir, "starting", -1)  # a crash before training must not look "stopped"
        freed = ckpt.remove_partial(run_dir)
        if freed:
            print(f"removed {freed / 2**20:.1f} MiB of unfinished checkpoint files", file=sys.stderr)

    on_main(prepare, lambda e: writable.write_problem(run_dir, e))
    setup_logging(run_dir if is_main() else None)


def model_on(spec: Model, task: Task, device: torch.device, world: int) -> torch.nn.Module:
    """The task's model on its device, frozen where --freeze says, SyncBatchNorm and its blocks recomputed in the
    backward (--activation-checkpointing) where asked (not yet wrapped nor sharded)."""
    model = task.model(spec)  # frozen before the optimizer: no state for those parameters
    if spec.activation_checkpointing:
        for name in task.blocks(model):
            recompute_in_backward(model.get_submodule(name))
    if spec.sync_bn and world > 1:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)
    if spec.channels_last:
        model.to(memory_format=torch.channels_last)
    return model


def check_same_data(data_dir: str, run_dir: Path, plan: Plan, names: list[str], saved_plan: dict) -> None:
    """A resume trains on the data the run trained on, wherever --data-dir (data_dir) now points: the same number of
    images in each split and the same classes as plan.json (saved_plan) and classes.json say (rank 0 reads them; all
    learn)."""
    found = broadcast_from_main(data_differences(saved_plan, rundir.read_classes(run_dir), plan, names)
                                if is_main() else None)
    if found:
        raise ConfigError(f"{data_dir} is not the data {run_dir} trained on "
                          f"({', '.join(found)}): point --data-dir at that data, or start a new --run-dir")


def loaders(spec: Sampling, data: Data, epochs: int, plan: Plan, layout: Layout, task: Task, train_set, val_set,
            device: torch.device) -> tuple:
    """(train loader, its sampler, validation loader) of this rank, as `spec` deals the samples and `data` loads them,
    batched by the task's collate (Task.collate); epochs: --epochs, for the line that says the run's steps."""
    ident, pin = identity(), device.type == "cuda"
    rank, world = ident.global_rank, ident.world_size
    train_loader, sampler = build_train_loader(train_set, spec, data, rank, world, pin, device,
                                               layout=(layout.world_size, layout.grad_accum), collate=task.collate)
    val_loader = build_val_loader(val_set, data, spec.batch_size, rank, world, pin, device, task.collate)
    if is_main() and epochs:  # the run's length in steps, from its length in epochs on this layout
        log.info("--epochs %d: %d steps (%d per epoch: %d images / (%d workers x batch %d x accumulation %d)), "
                 "warm-up %d steps", epochs, plan.max_steps, plan.steps_per_epoch, len(train_set),
                 world, spec.batch_size, spec.grad_accum, plan.warmup_steps)
    if is_main() and spec.reps and world == 1:
        log.info("sampler: %s", plan.sampler)
    return train_loader, sampler, val_loader


def for_training(model: torch.nn.Module, spec: Model, deterministic: bool, device: torch.device,
                 world: int) -> torch.nn.Module:
    """What trains: the model compiled (--compile) and, in a process group, DDP-wrapped (with the rank-ordered
    reduction under --deterministic); a sharded one (--parallel fsdp) as it is."""
    if spec.compile:
        model = torch.compile(model)
    if dist.is_initialized() and spec.parallel == "ddp":
        model = wrap(model, device, gradient_as_bucket_view=True, bucket_cap_mb=spec.bucket_cap_mb,
                     static_graph=spec.static_graph)
        if deterministic and world > 1:
            model.register_comm_hook(None, ordered_allreduce_hook)
    return model


def record_start(cfg: Config, run_dir: Path, device: torch.device, plan: Plan,
                 names: list[str], saved_plan: dict, resumed: Resumed | None, weights: dict,
                 checkpointer: Checkpointer) -> None:
    """config.json, classes.json, task.json (the task's description), plan.json (as trained: this start's plan after
    saved_plan's), manifest.json and status.json ("running"), by rank 0; then the run's opening lines."""
    ident = identity()
    hostnames = gather(socket.gethostname())

    def write() -> None:
        trained = plan_as_trained(plan.to_dict(), saved_plan, resumed, cfg.to_dict(), ident.world_size,
                                  plan.steps_per_epoch)
        rundir.write_run_files(run_dir, cfg.to_dict(), names, trained, checkpointer.task.description)
        manifest = build_manifest(cfg.run, ident, device, hostnames, resumed.step if resumed else None)
        rundir.write_manifest(run_dir, {**manifest, **weights})
        checkpointer.record("running", resumed.step if resumed else 0)

    on_main(write, lambda e: writable.write_problem(run_dir, e))
    if is_main():
        log.info("run %s: %d worker(s) via %s on %s, %d steps (%d per epoch), global batch %d, precision %s",
                 run_dir, ident.world_size, ident.launcher, device.type, plan.max_steps, plan.steps_per_epoch,
                 plan.global_batch, str(DTYPES[plan.precision] or "fp32").replace("torch.", ""))  # torch's: bfloat16
        if cfg.data.dataset == "shards":
            log.info("data: %s", packed_with(Path(cfg.data.data_dir)))
        if device.type == "cuda" and not cfg.run.deterministic:  # said once, where it applies
            log.info("note: on CUDA, a resumed or restarted run equals an uninterrupted one bit for bit only with "
                     "--deterministic (cuDNN and cuBLAS pick non-deterministic kernels otherwise, so even two "
                     "uninterrupted runs differ in rounding)")
