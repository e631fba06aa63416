"""One set of real images (the built-in drawn shapes, saved as PNG and JPEG files) as every source trainbox reads: an
ImageFolder, label files, WebDataset tars written by webdataset's own ShardWriter (in .venv-wds, `make wds-setup`),
tars written by Python's tarfile in the same layout, and Hugging Face datasets written by `datasets` itself
(save_to_disk and to_parquet, in .venv-hf, `make hf-setup`); each in the ImageFolder's order, so that every source
gives the same samples."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import torch
from PIL import Image

from tests.helpers import REPO, make, one_at_a_time
from train.data import SHAPE_CLASSES, make_shapes
from train.data.scan import scan_split

WDS_PYTHON = REPO / ".venv-wds" / "bin" / "python"
HF_PYTHON = REPO / ".venv-hf" / "bin" / "python"
# webdataset's ShardWriter, run where webdataset is installed: argv[1] a JSON list of [key, image file, label],
# argv[2] the shard pattern, argv[3] the samples per shard.
SHARD_WRITER = """
import json, pathlib, sys
import webdataset as wds
samples, pattern, per_shard = json.loads(pathlib.Path(sys.argv[1]).read_text()), sys.argv[2], int(sys.argv[3])
with wds.ShardWriter(pattern, maxcount=per_shard, verbose=0) as sink:
    for key, path, label in samples:
        image = pathlib.Path(path)
        sink.write({"__key__": key, image.suffix[1:]: image.read_bytes(), "cls": label})
"""


def draw_imagefolder(root: Path, classes: int = 3, train: int = 30, val: int = 12, size: int = 24) -> Path:
    """root/{train,val}/<shape>/NNN.png|jpg: the built-in shapes of `classes` kinds, every third image a JPEG."""
    for split, count, seed in (("train", train, 1), ("val", val, 2)):
        images, labels = make_shapes(count * 4, size, seed)
        kept = [i for i in range(len(labels)) if labels[i] < classes][:count]
        for n, i in enumerate(kept):
            folder = root / split / SHAPE_CLASSES[int(labels[i])]
            folder.mkdir(parents=True, exist_ok=True)
            suffix = "jpg" if n % 3 == 0 else "png"
            Image.fromarray(images[i].permute(1, 2, 0).numpy()).save(folder / f"{n:03d}.{suffix}")
    return root


def listing(folder: Path, split: str) -> tuple[list[str], list[tuple[str, int]]]:
    """The ImageFolder's classes and (image, label) samples of a split, in its order."""
    return scan_split(folder / split)


def link_imagefolder(folder: Path, root: Path) -> Path:
    """root/{train,val}/<class>/<name>, each a link to the ImageFolder's image (relative links in train/, absolute in
    val/), and one class of val/ a link to the ImageFolder's class folder: a dataset made of links into a pool."""
    for split in ("train", "val"):
        classes = sorted(p.name for p in (folder / split).iterdir())
        for name in classes:
            if split == "val" and name == classes[-1]:
                (root / split).mkdir(parents=True, exist_ok=True)
                (root / split / name).symlink_to(folder / split / name)
                continue
            (root / split / name).mkdir(parents=True)
            for image in (folder / split / name).iterdir():
                link = root / split / name / image.name
                link.symlink_to(os.path.relpath(image, link.parent) if split == "train" else image)
    return root


def write_label_files(folder: Path, root: Path, suffix: str = ".csv") -> Path:
    """root/train.csv and val.csv (or .tsv, .jsonl) listing the ImageFolder's images in its order, by class name;
    the paths relative to root (through ..) for the training split, absolute for the validation split."""
    root.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        classes, samples = listing(folder, split)
        rows = [(str(Path("..") / Path(p).relative_to(root.parent)) if split == "train" else p, classes[label])
                for p, label in samples]
        path = root / f"{split}{suffix}"
        if suffix == ".jsonl":
            path.write_text("".join(json.dumps({"image": p, "class": c}) + "\n" for p, c in rows))
        else:
            with open(path, "w", newline="") as f:
                writer = csv.writer(f, delimiter="\t" if suffix == ".tsv" else ",")
                writer.writerow(["path", "label"])
                writer.writerows(rows)
    return root


