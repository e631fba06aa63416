"""A finished run's model scored again, on its validation set or another, with the trainer's own evaluation
(validate(), train/run/validate.py), every sample counted once across ranks:

  python -m train.evaluate RUN_DIR (make evaluate RUN=...): a finished run's model, on its validation set or another

  python -m train.evaluate runs/exp1                         model.pt on the run's own validation set
  python -m train.evaluate runs/exp1 --checkpoint best       best.pt (ema: model_ema.pt; or a checkpoint: a file,
                                                             or a sharded step_N.dcp folder, its model read whole)
  python -m train.evaluate runs/exp1 --data-dir /nas/val2    another set: its val split (val/, val.csv, val-*.tar), the
                                                             run's classes
  python -m train.evaluate runs/exp1 --spawn 2               two local workers
  python -m train.evaluate runs/exp2 --model mypkg.nets:build a run of your own model: name its factory again
  torchrun --nproc-per-node=4 -m train.evaluate runs/exp1    any launcher, as for training (srun too)

Every rank scores its shard of the validation set, each sample counted exactly once (no padding), with the
trainer's own evaluation: on the same data and layout the figures equal the run's final evaluation bit for bit.
Rank 0 shows its progress (train/base/progress.py) and writes OUT (default RUN_DIR/eval-<checkpoint>.json): loss,
top-1, top-5 (more than 5 classes), per-class accuracy, the most confused pairs, the confusion matrix (rows: true
class, columns: predicted); OUT.png, the report a person reads (train/report/figure.py: the labelled matrix, per-class
accuracy worst first, the pairs); the figures and the report to TensorBoard (RUN_DIR/tensorboard/eval-<checkpoint>),
and to the run's MLflow run when the run is tracked (RUN_DIR/mlflow.json). It imports neither the trainer nor its
launcher, nor matplotlib but in the command's report.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from train.base.errors import EXIT_FAILED, ConfigError, end_process, fail, users_code
from train.base.progress import Progress
from train.cluster.distributed import init, teardown
from train.cluster.forkserver import start_fork_server
from train.cluster.identity import PeersNeverCame, check_launch, identity, is_main
from train.cluster.spawn import spawn_workers, workers_for
from train.config.settings import Config, Data, Model
from train.files import shards
from train.files.rundir import atomic_write, read_classes, read_config, to_json
from train.loading import build_val_loader
from train.run.runtime import DTYPES, configure_runtime, device_name, resolve_precision
from train.run.validate import validate
from train.tasks.contract import checked_scores
from train.tasks.factory import build_task
from train.tasks.task import Task


# --checkpoint by name: the run's final model, its best evaluation, and with --model-ema the EMA's of both.
CHECKPOINTS = {"model": "model.pt", "best": "best.pt", "ema": "model_ema.pt", "best_ema": "best_ema.pt"}


def load_run(run_dir: Path, checkpoint: str, model: str = "", task: str = "") -> tuple[Config, list[str], dict, Path]:
    """The run's config, class names and the weights to use (model.pt, best.pt, model_ema.pt or a checkpoint's
    model). A run folder is data, never code: a run of a `package.module:factory` model or task is loaded only when
    the command line names the same factory (`model`, --model; `task`, --task), since building it imports and runs
    that module."""
    saved, classes = read_config(run_dir), read_classes(run_dir)
    if not saved or classes is None:
        raise ConfigError(f"{run_dir} is not a trainbox run directory (no readable config.json / classes.json): pass "
                          f"the folder a run trained in (runs/<name>)")
    try:
        cfg = Config.from_dict(saved)
    except (TypeError, ConfigError) as e:  # a key this version does not know
        raise ConfigError(f"{run_dir / 'config.json'} cannot be read as a trainbox config ({str(e)[:120]}): pass the "
                          f"folder a run trained in (runs/<name>)") from None
    for flag, trained, given in (("model", cfg.model.model, model), ("task", cfg.run.task, task)):
        if ":" in trained and given != trained:
            why = f"--{flag} {given} does not name it" if given else "its factory would be imported and run"
            raise ConfigError(f"{run_dir} was trained with --{flag} {trained}, code outside trainbox, and {why}: pass "
                              f"--{flag} {trained} ({flag.upper()}= with make) if you trust that module")
        if given and given != trained:
            raise ConfigError(f"--{flag} {given}: {run_dir} was trained with --{flag} {trained}: pass that, or no "
                              f"--{flag}")
    path = run_dir / CHECKPOINTS[checkpoint] if checkpoint in CHECKPOINTS else Path(checkpoint)
    if path.is_dir() and path.suffix == shards.SUFFIX:  # a sharded checkpoint: its model's tensors, whole
        problem = shards.verify(path)
        if problem is not None:
            raise ConfigError(f"{path} cannot be read ({problem}): pass another checkpoint of the run, model.pt "
                              f"or best.pt")
        state = shards.read_model(path)
        check_finite(state, path, run_dir)
        return cfg, classes, state, path
    if not path.is_file():
        what = {"model": "the run has not finished (no model.pt)", "best": "no evaluation yet (no best.pt)",
                "ema": "no finished run with --model-ema (no model_ema.pt)",
                "best_ema": "no evaluation with --model-ema yet (no best_ema.pt)"}.get(checkpoint, "no such file")
        raise ConfigError(f"{path}: {what}: pass --checkpoint model, best, ema, best_ema or a checkpoint of the "
                          f"run")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same answer
        raise ConfigError(f"{path} cannot be read as weights ({str(e).splitlines()[0][:160]}): pass model.pt, "
                          f"best.pt or a checkpoint of the run") from None
    state = state.get("model", state) if isinstance(state, dict) else state
    check_finite(state, path, run_dir)
    return cfg, classes, state, path


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


@dataclass
class Job:
    run_dir: Path
    checkpoint: str
    data_dir: str
    out: Path
    model: str = ""  # --model: a run of a package.module:factory model is evaluated only when it names it
    task: str = ""  # --task: the same for a task of the user's
    device: str = ""  # cpu: GPUS=0 (make's), else the run's --device


def evaluate_run(job: Job) -> int:
    """One rank's part of the evaluation of a finished run; rank 0 writes what it found. Returns the exit code."""
    cfg, classes, state, source = load_run(job.run_dir, job.checkpoint, job.model, job.task)
    cfg = cfg.replace(**{name: value for name, value in (("data_dir", job.data_dir), ("device", job.device)) if value})
    configure_runtime(cfg.launch.threads, cfg.run.deterministic)
    ident = identity()
    device = torch.device(device_name(cfg.launch.device, ident))
    init(device, cfg.launch.timeout_s)
    clean = False
    try:
        task = build_task(cfg)
        _, val_set = task.datasets(run_dir=job.run_dir, train=False)
        if task.classes != classes:
            raise ConfigError(f"{cfg.data.data_dir}: its classes ({', '.join(task.classes[:5])}, ...) are not "
                              f"the {len(classes)} the run was trained on ({', '.join(classes[:5])}, ...): give a "
                              f"validation set of the run's classes ({task.classes_from})")
        loader = build_val_loader(val_set, cfg.data, cfg.optimisation.batch_size, ident.global_rank, ident.world_size,
                                  device.type == "cuda", device, task.collate)
        model = network_of(task, cfg.model, state, source)
        model.to(device)
        if cfg.model.channels_last:
            model.to(memory_format=torch.channels_last)
        share = f"rank 0's share of {len(val_set)} images" if ident.world_size > 1 else f"{len(val_set)} images"
        progress = Progress(f"evaluating {source.name} ({share})", total=len(loader), unit="batches", last=None,
                            quiet=not is_main()).start()  # rank 0 alone says how far it got
        try:
            dtype = DTYPES[resolve_precision(cfg.model, cfg.data, device)]
            result = checked_scores(task, validate(model, loader, task, device, dtype, progress.update, detail=True))
        finally:
            progress.close()
        if is_main():
            report(job, cfg.data, task, source, result, task.pictures(model, val_set, device))
        clean = True
        return 0
    finally:
        teardown(clean, cfg.launch.timeout_s)


