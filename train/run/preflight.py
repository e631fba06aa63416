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
from train.cluster.identity import Identity, alone_fix, launch_variables, resolve_identity
from train.cluster.jobs import port_problem
from train.components.models import frozen_names
from train.components.optim import decay_groups
from train.components.weights import read_weights, resolve
from train.config.resume import Layout, changed_settings, continue_layout, refusal
from train.config.settings import IN_MEMORY, Config
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
    with users_code((cfg.run.task, cfg.model.model)):
        return _preflight(cfg, world)


def _preflight(cfg: Config, world: int | None) -> Task:
    ident = check_launch(cfg.launch.spawn, cfg.run.dry_run)
    if not cfg.run.dry_run:  # a dry run plans for the devices the config asks for, present here or not
        check_devices(cfg, local_workers=world or cfg.launch.spawn or ident.local_world_size)
    task = build_task(cfg)
    # with --run-dir, tars in a folder that cannot be written are indexed into it once, for the check and the run
    task.check(Path(cfg.run.run_dir) if cfg.run.run_dir and not cfg.run.dry_run else None)
    check_weights(cfg, task)
    check_decay_groups(cfg, task)
    check_batch_of_one(task, cfg.model, cfg.optimisation.batch_size, world or cfg.launch.spawn or ident.world_size)
    if cfg.data.dataset in IN_MEMORY and ":" not in cfg.run.task:  # files: counted by the workers, once loaded
        check_steps(cfg.data.train_samples, world or cfg.launch.spawn or ident.world_size, cfg)
    # The process that will listen on the rendezvous port: the --spawn parent, or rank 0 of an srun step.
    port = os.environ.get("MASTER_PORT") if cfg.launch.spawn else \
        str(ident.master_port) if ident.launcher == "slurm" and ident.global_rank == 0 else None
    if port is not None and not cfg.run.dry_run:
        check_port(port, fix="unset MASTER_PORT so a free one is picked" if cfg.launch.spawn else
                   "set MASTER_PORT to a free port")
    if cfg.run.run_dir:
        check_run_dir(cfg, Path(cfg.run.run_dir), world or cfg.launch.spawn or ident.world_size)
    elif not cfg.run.dry_run:  # runs/<start time>, a new folder: the one it is made in must take it
        problem = run_dir_problem(Path(launch_run_dir(cfg)))
        if problem:
            raise ConfigError(problem)
    if not cfg.run.dry_run:
        check_tracking(cfg, ident.global_rank)
    return task


def check_weights(cfg: Config, task: Task) -> None:
    """--weights that name nothing or no file, and --freeze prefixes that match no parameter (the names, on a
    model built on the meta device: no memory, no time), answered before any worker starts."""
    if not cfg.model.weights and not cfg.model.freeze:
        return
    with torch.device("meta"):
        model = task.network(cfg.model)  # before the data is read: a classifier of a stand-in class count
    run_dir = Path(cfg.run.run_dir) if cfg.run.run_dir else None
    resuming = run_dir is not None and run_dir.is_dir() and bool(checkpoint_io.list_checkpoints(run_dir))
    if cfg.model.weights and resolve(cfg.model) is None and not resuming:  # a file (named weights: the workers fetch)
        task.start_from(read_weights(cfg.model, fetched=False)[0], model, sized=False)
    frozen_names(cfg.model, model, lambda: task.head(model))


def check_decay_groups(cfg: Config, task: Task) -> None:
    """A weight decay given for parameters the model has none of (--transformer-embedding-decay on a ResNet, a
    --norm-weight-decay whose layers are all frozen): one line before any worker starts, on the meta device."""
    opt = cfg.optimisation
    if opt.norm_weight_decay is None and opt.bias_weight_decay is None and opt.transformer_embedding_decay is None:
        return
    with torch.device("meta"):
        model = task.model(cfg.model)
    decay_groups(cfg.optimisation, model, cfg.model.model)


def check_tracking(cfg: Config, rank: int) -> None:
    """A tracked run names a server it can reach. Asked once per launch (the launcher and global rank 0),
    and only for a new run: a restart or resume of a tracked run trains on while the server is down."""
    uri = tracking_uri(cfg.tracking)
    if not uri:
        return
    check_uri(uri)
    if rank == 0 and not continues_a_tracked_run(cfg.run.run_dir):
        probe_server(uri)


def check_devices(cfg: Config, local_workers: int) -> None:
    problem = visible_devices_problem(os.environ.get("CUDA_VISIBLE_DEVICES"), host_gpu_count())
    if problem:
        raise ConfigError(problem)
    cuda = torch.cuda.is_available()
    if cfg.launch.device == "cuda" and not cuda:
        shown = f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']})" \
            if "CUDA_VISIBLE_DEVICES" in os.environ else ""
        raise ConfigError(f"--device cuda but no CUDA GPU is visible{shown}: use --device cpu, or check the driver "
                          f"and CUDA_VISIBLE_DEVICES")
    if cuda and cfg.launch.device != "cpu":
        check_gpu_per_worker(local_workers, torch.cuda.device_count())
    check_precision(cfg, on_cpu=cfg.launch.device == "cpu" or not cuda)


