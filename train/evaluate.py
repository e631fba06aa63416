"""python -m train.evaluate RUN_DIR (make evaluate RUN=...): score a run's model on its validation set, or another.

  python -m train.evaluate runs/exp1                         model.pt on the run's own validation set
  python -m train.evaluate runs/exp1 --weights best          best.pt (ema: model_ema.pt; or a checkpoint file)
  python -m train.evaluate runs/exp1 --data-dir /nas/val2    another set: /nas/val2/val/<class>/*, the run's classes
  python -m train.evaluate runs/exp1 --spawn 2               two local workers
  python -m train.evaluate runs/exp2 --model mypkg.nets:build a run of your own model: name its factory again
  torchrun --nproc-per-node=4 -m train.evaluate runs/exp1    any launcher, as for training (srun too)

Every rank scores its shard of the validation set, each sample counted exactly once (no padding), with the
trainer's own evaluation: on the same data and layout the figures equal the run's final evaluation bit for bit.
Rank 0 writes OUT (default RUN_DIR/eval-<weights>.json): loss, top-1, top-5 (more than 5 classes), per-class
accuracy, the confusion matrix (rows: true class, columns: predicted); OUT.png, the matrix as an image; and
the figures to TensorBoard (RUN_DIR/tensorboard/eval-<weights>).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from train.config import Config
from train.data import build_datasets, build_val_loader, class_names
from train.distributed import identity, init, is_main, teardown
from train.errors import ConfigError, end_process, fail
from train.export import load_run
from train.launch import spawn_workers
from train.models import build_model
from train.runtime import configure_runtime, pick_device, resolve_precision
from train.scoring import score
from train.weights import normalisation_on


@dataclass
class Job:
    run_dir: Path
    weights: str
    data_dir: str
    out: Path
    model: str = ""  # --model: a run of a package.module:factory model is evaluated only when it names it


def score_run(job: Job) -> int:
    """One rank's part of the evaluation; rank 0 writes what it found. Returns the exit code."""
    cfg, classes, state, source = load_run(job.run_dir, job.weights, job.model)
    cfg = Config(**{**cfg.to_dict(), **({"data_dir": job.data_dir} if job.data_dir else {})})
    configure_runtime(cfg)
    ident = identity()
    device = pick_device(cfg.device, ident)
    init(device, cfg.timeout_s)
    clean = False
    try:
        _, val_set, _ = build_datasets(cfg, train=False)
        if class_names(val_set) != classes:
            raise ConfigError(f"{cfg.data_dir}: its classes ({', '.join(class_names(val_set)[:5])}, ...) are not the "
                              f"{len(classes)} the run was trained on ({', '.join(classes[:5])}, ...): give a "
                              f"validation set with the run's class folders")
        loader = build_val_loader(cfg, val_set, ident.global_rank, ident.world_size, device.type == "cuda", device)
        model = build_model(cfg, len(classes))
        try:
            model.load_state_dict(state)
        except (RuntimeError, KeyError) as e:
            raise ConfigError(f"{source} does not fit the run's --model {cfg.model} "
                              f"({str(e).splitlines()[0][:160]}): pass weights of this run") from None
        model.to(device)
        if cfg.channels_last:
            model.to(memory_format=torch.channels_last)
        result = score(model, loader, device, resolve_precision(cfg, device), cfg.channels_last,
                          top5=len(classes) > 5, confusion_of=len(classes), norm=normalisation_on(cfg, device))
        if is_main():
            report(job, cfg, classes, source, result)
        clean = True
        return 0
    finally:
        teardown(clean, cfg.timeout_s)


def report(job: Job, cfg: Config, classes: list[str], source: Path, result: dict) -> None:
    confusion = torch.tensor(result["confusion"])
    per_class = {name: (confusion[i, i] / row).item() if (row := confusion[i].sum()) else None
                 for i, name in enumerate(classes)}
    figures = {k: result[k] for k in ("loss", "accuracy", "top5", "samples") if k in result}
    record = {"weights": str(source), "data_dir": cfg.data_dir, "dataset": cfg.dataset, "world_size":
              identity().world_size, **figures, "per_class_accuracy": per_class, "classes": classes,
              "confusion": result["confusion"]}
    job.out.write_text(json.dumps(record, indent=1) + "\n")
    write_png(confusion, job.out.with_suffix(".png"))
    from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - only the evaluation command writes here

    with SummaryWriter(str(job.run_dir / "tensorboard" / f"eval-{Path(job.weights).stem}")) as board:
        for key, value in figures.items():
            board.add_scalar(f"eval/{key}", value, 0)
    top5 = f", top-5 {100 * result['top5']:.2f}%" if "top5" in result else ""
    print(f"{source}: loss {result['loss']:.4f}, top-1 {100 * result['accuracy']:.2f}%{top5} over "
          f"{result['samples']} samples -> {job.out} (+ {job.out.with_suffix('.png').name})")
    worst = sorted((v, k) for k, v in per_class.items() if v is not None)[:5]
    print("lowest per-class accuracy: " + ", ".join(f"{k} {100 * v:.1f}%" for v, k in worst))


def write_png(confusion: torch.Tensor, path: Path) -> None:
    """The confusion matrix as an image: each row normalised by its true-class count, dark = many."""
    from torchvision.io import write_png as write  # noqa: PLC0415 - torchvision: see train/data.py

    cell = max(1, 512 // len(confusion))
    rows = confusion.sum(1, keepdim=True).clamp(min=1)
    shade = (255 - 255 * confusion / rows).round().to(torch.uint8)
    image = shade.repeat_interleave(cell, 0).repeat_interleave(cell, 1)
    write(image.expand(3, *image.shape).contiguous(), str(path))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run's folder (runs/<name>)")
    parser.add_argument("--weights", default="model", help="model (model.pt, default), best (best.pt), ema "
                                                           "(model_ema.pt), best_ema (best_ema.pt) or a checkpoint "
                                                           "file of the run")
    parser.add_argument("--data-dir", default="", help="another dataset root (its val/ split, the run's classes); "
                                                       "default: the run's --data-dir")
    parser.add_argument("--out", type=Path, help="the report (default: RUN_DIR/eval-<weights>.json)")
    parser.add_argument("--spawn", type=int, default=0, help="start N local workers (torch.multiprocessing)")
    parser.add_argument("--model", default="", help="a run of a package.module:factory model: the same factory, "
                                                    "to allow its import (a run folder alone never runs code)")
    ns = parser.parse_args(argv)
    job = Job(ns.run_dir, ns.weights, ns.data_dir, ns.out or ns.run_dir / f"eval-{Path(ns.weights).stem}.json",
              ns.model)
    try:
        load_run(job.run_dir, job.weights, job.model)  # a bad run folder, weights or model: one line, no worker
        if ns.spawn < 0:
            raise ConfigError(f"--spawn must be >= 0, got {ns.spawn}: pass 0 or a worker count")
        if ns.spawn:
            return spawn_workers(ns.spawn, partial(worker, job))
        return worker(job)
    except ConfigError as e:
        return fail(str(e))


def worker(job: Job) -> int:
    """A rank of the evaluation: a user's mistake is one line (on rank 0) and exit code 2."""
    try:
        return score_run(job)
    except ConfigError as e:
        if is_main():
            print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
