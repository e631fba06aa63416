"""Datasets, sharding and loaders.

- shapes: built-in, generated from the seed in memory (no download): 10 classes of procedurally drawn
  shapes and textures with random position, size, colours and noise. It needs a real model to learn.
- cifar10: torchvision's CIFAR10 under --data-dir (downloaded only with --download, by local rank 0).
- imagefolder: DATA_DIR/train/<class>/* and DATA_DIR/val/<class>/*, decoded by torchvision.io into uint8
  tensors (PIL for the formats it does not read) and augmented on tensors by the recipe (see recipe()):
  in the loader workers (--decode cpu), or in the training process on its GPU (--decode gpu:
  FileBytes, DeviceDecoder).
- shards: an ImageFolder packed by train/pack.py, read by offset (ShardSplit), decoded as above.

Training batches come from ShardSampler: every epoch one permutation drawn from (seed, epoch), shared
by all ranks, rank r taking every world_size-th index. Each index travels with its own augmentation
seed, so a run resumed mid-epoch, or with another number of loader workers, sees the same images.

torchvision is imported only by the runs that use it (here and in train/models.py): the import costs
about 1.5 s of every worker's start-up, and the built-in dataset and model need none of it.
"""

from __future__ import annotations

import bisect
import io
import json
import math
import signal
from functools import partial
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset, Sampler

from train.config import Config, recipe
from train.distributed import gather, identity, usable_cores
from train.errors import ConfigError, DataError
from train.weights import MEAN, STD

NUM_SHAPE_CLASSES = 10
SYNTHETIC_CLASSES = 1000
SHAPE_CLASSES = ("disk", "square", "ring", "plus", "triangle", "diamond",
                 "h-stripes", "v-stripes", "checker", "x-cross")


