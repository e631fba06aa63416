"""The input pipeline's CPU rows: loader workers against the training step, an epoch's start with and without
persistent workers, packed shards against the loose files they came from."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from PIL import Image

from train.bench.arms import arm_dir, arm_result, drain, median, row, trainer_arm
from train.bench.cpu import ONE_RANK
from train.cli import parse_config
from train.data import SHAPE_CLASSES, build_datasets, make_shapes
from train.loading import build_train_loader, default_num_workers, sampling
from train.pack.command import pack


def _cifar_like(root: Path, train: int, val: int) -> None:
    """A CIFAR-sized ImageFolder: 10 classes of 32x32 PNGs (the shapes, written as files)."""

    if (root / ".complete").exists():
        return
    chunk = 5000  # make_shapes holds every mask of its images at once: bounded memory for big folders
    for split, n, seed in (("train", train, 1), ("val", val, 2)):
        for c in SHAPE_CLASSES:
            (root / split / c).mkdir(parents=True, exist_ok=True)
        for first in range(0, n, chunk):
            images, labels = make_shapes(min(chunk, n - first), 32, seed + 1000 * (first // chunk))
            for i, (img, label) in enumerate(zip(images, labels, strict=True), start=first):
                Image.fromarray(img.permute(1, 2, 0).numpy()).save(root / split / SHAPE_CLASSES[label] / f"{i}.png")
    (root / ".complete").write_text("")


def loader_alone(cfg_args: list, batches: int) -> float:
    """Samples/s of the trainer's own train loader with nothing consuming it (first batch dropped)."""

    cfg = parse_config(list(map(str, cfg_args)))
    train_set, _, _ = build_datasets(cfg)
    count, seconds = drain(*build_train_loader(train_set, sampling(cfg), cfg.data, 0, 1, pin_memory=False), batches)
    return count / seconds


def epoch_start(cfg_args: list, persistent: bool, epochs: int) -> float:
    """Median wait from iter() to the first batch of epochs 2.. of the trainer's train loader, with
    persistent DataLoader workers (the trainer's default) or workers started anew every epoch."""

    cfg = parse_config(list(map(str, cfg_args)))
    train_set, _, _ = build_datasets(cfg)
    loader, sampler = build_train_loader(train_set, sampling(cfg), cfg.data, 0, 1, False, persistent=persistent)
    waits = []
    for epoch in range(epochs + 1):
        sampler.set_epoch(epoch)
        start = time.perf_counter()
        it = iter(loader)
        next(it)
        if epoch:
            waits.append(time.perf_counter() - start)
        for _ in it:  # the whole epoch, so no batch is still in flight when the next one starts
            pass
        del it
    del loader
    return median(waits)


