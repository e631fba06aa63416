"""The sources' rows: images/s on one core from a label file, from another tool's WebDataset tars and from a Hugging
Face dataset (saved to disk; and as Parquet files, made Arrow files once) against the same images as an ImageFolder,
and the label-file check over a million generated rows against Python's csv.reader reading the same file."""

from __future__ import annotations

import csv
import io
import json
import random
import shutil
import tarfile
import time
from pathlib import Path

import torch

from train.bench.arms import median, row
from train.cli import parse_config
from train.data import build_datasets, check_labelfiles
from train.data.hfdisk import arrow
from train.data.scan import scan_split
from train.data.tarindex import CACHE
from train.loading import SeededSample

PER_TAR = 1000  # samples per tar, as img2dataset's default of 10,000 would leave too few tars here
PER_BATCH = 1000  # rows per Arrow record batch, as save_to_disk writes them
PER_GROUP = 100  # rows per Parquet row group: `datasets`' size for image datasets


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


def write_hf(folder: Path, out: Path) -> tuple[Path, Path]:
    """The ImageFolder as save_to_disk writes a DatasetDict (per split an Arrow stream of an Image column, the files'
    bytes with their names, and a ClassLabel column, the features in the schema's "huggingface" metadata, state.json)
    and as Parquet files as push_to_hub lays them out (data/train-00000-of-00001.parquet); made once."""
    pa = arrow()
    disk, parquet = out / "many-files-hf", out / "many-files-hf-parquet"
    if (disk / "done").exists():
        return disk, parquet
    for root in (disk, parquet):
        shutil.rmtree(root, ignore_errors=True)
    for split, name in (("train", "train"), ("val", "validation")):
        classes, samples = scan_split(folder / split)
        features = {"image": {"_type": "Image"}, "label": {"names": classes, "_type": "ClassLabel"}}
        schema = pa.schema([("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                            ("label", pa.int64())], metadata={"huggingface": json.dumps({"info": {"features":
                                                                                                   features}})})
        (disk / name).mkdir(parents=True)
        (parquet / "data").mkdir(parents=True, exist_ok=True)
        with pa.OSFile(str(disk / name / "data-00000-of-00001.arrow"), "wb") as sink, \
                pa.ipc.new_stream(sink, schema) as arrows, \
                pa.parquet.ParquetWriter(parquet / "data" / f"{name}-00000-of-00001.parquet", schema) as parquets:
            for start in range(0, len(samples), PER_BATCH):
                rows = samples[start:start + PER_BATCH]
                table = pa.table({"image": [{"bytes": Path(p).read_bytes(), "path": Path(p).name} for p, _ in rows],
                                  "label": [label for _, label in rows]}, schema=schema)
                arrows.write_table(table)
                parquets.write_table(table, row_group_size=PER_GROUP)
        (disk / name / "state.json").write_text(json.dumps({"_data_files": [{"filename":
                                                                             "data-00000-of-00001.arrow"}]}))
    (disk / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "validation"]}))
    (disk / "done").touch()
    return disk, parquet


def images_per_s(dataset, count: int) -> float:
    """The first `count` training samples read, decoded and augmented here, each under its own seed, as a loader
    worker does them (one thread)."""
    seeded = SeededSample(dataset)
    start = time.perf_counter()
    for i in range(count):
        seeded[i, i]
    return count / (time.perf_counter() - start)


def source_rows(out: Path, size: dict, rounds: int) -> list[dict]:
    """Label file / ImageFolder, tars / ImageFolder and a Hugging Face dataset / ImageFolder, images/s on one core
    (CIFAR-sized PNGs, the packed-shards row's folder); the label-file check's rows/s over 1,000,000 generated rows."""
    folder = out / "many-files"  # made by shard_rows
    csvs, tars = write_sources(folder, out)
    disk, parquet = write_hf(folder, out)
    common = ["--image-size", 32, "--num-workers", 0]
    arms = {"imagefolder": ["--dataset", "imagefolder", "--data-dir", folder], "csv": ["--dataset", "csv",
            "--data-dir", csvs], "tars": ["--dataset", "shards", "--data-dir", tars],
            "hf": ["--dataset", "hf", "--data-dir", disk], "parquet": ["--dataset", "hf", "--data-dir", parquet]}
    for path in [*(tars / CACHE).glob("*"), *(parquet / CACHE).glob("*")]:  # made anew: timed as a first start
        path.unlink()
    datasets, listed = {}, {}
    for name, flags in arms.items():
        started = time.perf_counter()
        datasets[name] = build_datasets(parse_config(list(map(str, [*flags, *common]))))[0]
        listed[name] = time.perf_counter() - started
    count = min(len(datasets["imagefolder"]), 100 if size["quick"] else 5000)
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
                f"{len(list(tars.glob('train-*.tar')))} tars)"),
            row("Hugging Face dataset: images/s on one core, hf / the same ImageFolder",
                [h / f for h, f in zip(speeds["hf"], speeds["imagefolder"], strict=True)],
                f"{detail}, hf {seen['hf']:.0f}/s (save_to_disk's Arrow files, memory-mapped), its Parquet files "
                f"{seen['parquet']:.0f}/s (made Arrow files once); both splits ready in: hf {listed['hf']:.1f} s "
                f"(labels checked), Parquet {listed['parquet']:.1f} s (labels checked, the image column converted)")]
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
