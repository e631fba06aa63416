"""The file datasets on disk and their checks: an ImageFolder (DATA_DIR/train/<class>/*, DATA_DIR/val/<class>/*),
listed by this project's own scan (train/data/scan.py: torchvision's ImageFolder's classes, samples and order, links
followed and held to the folders, train and val apart), a pack of shards (train/pack/command.py writes it; read by
offset: ShardSplit, an OffsetSplit as other tools' tars are, train/data/tars.py) and CIFAR-10 (torchvision's, downloaded
only with --download, by local rank 0 of each node, safely into a --data-dir that several nodes share).
"""

from __future__ import annotations

import bisect
import json
import shutil
from pathlib import Path

import torch
from torch.utils.data import Dataset

from train.base import vision
from train.base.errors import ConfigError, DataError
from train.cluster.distributed import gather
from train.cluster.identity import identity
from train.data.decode import as_tensor, load_image
from train.data.scan import FolderScan, scan_split, scan_splits, within
from train.files.downloads import private_name, publish


PACK_JOURNAL = ".pack-journal.jsonl"  # an unfinished pack's record (train/pack/command.py)


def path_of(folder, index: int) -> str:
    return folder.samples[index][0]


class ImageFolderSplit(Dataset):
    """One split of an ImageFolder: item i is (image, label), the image made by `loader` (and `transform`, when
    set) from its file; classes and samples as scan_split lists them (listing: already listed)."""

    def __init__(self, root: Path, loader=load_image, listing: tuple | None = None):
        self.root, self.loader, self.transform = root, loader, None
        self.classes, self.samples = listing or scan_split(root)
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        image = self.loader(path)
        return (image if self.transform is None else self.transform(image)), label

    def describe(self) -> dict:
        return {"kind": "imagefolder", "from": str(self.root),
                "order": "classes sorted by name; each class's images in os.walk's order (folders by path, files by "
                         "name)", "classes_from": "the class folders' names, sorted"}


def imagefolder_split(root: Path, split: str, loader=load_image) -> ImageFolderSplit:
    return ImageFolderSplit(root / split, loader)


def imagefolder_splits(root: Path, loader=load_image) -> dict[str, ImageFolderSplit]:
    """Both splits, listed together: an image in both is refused (scan_splits)."""
    return {split: ImageFolderSplit(root / split, loader, listing) for split, listing in scan_splits(root).items()}


def check_imagefolder(root: Path, splits: tuple[str, ...] = ("train", "val")) -> None:
    """The folder layout, checked before any worker starts: both splits, the same non-empty class list, the links
    among the class folders (FolderScan), and train and val apart (their images, listed by each worker, too:
    scan_splits)."""
    classes, real = {"train": None, "val": None}, {}
    for split in splits:
        path = root / split
        if not path.is_dir() and not path.is_symlink():
            raise ConfigError(f"{path} is missing: an imagefolder dataset needs {root}/train/<class>/ and "
                              f"{root}/val/<class>/")
        scan = FolderScan(path)
        classes[split], real[split] = [name for name, _, _ in scan.classes()], scan.real_top
        if not classes[split]:
            raise ConfigError(f"{path} has no class folders: put images in {path}/<class>/")
    if len(real) == 2 and (within(real["train"], real["val"]) or within(real["val"], real["train"])):
        raise ConfigError(f"{root}/train and {root}/val are the same folder, or one holds the other ({real['train']}, "
                          f"{real['val']}): the model would be scored on images it trained on: give val/ its own "
                          f"class folders")
    if None not in classes.values() and classes["train"] != classes["val"]:
        only = sorted(set(classes["train"]) ^ set(classes["val"]))
        raise ConfigError(f"{root}: train and val hold different classes (only in one: {', '.join(only[:5])}): "
                          f"give both the same class folders")


def read_index(root: Path) -> dict:
    try:
        return json.loads((root / "index.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"{root}/index.json is missing: pack an ImageFolder with `make pack SRC=... DST={root}` "
                          f"(a folder without it is an unfinished pack: the same command continues it)") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{root}/index.json cannot be read ({e}): pack the dataset again") from None


def is_pack(root: Path) -> bool:
    """Whether root holds a trainbox pack, finished (index.json) or not (make pack's journal): else its tars, if
    any, are another tool's (train/data/tars.py)."""
    return (root / "index.json").exists() or (root / PACK_JOURNAL).exists()


def packed_with(root: Path) -> str:
    """The settings a pack's images were stored with (index.json's max_side and quality), said once at a run's
    start: what the model trains on may be smaller than the photos it came from."""
    if not is_pack(root):
        return f"shards in {root}: WebDataset tars of another tool, read by offset from the index made of them"
    index = read_index(root)
    if index.get("max_side"):
        return (f"shards in {root}: packed with MAX_SIDE={index['max_side']} QUALITY={index['quality']} (every image "
                f"whose longer side was over {index['max_side']} px resized to it and re-encoded as JPEG)")
    return f"shards in {root}: packed with the images as they were (no MAX_SIDE)"


def read_idx(shard: Path) -> torch.Tensor:
    data = (shard.parent / f"{shard.name}.idx").read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.int64).view(-1, 3)