def pipeline_rows(out: Path, size: dict, rounds: int) -> list[dict]:
    """Each loader against the trainer's consumption of it, the data wait of the default ImageFolder run and an
    epoch's start. --quick: the built-in set's consumption is the trainer rows' run on 1 rank x 2 threads (the same
    model, data and batch; the cores' threads on 2 cores), where the bench starts no run of its own for it."""
    model = ["--width", size["width"], "--batch-size", size["batch"]]
    _cifar_like(out / "cifar-like", size["files"], 200)
    folder = ["--dataset", "imagefolder", "--data-dir", out / "cifar-like", *model]
    # The wait at an epoch's start does not grow with the epoch: a short one will do.
    _cifar_like(out / "cifar-small", max(size["files"] // 6, 4 * size["batch"]), 100)
    short = ["--dataset", "imagefolder", "--data-dir", out / "cifar-small", *model]
    builtin = ["--train-samples", size["samples"], *model]
    run = ["--max-steps", size["steps"], "--log-every", size["window"], "--eval-every", 0, "--save-every", 10**6]
    headroom = {"imagefolder": [], "shapes": []}
    waits, restart = [], []
    for r in range(rounds):
        fresh, kept = epoch_start(short, False, 2), epoch_start(short, True, 2)
        restart.append(fresh / kept)
        for name, args in (("imagefolder", folder), ("shapes", builtin)):
            alone = loader_alone(args, size["loader_batches"])
            shared = arm_dir(out, ONE_RANK, r)
            if name == "shapes" and size["quick"] and shared.is_dir():  # the trainer rows' run, 1 rank x 2 threads
                trained = arm_result(shared, size["warmup"])
            else:
                trained = trainer_arm(arm_dir(out, f"pipeline-{name}", r), [*args, *run], size["warmup"])
            consumed = size["batch"] / median(trained["step_times"])
            headroom[name].append(alone / consumed)
            if name == "imagefolder":
                waits.append(median(trained["data_wait"]))

    workers = default_num_workers(parse_config(list(map(str, folder))).data)
    return [
        row("input headroom, built-in: loader alone / model consumption (samples/s)", headroom["shapes"],
            "in-memory batches cut on the training device"),
        row(f"input headroom, CIFAR-sized ImageFolder ({workers} loader worker(s), default): loader / model",
            headroom["imagefolder"], "PNG decode + augmentation vs the default CNN's training speed"),
        row("data wait fraction per step, CIFAR-sized ImageFolder, defaults", waits,
            "time in next(batch) / step time", "< 0.05", median(waits) < 0.05),
        row("persistent workers: epoch-start wait with workers started anew / kept (CIFAR-sized ImageFolder)",
            restart, f"iter() to the first batch of an epoch ({size['batch']} PNGs); > 1: persistent workers save it"),
    ]


def first_batch_and_epoch(cfg_args: list) -> tuple[float, float]:
    """(seconds from nothing to the first batch, samples/s over the rest of the epoch) of the trainer's own
    train loader: the dataset's listing (or index), the workers' start and every file read included."""
    cfg = parse_config(list(map(str, cfg_args)))
    start = time.perf_counter()
    train_set, _, _ = build_datasets(cfg)
    loader, sampler = build_train_loader(train_set, sampling(cfg), cfg.data, 0, 1, pin_memory=False, persistent=False)
    sampler.set_epoch(0)
    it = iter(loader)
    next(it)
    first = time.perf_counter() - start
    count, start = 0, time.perf_counter()
    for x, _ in it:
        count += len(x)
    return first, count / (time.perf_counter() - start)


def shard_rows(out: Path, size: dict, rounds: int) -> list[dict]:
    """Packed shards vs the same loose files (CIFAR-sized PNGs), through the trainer's loader."""
    loose, packed = out / "many-files", out / "many-files-shards"
    _cifar_like(loose, size["many_files"], min(1000, size["many_files"] // 6))
    if not (packed / "index.json").exists():
        shutil.rmtree(packed, ignore_errors=True)
        pack(loose, packed)
    common = ["--width", size["width"], "--batch-size", 256, "--image-size", 32]
    folder = ["--dataset", "imagefolder", "--data-dir", loose, *common]
    shards = ["--dataset", "shards", "--data-dir", packed, *common]
    firsts, speeds, seen = [], [], {}
    for _ in range(rounds):
        (f_first, f_speed), (s_first, s_speed) = first_batch_and_epoch(folder), first_batch_and_epoch(shards)
        firsts.append(f_first / s_first)
        speeds.append(s_speed / f_speed)
        seen = {"files": (f_first, f_speed), "shards": (s_first, s_speed)}
    workers = default_num_workers(parse_config(list(map(str, folder))).data)
    detail = (f"{size['many_files']:,} PNGs of 32 px, {workers} loader worker(s), page cache warm (a NAS adds a "
              f"round trip per file): files {seen['files'][0]:.1f} s, shards {seen['shards'][0]:.1f} s")
    return [
        row("packed shards: time to the first batch, loose ImageFolder / shards", firsts, detail),
        row("packed shards: samples/s over an epoch, shards / loose ImageFolder", speeds,
            f"files {seen['files'][1]:.0f}/s, shards {seen['shards'][1]:.0f}/s"),
    ]