def make_shapes(n: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n images (uint8, n x 3 x size x size) of 10 classes, a pure function of (n, size, seed)."""
    g = torch.Generator().manual_seed(seed)
    u = lambda *shape: torch.rand(*shape, generator=g)  # noqa: E731
    labels = torch.randint(0, NUM_SHAPE_CLASSES, (n,), generator=g)
    coords = (torch.arange(size, dtype=torch.float32) + 0.5) / size  # pixel centres in [0, 1]
    y, x = coords.view(1, size, 1), coords.view(1, 1, size)
    r = (0.14 + 0.16 * u(n)).view(n, 1, 1)  # shape radius
    cx = (0.5 + (u(n) - 0.5) * 0.5).view(n, 1, 1)
    cy = (0.5 + (u(n) - 0.5) * 0.5).view(n, 1, 1)
    dx, dy = x - cx, y - cy
    dist = torch.sqrt(dx**2 + dy**2)
    period = (0.12 + 0.12 * u(n)).view(n, 1, 1)
    phase = u(n).view(n, 1, 1) * 2 * math.pi
    wave = lambda t: torch.sin(2 * math.pi * t / period + phase) > 0  # noqa: E731
    masks = torch.stack([
        dist < r,                                                           # disk
        (dx.abs() < r * 0.85) & (dy.abs() < r * 0.85),                      # square
        (dist < r) & (dist > r * 0.55),                                     # ring
        ((dx.abs() < r * 0.3) & (dy.abs() < r)) | ((dy.abs() < r * 0.3) & (dx.abs() < r)),  # plus
        (dy < r * 0.8) & (dy > -r) & (dx.abs() < (dy + r) * 0.55),          # triangle
        dx.abs() + dy.abs() < r * 1.1,                                      # diamond
        wave(y).expand(n, size, size),                                      # horizontal stripes
        wave(x).expand(n, size, size),                                      # vertical stripes
        wave(x) ^ wave(y),                                                  # checkerboard
        (((dx - dy).abs() < r * 0.25) | ((dx + dy).abs() < r * 0.25)) & (dist < r * 1.2),  # x-cross
    ], dim=1)
    mask = masks[torch.arange(n), labels].unsqueeze(1).float()  # n x 1 x H x W
    fg, bg = u(n, 3, 1, 1), u(n, 3, 1, 1)
    # Keep foreground and background apart in brightness so every image is legible.
    fg = torch.where((fg - bg).abs().mean(1, keepdim=True) < 0.25, 1 - bg, fg)
    images = mask * fg + (1 - mask) * bg + 0.12 * torch.randn(n, 3, size, size, generator=g)
    return (images.clamp(0, 1) * 255).round().to(torch.uint8), labels


class ShapesDataset(Dataset):
    """In-memory images and labels; the trainer moves them to its device once, so batches never wait."""

    def __init__(self, n: int, size: int, seed: int):
        self.images, self.labels = make_shapes(n, size, seed)
        self.classes = list(SHAPE_CLASSES)

    def to(self, device: torch.device) -> ShapesDataset:
        self.images, self.labels = self.images.to(device), self.labels.to(device)
        return self

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], self.labels[index]


class SyntheticDataset(ShapesDataset):
    """Random images and labels (1000 classes), for measuring speed: nothing to learn, nothing to load."""

    def __init__(self, n: int, size: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)
        self.labels = torch.randint(0, SYNTHETIC_CLASSES, (n,), generator=g)
        self.classes = [str(i) for i in range(SYNTHETIC_CLASSES)]


class SeededSample(Dataset):
    """Wraps a dataset whose transforms draw random numbers: each item is (index, seed) and the
    transform's randomness comes from that seed alone, not from which worker happens to load it."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item):
        index, seed = item
        if torch.utils.data.get_worker_info() is not None:
            torch.manual_seed(seed)
            return self.dataset[index]
        with torch.random.fork_rng(devices=[]):  # loading in the trainer itself: leave its RNG alone
            torch.manual_seed(seed)
            return self.dataset[index]


def samples_per_rank(length: int, world: int, reps: int = 0) -> int:
    """The samples each rank takes in one epoch: an equal share of the set cut to a multiple of the world
    size, or with --ra-reps on more than one worker the repeated-augmentation sampler's (torchvision's
    reference: the set cut to a multiple of 256, then shared by the ranks)."""
    return length // 256 * 256 // world if reps and world > 1 else length // world


def describe_sampler(reps: int, world: int) -> str:
    """What the training sampler does with --ra-reps `reps` on `world` workers, in a line (the plan's, the log's)."""
    if reps and world > 1:
        return (f"repeated augmentation (torchvision's RASampler): each image {reps} times in a row in the epoch's "
                f"order, dealt round the {world} ranks in turn (a rank gets several copies of an image when there are "
                f"fewer ranks than copies), each copy augmented apart; the epoch cut to a multiple of 256 images")
    shared = f", rank r taking every {world}-th" if world > 1 else ""
    plain = f"one shuffled pass over the set per epoch{shared}"
    if reps:
        return (f"{plain}: --ra-reps {reps} on one worker samples plainly at random, as torchvision's reference does "
                f"outside distributed runs (the repetitions need 2 or more workers)")
    return plain


class ShardSampler(Sampler):
    """Like DistributedSampler (shared per-epoch permutation, rank r takes every world-th index),
    plus: a start position inside the epoch for resuming, and a per-sample augmentation seed.
    The epoch is cut to a multiple of world_size so every rank yields the same number of indices.
    reps > 0 on more than one worker: torchvision's repeated-augmentation sampler (RASampler) instead (one worker
    samples plainly, as the reference outside distributed runs): the epoch's permutation (seeded
    with seed + epoch, as the reference's) with each index repeated `reps` times in a row, padded from its
    start to a multiple of the world size, rank r taking every world-th entry from r, cut to
    samples_per_rank. Each entry has a seed of its own, so the repetitions of an image are augmented apart."""

    def __init__(self, length: int, rank: int, world_size: int, seed: int, with_seeds: bool, reps: int = 0):
        if length < world_size:
            raise ConfigError(f"dataset has {length} samples but there are {world_size} workers: use more data")
        self.length, self.rank, self.world_size, self.seed = length, rank, world_size, seed
        self.with_seeds, self.reps = with_seeds, reps if world_size > 1 else 0  # one worker: plain (the reference)
        self.epoch = 0
        self.start = 0  # indices of this rank to skip in the current epoch (resume)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return samples_per_rank(self.length, self.world_size, self.reps) - self.start

    def __iter__(self):
        if self.reps:
            return self._repeated()
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.length, generator=g)
        usable = self.length - self.length % self.world_size
        mine = order[self.rank:usable:self.world_size][self.start:].tolist()
        if not self.with_seeds:
            return iter(mine)
        # One seed per (run seed, epoch, sample): the same wherever and whenever the sample is loaded.
        base = (self.seed * 1_000_003 + self.epoch) * 10_000_019
        return iter([(i, (base + i) % (2**63 - 1)) for i in mine])

    def _repeated(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.length, generator=g).repeat_interleave(self.reps)
        total = -(-self.length * self.reps // self.world_size) * self.world_size
        order = torch.cat([order, order[:total - len(order)]])
        positions = torch.arange(self.rank, total, self.world_size)[:samples_per_rank(self.length, self.world_size,
                                                                                       self.reps)][self.start:]
        mine = order[positions].tolist()
        if not self.with_seeds:
            return iter(mine)
        base = (self.seed * 1_000_003 + self.epoch) * 10_000_019  # a seed per entry of the epoch, not per image
        return iter([(i, (base + p) % (2**63 - 1)) for i, p in zip(mine, positions.tolist(), strict=True)])


class TensorLoader:
    """Batches straight from in-memory tensors: no worker processes, no per-sample collate."""

    def __init__(self, dataset: ShapesDataset, sampler: ShardSampler, batch_size: int):
        self.dataset, self.sampler, self.batch_size = dataset, sampler, batch_size

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size

    def __iter__(self):
        indices = torch.tensor(list(self.sampler), dtype=torch.long).to(self.dataset.images.device)
        for b in range(len(self)):
            idx = indices[b * self.batch_size:(b + 1) * self.batch_size]
            yield self.dataset.images[idx], self.dataset.labels[idx]


def read_bytes(path: str) -> torch.Tensor:
    """A file's bytes as a uint8 tensor, failing with one line that names the file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DataError(f"cannot read image {path} ({e}): check the file's permissions and storage, then run the "
                        f"same command to resume") from None
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode(data: torch.Tensor, path: str) -> torch.Tensor:
    """Encoded bytes to a uint8 RGB tensor (3 x H x W): torchvision.io (libjpeg-turbo, libpng, libwebp), PIL
    for what it cannot decode; a file neither reads stops the run with one line that names it."""
    from torchvision.io import ImageReadMode, decode_image  # noqa: PLC0415 - torchvision: see the module docstring
    from torchvision.transforms.v2.functional import pil_to_tensor  # noqa: PLC0415 - as above

    try:
        return decode_image(data, mode=ImageReadMode.RGB)
    except RuntimeError:
        pass  # a format torchvision.io does not decode (or a damaged file): PIL has the last word
    try:
        with Image.open(io.BytesIO(data.numpy().tobytes())) as image:
            return pil_to_tensor(image.convert("RGB"))
    except UnidentifiedImageError:
        reason = "not an image torchvision.io or PIL can read"
    except (OSError, SyntaxError, ValueError) as e:  # PIL raises all three for damaged files
        reason = str(e)
    raise DataError(f"cannot read image {path} ({reason}): delete or replace the file, then run the same command "
                    f"to resume")


def load_image(path: str) -> torch.Tensor:
    """ImageFolder's loader for --decode cpu: the file decoded in the loader worker."""
    return decode(read_bytes(path), path)


JPEG_START = (0xFF, 0xD8)


def decode_batch(data: list[torch.Tensor], paths: list[str], seeds: list[int], transform,
                 device: torch.device) -> torch.Tensor:
    """--decode gpu, in the training process: a batch of encoded files to augmented uint8 images on the
    device. JPEGs are decoded together on the device (nvJPEG on CUDA), other formats on the CPU; each
    sample is then augmented on the device under its own seed, so a batch equals what the loader workers
    would have made of it, whatever the worker count or the resume point."""
    from torchvision.io import ImageReadMode, decode_jpeg  # noqa: PLC0415 - torchvision: see the module docstring

    images: list[torch.Tensor | None] = [None] * len(data)
    jpegs = [i for i, d in enumerate(data) if len(d) > 2 and tuple(d[:2].tolist()) == JPEG_START]
    if jpegs:
        try:
            decoded = decode_jpeg([data[i] for i in jpegs], mode=ImageReadMode.RGB, device=device)
        except RuntimeError:  # one damaged file fails the batch: find it, and name it
            decoded = [decode(data[i], paths[i]).to(device) for i in jpegs]
        for i, image in zip(jpegs, decoded, strict=True):
            images[i] = image
    for i, image in enumerate(images):
        if image is None:
            images[i] = decode(data[i], paths[i]).to(device, non_blocking=True)
    out = []
    for image, seed in zip(images, seeds, strict=True):
        with torch.random.fork_rng(devices=[]):  # the draws come from the CPU generator, as in a worker
            torch.manual_seed(seed)
            out.append(transform(image))
    return torch.stack(out)


class FileBytes(Dataset):
    """--decode gpu: items are (bytes, label, seed, index); decoding and the transform wait for the training
    process (DeviceDecoder). source yields (bytes, label); name(index) says which file a sample is."""

    def __init__(self, source, transform, name):
        self.source, self.transform, self.name = source, transform, name

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, item):
        index, seed = item if isinstance(item, tuple) else (item, 0)
        data, label = self.source[index]
        return data, label, seed, index