def write_wds_shards(folder: Path, root: Path, per_shard: int = 7) -> Path:
    """root/{train,val}-NNNNNN.tar written by webdataset's ShardWriter (<key>.png|jpg, <key>.cls), the ImageFolder's
    images in its order, and root/classes.txt with its class names."""
    with one_at_a_time("wds-setup"):  # test workers at once would install into the one .venv-wds
        make("wds-setup", timeout=600)
    root.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        classes, samples = listing(folder, split)
        plan = root.parent / f".{root.name}-{split}.json"
        plan.write_text(json.dumps([[f"s{i:05d}", p, label] for i, (p, label) in enumerate(samples)]))
        subprocess.run([str(WDS_PYTHON), "-c", SHARD_WRITER, str(plan), str(root / f"{split}-%06d.tar"),
                        str(per_shard)], check=True, capture_output=True, timeout=120)
        plan.unlink()
    (root / "classes.txt").write_text("\n".join(classes) + "\n")
    return root


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_plain_tars(folder: Path, root: Path, per_shard: int = 11, label_key: str = "label") -> Path:
    """root/train/*.tar and root/val/*.tar written by Python's tarfile (GNU format, a folder member first), each
    sample's label in its .json under label_key, and root/classes.json with the class names."""
    for split in ("train", "val"):
        classes, samples = listing(folder, split)
        (root / split).mkdir(parents=True, exist_ok=True)
        for start in range(0, len(samples), per_shard):
            with tarfile.open(root / split / f"part-{start // per_shard:03d}.tar", "w",
                              format=tarfile.GNU_FORMAT) as tar:
                folder_member = tarfile.TarInfo("images")
                folder_member.type = tarfile.DIRTYPE
                tar.addfile(folder_member)
                for i, (path, label) in enumerate(samples[start:start + per_shard], start):
                    key = f"images/{split}_{i:05d}"
                    add_member(tar, f"{key}.json", json.dumps({label_key: label, "source": path}).encode())
                    add_member(tar, f"{key}{Path(path).suffix}", Path(path).read_bytes())
    (root / "classes.json").write_text(json.dumps(classes))
    return root


# Hugging Face's datasets, run where it is installed: argv[1] a JSON file of {folder: plan}, each plan {"form": "disk",
# "parquet" or "dataset" (one saved Dataset), "splits": {name: [[image, label], ...]}, "classes": [...]}; an image is
# a path (read from the dataset's folder where relative), ["bytes", path] for the file's bytes (no path), or null, as
# a label may be.
HF_WRITER = """
import json, os, pathlib, sys
from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, Value
def image(value):
    return {"bytes": pathlib.Path(value[1]).read_bytes(), "path": None} if isinstance(value, list) else value
def table(rows, features):
    image_column, label_column = features
    return Dataset.from_dict({image_column: [image(i) for i, _ in rows], label_column: [l for _, l in rows]},
                             features=features)
for out, plan in json.loads(pathlib.Path(sys.argv[1]).read_text()).items():
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(out)
    splits = plan["splits"]
    if plan["form"] in ("disk", "dataset"):  # an Image column of paths (save_to_disk embeds the files), a ClassLabel
        features = Features({"image": Image(), "label": ClassLabel(names=plan["classes"])})
        if plan["form"] == "dataset":  # one saved Dataset: a single split
            table(next(iter(splits.values())), features).save_to_disk(str(out))
        else:
            DatasetDict({name: table(rows, features) for name, rows in splits.items()}).save_to_disk(
                str(out), num_shards={name: min(2, len(rows)) for name, rows in splits.items()})
    else:  # Parquet as push_to_hub lays it out; columns img and labels (class names)
        features = Features({"img": Image(), "labels": Value("string")})
        for name, rows in splits.items():
            shards = 2 if len(rows) > 1 else 1
            for i in range(shards):
                table(rows, features).shard(shards, i, contiguous=True).to_parquet(
                    str(out / "data" / f"{name}-{i:05d}-of-{shards:05d}.parquet"))
"""