def check_gpu_per_worker(local_workers: int, visible: int) -> None:
    """Local rank r trains on GPU r."""
    if local_workers > visible:
        raise ConfigError(f"{local_workers} workers on this node but {visible} GPU(s) visible: start at most "
                          f"{visible} (torchrun --nproc-per-node, --spawn, NPROC_PER_NODE) or set CUDA_VISIBLE_DEVICES")


def check_precision(cfg: Config, on_cpu: bool) -> None:
    if on_cpu and cfg.model.precision in ("fp16", "bf16"):
        raise ConfigError(f"--precision {cfg.model.precision} needs a CUDA GPU: use --precision fp32 (or auto) on CPU")
    if on_cpu and cfg.model.sync_bn:
        raise ConfigError("--sync-bn needs CUDA GPUs (SyncBatchNorm has no CPU implementation): drop it on CPU")
    if cfg.data.decode == "gpu" and cfg.data.dataset not in ("imagefolder", "csv", "shards", "hf"):
        raise ConfigError(f"--decode gpu decodes image files, and --dataset {cfg.data.dataset} has none: use it with "
                          f"--dataset imagefolder, csv, shards or hf, or drop it")
    if cfg.data.decode == "gpu" and on_cpu:
        raise ConfigError("--decode gpu needs a CUDA GPU (nvJPEG): use --decode cpu on CPU")


def check_steps(train_samples: int, world: int, cfg: Config, grad_accum: int | None = None) -> int:
    """The optimizer steps in one epoch, which must be at least one; world and grad_accum (default --grad-accum): the
    layout the samples are laid out for."""
    opt, accum = cfg.optimisation, grad_accum or cfg.optimisation.grad_accum
    steps = samples_per_rank(train_samples, world, cfg.augmentation.ra_reps) // opt.batch_size // accum
    if steps == 0:
        cut = " (--ra-reps takes a multiple of 256 of them)" if cfg.augmentation.ra_reps else ""
        raise ConfigError(f"{train_samples} training samples{cut} are fewer than one step needs "
                          f"({world} workers x {cfg.optimisation.batch_size} x {accum}): "
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


def check_launch(spawn: int, dry_run: bool = False) -> Identity:
    """The launch environment of a command that trains or evaluates (python -m train, train.evaluate): --spawn inside
    another launcher's workers, or a rank from the environment without the variables of its rendezvous (left in a
    shell by another job?), is one line. Returns who this process is."""
    ident = resolve_identity()
    if spawn and ident.launcher == "env":
        raise ConfigError(f"--spawn with {launch_variables()} set in the environment would start workers twice: drop "
                          f"--spawn, or {alone_fix()} and let --spawn number its workers")
    if spawn and ident.launcher != "single":  # this process is already one of torchrun's or srun's workers
        raise ConfigError("--spawn inside torchrun or srun would start workers twice: drop --spawn")
    if ident.launcher == "env" and not dry_run:
        check_rendezvous_variables()
    return ident


def check_rendezvous_variables(env=None) -> None:
    """RANK and WORLD_SIZE set by something other than torchrun or --spawn: the env:// rendezvous needs
    MASTER_ADDR and MASTER_PORT as well."""
    env = os.environ if env is None else env
    missing = [key for key in ("MASTER_ADDR", "MASTER_PORT") if key not in env]
    fixes = {"MASTER_ADDR": "MASTER_ADDR to rank 0's host", "MASTER_PORT": "MASTER_PORT to a free port there"}
    if missing:
        raise ConfigError(f"{launch_variables(env)} are set in the environment (by neither torchrun nor --spawn) but "
                          f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: set "
                          f"{' and '.join(fixes[key] for key in missing)}, or {alone_fix(env)} to train alone")


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


def check_run_dir(cfg: Config, run_dir: Path, world: int = 1) -> None:
    if run_dir.is_absolute() and not run_dir.parent.exists():
        raise ConfigError(f"{run_dir.parent} does not exist (is the NAS mounted?): create it, or pass a "
                          f"--run-dir inside an existing folder")
    problem = run_dir_problem(run_dir, room=False)  # a file in the way, a read-only file system, another's folder
    if problem:
        raise ConfigError(problem)
    check_resume(cfg, run_dir, world)
    problem = checkpoint_io.space_problem(run_dir) or run_dir_problem(run_dir)  # room for its checkpoint, or to start
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