class Decoded(Dataset):
    """--decode cpu over a source of (bytes, label), such as a pack's split: decoded and transformed here."""

    def __init__(self, source, transform, name):
        self.source, self.transform, self.name = source, transform, name

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int):
        data, label = self.source[index]
        return self.transform(decode(data, self.name(index))), label


def _collate_files(batch):
    data, labels, seeds, indices = zip(*batch, strict=True)
    return list(data), torch.tensor(labels), list(seeds), list(indices)


class DeviceDecoder:
    """A loader of FileBytes batches that yields (images on the device, labels), as the CPU path's loader
    yields (images, labels): the trainer's prepare_inputs then normalises them where they already are."""

    def __init__(self, loader: DataLoader, files: FileBytes, device: torch.device):
        self.loader, self.files, self.device = loader, files, device

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for data, labels, seeds, indices in self.loader:
            names = [self.files.name(i) for i in indices]
            yield decode_batch(data, names, seeds, self.files.transform, self.device), labels


def _path_of(folder, index: int) -> str:
    return folder.samples[index][0]


def _imagefolder_split(root: Path, split: str, loader=load_image):
    from torchvision import datasets  # noqa: PLC0415 - torchvision: see the module docstring

    path = root / split
    try:
        return datasets.ImageFolder(str(path), loader=loader)
    except (FileNotFoundError, RuntimeError) as e:
        raise ConfigError(f"{path}: {str(e).splitlines()[0]}: put images in {path}/<class>/") from None


