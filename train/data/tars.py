"""WebDataset tars made by other tools (img2dataset, webdataset's ShardWriter, tar itself): --dataset shards on a
folder that holds no trainbox pack (no index.json), read by offset as a pack is (TarSplit, an OffsetSplit).

  DIR/train-*.tar, DIR/val-*.tar      the splits as tars in one folder,
  DIR/train/*.tar, DIR/val/*.tar      or as a folder of tars each (one layout or the other, not both)
  DIR/classes.txt or classes.json     optional: the class names, in label order (else "0", "1", ... the largest label)

A sample is the run of consecutive members that share a key (webdataset's rule: the member's name up to the first
dot of its last part): its image is the first of <key>.jpg .jpeg .png .ppm .bmp .pgm .tif .tiff .webp it has, its
label the integer in <key>.<label key> (--label-key, default cls), else the value of that key in <key>.json.

Indexing reads each member's header (tarfile gives its data's offset and size) and the small label members, once,
in a process per core over the tars; the index goes into DIR/.trainbox-index/ (or, where DIR cannot be written,
RUN_DIR/data-index/), and is used again while every tar keeps its size and modification time. Order: the tars
sorted by name, each one's samples in the tar's order. A sample without an image or a label, a label that is not a
whole number or names no class, and a tar that is damaged, compressed or not a tar, are one line naming the tar (and
the sample's key), before any worker starts.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import re
import tarfile
from array import array
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from train.data.folders import OffsetSplit, is_pack, read_index
from train.data.labelfiles import class_list
from train.data.scan import IMAGE_EXTENSIONS
from train.distributed import broadcast_from_main, is_main, usable_cores
from train.errors import ConfigError
from train.progress import Progress
from train.runfiles import atomic_write, to_json

CACHE = ".trainbox-index"  # beside the tars
FALLBACK = "data-index"  # in the run folder, where the tars' folder cannot be written
FORMAT = 1
SPLITS = ("train", "val")
IMAGE_SUFFIXES = tuple(e[1:] for e in IMAGE_EXTENSIONS)  # the ImageFolder's, in the order a sample's image is taken
KEY = re.compile(r"^((?:.*/|)[^./][^.]*)\.([^/]*)$")  # webdataset's base_plus_ext: key, suffix
DEFAULT_LABEL_KEY = "cls"


def find_tars(root: Path, splits: tuple[str, ...] = SPLITS) -> dict[str, list[Path]]:
    """Each split's tars, sorted by name: DIR/SPLIT-*.tar, or DIR/SPLIT/*.tar."""
    flat = {s: sorted(root.glob(f"{s}-*.tar")) for s in splits}
    nested = {s: sorted((root / s).glob("*.tar")) if (root / s).is_dir() else [] for s in splits}
    if any(flat.values()) and any(nested.values()):
        raise ConfigError(f"{root} holds tars both as {splits[0]}-*.tar and in {splits[0]}/: which are the dataset "
                          f"is unclear: keep one layout")
    tars = flat if any(flat.values()) else nested
    for split, found in tars.items():
        if not found:
            raise ConfigError(f"{root} has no {split} shards: a shards dataset is a trainbox pack (make pack: "
                              f"index.json) or WebDataset tars as {root}/{split}-*.tar or {root}/{split}/*.tar")
    return tars


def _label(tar: tarfile.TarFile, members: dict, key: str, label_key: str, path: str) -> int:
    """The sample's label: the integer in <key>.<label_key>, else <key>.json's value at label_key."""
    if label_key in members:
        text, where = tar.extractfile(members[label_key]).read().decode("utf-8", "replace").strip(), \
            f"{key}.{label_key}"
    elif "json" in members:
        try:
            record = json.loads(tar.extractfile(members["json"]).read())
        except ValueError as e:
            raise ConfigError(f"{path}: the sample {key!r} has a {key}.json that is not JSON ({e}): repair or remove "
                              f"the sample") from None
        if not isinstance(record, dict) or label_key not in record:
            raise ConfigError(f"{path}: the sample {key!r} has no label (no {key}.{label_key}, and no "
                              f"{label_key!r} in {key}.json): pass --label-key with the name its label has, or "
                              f"remove the sample")
        text, where = record[label_key], f"{key}.json's {label_key!r}"
        text = str(text).strip() if isinstance(text, (int, str)) and not isinstance(text, bool) else repr(text)
    else:
        raise ConfigError(f"{path}: the sample {key!r} has no label (no {key}.{label_key} or {key}.json): add one, "
                          f"pass --label-key with the name its label has, or remove the sample")
    if not (text.isascii() and text.isdigit()):
        raise ConfigError(f"{path}: the label of the sample {key!r} ({where}: {text!r}) is not a class index (a whole "
                          f"number from 0): give the index, with the names in {Path(path).parent}/classes.txt")
    return int(text)


