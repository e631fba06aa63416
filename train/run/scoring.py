"""A finished run's model scored again on each rank (make evaluate's workers, train/evaluate.py's command line): its
weights read and checked, the task's network, the trainer's own validate() over the validation set, and rank 0's
report: the record (JSON), the picture (PNG), TensorBoard and, for a tracked run, its MLflow run. The command reads
the run folder and refuses what it can before this module, and torch with it, is imported."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from train.base.errors import EXIT_FAILED, ConfigError
from train.base.progress import Progress
from train.cluster.distributed import init, teardown
from train.cluster.identity import PeersNeverCame, identity, is_main
from train.config.settings import Config, Data, Model
from train.files import shards
from train.files.rundir import atomic_write, to_json
from train.loading import build_val_loader
from train.run.runtime import DTYPES, configure_runtime, device_name, resolve_precision
from train.run.validate import validate
from train.tasks.contract import checked_scores
from train.tasks.factory import build_task
from train.tasks.task import Task


@dataclass
class Evaluation:
    """What every rank of one evaluation scores: the run, its config as the command line amended it (--data-dir, the
    CPU for GPUS=0), its class names, and the weights' file or sharded folder (`checkpoint` as the user named it)."""
    run_dir: Path
    checkpoint: str
    cfg: Config
    classes: list[str]
    source: Path
    out: Path


def load_weights(path: Path, run_dir: Path) -> dict:
    """The model's tensors from a checkpoint (model.pt, best.pt, a step_N.pt's model) or a sharded step_N.dcp folder
    (read whole): a file that cannot be read, a damaged folder and weights that are not finite are one line each."""
    if path.is_dir():
        if path.suffix != shards.SUFFIX:
            raise ConfigError(f"{path} is a folder, not a checkpoint: pass model.pt, best.pt, a step_N.pt file or a "
                              f"step_N{shards.SUFFIX} folder of the run")
        problem = shards.verify(path)
        if problem is not None:
            raise ConfigError(f"{path} cannot be read ({problem}): pass another checkpoint of the run, model.pt "
                              f"or best.pt")
        state = shards.read_model(path)
        check_finite(state, path, run_dir)
        return state
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same answer
        raise ConfigError(f"{path} cannot be read as weights ({str(e).splitlines()[0][:160]}): pass model.pt, "
                          f"best.pt or a checkpoint of the run") from None
    state = state.get("model", state) if isinstance(state, dict) else state
    check_finite(state, path, run_dir)
    return state


def check_finite(state, path: Path, run_dir: Path) -> None:
    """Weights to score or ship hold finite numbers only: a tensor with NaN or Infinity in it (a diverged model's,
    BatchNorm statistics included) is one line naming it."""
    for name, tensor in state.items() if isinstance(state, dict) else ():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not tensor.isfinite().all():
            bad = int((~tensor.isfinite()).sum())
            raise ConfigError(f"{path}: {name} is not finite ({bad} of {tensor.numel()} values NaN or infinite), "
                              f"the weights of a diverged run: pass a checkpoint from before it diverged "
                              f"(--checkpoint {run_dir / 'checkpoints'}/step_N.pt, CHECKPOINT= with make), or train "
                              f"again with a lower --lr")


def network_of(task: Task, spec: Model, state: dict, source: Path) -> torch.nn.Module:
    """The run's network (its task's) with the weights `state` read from `source`: weights of another network are one
    line."""
    model = task.network(spec)
    try:
        model.load_state_dict(state)
    except (RuntimeError, KeyError, TypeError) as e:
        raise ConfigError(f"{source} does not fit the run's --model {spec.model} "
                          f"({str(e).splitlines()[0][:160]}): pass weights of this run") from None
    return model