class OffsetSplit(Dataset):
    """Samples read by offset from tar files: item i is (bytes, label), from rows (offset, size, label) per tar;
    files stay open per loader worker. Subclasses name a sample (name) and say the fixes (FIXES)."""

    FIXES = {"empty": "", "unreadable": "", "cut_short": ""}

    def __init__(self, root: Path, shards: list[Path], rows: list[torch.Tensor], classes: list[str]):
        self.root, self.shards, self.rows, self.classes = root, shards, rows, classes
        self.starts = [0]
        for shard_rows in self.rows:
            self.starts.append(self.starts[-1] + len(shard_rows))
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
        if size == 0:
            raise DataError(f"{self.name(index)} is empty {self.FIXES['empty']}")
        try:
            f = self._open.get(shard)
            if f is None:
                f = self._open[shard] = open(self.shards[shard], "rb")
            f.seek(offset)
            data = f.read(size)
        except OSError as e:
            raise DataError(f"cannot read {self.name(index)} ({e}): {self.FIXES['unreadable']}") from None
        if len(data) != size:
            raise DataError(f"{self.shards[shard]} is damaged: {self.name(index)} is cut short: "
                            f"{self.FIXES['cut_short'].format(root=self.root)}")
        return as_tensor(data), label


class ShardSplit(OffsetSplit):
    """One split of a pack (index.json and each shard's .idx), read by offset."""

    FIXES = {"empty": "(0 bytes: its image was an empty file when it was packed): replace that image in the "
                      "ImageFolder and pack it into a new DST",
             "unreadable": "check the storage, or pack the dataset again",
             "cut_short": "run `python -m train.pack --verify {root}`, then pack the dataset again"}

    def __init__(self, root: Path, split: str):
        info = read_index(root)["splits"][split]
        shards = [root / s["name"] for s in info["shards"]]
        try:
            rows = [read_idx(shard) for shard in shards]
        except OSError as e:
            raise ConfigError(f"{root}: {e}: the pack is incomplete: pack it again, or run "
                              f"`python -m train.pack --verify {root}`") from None
        super().__init__(root, shards, rows, info["classes"])

    def describe(self) -> dict:
        return {"kind": "shards (a trainbox pack)", "from": f"{len(self.shards)} shard(s) in {self.root}",
                "order": "the pack's: its source's order (make pack)", "classes_from": f"{self.root}/index.json"}


def check_cifar(root: Path, download: bool) -> None:
    if not download and not (root / "cifar-10-batches-py").is_dir():
        raise ConfigError(f"CIFAR-10 not found under {root}: pass --download or point --data-dir at it")


def cifar_split(root: Path, train: bool, transform, download: bool = False):
    """CIFAR-10's training or validation split under root, downloaded first with --download (local rank 0 of
    each node, `download_cifar`; every rank learns whether that worked, and none waits)."""
    check_cifar(root, download)
    if download:
        error = None
        if identity().local_rank == 0:  # once per node
            try:
                download_cifar(root)
            except (OSError, RuntimeError) as e:
                error = f"downloading CIFAR-10 into {root} failed ({e}): check the network or download it by hand"
            except DamagedFolder as e:
                error = str(e)
        failed = [e for e in gather(error) if e]
        if failed:
            raise ConfigError(failed[0])
    try:
        return vision.datasets.CIFAR10(str(root), train=train, transform=transform)
    except RuntimeError as e:  # torchvision's checksum test failed
        raise ConfigError(f"CIFAR-10 under {root} is incomplete or corrupted ({e}): delete "
                          f"{root / 'cifar-10-batches-py'} and pass --download") from None


class DamagedFolder(ValueError):
    """A dataset folder already in place whose files fail their checksums."""


def download_cifar(root: Path, dataset=None) -> bool:
    """CIFAR-10 into root/cifar-10-batches-py as torchvision's own download puts it there (its URL, the archive's
    MD5 and every file's, checked by torchvision), safe when several nodes download into one --data-dir at once:
    each process downloads and extracts into a private folder inside root, checks it, and renames it into
    place; the first complete copy wins, a later one is discarded (train/files/downloads.py). An archive placed in
    root by hand (cifar-10-python.tar.gz) is used instead of the network; no archive is kept. Whether this
    process's copy was placed (False: a complete copy was there). dataset: torchvision's CIFAR10 class, or a
    class with its attributes (the tests')."""
    dataset = dataset or vision.datasets.CIFAR10
    utils = vision.datasets.utils
    checksums = {**dict(dataset.train_list), **dict(dataset.test_list), dataset.meta["filename"]: dataset.meta["md5"]}

    def complete(folder: Path) -> bool:
        return all(utils.check_integrity(folder / name, md5) for name, md5 in checksums.items())

    final = root / dataset.base_folder
    if final.exists():
        if complete(final):
            return False
        raise DamagedFolder(f"CIFAR-10 under {root} is incomplete or corrupted (a file fails its MD5): delete {final} "
                            "and pass --download")
    root.mkdir(parents=True, exist_ok=True)
    private = private_name(final)
    private.mkdir()
    try:
        archive = root / dataset.filename
        if not utils.check_integrity(archive, dataset.tgz_md5):
            utils.download_url(dataset.url, private, dataset.filename, dataset.tgz_md5)  # checks the archive's MD5
            archive = private / dataset.filename
        utils.extract_archive(archive, private)
        if not complete(private / dataset.base_folder):
            raise RuntimeError(f"the files of {dataset.url} fail their MD5")
        placed = publish(private / dataset.base_folder, final)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    if not placed and not complete(final):
        raise DamagedFolder(f"CIFAR-10 under {root}, placed there by another process, is incomplete or corrupted: "
                            f"delete {final} and pass --download")
    return placed
