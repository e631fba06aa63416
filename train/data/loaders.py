"""The datasets a run trains and evaluates on (build_datasets) and their loaders: the training loader with its
sampler (in-memory batches for the built-in sets, DataLoader workers for files) and the validation loader
(every sample once across ranks, no padding).
"""

from __future__ import annotations

import signal
from functools import partial
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from train.cluster.identity import identity, usable_cores
from train.config.settings import IN_MEMORY, Config, Data
from train.data.decode import Decoded, DeviceDecoder, FileBytes, collate_files, load_image, read_bytes
from train.data.folders import (ShardSplit, check_imagefolder, cifar_split, imagefolder_split, imagefolder_splits,
                                is_pack, path_of)
from train.data.hfrows import hf_splits
from train.data.labelfiles import LabelFileSplit, read_labelfiles
from train.data.samplers import Sampling, SeededSample, ShardSampler
from train.data.shapes import ShapesDataset, SyntheticDataset
from train.data.tars import tar_splits
from train.data.transforms import image_transforms


def in_memory(dataset) -> tuple[torch.Tensor, ...] | None:
    """The tensors of a dataset held in memory whole, its items their rows (the built-in sets; a task's TensorDataset),
    moved to the training device once and cut into batches there; None for any other dataset."""
    if isinstance(dataset, ShapesDataset):
        return dataset.images, dataset.labels
    return tuple(dataset.tensors) if isinstance(dataset, TensorDataset) else None


def to_device(dataset, device: torch.device) -> tuple[torch.Tensor, ...]:
    """An in-memory dataset's tensors on the device (the built-in sets keep them there)."""
    if isinstance(dataset, ShapesDataset):
        return dataset.to(device).images, dataset.labels
    dataset.tensors = tuple(t.to(device) for t in dataset.tensors)
    return dataset.tensors


class TensorLoader:
    """Batches straight from in-memory tensors: no worker processes, no per-sample collate."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], sampler: ShardSampler, batch_size: int):
        self.tensors, self.sampler, self.batch_size = tensors, sampler, batch_size

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size

    def __iter__(self):
        indices = torch.tensor(list(self.sampler), dtype=torch.long).to(self.tensors[0].device)
        for b in range(len(self)):
            idx = indices[b * self.batch_size:(b + 1) * self.batch_size]
            yield tuple(t[idx] for t in self.tensors)


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
    root = Path(cfg.data.data_dir)
    if not train:
        val = validation_set(cfg, root, run_dir)
        return None, val, len(class_names(val))
    if cfg.data.dataset in IN_MEMORY:
        kind = ShapesDataset if cfg.data.dataset == "shapes" else SyntheticDataset
        train_set = kind(cfg.data.train_samples, cfg.data.image_size, seed=cfg.run.seed * 2 + 1)
    elif cfg.data.dataset == "cifar10":
        train_set = cifar_split(root, True, image_transforms(cfg, True), cfg.data.download)
    elif cfg.data.dataset in ("shards", "csv", "hf"):
        splits = source_splits(cfg, root, ("train", "val"), run_dir)
        return *(decoded(cfg, splits[s], s == "train") for s in ("train", "val")), len(splits["train"].classes)
    else:
        check_imagefolder(root)
        splits = imagefolder_splits(root, loader=read_bytes if cfg.data.decode == "gpu" else load_image)
        train_set, val_set = (transformed(cfg, splits[s], s == "train") for s in ("train", "val"))
        return train_set, val_set, len(class_names(train_set))
    return train_set, validation_set(cfg, root, run_dir), len(class_names(train_set))


def source_splits(cfg: Config, root: Path, splits: tuple[str, ...], run_dir: Path | None = None) -> dict:
    """The splits of a file source that gives (bytes, label): a pack's, another tool's tars, a label file's, a
    Hugging Face dataset's (a dry run reads its labels alone)."""
    data = cfg.data
    if data.dataset == "hf":
        return hf_splits(root, data.image_column, data.label_column, data.train_split, data.val_split, splits, run_dir,
                         images=not cfg.run.dry_run)
    if cfg.data.dataset == "csv":
        listings = read_labelfiles(root, cfg.data.path_column, cfg.data.label_column, splits)
        return {split: LabelFileSplit(listing) for split, listing in listings.items()}
    if is_pack(root):
        return {split: ShardSplit(root, split) for split in splits}
    return tar_splits(root, splits, cfg.data.label_key, run_dir)


def decoded(cfg: Config, split, train: bool):
    """A source of (bytes, label), decoded and transformed: in the loader workers, or on the device (--decode gpu)."""
    return (FileBytes if cfg.data.decode == "gpu" else Decoded)(split, image_transforms(cfg, train), split.name)


def validation_set(cfg: Config, root: Path, run_dir: Path | None = None):
    """The validation set, with the evaluation's transforms."""
    if cfg.data.dataset in IN_MEMORY:
        kind = ShapesDataset if cfg.data.dataset == "shapes" else SyntheticDataset
        return kind(cfg.data.val_samples, cfg.data.image_size, seed=cfg.run.seed * 2 + 2)
    if cfg.data.dataset == "cifar10":
        return cifar_split(root, False, image_transforms(cfg, False))
    if cfg.data.dataset in ("shards", "csv", "hf"):
        return decoded(cfg, source_splits(cfg, root, ("val",), run_dir)["val"], False)
    check_imagefolder(root, ("val",))
    split = imagefolder_split(root, "val", loader=read_bytes if cfg.data.decode == "gpu" else load_image)
    return transformed(cfg, split, False)