def check_imagefolder(root: Path, splits: tuple[str, ...] = ("train", "val")) -> None:
    """The folder layout, checked before any worker starts: both splits, the same non-empty class list."""
    classes = {"train": None, "val": None}
    for split in splits:
        path = root / split
        if not path.is_dir():
            raise ConfigError(f"{path} is missing: an imagefolder dataset needs {root}/train/<class>/ and "
                              f"{root}/val/<class>/")
        classes[split] = sorted(d.name for d in path.iterdir() if d.is_dir())
        if not classes[split]:
            raise ConfigError(f"{path} has no class folders: put images in {path}/<class>/")
    if None not in classes.values() and classes["train"] != classes["val"]:
        only = sorted(set(classes["train"]) ^ set(classes["val"]))
        raise ConfigError(f"{root}: train and val hold different classes (only in one: {', '.join(only[:5])}): "
                          f"give both the same class folders")


# ---------------------------------------------------------------- packed shards (train/pack.py writes them)

def read_index(root: Path) -> dict:
    try:
        return json.loads((root / "index.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"{root}/index.json is missing: pack an ImageFolder with `make pack SRC=... DST={root}` "
                          f"(a folder without it is an unfinished pack)") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{root}/index.json cannot be read ({e}): pack the dataset again") from None


def read_idx(shard: Path) -> torch.Tensor:
    data = (shard.parent / f"{shard.name}.idx").read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.int64).view(-1, 3)