def report(job: Job, data: Data, task: Task, source: Path, result: dict, pictures: list) -> None:
    """Rank 0: the record (JSON), the report (PNG), both to TensorBoard and, for a tracked run, MLflow; a summary. What
    the record holds beyond the scores, the picture and the summary's lines are the task's (task.report)."""
    scores = {k: v for k, v in result.items() if isinstance(v, (int, float))}
    record = {"run": job.run_dir.resolve().name, "weights": str(source), "data_dir": data.data_dir,
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
    print(f"{source}: {lines[0]} over {result['samples']} samples -> {job.out} (+ {picture.name}"
          f"{', MLflow run ' + tracked if tracked else ''})")
    for line in lines[1:]:
        print(line)


def main(argv: list[str]) -> int:
    parser = finished_run_parser("python -m train.evaluate", __doc__)
    parser.add_argument("--data-dir", default="", help="another dataset root (its val/ split, the run's classes); "
                                                       "default: the run's --data-dir")
    parser.add_argument("--out", type=Path, help="the report (default: RUN_DIR/eval-<weights>.json)")
    parser.add_argument("--spawn", type=int, default=0, help="start N local workers (torch.multiprocessing)")
    parser.add_argument("--gpus", default="", help="make evaluate's GPUS=: local workers, counted and checked as make "
                                                   "train counts them (0: one on the CPU); empty: one")
    ns = parser.parse_args(argv)
    if ns.weights is not None:
        return fail(renamed(parser.prog, ns.weights))
    try:
        spawn, on_cpu = local_workers(ns.spawn, ns.gpus)
        check_launch(spawn)  # a rank from the environment (a shell's leftovers) without its rendezvous: one line
        job = Job(ns.run_dir, ns.checkpoint, ns.data_dir,
                  ns.out or ns.run_dir / f"eval-{Path(ns.checkpoint).stem}.json", ns.model, ns.task,
                  "cpu" if on_cpu else "")
        cfg = load_run(job.run_dir, job.checkpoint, job.model, job.task)[0]  # a bad run folder, checkpoint, model
        with users_code((cfg.run.task, cfg.model.model)):  # the data's checks, as training runs them: one line each
            task = build_task(cfg.replace(data_dir=job.data_dir) if job.data_dir else cfg)
            if "train" in inspect.signature(task.check).parameters:  # a task of before its train=False: not asked
                task.check(train=False)
        if spawn:
            start_fork_server(["train.evaluate"])  # what its workers run, imported once, torch with it
            return spawn_workers(spawn, partial(worker, job))
        return worker(job)
    except ConfigError as e:
        return fail(e)


def local_workers(spawn: int, gpus: str) -> tuple[int, bool]:
    """(--spawn's workers, 0 for this process alone; whether on the CPU) from --spawn, or from GPUS= (--gpus) as
    make train reads it: a negative count, a word or more GPUs than there are refused in its one line."""
    if spawn < 0:
        raise ConfigError(f"--spawn must be >= 0, got {spawn}: pass 0 or a worker count")
    if not gpus.strip():
        return spawn, False
    if spawn:
        raise ConfigError(f"--gpus {gpus} (make's GPUS=) and --spawn {spawn} both count the workers: give one")
    workers, on_cpu = workers_for(gpus, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    return (workers if workers > 1 else 0), on_cpu


def worker(job: Job) -> int:
    """A rank of the evaluation: a user's mistake is one line (on rank 0) and exit code 2; a rank from the
    environment whose peers never came, the line naming its variables (as the trainer's) and exit code 1."""
    try:
        return evaluate_run(job)
    except ConfigError as e:
        if is_main():
            print(f"error: {e}", file=sys.stderr)
        return 2
    except PeersNeverCame as e:
        print(f"error: [rank {identity().global_rank}] {e}", file=sys.stderr)
        return EXIT_FAILED


def finished_run_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The command line of a command on a finished run (evaluate, export): its folder, the checkpoint, the
    model factory it may import, and the old --weights (refused by `renamed`)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run's folder (runs/<name>)")
    parser.add_argument("--checkpoint", default="model", help="model (model.pt, default), best (best.pt), ema "
                                                              "(model_ema.pt), best_ema (best_ema.pt) or a checkpoint "
                                                              "file of the run")
    parser.add_argument("--weights", help=argparse.SUPPRESS)  # the old spelling: one line naming the new
    parser.add_argument("--model", default="", help="a run of a package.module:factory model: the same factory, "
                                                    "to allow its import (a run folder alone never runs code)")
    parser.add_argument("--task", default="", help="a run of a package.module:factory task: the same factory, to "
                                                   "allow its import")
    return parser


def renamed(command: str, value: str) -> str:
    """The old --weights of evaluate and export: one line naming --checkpoint (--weights is the starting weights of
    python -m train)."""
    return (f"{command} --weights {value}: a finished run's weights are --checkpoint {value} (CHECKPOINT= with "
            f"make); --weights is python -m train's starting weights")


if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
