"""The image datasets a run of classification trains and evaluates on (build_datasets), from every source; what the
plan says of them (source_of). Their loaders, which know no image, are train/loading/loaders.py's.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from train.config.catalog import source
from train.config.settings import Augmentation, Config, Data
from train.data.decode import Decoded, FileBytes, load_image, read_bytes
from train.data.folders import (ShardSplit, check_imagefolder, cifar_split, imagefolder_split, imagefolder_splits,
                                is_pack, path_of)
from train.data.hfrows import hf_splits
from train.data.labelfiles import LabelFileSplit, read_labelfiles
from train.data.shapes import ShapesDataset, SyntheticDataset
from train.data.tars import tar_splits
from train.data.transforms import image_transforms

IN_MEMORY = {"shapes": ShapesDataset, "synthetic": SyntheticDataset}  # the catalogue's sources made in memory


def class_names(dataset) -> list[str]:
    """The class names of a dataset that build_datasets made, in label order (through its wrappers)."""
    while not hasattr(dataset, "classes") and hasattr(dataset, "source"):
        dataset = dataset.source
    return [str(c) for c in dataset.classes]


def build_datasets(cfg: Config, train: bool = True, run_dir: Path | None = None):
    """(train, val, num_classes). File datasets get their transforms; images stay uint8 (normalised on device).
    train=False: the validation set alone (train is None; an ImageFolder needs no train/ then). run_dir: where the
    index of another tool's tars (train/data/tars.py), or the Arrow files made of a Hugging Face dataset's Parquet
    files (train/data/hfcache.py), go when their folder cannot be written."""
    data, aug, images = cfg.data, cfg.augmentation, not cfg.run.dry_run
    root = Path(data.data_dir)
    if not train:
        val = validation_set(data, aug, root, run_dir, cfg.run.seed, images)
        return None, val, len(class_names(val))
    if data.dataset in IN_MEMORY:
        train_set = IN_MEMORY[data.dataset](data.train_samples, data.image_size, seed=cfg.run.seed * 2 + 1)
    elif data.dataset == "cifar10":
        train_set = cifar_split(root, True, image_transforms(data, aug, True), data.download)
    elif source(data.dataset).encoded:
        splits = source_splits(data, root, ("train", "val"), run_dir, images)
        return *(decoded(data, aug, splits[s], s == "train") for s in ("train", "val")), len(splits["train"].classes)
    else:
        check_imagefolder(root)
        splits = imagefolder_splits(root, loader=read_bytes if data.decode == "gpu" else load_image)
        train_set, val_set = (transformed(data, aug, splits[s], s == "train") for s in ("train", "val"))
        return train_set, val_set, len(class_names(train_set))
    return train_set, validation_set(data, aug, root, run_dir, cfg.run.seed, images), len(class_names(train_set))


def source_splits(data: Data, root: Path, splits: tuple[str, ...], run_dir: Path | None, images: bool) -> dict:
    """The splits of a file source that gives (bytes, label): a pack's, another tool's tars, a label file's, a
    Hugging Face dataset's (images False, a dry run: its labels alone)."""
    if data.dataset == "hf":
        return hf_splits(root, data.image_column, data.label_column, data.train_split, data.val_split, splits, run_dir,
                         images=images)
    if data.dataset == "csv":
        listings = read_labelfiles(root, data.path_column, data.label_column, splits)
        return {split: LabelFileSplit(listing) for split, listing in listings.items()}
    if is_pack(root):
        return {split: ShardSplit(root, split) for split in splits}
    return tar_splits(root, splits, data.label_key, run_dir)


def decoded(data: Data, aug: Augmentation, split, train: bool):
    """A source of (bytes, label), decoded and transformed: in the loader workers, or on the device (--decode gpu)."""
    return (FileBytes if data.decode == "gpu" else Decoded)(split, image_transforms(data, aug, train), split.name)


def validation_set(data: Data, aug: Augmentation, root: Path, run_dir: Path | None, seed: int, images: bool):
    """The validation set, with the evaluation's transforms (seed: the run's, of the built-in sets; images: as
    source_splits)."""
    if data.dataset in IN_MEMORY:
        return IN_MEMORY[data.dataset](data.val_samples, data.image_size, seed=seed * 2 + 2)
    if data.dataset == "cifar10":
        return cifar_split(root, False, image_transforms(data, aug, False))
    if source(data.dataset).encoded:
        return decoded(data, aug, source_splits(data, root, ("val",), run_dir, images)["val"], False)
    check_imagefolder(root, ("val",))
    split = imagefolder_split(root, "val", loader=read_bytes if data.decode == "gpu" else load_image)
    return transformed(data, aug, split, False)


def transformed(data: Data, aug: Augmentation, split, train: bool):
    """An ImageFolder's split with its transforms: in the loader workers, or (--decode gpu: the workers read bytes)
    on the device, the training process decoding (DeviceDecoder)."""
    if data.decode == "gpu":
        return FileBytes(split, image_transforms(data, aug, train), partial(path_of, split))
    split.transform = image_transforms(data, aug, train)
    return split


def source_of(data: Data, train_set, val_set) -> dict:
    """What the run reads, for the plan: the kind of source, each split's files, the order of its samples and where
    its class names come from."""
    def described(dataset) -> dict | None:
        while dataset is not None and not hasattr(dataset, "describe"):
            dataset = getattr(dataset, "source", None)
        return dataset.describe() if dataset is not None else None

    val = described(val_set)
    if val is None:  # built in, or CIFAR-10
        where = "made in memory from the seed" if data.dataset in IN_MEMORY else \
            f"torchvision's CIFAR10 in {data.data_dir}: its batches' order"
        return {"kind": data.dataset, "order": where, "classes_from": "the dataset's own names"}
    train = described(train_set) if train_set is not None else None
    return {"kind": val["kind"], **({"train": train["from"]} if train else {}), "val": val["from"],
            "order": val["order"], "classes_from": (train or val)["classes_from"]}