class ShardSplit(Dataset):
    """One split of a pack, read by offset: item i is (bytes, label); files stay open per loader worker."""

    def __init__(self, root: Path, split: str):
        info = read_index(root)["splits"][split]
        self.root, self.classes = root, info["classes"]
        self.shards = [root / s["name"] for s in info["shards"]]
        try:
            self.rows = [read_idx(shard) for shard in self.shards]
        except OSError as e:
            raise ConfigError(f"{root}: {e}: the pack is incomplete: pack it again, or run "
                              f"`python -m train.pack --verify {root}`") from None
        self.starts = [0]
        for rows in self.rows:
            self.starts.append(self.starts[-1] + len(rows))
        self._open: dict[int, object] = {}

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self):  # loader workers open their own files
        return {**self.__dict__, "_open": {}}

    def locate(self, index: int) -> tuple[int, int]:
        shard = bisect.bisect_right(self.starts, index) - 1
        return shard, index - self.starts[shard]

    def name(self, index: int) -> str:
        shard, row = self.locate(index)
        return f"sample {index:09d} of {self.shards[shard]}"

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        shard, row = self.locate(index)
        offset, size, label = self.rows[shard][row].tolist()
        try:
            f = self._open.get(shard)
            if f is None:
                f = self._open[shard] = open(self.shards[shard], "rb")
            f.seek(offset)
            data = f.read(size)
        except OSError as e:
            raise DataError(f"cannot read {self.name(index)} ({e}): check the storage, or pack the dataset again") \
                from None
        if len(data) != size:
            raise DataError(f"{self.shards[shard]} is damaged: {self.name(index)} is cut short: run `python -m "
                            f"train.pack --verify {self.root}`, then pack the dataset again")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8), label


def check_cifar(root: Path, download: bool) -> None:
    if not download and not (root / "cifar-10-batches-py").is_dir():
        raise ConfigError(f"CIFAR-10 not found under {root}: pass --download or point --data-dir at it")


def eval_resize(size: int) -> int:
    """The evaluation's resize before its centre crop: size / 0.875 (256 for 224, as torchvision's references)."""
    return int(size / 0.875)