def transformed(cfg: Config, split, train: bool):
    """An ImageFolder's split with its transforms: in the loader workers, or (--decode gpu: the workers read bytes)
    on the device, the training process decoding (DeviceDecoder)."""
    if cfg.data.decode == "gpu":
        return FileBytes(split, image_transforms(cfg, train), partial(path_of, split))
    split.transform = image_transforms(cfg, train)
    return split


def source_of(cfg: Config, train_set, val_set) -> dict:
    """What the run reads, for the plan: the kind of source, each split's files, the order of its samples and where
    its class names come from."""
    def described(dataset) -> dict | None:
        while dataset is not None and not hasattr(dataset, "describe"):
            dataset = getattr(dataset, "source", None)
        return dataset.describe() if dataset is not None else None

    val = described(val_set)
    if val is None:  # built in, or CIFAR-10
        where = "made in memory from the seed" if cfg.data.dataset in IN_MEMORY else \
            f"torchvision's CIFAR10 in {cfg.data.data_dir}: its batches' order"
        return {"kind": cfg.data.dataset, "order": where, "classes_from": "the dataset's own names"}
    train = described(train_set) if train_set is not None else None
    return {"kind": val["kind"], **({"train": train["from"]} if train else {}), "val": val["from"],
            "order": val["order"], "classes_from": (train or val)["classes_from"]}


def default_num_workers(data: Data) -> int:
    """--num-workers, or where it is -1 the DataLoader workers per process that the data wants."""
    if data.num_workers >= 0:
        return data.num_workers
    if data.dataset in IN_MEMORY:
        return 0
    # Every core of this process's share but one (the one that runs the training loop itself), no cap:
    # decoding and augmenting is the work that scales with cores (make bench: images/s per loader worker).
    return max(1, usable_cores() // max(1, identity().local_world_size) - 1)


def ignore_stop_signals(_worker_id: int) -> None:
    # A preemption signal sent to the whole process group must not kill loader workers before
    # the trainer has saved its checkpoint; the trainer shuts them down itself.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)


def sampling(cfg: Config) -> Sampling:
    """The run's sampler spec: what of its config the training sampler reads."""
    return Sampling(cfg.run.seed, cfg.augmentation.ra_reps, cfg.optimisation.batch_size, cfg.optimisation.grad_accum)


def build_train_loader(dataset, spec: Sampling, data: Data, rank: int, world_size: int, pin_memory: bool,
                       device: torch.device | None = None, persistent: bool = True,
                       layout: tuple[int, int] | None = None):
    """The training loader of this rank and its sampler, as `spec` deals the samples and `data` (--num-workers) loads
    them. layout: the (workers, --grad-accum) the run's sample order is laid out for (a resume on other workers keeps
    it); default: this one."""
    held = in_memory(dataset) is not None
    sampler = ShardSampler(len(dataset), rank, world_size, spec.seed, with_seeds=not held, reps=spec.reps,
                           batch_size=spec.batch_size, grad_accum=spec.grad_accum, layout=layout)
    if held:  # in memory: batches are cut on the training device itself
        return TensorLoader(to_device(dataset, device or torch.device("cpu")), sampler, spec.batch_size), sampler
    workers = default_num_workers(data)
    files = isinstance(dataset, FileBytes)
    loader = DataLoader(dataset if files else SeededSample(dataset), batch_size=spec.batch_size,
                        sampler=sampler, drop_last=True, num_workers=workers, pin_memory=pin_memory and not files,
                        persistent_workers=persistent and workers > 0,
                        worker_init_fn=ignore_stop_signals if workers > 0 else None,
                        prefetch_factor=4 if workers > 0 else None, collate_fn=collate_files if files else None,
                        generator=torch.Generator().manual_seed(spec.seed))  # iter() must not draw global RNG
    return (DeviceDecoder(loader, dataset, device or torch.device("cpu")) if files else loader), sampler


def build_val_loader(dataset, data: Data, batch_size: int, rank: int, world_size: int, pin_memory: bool,
                     device: torch.device | None = None):
    """This rank's validation loader: each rank takes indices rank, rank+W, ... with no padding, every sample counted
    exactly once; files in batches of twice the run's `batch_size` (no gradients to hold), in-memory sets of 256."""
    indices = list(range(rank, len(dataset), world_size))
    if in_memory(dataset) is not None:
        tensors = to_device(dataset, device or torch.device("cpu"))
        idx = torch.tensor(indices, dtype=torch.long, device=tensors[0].device)
        return [tuple(t[idx[i:i + 256]] for t in tensors) for i in range(0, len(idx), 256)]
    workers = default_num_workers(data)
    files = isinstance(dataset, FileBytes)
    loader = DataLoader(torch.utils.data.Subset(dataset, indices), batch_size=2 * batch_size,
                        num_workers=workers, pin_memory=pin_memory and not files,
                        worker_init_fn=ignore_stop_signals if workers > 0 else None,
                        collate_fn=collate_files if files else None)
    return DeviceDecoder(loader, dataset, device or torch.device("cpu")) if files else loader
