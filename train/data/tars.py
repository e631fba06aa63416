"""WebDataset tars made by other tools (img2dataset, webdataset's ShardWriter, tar itself): --dataset shards on a
folder that holds no trainbox pack (no index.json), read by offset as a pack is (TarSplit, an OffsetSplit).

  DIR/train-*.tar, DIR/val-*.tar      the splits as tars in one folder,
  DIR/train/*.tar, DIR/val/*.tar      or as a folder of tars each (one layout or the other, not both)
  DIR/classes.txt or classes.json     optional: the class names, in label order (else "0", "1", ... the largest label)

A sample is the run of consecutive members that share a key (webdataset's rule: the member's name up to the first
dot of its last part): its image is the first of <key>.jpg .jpeg .png .ppm .bmp .pgm .tif .tiff .webp it has, its
label the integer in <key>.<label key> (--label-key, default cls), else the value of that key in <key>.json.

Indexing (train/data/tarindex.py) reads each member's header (tarfile gives its data's offset and size) and the small
label members, once, in a process per core over the tars; the index goes into DIR/.trainbox-index/ (or, where DIR
cannot be written, RUN_DIR/data-index/), and is used again while every tar keeps its size and modification time. The
processes that start at once share one indexing (a lock file beside the index); the ranks of a run read rank 0's.
Order: the tars sorted by name, each one's samples in the tar's order. A sample without an image or a label, a label
that is not a whole number or names no class, and a tar that is cut short, damaged, compressed or not a tar, are one
line naming the tar (and the sample's key or the member), before any worker starts.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from train.base.errors import ConfigError
from train.data.folders import OffsetSplit, is_pack, read_index
from train.data.labelfiles import class_list
from train.data.tarindex import DEFAULT_LABEL_KEY, FALLBACK, TarIndex, has_split, load_split, shared_split
from train.data.tarread import KEY


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


def tar_splits(root: Path, splits: tuple[str, ...], label_key: str, run_dir: Path | None = None) -> dict[str, TarSplit]:
    """Splits of another tool's tars, indexed once per run (rank 0 first), with their classes (the training split's,
    read also for the validation split alone where there is one: an evaluation of another set may have none)."""
    indices = {split: shared_split(root, split, label_key, run_dir) for split in splits}
    train = indices.get("train") or (shared_split(root, "train", label_key, run_dir) if has_split(root, "train")
                                     else None)
    return {split: TarSplit(index, *classes_of(root, train, index, split)) for split, index in indices.items()}


def check_pack_sizes(root: Path, index: dict) -> None:
    """Every shard of a pack as large as index.json records (a stat each): a shard cut short would otherwise stop
    the run only where the loader meets it."""
    try:
        shards = [(root / s["name"], s["bytes"]) for split in index["splits"].values() for s in split["shards"]]
    except (KeyError, TypeError, AttributeError):
        raise ConfigError(f"{root}/index.json is not a pack's index (no splits with their shards' names and sizes): "
                          f"pack the dataset again") from None
    for path, recorded in shards:
        size = path.stat().st_size if path.is_file() else None
        if size != recorded:
            now = "is missing" if size is None else f"holds {size:,} bytes"
            raise ConfigError(f"{path} {now}, and index.json records {recorded:,}: a shard cut short, changed or "
                              f"removed: run `python -m train.pack --verify {root}`, then pack the dataset again")


def check_shards(root: Path, label_key: str = DEFAULT_LABEL_KEY, run_dir: Path | None = None) -> None:
    """--dataset shards, before any worker starts: a pack's index and its shards' sizes, or the tars of another tool
    indexed (cached beside them, else in run_dir, the run's folder, where the run reads it; the processes that start
    at once share one indexing) and every sample's image and label checked. A run folder this check made for a
    dataset it refuses is removed again."""
    if not root.is_dir():
        raise ConfigError(f"{root} is not a folder: point --data-dir at the shards (a pack, or WebDataset tars)")
    if is_pack(root):
        index = read_index(root)
        if label_key != DEFAULT_LABEL_KEY:
            raise ConfigError(f"--label-key {label_key} has no effect on {root}, a trainbox pack (its labels are in "
                              f"its index): drop it")
        check_pack_sizes(root, index)
        return
    made = run_dir is not None and not run_dir.exists()
    try:
        train = load_split(root, "train", label_key, run_dir)
        val = load_split(root, "val", label_key, run_dir)
        classes_of(root, train, train, "train")
        classes_of(root, train, val, "val")
    except ConfigError:
        if made:
            shutil.rmtree(run_dir / FALLBACK, ignore_errors=True)
            with contextlib.suppress(OSError):
                run_dir.rmdir()
        raise