def write_hf(plans: dict[Path, dict]) -> None:
    """Hugging Face datasets written by `datasets` itself (.venv-hf, `make hf-setup`, on first use), one plan
    (HF_WRITER's) per folder, all in one process (its import takes seconds)."""
    with one_at_a_time("hf-setup"):  # test workers at once would install into the one .venv-hf
        make("hf-setup", timeout=600)
    spec = Path(tempfile.mkstemp(suffix=".json")[1])
    spec.write_text(json.dumps({str(folder): plan for folder, plan in plans.items()}))
    try:
        subprocess.run([str(HF_PYTHON), "-c", HF_WRITER, str(spec)], check=True, capture_output=True, timeout=300,
                       env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                            "HF_HOME": str(spec.with_suffix(".hf-home"))})
    finally:
        spec.unlink()
        shutil.rmtree(spec.with_suffix(".hf-home"), ignore_errors=True)


def hf_disk_plan(folder: Path) -> dict:
    """The ImageFolder as a DatasetDict saved to disk (root/dataset_dict.json, root/train/ in 2 Arrow files,
    root/validation/): an Image column of its files (their bytes embedded by save_to_disk) and a ClassLabel of its
    class names, in its order."""
    splits, classes = {}, None
    for split, name in (("train", "train"), ("val", "validation")):
        classes, samples = listing(folder, split)
        splits[name] = [[path, label] for path, label in samples]
    return {"form": "disk", "splits": splits, "classes": classes}


def hf_parquet_plan(folder: Path, root: Path) -> dict:
    """The ImageFolder as Parquet files in root (root/data/train-0000N-of-00002.parquet, root/data/validation-...),
    columns img and labels (class names): the training split's images as paths relative to root, the validation
    split's as their bytes, without a path."""
    splits = {}
    for split, name in (("train", "train"), ("val", "validation")):
        classes, samples = listing(folder, split)
        splits[name] = [[os.path.relpath(p, root) if split == "train" else ["bytes", p], classes[label]]
                        for p, label in samples]
    return {"form": "parquet", "splits": splits}


def write_hf_sources(folder: Path, disk: Path, parquet: Path) -> tuple[Path, Path]:
    """The ImageFolder as a saved DatasetDict in `disk` and as Parquet files in `parquet` (the plans above)."""
    write_hf({disk: hf_disk_plan(folder), parquet: hf_parquet_plan(folder, parquet)})
    return disk, parquet


def batches(cfg, start: int = 0, val: bool = False) -> list:
    """The batches one rank of one worker reads from cfg's data: the validation loader's, or the training loader's
    of epoch 1 from sample `start` on."""
    from train.data import build_datasets
    from train.loading import build_train_loader, build_val_loader, sampling

    train_set, val_set, _ = build_datasets(cfg)
    if val:
        return list(build_val_loader(val_set, cfg.data, cfg.optimisation.batch_size, 0, 1, pin_memory=False))
    loader, sampler = build_train_loader(train_set, sampling(cfg), cfg.data, 0, 1, pin_memory=False)
    sampler.set_epoch(1, start=start)
    return list(loader)


def assert_same_batches(a: list, b: list) -> None:
    """The same images, bit for bit (the loaders' uint8, decoded on the trainer), with the same labels, in order."""
    assert len(a) == len(b) > 0
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert xa.dtype == xb.dtype == torch.uint8 and torch.equal(xa, xb) and torch.equal(ya, yb)
