"""Every user-facing check, written once. `preflight` runs them all before any worker or process group
starts (python -m train, --spawn, make train, and every torchrun worker on its own); the worker calls
the few that need what only it knows (the dataset's size, a checkpoint's config).

Each raises ConfigError with one line: the cause and the fix.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch

from train.base.errors import ConfigError, users_code
from train.cluster.identity import check_launch
from train.cluster.jobs import port_problem
from train.components.models import frozen_names
from train.components.optim import decay_groups
from train.components.weights import read_weights, resolve
from train.config.resume import Layout, changed_settings, continue_layout, refusal
from train.config.catalog import SOURCES, source
from train.config.settings import Config, Data, Model, Optimisation, Tracking
from train.files import checkpoint_io
from train.files.rundir import launch_run_dir
from train.files.rundir import read_config, read_json
from train.files.writable import run_dir_problem
from train.loading import samples_per_rank
from train.report.hardware import nvml_read
from train.report.mlflow_tracking import check_uri, continues_a_tracked_run, probe_server, tracking_uri
from train.tasks.contract import check_batch_of_one
from train.tasks.factory import build_task
from train.tasks.task import Task



def preflight(cfg: Config, world: int | None = None) -> Task:
    """All checks that need no process group. world: the workers about to start, when the caller knows
    (the launcher); else from the launch environment. An exception raised in the user's own task or model code leaves
    as a UserCodeError: its traceback, once. Returns the run's task, built once (a worker in this process trains
    with it)."""
    run, dry = cfg.run, cfg.run.dry_run
    with users_code((run.task, cfg.model.model)):
        ident = check_launch(cfg.launch.spawn, dry)
        if not dry:  # a dry run plans for the devices the config asks for, present here or not
            check_devices(cfg.launch.device, cfg.model, cfg.data, world or cfg.launch.spawn or ident.local_world_size)
        workers = world or cfg.launch.spawn or ident.world_size
        check_spread(cfg.model, workers)
        task = build_task(cfg)
        # with --run-dir, tars in a folder that cannot be written are indexed into it once, for the check and the run
        task.check(Path(run.run_dir) if run.run_dir and not dry else None)
        check_weights(cfg.model, run.run_dir, task)
        check_decay_groups(cfg.optimisation, cfg.model, task)
        check_blocks(cfg.model, task)
        check_batch_of_one(task, cfg.model, cfg.optimisation.batch_size, workers)
        if source(cfg.data.dataset).in_memory and ":" not in run.task:  # files: counted by the workers, once loaded
            check_steps(cfg.data.train_samples, workers, cfg.optimisation, cfg.augmentation.ra_reps)
        # The process that will listen on the rendezvous port: the --spawn parent, or rank 0 of an srun step.
        port = os.environ.get("MASTER_PORT") if cfg.launch.spawn else \
            str(ident.master_port) if ident.launcher == "slurm" and ident.global_rank == 0 else None
        if port is not None and not dry:
            check_port(port, fix="unset MASTER_PORT so a free one is picked" if cfg.launch.spawn else
                       "set MASTER_PORT to a free port")
        if run.run_dir:
            check_run_dir(Path(run.run_dir))
            check_resume(cfg, Path(run.run_dir), workers)
            check_room(Path(run.run_dir))
        elif not dry:  # runs/<start time>, a new folder: the one it is made in must take it
            problem = run_dir_problem(Path(launch_run_dir(run.run_dir)))
            if problem:
                raise ConfigError(problem)
        if not dry:
            check_tracking(cfg.tracking, run.run_dir, ident.global_rank)
        return task


def check_spread(spec: Model, workers: int) -> None:
    """--parallel fsdp shards the model over the workers: one worker has nothing to shard it over."""
    if spec.parallel == "fsdp" and workers < 2:
        raise ConfigError("--parallel fsdp shards the model over the workers, and this launch starts one: start "
                          "several (--spawn N, torchrun --nproc-per-node N, make train GPUS=N), or drop it")


def check_weights(spec: Model, run_dir: str, task: Task) -> None:
    """--weights that name nothing or no file, and --freeze prefixes that match no parameter (the names, on a
    model built on the meta device: no memory, no time), answered before any worker starts. run_dir: --run-dir (a
    resume ignores --weights)."""
    if not spec.weights and not spec.freeze:
        return
    with torch.device("meta"):
        model = task.network(spec)  # before the data is read: a classifier of a stand-in class count
    folder = Path(run_dir) if run_dir else None
    resuming = folder is not None and folder.is_dir() and bool(checkpoint_io.list_checkpoints(folder))
    if spec.weights and resolve(spec) is None and not resuming:  # a file (named weights: the workers fetch)
        task.start_from(read_weights(spec, fetched=False)[0], model, sized=False)
    frozen_names(spec, model, lambda: task.head(model))


def check_blocks(spec: Model, task: Task) -> None:
    """The blocks the task names (Task.blocks), on a model built on the meta device, where a run uses them (--parallel
    fsdp shards them, --activation-checkpointing recomputes them): module names of its model; with
    --activation-checkpointing at least one, and none that keeps running statistics (BatchNorm would update them twice
    a step)."""
    if not spec.activation_checkpointing and spec.parallel == "ddp":
        return
    with torch.device("meta"):
        model = task.network(spec)
    blocks, modules = task.blocks(model), dict(model.named_modules())
    if not isinstance(blocks, list) or not all(isinstance(name, str) and name in modules for name in blocks):
        raise ConfigError(f"--task {task.name}'s blocks() gave {blocks!r}, not a list of its model's module names: "
                          f"return names from model.named_modules() (Task.blocks, docs/tasks.md)")
    if not spec.activation_checkpointing:
        return
    if not blocks:
        raise ConfigError(f"--activation-checkpointing recomputes the blocks a task names, and --task {task.name} "
                          f"names none of --model {spec.model}'s (Task.blocks): drop it")
    for name in blocks:
        kept = [f"{name}.{n}" for n, m in modules[name].named_modules()
                if getattr(m, "track_running_stats", False) and getattr(m, "running_mean", None) is not None]
        if kept:
            raise ConfigError(f"--activation-checkpointing would run {kept[0]} twice a step, which updates its running "
                              f"statistics twice (not the weights trained without it): drop it")


def check_decay_groups(opt: Optimisation, spec: Model, task: Task) -> None:
    """A weight decay given for parameters the model has none of (--transformer-embedding-decay on a ResNet, a
    --norm-weight-decay whose layers are all frozen): one line before any worker starts, on the meta device."""
    if opt.norm_weight_decay is None and opt.bias_weight_decay is None and opt.transformer_embedding_decay is None:
        return
    with torch.device("meta"):
        model = task.model(spec)
    decay_groups(opt, model, spec.model)


def check_tracking(tracking: Tracking, run_dir: str, rank: int) -> None:
    """A tracked run names a server it can reach. Asked once per launch (the launcher and global rank 0),
    and only for a new run (run_dir: --run-dir): a restart or resume of a tracked run trains on while the server is
    down."""
    uri = tracking_uri(tracking)
    if not uri:
        return
    check_uri(uri)
    if rank == 0 and not continues_a_tracked_run(run_dir):
        probe_server(uri)


def check_devices(requested: str, spec: Model, data: Data, local_workers: int) -> None:
    """--device (requested) and the GPUs this node shows, for its local workers; the precision and the rest that need
    a GPU (check_precision)."""
    problem = visible_devices_problem(os.environ.get("CUDA_VISIBLE_DEVICES"), host_gpu_count())
    if problem:
        raise ConfigError(problem)
    cuda = torch.cuda.is_available()
    if requested == "cuda" and not cuda:
        shown = f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']})" \
            if "CUDA_VISIBLE_DEVICES" in os.environ else ""
        raise ConfigError(f"--device cuda but no CUDA GPU is visible{shown}: use --device cpu, or check the driver "
                          f"and CUDA_VISIBLE_DEVICES")
    if cuda and requested != "cpu":
        check_gpu_per_worker(local_workers, torch.cuda.device_count())
    check_precision(spec, data, on_cpu=requested == "cpu" or not cuda)


def check_gpu_per_worker(local_workers: int, visible: int) -> None:
    """Local rank r trains on GPU r."""
    if local_workers > visible:
        raise ConfigError(f"{local_workers} workers on this node but {visible} GPU(s) visible: start at most "
                          f"{visible} (torchrun --nproc-per-node, --spawn, NPROC_PER_NODE) or set CUDA_VISIBLE_DEVICES")


def check_precision(spec: Model, data: Data, on_cpu: bool) -> None:
    """What needs a CUDA GPU (--precision fp16/bf16, --sync-bn, --decode gpu), refused where there is none. bf16
    under --parallel fsdp is FSDP2's mixed-precision policy (bf16 parameters, fp32 reduction), which runs on the CPU
    too."""
    if on_cpu and (spec.precision == "fp16" or spec.precision == "bf16" and spec.parallel != "fsdp"):
        raise ConfigError(f"--precision {spec.precision} needs a CUDA GPU: use --precision fp32 (or auto) on CPU")
    if on_cpu and spec.sync_bn:
        raise ConfigError("--sync-bn needs CUDA GPUs (SyncBatchNorm has no CPU implementation): drop it on CPU")
    if data.decode == "gpu" and not source(data.dataset).gpu_decode:
        files = [name for name, s in SOURCES.items() if s.gpu_decode]
        raise ConfigError(f"--decode gpu decodes image files, and --dataset {data.dataset} has none: use it with "
                          f"--dataset {', '.join(files[:-1])} or {files[-1]}, or drop it")
    if data.decode == "gpu" and on_cpu:
        raise ConfigError("--decode gpu needs a CUDA GPU (nvJPEG): use --decode cpu on CPU")


def check_steps(train_samples: int, world: int, opt: Optimisation, ra_reps: int, grad_accum: int | None = None) -> int:
    """The optimizer steps in one epoch, which must be at least one; world and grad_accum (default --grad-accum): the
    layout the samples are laid out for; ra_reps: --ra-reps."""
    accum = grad_accum or opt.grad_accum
    steps = samples_per_rank(train_samples, world, ra_reps) // opt.batch_size // accum
    if steps == 0:
        cut = " (--ra-reps takes a multiple of 256 of them)" if ra_reps else ""
        raise ConfigError(f"{train_samples} training samples{cut} are fewer than one step needs "
                          f"({world} workers x {opt.batch_size} x {accum}): "
                          f"lower --batch-size or --grad-accum")
    return steps


def check_resume(cfg: Config, run_dir: Path, world: int) -> None:
    """A run folder with a checkpoint is resumed: refused in one line, before any worker starts, when the command
    changes a setting the checkpoint fixes, or asks for a number of workers that cannot keep the run's global batch
    (train/config/resume.py; config.json and plan.json say what the run is). Each worker checks again against the
    checkpoint itself."""
    if not run_dir.is_dir() or not checkpoint_io.list_checkpoints(run_dir):
        return
    changes = changed_settings(read_config(run_dir), cfg.to_dict())
    if changes:
        raise ConfigError(refusal(run_dir, changes, checkpoint_io.list_checkpoints(run_dir)[-1]))
    plan = read_json(run_dir / "plan.json")
    if "layout" in plan:
        layout = Layout(**plan["layout"])
        continue_layout(layout, world, cfg.optimisation.batch_size, cfg.optimisation.grad_accum,
                        cfg.optimisation.grad_accum != layout.grad_accum, run_dir, cfg.model.sync_bn)


def check_port(port: str, fix: str) -> None:
    problem = port_problem("MASTER_PORT", port)
    if problem:
        raise ConfigError(f"{problem}: {fix}, or set a free one")
    if not port_free(int(port)):
        raise ConfigError(f"rendezvous port {port} is in use on this host: {fix}, or choose another")


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def check_run_dir(run_dir: Path) -> None:
    """--run-dir can be used: its parent exists, and no file, read-only file system or other user's folder is in the
    way (the room it needs: check_room, once check_resume has said whether it resumes)."""
    if run_dir.is_absolute() and not run_dir.parent.exists():
        raise ConfigError(f"{run_dir.parent} does not exist (is the NAS mounted?): create it, or pass a "
                          f"--run-dir inside an existing folder")
    problem = run_dir_problem(run_dir, room=False)  # a file in the way, a read-only file system, another's folder
    if problem:
        raise ConfigError(problem)


def check_room(run_dir: Path) -> None:
    """--run-dir has room for its next checkpoint, or to start."""
    problem = checkpoint_io.space_problem(run_dir) or run_dir_problem(run_dir)
    if problem:
        raise ConfigError(problem)


def host_gpu_count() -> int | None:
    """GPUs the driver has, whatever CUDA_VISIBLE_DEVICES says (NVML); None without an NVIDIA driver."""
    return nvml_read("nvmlDeviceGetCount")


def visible_devices_problem(value: str | None, host_gpus: int | None) -> str | None:
    """CUDA_VISIBLE_DEVICES naming a GPU index the host does not have (CUDA would silently drop it and
    every GPU after it). An empty value hides all GPUs on purpose; UUIDs are left to CUDA."""
    if not value or host_gpus is None:
        return None
    for item in (v.strip() for v in value.split(",")):
        if item.isdigit() and int(item) >= host_gpus:
            return (f"CUDA_VISIBLE_DEVICES={value} names GPU {item} but this host has {host_gpus} "
                    f"(0-{host_gpus - 1}): fix CUDA_VISIBLE_DEVICES or unset it")
    return None
