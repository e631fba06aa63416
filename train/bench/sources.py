"""The sources' rows: images/s on one core from a label file and from another tool's WebDataset tars against the
same images as an ImageFolder, and the label-file check over a million generated rows against Python's csv.reader
reading the same file."""

from __future__ import annotations

import csv
import io
import random
import tarfile
import time
from pathlib import Path

import torch

from train.bench.arms import median, row
from train.config import parse_config
from train.data import SeededSample, build_datasets, check_labelfiles
from train.data.scan import scan_split
from train.data.tarindex import CACHE

PER_TAR = 1000  # samples per tar, as img2dataset's default of 10,000 would leave too few tars here


def write_sources(folder: Path, out: Path) -> tuple[Path, Path]:
    """The ImageFolder as label files (absolute paths) and as WebDataset tars (Python's tarfile, webdataset's
    layout: <key>.png and <key>.cls), each in the folder's order; made once."""
    csvs, tars = out / "many-files-csv", out / "many-files-tars"
    for split in ("train", "val"):
        classes, samples = scan_split(folder / split)
        if not (csvs / f"{split}.csv").exists():
            csvs.mkdir(parents=True, exist_ok=True)
            with open(csvs / f".{split}.csv", "w", newline="") as f:
                csv.writer(f).writerows([("path", "label"), *((p, classes[label]) for p, label in samples)])
            (csvs / f".{split}.csv").rename(csvs / f"{split}.csv")
        if not (tars / f"{split}-done").exists():
            tars.mkdir(parents=True, exist_ok=True)
            for start in range(0, len(samples), PER_TAR):
                with tarfile.open(tars / f"{split}-{start // PER_TAR:06d}.tar", "w") as tar:
                    for i, (path, label) in enumerate(samples[start:start + PER_TAR], start):
                        for name, data in ((f"{i:09d}.png", Path(path).read_bytes()), (f"{i:09d}.cls",
                                                                                       str(label).encode())):
                            info = tarfile.TarInfo(name)
                            info.size = len(data)
                            tar.addfile(info, io.BytesIO(data))
            (tars / f"{split}-done").touch()
        (tars / "classes.txt").write_text("\n".join(classes) + "\n")
    return csvs, tars


def images_per_s(dataset, count: int) -> float:
    """The first `count` training samples read, decoded and augmented here, each under its own seed, as a loader
    worker does them (one thread)."""
    seeded = SeededSample(dataset)
    start = time.perf_counter()
    for i in range(count):
        seeded[i, i]
    return count / (time.perf_counter() - start)


def source_rows(out: Path, size: dict, rounds: int) -> list[dict]:
    """Label file / ImageFolder and tars / ImageFolder, images/s on one core (CIFAR-sized PNGs, the packed-shards
    row's folder); the label-file check's rows/s over 1,000,000 generated rows."""
    folder = out / "many-files"  # made by shard_rows
    csvs, tars = write_sources(folder, out)
    common = ["--image-size", 32, "--num-workers", 0]
    arms = {"imagefolder": ["--dataset", "imagefolder", "--data-dir", folder], "csv": ["--dataset", "csv",
            "--data-dir", csvs], "tars": ["--dataset", "shards", "--data-dir", tars]}
    for path in (tars / CACHE).glob("*"):  # the index made anew: its time is this run's first start
        path.unlink()
    datasets, listed = {}, {}
    for name, flags in arms.items():
        started = time.perf_counter()
        datasets[name] = build_datasets(parse_config(list(map(str, [*flags, *common]))))[0]
        listed[name] = time.perf_counter() - started
    count = min(len(datasets["imagefolder"]), 600 if size["quick"] else 5000)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    speeds: dict[str, list[float]] = {name: [] for name in arms}
    try:
        for _ in range(rounds):
            for name, dataset in datasets.items():
                speeds[name].append(images_per_s(dataset, count))
    finally:
        torch.set_num_threads(threads)
    seen = {name: median(values) for name, values in speeds.items()}
    detail = f"{count:,} CIFAR-sized PNGs on one core: ImageFolder {seen['imagefolder']:.0f}/s"
    rows = [row("label file: images/s on one core, csv / the same ImageFolder",
                [c / f for c, f in zip(speeds["csv"], speeds["imagefolder"], strict=True)],
                f"{detail}, csv {seen['csv']:.0f}/s (each path read as listed)"),
            row("WebDataset tars of another tool: images/s on one core, tars / the same ImageFolder",
                [t / f for t, f in zip(speeds["tars"], speeds["imagefolder"], strict=True)],
                f"{detail}, tars {seen['tars']:.0f}/s (read by offset); both splits ready in: ImageFolder "
                f"{listed['imagefolder']:.1f} s (listed), csv {listed['csv']:.1f} s (checked), tars "
                f"{listed['tars']:.1f} s (indexed: {len(datasets['tars']):,} samples, "
                f"{len(list(tars.glob('train-*.tar')))} tars)")]
    return rows + [label_check_row(out, 20_000 if size["quick"] else 1_000_000, rounds)]


def label_check_row(out: Path, count: int, rounds: int) -> dict:
    """The label-file check (every row: columns, labels, duplicates; no file asked about) against csv.reader alone."""
    root = out / f"labels-{count}"
    if not (root / "val.csv").exists():
        root.mkdir(parents=True, exist_ok=True)
        rng = random.Random(0)
        for split, rows in (("train", count), ("val", count // 100)):
            with open(root / f"{split}.csv", "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(["path", "label"])
                for i in range(rows):
                    label = f"class{rng.randrange(1000):03d}"
                    writer.writerow([f"{split}/{label}/n{i:08d}.JPEG", label])
    checks, reads = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        check_labelfiles(root)
        checks.append(time.perf_counter() - start)
        start = time.perf_counter()
        for split in ("train", "val"):
            with open(root / f"{split}.csv", newline="") as f:
                for _ in csv.reader(f):
                    pass
        reads.append(time.perf_counter() - start)
    total = count + count // 100
    return row("label-file check (every row, no file asked about): seconds / csv.reader's alone over the same rows",
               [c / r for c, r in zip(checks, reads, strict=True)],
               f"{total:,} generated rows (1,000 classes by name): check {total / median(checks):,.0f} rows/s "
               f"({median(checks):.2f} s), csv.reader alone {total / median(reads):,.0f} rows/s")
