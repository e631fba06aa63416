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
launcher, nor matplotlib but in the command's report; torch only once the command line, the run folder and the
checkpoint's name hold (a refusal answers at once; GPUS=N above 0 imports it first, to count the GPUs). Each rank's
work is train/run/scoring.py's.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from functools import partial
from pathlib import Path

from train.base.errors import ConfigError, OneLineParser, end_process, fail, users_code
from train.cluster.forkserver import start_fork_server
from train.cluster.identity import check_launch
from train.cluster.spawn import spawn_workers, workers_for
from train.config.catalog import source
from train.config.settings import Config
from train.files.rundir import read_classes, read_config


# What --spawn's fork server imports once, beside torch, before it forks: each rank's work.
PRELOAD = ["train.run.scoring"]
# --checkpoint by name: the run's final model, its best evaluation, and with --model-ema the EMA's of both.
CHECKPOINTS = {"model": "model.pt", "best": "best.pt", "ema": "model_ema.pt", "best_ema": "best_ema.pt"}


def read_run(run_dir: Path, checkpoint: str, model: str = "", task: str = "") -> tuple[Config, list[str], Path]:
    """The run's config, class names and the weights' path (model.pt, best.pt, model_ema.pt, a checkpoint file or a
    sharded step_N.dcp folder), without torch: the weights are read by train/run/scoring.py's load_weights. A run
    folder is data, never code: a run of a `package.module:factory` model or task is loaded only when the command
    line names the same factory (`model`, --model; `task`, --task), since building it imports and runs that module."""
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
    if not path.is_file() and not path.is_dir():
        what = {"model": "the run has not finished (no model.pt)", "best": "no evaluation yet (no best.pt)",
                "ema": "no finished run with --model-ema (no model_ema.pt)",
                "best_ema": "no evaluation with --model-ema yet (no best_ema.pt)"}.get(checkpoint, "no such file")
        raise ConfigError(f"{path}: {what}: pass --checkpoint model, best, ema, best_ema or a checkpoint of the "
                          f"run")
    return cfg, classes, path


def main(argv: list[str]) -> int:
    parser = finished_run_parser("python -m train.evaluate", __doc__)
    parser.add_argument("--data-dir", default="", help="another dataset root (its val/ split, the run's classes); "
                                                       "default: the run's --data-dir")
    parser.add_argument("--out", type=Path, help="the report (default: RUN_DIR/eval-<weights>.json)")
    parser.add_argument("--spawn", type=int, default=0, help="start N local workers (torch.multiprocessing)")
    parser.add_argument("--gpus", default="", help="make evaluate's GPUS=: local workers, counted and checked as make "
                                                   "train counts them (0: one on the CPU); empty: one")
    try:
        ns = parser.parse_args(argv)
    except ConfigError as e:
        return fail(e)
    if ns.weights is not None:
        return fail(renamed(parser.prog, ns.weights))
    try:
        spawn, on_cpu = local_workers(ns.spawn, ns.gpus)
        check_launch(spawn)  # a rank from the environment (a shell's leftovers) without its rendezvous: one line
        cfg, classes, source = read_run(ns.run_dir, ns.checkpoint, ns.model, ns.task)  # a bad folder, name, factory
        check_other_data(cfg.data.dataset, cfg.run.task, ns.data_dir, ns.run_dir)
        cfg = cfg.replace(**{name: value for name, value in (("data_dir", ns.data_dir), ("device", on_cpu and "cpu"))
                             if value})
        # torch, the task and the weights from here on: each rank's work (train/run/scoring.py)
        from train.run.scoring import Evaluation, load_weights, worker  # noqa: PLC0415
        from train.tasks.factory import build_task  # noqa: PLC0415

        state = load_weights(source, ns.run_dir)  # weights that do not read, or are not finite: one line
        with users_code((cfg.run.task, cfg.model.model)):  # the data's checks, as training runs them: one line each
            task = build_task(cfg)
            if "train" in inspect.signature(task.check).parameters:  # a task of before its train=False: not asked
                task.check(train=False)
        job = Evaluation(ns.run_dir, ns.checkpoint, cfg, classes, source,
                         ns.out or ns.run_dir / f"eval-{Path(ns.checkpoint).stem}.json")
        if spawn:
            del state  # each worker reads the weights itself: the launcher keeps no copy while they run
            start_fork_server(PRELOAD)
            return spawn_workers(spawn, partial(worker, job))
        return worker(job, state)
    except ConfigError as e:
        return fail(e)


def check_other_data(name: str, task: str, data_dir: str, run_dir: Path) -> None:
    """--data-dir for a run whose built-in task trained on data made from the seed (--dataset NAME): nothing to read
    there, so one line, never a score of the seed's data under another set's name."""
    if data_dir and ":" not in task and source(name).generated:
        raise ConfigError(f"--data-dir {data_dir} has no effect on {run_dir}: it trained on --dataset {name}, made "
                          f"from the seed (no files are read): drop it, or evaluate a run that trained on files")


def local_workers(spawn: int, gpus: str) -> tuple[int, bool]:
    """(--spawn's workers, 0 for this process alone; whether on the CPU) from --spawn, or from GPUS= (--gpus) as
    make train reads it: a negative count, a word or more GPUs than there are refused in its one line."""
    if spawn < 0:
        raise ConfigError(f"--spawn must be >= 0, got {spawn}: pass 0 or a worker count")
    if not gpus.strip():
        return spawn, False
    if spawn:
        raise ConfigError(f"--gpus {gpus} (make's GPUS=) and --spawn {spawn} both count the workers: give one")
    workers_for(gpus, 0)  # a negative count or a word: its line, before torch is imported to count the GPUs
    if int(gpus) == 0:
        return 0, True
    import torch  # noqa: PLC0415 - GPUS=N: the GPUs there are

    workers, on_cpu = workers_for(gpus, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    return (workers if workers > 1 else 0), on_cpu


def finished_run_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The command line of a command on a finished run (evaluate, export): its folder, the checkpoint, the
    model factory it may import, and the old --weights (refused by `renamed`)."""
    parser = OneLineParser(prog=prog, description=doc.split("\n\n")[0])
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