def index_tar(path: str, label_key: str) -> tuple[bytes, str]:
    """One tar's samples: their rows (offset, size, label; int64 x 3, as bytes) and their image members' names, one a
    line. Runs in an indexing process."""
    rows, names = array("q"), []

    def close(key: str | None, members: dict) -> None:
        if key is None:
            return
        image = next((members[s] for s in IMAGE_SUFFIXES if s in members), None)
        if image is None:
            raise ConfigError(f"{path}: the sample {key!r} has no image ({', '.join(f'.{s}' for s in IMAGE_SUFFIXES)};"
                              f" it has {', '.join(sorted(members))}): add its image, or remove the sample")
        if "\n" in image.name:
            raise ConfigError(f"{path}: the sample {key!r} has a line break in its name: rename it")
        rows.extend((image.offset_data, image.size, _label(tar, members, key, label_key, path)))
        names.append(image.name)

    try:
        with tarfile.open(path, mode="r:") as tar:
            key, members = None, {}
            for member in tar:
                match = KEY.match(member.name) if member.isfile() else None
                if match is None:
                    continue  # folders, links, files without a suffix: not a sample's part (webdataset skips them)
                if match[1] != key:
                    close(key, members)
                    key, members = match[1], {}
                members[match[2].lower() if match[2].lower() in IMAGE_SUFFIXES else match[2]] = member
            close(key, members)
    except (tarfile.ReadError, EOFError) as e:
        if str(e) == "unexpected end of data":  # tarfile's word for a file that ends inside a member
            raise ConfigError(f"{path} is cut short (it ends inside a member, after the sample {key!r}): copy the tar "
                              f"again") from None
        raise ConfigError(f"{path} cannot be read as a plain tar ({e}): a damaged, compressed (.tar.gz) or other file; "
                          f"reading by offset needs uncompressed tars: copy it again, or decompress it") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path} ({e.strerror}): check its permissions and the storage") from None
    if not names:
        raise ConfigError(f"{path} holds no sample (members named <key>.<suffix>): remove it from {Path(path).parent}")
    return rows.tobytes(), "\n".join(names)


class TarIndex:
    """One split's index: its tars, each one's rows (offset, size, label) and its image members' names."""

    def __init__(self, root: Path, tars: list[Path], rows: list[torch.Tensor], names: list[str],
                 where: Path | None = None):
        self.root, self.tars, self.rows, self.names, self.where = root, tars, rows, names, where

    def member_names(self, shard: int) -> list[str]:
        return self.names[shard].split("\n")

    def labels(self) -> torch.Tensor:
        return torch.cat([r[:, 2] for r in self.rows]) if self.rows else torch.empty(0, dtype=torch.int64)

    def key_of(self, flat: int) -> tuple[Path, str]:
        """The tar and the image member of the flat-th sample."""
        for shard, rows in enumerate(self.rows):
            if flat < len(rows):
                return self.tars[shard], self.member_names(shard)[flat]
            flat -= len(rows)
        raise IndexError(flat)