def evaluate_run(job: Evaluation, state: dict | None = None) -> int:
    """One rank's part of the evaluation of a finished run (`state`: the weights, when this process has read them
    already); rank 0 writes what it found. Returns the exit code."""
    cfg = job.cfg
    state = load_weights(job.source, job.run_dir) if state is None else state
    configure_runtime(cfg.launch.threads, cfg.run.deterministic)
    ident = identity()
    device = torch.device(device_name(cfg.launch.device, ident))
    init(device, cfg.launch.timeout_s)
    clean = False
    try:
        task = build_task(cfg)
        _, val_set = task.datasets(run_dir=job.run_dir, train=False)
        if task.classes != job.classes:
            raise ConfigError(f"{cfg.data.data_dir}: its classes ({', '.join(task.classes[:5])}, ...) are not "
                              f"the {len(job.classes)} the run was trained on ({', '.join(job.classes[:5])}, ...): "
                              f"give a validation set of the run's classes ({task.classes_from})")
        loader = build_val_loader(val_set, cfg.data, cfg.optimisation.batch_size, ident.global_rank, ident.world_size,
                                  device.type == "cuda", device, task.collate)
        model = network_of(task, cfg.model, state, job.source)
        model.to(device)
        if cfg.model.channels_last:
            model.to(memory_format=torch.channels_last)
        share = f"rank 0's share of {len(val_set)} images" if ident.world_size > 1 else f"{len(val_set)} images"
        progress = Progress(f"evaluating {job.source.name} ({share})", total=len(loader), unit="batches", last=None,
                            quiet=not is_main()).start()  # rank 0 alone says how far it got
        try:
            dtype = DTYPES[resolve_precision(cfg.model, cfg.data, device)]
            result = checked_scores(task, validate(model, loader, task, device, dtype, progress.update, detail=True))
        finally:
            progress.close()
        if is_main():
            report(job, cfg.data, task, result, task.pictures(model, val_set, device))
        clean = True
        return 0
    finally:
        teardown(clean, cfg.launch.timeout_s)


def report(job: Evaluation, data: Data, task: Task, result: dict, pictures: list) -> None:
    """Rank 0: the record (JSON), the report (PNG), both to TensorBoard and, for a tracked run, MLflow; a summary. What
    the record holds beyond the scores, the picture and the summary's lines are the task's (task.report)."""
    scores = {k: v for k, v in result.items() if isinstance(v, (int, float))}
    record = {"run": job.run_dir.resolve().name, "weights": str(job.source), "data_dir": data.data_dir,
              "dataset": data.dataset, "world_size": identity().world_size, "task": task.name, **scores}
    figure, lines = task.report(record, result, pictures)
    atomic_write(job.out, (to_json(record, indent=1) + "\n").encode())
    picture = job.out.with_suffix(".png")
    from train.report import figure as figures  # noqa: PLC0415 - matplotlib: the evaluation command's alone

    pixels = figures.save(figure, picture)
    figures.plt.close(figure)
    from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - only the evaluation command writes here

    name = f"eval-{Path(job.checkpoint).stem}"
    with SummaryWriter(str(job.run_dir / "tensorboard" / name)) as board:
        for key, value in scores.items():
            board.add_scalar(f"eval/{key}", value, 0)
        board.add_image("eval/report", pixels, 0, dataformats="HWC")
    from train.report.mlflow_tracking import log_evaluation  # noqa: PLC0415 - mlflow: for tracked runs only

    tracked = log_evaluation(job.run_dir, name, scores, [job.out, picture])
    print(f"{job.source}: {lines[0]} over {result['samples']} samples -> {job.out} (+ {picture.name}"
          f"{', MLflow run ' + tracked if tracked else ''})")
    for line in lines[1:]:
        print(line)


def worker(job: Evaluation, state: dict | None = None) -> int:
    """A rank of the evaluation: a user's mistake is one line (on rank 0) and exit code 2; a rank from the
    environment whose peers never came, the line naming its variables (as the trainer's) and exit code 1."""
    try:
        return evaluate_run(job, state)
    except ConfigError as e:
        if is_main():
            print(f"error: {e}", file=sys.stderr)
        return 2
    except PeersNeverCame as e:
        print(f"error: [rank {identity().global_rank}] {e}", file=sys.stderr)
        return EXIT_FAILED