def _transforms(cfg: Config, train: bool):
    """uint8 tensors (or PIL images) in, uint8 tensors out: normalisation happens on the training device.
    imagenet: torchvision's reference classification presets (RandomResizedCrop to --train-crop-size, flip,
    --auto-augment; eval: resize to --val-resize-size, centre crop to --val-crop-size, --interpolation);
    cifar: resize, padded random crop, flip, --auto-augment. --random-erase follows the normalisation, on the
    training device (train/augment.py), as the reference's preset has it after Normalize."""
    from torchvision.transforms import v2  # noqa: PLC0415 - torchvision: see the module docstring

    size, mode = cfg.image_size, v2.InterpolationMode(cfg.interpolation)
    if recipe(cfg) == "imagenet" and train:
        steps = [v2.RandomResizedCrop(cfg.train_crop_size or size, interpolation=mode, antialias=True),
                 v2.RandomHorizontalFlip(), *auto_augment(cfg)]
    elif recipe(cfg) == "imagenet":
        resize, crop, _ = eval_steps(cfg)
        steps = [v2.Resize(resize, interpolation=mode, antialias=True), v2.CenterCrop(crop)]
    else:
        steps = [v2.Resize(size, antialias=True), v2.CenterCrop(size)]
        if train:
            steps += [v2.RandomCrop(size, padding=size // 8), v2.RandomHorizontalFlip(), *auto_augment(cfg)]
    return v2.Compose([v2.ToImage(), *steps, v2.ToDtype(torch.uint8, scale=True)])


def auto_augment(cfg: Config) -> list:
    """--auto-augment as torchvision's reference preset builds it, on uint8 images. Their rotations and shears
    on tensors take nearest or bilinear only: with --interpolation bicubic they resample bilinearly."""
    from torchvision.transforms import v2  # noqa: PLC0415 - torchvision: see the module docstring

    mode = v2.InterpolationMode.BILINEAR
    return {"none": [], "ta_wide": [v2.TrivialAugmentWide(interpolation=mode)],
            "ra": [v2.RandAugment(interpolation=mode, magnitude=cfg.ra_magnitude)],
            "augmix": [v2.AugMix(interpolation=mode, severity=cfg.augmix_severity)],
            "imagenet": [v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET, interpolation=mode)]}[cfg.auto_augment]


def class_names(dataset) -> list[str]:
    """The class names of a dataset that build_datasets made, in label order (through its wrappers)."""
    while not hasattr(dataset, "classes") and hasattr(dataset, "source"):
        dataset = dataset.source
    return [str(c) for c in dataset.classes]


def build_datasets(cfg: Config, train: bool = True):
    """(train, val, num_classes). File datasets get their transforms; images stay uint8 (normalised on device).
    train=False: the validation set alone (train is None; an ImageFolder needs no train/ then)."""
    root = Path(cfg.data_dir)
    if not train:
        val = _validation_set(cfg, root)
        return None, val, len(class_names(val))
    if cfg.dataset in ("shapes", "synthetic"):
        kind = ShapesDataset if cfg.dataset == "shapes" else SyntheticDataset
        train_set = kind(cfg.train_samples, cfg.image_size, seed=cfg.seed * 2 + 1)
    elif cfg.dataset == "cifar10":
        train_set = _cifar_train(cfg, root)
    elif cfg.dataset == "shards":
        split = ShardSplit(root, "train")
        train_set = (FileBytes if cfg.decode == "gpu" else Decoded)(split, _transforms(cfg, True), split.name)
    else:
        check_imagefolder(root)
        if cfg.decode == "gpu":  # the workers read bytes; the training process decodes (DeviceDecoder)
            split = _imagefolder_split(root, "train", loader=read_bytes)
            train_set = FileBytes(split, _transforms(cfg, True), partial(_path_of, split))
        else:
            train_set = _imagefolder_split(root, "train")
            train_set.transform = _transforms(cfg, True)
    return train_set, _validation_set(cfg, root), len(class_names(train_set))


def _validation_set(cfg: Config, root: Path):
    """The validation set, with the evaluation's transforms."""
    if cfg.dataset in ("shapes", "synthetic"):
        kind = ShapesDataset if cfg.dataset == "shapes" else SyntheticDataset
        return kind(cfg.val_samples, cfg.image_size, seed=cfg.seed * 2 + 2)
    if cfg.dataset == "cifar10":
        from torchvision import datasets  # noqa: PLC0415 - torchvision: see the module docstring

        check_cifar(root, False)
        return _cifar_checked(root, lambda: datasets.CIFAR10(str(root), train=False, transform=_transforms(cfg, False)))
    if cfg.dataset == "shards":
        split = ShardSplit(root, "val")
        return (FileBytes if cfg.decode == "gpu" else Decoded)(split, _transforms(cfg, False), split.name)
    check_imagefolder(root, ("val",))
    if cfg.decode == "gpu":
        split = _imagefolder_split(root, "val", loader=read_bytes)
        return FileBytes(split, _transforms(cfg, False), partial(_path_of, split))
    split = _imagefolder_split(root, "val")
    split.transform = _transforms(cfg, False)
    return split


def _cifar_train(cfg: Config, root: Path):
    """CIFAR-10's training set, downloaded first with --download (once per node)."""
    from torchvision import datasets  # noqa: PLC0415 - torchvision: see the module docstring

    check_cifar(root, cfg.download)
    error = None
    if identity().local_rank == 0 and cfg.download:  # once per node
        try:
            datasets.CIFAR10(str(root), train=True, download=True)
        except (OSError, RuntimeError) as e:
            error = f"downloading CIFAR-10 into {root} failed ({e}): check the network or download it by hand"
    failed = [e for e in gather(error) if e]  # every rank learns of a failed download; none waits
    if failed:
        raise ConfigError(failed[0])
    return _cifar_checked(root, lambda: datasets.CIFAR10(str(root), train=True, transform=_transforms(cfg, True)))


def _cifar_checked(root: Path, load):
    try:
        return load()
    except RuntimeError as e:  # torchvision's checksum test failed
        raise ConfigError(f"CIFAR-10 under {root} is incomplete or corrupted ({e}): delete "
                          f"{root / 'cifar-10-batches-py'} and pass --download") from None


def default_num_workers(cfg: Config) -> int:
    if cfg.num_workers >= 0:
        return cfg.num_workers
    if cfg.dataset in ("shapes", "synthetic"):
        return 0
    # Every core of this process's share but one (the one that runs the training loop itself), no cap:
    # decoding and augmenting is the work that scales with cores (make bench: images/s per loader worker).
    return max(1, usable_cores() // max(1, identity().local_world_size) - 1)


def _ignore_stop_signals(_worker_id: int) -> None:
    # A preemption signal sent to the whole process group must not kill loader workers before
    # the trainer has saved its checkpoint; the trainer shuts them down itself.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)


def build_train_loader(cfg: Config, dataset, rank: int, world_size: int, pin_memory: bool,
                       device: torch.device | None = None, persistent: bool = True):
    if isinstance(dataset, ShapesDataset):  # in memory: batches are cut on the training device itself
        sampler = ShardSampler(len(dataset), rank, world_size, cfg.seed, with_seeds=False, reps=cfg.ra_reps)
        return TensorLoader(dataset.to(device or torch.device("cpu")), sampler, cfg.batch_size), sampler
    sampler = ShardSampler(len(dataset), rank, world_size, cfg.seed, with_seeds=True, reps=cfg.ra_reps)
    workers = default_num_workers(cfg)
    files = isinstance(dataset, FileBytes)
    loader = DataLoader(dataset if files else SeededSample(dataset), batch_size=cfg.batch_size, sampler=sampler,
                        drop_last=True, num_workers=workers, pin_memory=pin_memory and not files,
                        persistent_workers=persistent and workers > 0,
                        worker_init_fn=_ignore_stop_signals if workers > 0 else None,
                        prefetch_factor=4 if workers > 0 else None, collate_fn=_collate_files if files else None,
                        generator=torch.Generator().manual_seed(cfg.seed))  # iter() must not draw global RNG
    return (DeviceDecoder(loader, dataset, device or torch.device("cpu")) if files else loader), sampler


def build_val_loader(cfg: Config, dataset, rank: int, world_size: int, pin_memory: bool,
                     device: torch.device | None = None):
    """Each rank takes indices rank, rank+W, ... with no padding: every sample counted exactly once."""
    indices = list(range(rank, len(dataset), world_size))
    if isinstance(dataset, ShapesDataset):
        dataset.to(device or torch.device("cpu"))
        idx = torch.tensor(indices, dtype=torch.long, device=dataset.images.device)
        return [(dataset.images[idx[i:i + 256]], dataset.labels[idx[i:i + 256]]) for i in range(0, len(idx), 256)]
    workers = default_num_workers(cfg)
    files = isinstance(dataset, FileBytes)
    loader = DataLoader(torch.utils.data.Subset(dataset, indices), batch_size=cfg.batch_size * 2,
                        num_workers=workers, pin_memory=pin_memory and not files,
                        worker_init_fn=_ignore_stop_signals if workers > 0 else None,
                        collate_fn=_collate_files if files else None)
    return DeviceDecoder(loader, dataset, device or torch.device("cpu")) if files else loader


def preprocessing(cfg: Config, classes: list[str], mean: tuple, std: tuple) -> dict:
    """What a caller of the trained model does to an RGB image before it: the evaluation's own steps."""
    resize, crop, interpolation = eval_steps(cfg)
    return {"resize": resize, "resize_of": "the shorter side", "interpolation": interpolation, "antialias": True,
            "center_crop": crop, "scale": 1 / 255, "mean": list(mean), "std": list(std), "channels": "RGB",
            "layout": "N x 3 x H x W float32", "classes": classes}


def eval_steps(cfg: Config) -> tuple[int, int, str]:
    """The evaluation's (resize, centre crop, interpolation), the recipe's: imagenet: --val-resize-size or the crop
    / 0.875, --val-crop-size or --image-size, --interpolation; cifar and the built-in sets: --image-size, bilinear.
    (Named --weights make their own transforms the defaults of these flags: config._weights_sizes.)"""
    files = cfg.dataset not in ("shapes", "synthetic")
    if not files or recipe(cfg) != "imagenet":
        return cfg.image_size, cfg.image_size, "bilinear"
    crop = cfg.val_crop_size or cfg.image_size
    return cfg.val_resize_size or eval_resize(crop), crop, cfg.interpolation


def prepare_inputs(x: torch.Tensor, device: torch.device, channels_last: bool, mean=MEAN, std=STD) -> torch.Tensor:
    """A batch of uint8 images onto the device (non-blocking from pinned memory), normalised there (mean and std:
    numbers, or per-channel tensors of shape 1 x 3 x 1 x 1 on the device)."""
    x = x.to(device, non_blocking=True).float().div_(255).sub_(mean).div_(std)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def relayout(step_in_epoch: int, saved: tuple[int, int, int], now: tuple[int, int, int]) -> int:
    """A position inside the epoch saved with (workers, batch, accumulation) `saved`, in steps of `now`:
    the samples seen, rounded down to a whole step of the new layout (the data order is kept)."""
    if saved == now:
        return step_in_epoch
    return step_in_epoch * saved[0] * saved[1] * saved[2] // (now[0] * now[1] * now[2])