def _stats(root: Path, tars: list[Path]) -> list[dict]:
    out = []
    for tar in tars:
        stat = tar.stat()
        out.append({"name": str(tar.relative_to(root)), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    return out


def _cache_dirs(root: Path, run_dir: Path | None) -> list[Path]:
    beside = [root / CACHE]
    if run_dir is None:
        return beside
    digest = hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:16]
    return [*beside, run_dir / FALLBACK / digest]


def _read_cache(folder: Path, root: Path, split: str, tars: list[Path], stats: list[dict],
                label_key: str) -> TarIndex | None:
    try:
        record = json.loads((folder / f"{split}.json").read_text())
        if record != {"format": FORMAT, "label_key": label_key, "tars": record["tars"]} or \
                [{k: t[k] for k in ("name", "bytes", "mtime_ns")} for t in record["tars"]] != stats:
            return None
        flat = (folder / f"{split}.idx").read_bytes()
        names = (folder / f"{split}.names").read_text(encoding="utf-8").split("\n")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    counts = [t["samples"] for t in record["tars"]]
    if len(flat) != 24 * sum(counts) or len(names) != sum(counts):
        return None
    table = torch.frombuffer(bytearray(flat), dtype=torch.int64).view(-1, 3)
    rows, joined, start = [], [], 0
    for count in counts:
        rows.append(table[start:start + count].clone())
        joined.append("\n".join(names[start:start + count]))
        start += count
    return TarIndex(root, tars, rows, joined, folder)


def _write_cache(folder: Path, split: str, index: TarIndex, stats: list[dict], label_key: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / f"{split}.idx", b"".join(bytes(r.numpy().tobytes()) for r in index.rows))
    atomic_write(folder / f"{split}.names", "\n".join(index.names).encode())
    tars = [{**s, "samples": len(r)} for s, r in zip(stats, index.rows, strict=True)]
    atomic_write(folder / f"{split}.json", to_json({"format": FORMAT, "label_key": label_key, "tars": tars},
                                                   indent=1).encode())  # last: it makes the other two valid


def index_split(root: Path, tars: list[Path], label_key: str, quiet: bool = False, stream=None) -> TarIndex:
    """The tars indexed, in a process per usable core (this one alone for a single tar or core); a progress line on
    stream (default stderr) unless quiet."""
    results = []
    with Progress(f"indexing the tars in {root}", total=len(tars), unit="tars", stream=stream, quiet=quiet,
                  last=None) as progress:
        workers = min(len(tars), usable_cores())
        if workers <= 1:
            for tar in tars:
                results.append(index_tar(str(tar), label_key))
                progress.advance()
        else:
            # Forked, as make pack's workers and the DataLoader's are: a fast start; they run the standard library alone
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
                for result in pool.map(index_tar, map(str, tars), [label_key] * len(tars)):
                    results.append(result)
                    progress.advance()
    rows = [torch.frombuffer(bytearray(data), dtype=torch.int64).view(-1, 3) for data, _ in results]
    return TarIndex(root, tars, rows, [names for _, names in results])


def load_split(root: Path, split: str, label_key: str, run_dir: Path | None = None, quiet: bool = False,
               stream=None) -> TarIndex:
    """The split's index: from a cache that matches the tars, else indexed and cached (beside the tars, else in the
    run folder, else kept in memory)."""
    tars = find_tars(root, (split,))[split]
    stats = _stats(root, tars)
    folders = _cache_dirs(root, run_dir)
    for folder in folders:
        cached = _read_cache(folder, root, split, tars, stats, label_key)
        if cached is not None:
            return cached
    index = index_split(root, tars, label_key, quiet, stream)
    for folder in folders:
        try:
            _write_cache(folder, split, index, stats, label_key)
        except OSError:
            continue  # a read-only NAS folder: the next place
        index.where = folder
        break
    return index


def shared_split(root: Path, split: str, label_key: str, run_dir: Path | None) -> TarIndex:
    """load_split on every rank of a run: rank 0 first (it indexes, if anyone must), then the others read its cache.
    A bad tar is the same one line on every rank."""
    error, where = None, None
    if is_main():
        try:
            index = load_split(root, split, label_key, run_dir)
            where = str(index.where) if index.where else None
        except ConfigError as e:
            error = str(e)
    error, where = broadcast_from_main((error, where))
    if error:
        raise ConfigError(error)
    if is_main():
        return index
    tars = find_tars(root, (split,))[split]
    cached = _read_cache(Path(where), root, split, tars, _stats(root, tars), label_key) if where else None
    return cached or load_split(root, split, label_key, run_dir, quiet=True)


def classes_of(root: Path, train: TarIndex | None, split: TarIndex, split_name: str) -> tuple[list[str], str]:
    """(class names, where they come from): classes.txt or classes.json beside the tars, else "0" .. the largest
    training label. Every label of `split` must name one; else one line naming the tar and the sample."""
    listed = class_list(root)
    if listed is not None:
        classes, source = listed[0], f"{listed[1].name}, in its order"
    else:
        top = int((train or split).labels().max())
        classes, source = [str(i) for i in range(top + 1)], "the labels (integers: 0 .. the largest training label)"
    labels = split.labels()
    beyond = (labels >= len(classes)).nonzero()
    if len(beyond):
        tar, member = split.key_of(int(beyond[0]))
        fix = f"fix the label, or add its name to {listed[1]}" if listed else "fix the label, or list the classes in " \
            f"{root}/classes.txt"
        raise ConfigError(f"{tar}: the label {int(labels[beyond[0]])} of the sample {KEY.match(member)[1]!r} names no "
                          f"class ({len(classes)}: {source}) in the {split_name} split: {fix}")
    return classes, source


class TarSplit(OffsetSplit):
    """One split of another tool's WebDataset tars, read by offset from their index (TarIndex)."""

    FIXES = {"empty": "(its image member has 0 bytes): replace or remove the sample in its tar",
             "unreadable": "check the storage",
             "cut_short": "the tar changed after it was indexed: run the same command again (a changed tar is "
                          "indexed again), or copy the tar again"}

    def __init__(self, index: TarIndex, classes: list[str], classes_from: str):
        super().__init__(index.root, index.tars, index.rows, classes)
        self.index, self.classes_from = index, classes_from
        self._names: dict[int, list[str]] = {}

    def __getstate__(self):
        return {**super().__getstate__(), "_names": {}}

    def name(self, index: int) -> str:
        shard, row = self.locate(index)
        if shard not in self._names:
            self._names[shard] = self.index.member_names(shard)
        return f"{self.shards[shard]} member {self._names[shard][row]}"

    def describe(self) -> dict:
        return {"kind": "shards (WebDataset tars of another tool)", "from": f"{len(self.shards)} tar(s) in {self.root}",
                "order": "the tars sorted by name, each one's samples in its order", "classes_from": self.classes_from}


def has_split(root: Path, split: str) -> bool:
    return any(root.glob(f"{split}-*.tar")) or (root / split).is_dir() and any((root / split).glob("*.tar"))


def tar_splits(root: Path, splits: tuple[str, ...], label_key: str, run_dir: Path | None = None) -> dict[str, TarSplit]:
    """Splits of another tool's tars, indexed once per run (rank 0 first), with their classes (the training split's,
    read also for the validation split alone where there is one: an evaluation of another set may have none)."""
    indices = {split: shared_split(root, split, label_key, run_dir) for split in splits}
    train = indices.get("train") or (shared_split(root, "train", label_key, run_dir) if has_split(root, "train")
                                     else None)
    return {split: TarSplit(index, *classes_of(root, train, index, split)) for split, index in indices.items()}


def check_shards(root: Path, label_key: str = DEFAULT_LABEL_KEY) -> None:
    """--dataset shards, before any worker starts: a pack's index, or the tars of another tool indexed (cached beside
    them where the folder can be written) and every sample's image and label checked."""
    if not root.is_dir():
        raise ConfigError(f"{root} is not a folder: point --data-dir at the shards (a pack, or WebDataset tars)")
    if is_pack(root):
        read_index(root)
        if label_key != DEFAULT_LABEL_KEY:
            raise ConfigError(f"--label-key {label_key} has no effect on {root}, a trainbox pack (its labels are in "
                              f"its index): drop it")
        return
    train = load_split(root, "train", label_key)
    val = load_split(root, "val", label_key)
    classes_of(root, train, train, "train")
    classes_of(root, train, val, "val")
