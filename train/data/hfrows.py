"""--dataset hf: a Hugging Face dataset saved to disk (save_to_disk's Arrow files, or Parquet files: the layouts in
train/data/hfdisk.py), read row by row from memory-mapped Arrow files, as a pack is read by offset: the sampler, the
per-sample seeds, exact resume and every recipe work as with loose files.

  image   the image column: an Image feature ({bytes, path}: the bytes, else the file at the path, relative to DIR or
          absolute), or plain bytes, or paths; --image-column, else the first of image, img, else its one Image column
  label   the label column: a ClassLabel (its names are the classes, in their order), integers (the classes "0" ..
          the largest training label) or names (the training split's, sorted, as label files sort them);
          --label-column, else the first of label, labels, else its one ClassLabel column
  splits  --train-split (train) and --val-split (else the first of validation, val, test the dataset has)

Order: the split's rows in the dataset's order (ds[0], ds[1], ...). Every label is checked before any worker starts
(the label column alone is read: a row without a label, a label that names no class, -1 for "no label"); an image
is read when the loader meets it, and one that is empty, missing or does not decode is one line naming its row.
"""

from __future__ import annotations

import bisect
import os
from array import array
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils.data import Dataset

from train.base.errors import ConfigError, DataError
from train.data.decode import as_tensor
from train.data.hfcache import arrow_files, shared_arrow_files
from train.data.hfdisk import (WHOLE, Columns, Labels, SplitFiles, arrow, arrow_error, columns_of, find_splits,
                               read_labels)
from train.data.scan import IMAGE_EXTENSIONS

VAL_SPLITS = ("validation", "val", "test")
NAMED = 8  # the splits a line names (then their count)
_opened: dict[tuple[str, str], tuple[list, list[int]]] = {}  # this process's memory-mapped columns, by file


def _column(file: str, column: str) -> tuple[list, list[int]]:
    """An Arrow file's image column as (bytes, path) arrays per chunk (None where the column has no such part) and
    where each chunk starts, memory-mapped once per process (a loader worker opens its own on its first read; a
    forked one keeps its parent's)."""
    key = (file, column)
    if key not in _opened:
        pa = arrow()
        try:
            with pa.memory_map(file) as source:
                chunks = pa.ipc.open_stream(source).read_all().column(column).chunks
        except (OSError, KeyError, pa.ArrowException) as e:
            raise DataError(f"cannot read {file} ({arrow_error(e)}): check the storage, or save the dataset "
                            f"again, then run the same command to resume") from None
        parts, starts = [], [0]
        for chunk in chunks:
            if pa.types.is_struct(chunk.type):  # an Image feature: its parts, a row without one null in both
                fields = dict(zip((f.name for f in chunk.type), chunk.flatten(), strict=True))
                parts.append((fields.get("bytes"), fields.get("path")))
            else:
                parts.append((None, chunk) if pa.types.is_string(chunk.type) or pa.types.is_large_string(chunk.type)
                             else (chunk, None))
            starts.append(starts[-1] + len(chunk))
        _opened[key] = parts, starts
    return _opened[key]


class HfRow(NamedTuple):
    """One row of a split, as make pack lists it (train/data/sources.py): which Arrow file and row hold its image."""
    file: str  # the Arrow file (save_to_disk's, or one made of a Parquet file)
    row: int  # in that file
    column: str
    root: str  # DIR: a relative path is relative to it
    split: str
    index: int  # the row in its split

    def _parts(self) -> tuple[tuple, int]:
        parts, starts = _column(self.file, self.column)
        chunk = bisect.bisect_right(starts, self.row) - 1
        return parts[chunk], self.row - starts[chunk]

    def cell(self) -> tuple[bytes | None, str | None]:
        """The row's image bytes and path, either None where the row has none."""
        parts, at = self._parts()
        return tuple(None if part is None else part[at].as_py() for part in parts)

    def path(self) -> str | None:
        (_, paths), at = self._parts()
        return None if paths is None else paths[at].as_py()

    def name(self) -> str:
        path = self.path()
        return f"row {self.index} of the {self.split or 'one'} split of {self.root}" + (f" ({path})" if path else "")

    def image(self, then: str) -> bytes:
        """The image's bytes: the cell's, else the file it names. then: what to do after mending it."""
        data, path = self.cell()
        if data is not None:
            return data
        if not path:
            raise DataError(f"row {self.index} of the {self.split or 'one'} split of {self.root} has no image (its "
                            f"{self.column!r} is empty): give it one or remove the row, then {then}")
        full = path if os.path.isabs(path) else os.path.join(self.root, path)
        try:
            with open(full, "rb") as f:
                return f.read()
        except OSError as e:
            raise DataError(f"cannot read image {full}, the image of row {self.index} of the {self.split or 'one'} "
                            f"split of {self.root} ({e.strerror}): restore the file, or fix the path in the dataset, "
                            f"then {then}") from None

    def suffix(self, data: bytes) -> str:
        """The suffix its image keeps in a pack: its path's, where that names an image; else by its first bytes."""
        path = self.path()
        if path and path.lower().endswith(IMAGE_EXTENSIONS):
            return os.path.splitext(path)[1].lower()
        for start, suffix in ((b"\xff\xd8", ".jpg"), (b"\x89PNG", ".png"), (b"RIFF", ".webp"), (b"BM", ".bmp"),
                              (b"II*\0", ".tiff"), (b"MM\0*", ".tiff"), (b"P6", ".ppm"), (b"P5", ".pgm")):
            if data.startswith(start):
                return suffix
        return ".img"


class HfSplit(Dataset):
    """One split of a Hugging Face dataset as a source of (bytes, label): row i's image (decoded by the Decoded or
    FileBytes wrapper around it) and its class index; name(i) says the row."""

    def __init__(self, root: Path, split: SplitFiles, columns: Columns, labels: Labels, files: list[Path] | None):
        self.root, self.split, self.columns = root, split, columns
        self.classes, self.classes_from = labels.classes, labels.classes_from
        self.labels = array("q", labels.labels.tolist())  # an int a read, not a tensor's element
        self.files = [str(f) for f in files] if files is not None else None  # None: a dry run reads no image
        self.starts = [0]
        for count in labels.counts:
            self.starts.append(self.starts[-1] + count)

    def __len__(self) -> int:
        return self.starts[-1]

    def row(self, index: int) -> HfRow:
        if self.files is None:
            raise RuntimeError("a dry run's dataset reads no image")
        shard = bisect.bisect_right(self.starts, index) - 1
        return HfRow(self.files[shard], index - self.starts[shard], self.columns.image, str(self.root),
                     self.split.name, index)

    def name(self, index: int) -> str:
        return self.row(index).name()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return as_tensor(self.row(index).image("run the same command to resume")), self.labels[index]

    def describe(self) -> dict:
        what = "Arrow file(s) (save_to_disk)" if self.split.format == "arrow" else "Parquet file(s)"
        split = f"the {self.split.name!r} split" if self.split.name != WHOLE else "the one split"
        return {"kind": "hf (a Hugging Face dataset)",
                "from": f"{split} of {self.root}: {len(self.split.files)} {what}",
                "order": "the split's rows in the dataset's order (its files in order)",
                "classes_from": self.classes_from}


def pick_splits(root: Path, found: dict[str, SplitFiles], train_split: str, val_split: str,
                wanted: tuple[str, ...]) -> dict[str, SplitFiles]:
    """The splits trainbox calls train and val (those of `wanted`): --train-split, and --val-split or the first of
    VAL_SPLITS the dataset has."""
    if not found:
        raise ConfigError(f"{root} holds no Hugging Face dataset: save one there with save_to_disk, or give Parquet "
                          f"files as {root}/data/train-00000-of-00001.parquet (or {root}/train/*.parquet)")
    if WHOLE in found:
        if "train" in wanted:
            raise ConfigError(f"{root} is one saved Dataset, a single split: training needs a training and a "
                              f"validation split: save a DatasetDict (ds.train_test_split(test_size=0.1, seed=0)"
                              f".save_to_disk(...)) and point --data-dir at it")
        return {"val": found[WHOLE]}
    have = ", ".join(sorted(found)[:NAMED]) + (f" and {len(found) - NAMED:,} more" if len(found) > NAMED else "")
    val = val_split or next((name for name in VAL_SPLITS if name in found), "")
    names = {"train": train_split, "val": val}
    if "val" in wanted and list(found) == [train_split]:
        raise ConfigError(f"{root} has only the split {train_split!r}, and training needs a validation split too: "
                          f"make one ({split_command(root, found[train_split])}), then point --data-dir (make pack: "
                          f"SRC) at {root}-split, whose splits are train and test")
    for split, flag in (("train", "--train-split"), ("val", "--val-split")):
        if split in wanted and names[split] not in found:
            what = f"no split {names[split]!r}" if names[split] else f"none of the splits {', '.join(VAL_SPLITS)}"
            raise ConfigError(f"{root} has {what} (it has: {have}): name the {split} split with {flag}")
    if names["train"] == names["val"] and len(wanted) == 2:
        raise ConfigError(f"{root}: --train-split and --val-split both name {names['train']!r}: the model would be "
                          f"scored on images it trained on: give the validation split its own name")
    return {split: found[names[split]] for split in wanted}


def split_command(root: Path, split: SplitFiles) -> str:
    """The command that makes a dataset of one split (split) into a training and a validation split, `datasets`'
    train_test_split saved to ROOT-split: from save_to_disk's files, or from Parquet files."""
    load = f"load_from_disk({str(split.files[0].parent)!r})" if split.format == "arrow" else \
        f"load_dataset({str(root)!r}, split={split.name!r})"
    return (f"python -c \"import datasets; datasets.{load}.train_test_split(test_size=0.1, seed=0)"
            f".save_to_disk({f'{root}-split'!r})\"")


def read_splits(root: Path, image_column: str = "", label_column: str = "", train_split: str = "train",
                val_split: str = "", splits: tuple[str, ...] = ("train", "val")) -> dict[str, tuple]:
    """{split: (files, columns, labels)}, every label checked; the classes from the training split, read also where
    only the validation split is asked for (an evaluation), unless the dataset is a single split."""
    if not root.is_dir():
        raise ConfigError(f"{root} is not a folder: point --data-dir at a Hugging Face dataset saved to disk")
    found = find_splits(root)
    alone = WHOLE in found or ("train" not in splits and train_split not in found)
    picked = pick_splits(root, found, train_split, val_split, splits if alone else ("train", "val"))
    read: dict[str, tuple] = {}
    for split in ("train", "val"):
        if split not in picked:
            continue
        files = picked[split]
        columns = columns_of(files, root, image_column, label_column)
        trained = read.get("train")
        if trained and columns.label_kind != trained[1].label_kind:
            raise ConfigError(f"the {files.name} split of {root} labels its rows with "
                              f"{'integers' if columns.label_kind == 'index' else 'names'}, the {trained[0].name} "
                              f"split with {'integers' if trained[1].label_kind == 'index' else 'names'}: give both "
                              f"splits the same kind of label")
        if trained and columns.names and trained[1].names and columns.names != trained[1].names:
            raise ConfigError(f"the {files.name} split of {root} has other classes than the {trained[0].name} split "
                              f"(their ClassLabel names differ): give both splits the same ClassLabel")
        read[split] = (files, columns, read_labels(root, files, columns, trained[2] if trained else None))
    return {split: read[split] for split in splits}


def check_hf(root: Path, image_column: str = "", label_column: str = "", train_split: str = "train",
             val_split: str = "") -> None:
    """Both splits' layout, columns and every label (preflight: before any worker starts)."""
    read_splits(root, image_column, label_column, train_split, val_split)


def hf_splits(root: Path, image_column: str, label_column: str, train_split: str, val_split: str,
              splits: tuple[str, ...], run_dir: Path | None = None, images: bool = True) -> dict[str, HfSplit]:
    """The splits of a run: the Parquet ones made Arrow files once (rank 0 first); images=False (a dry run): the
    labels alone."""
    out = {}
    for split, (files, columns, labels) in read_splits(root, image_column, label_column, train_split, val_split,
                                                       splits).items():
        arrows = None
        if images:
            arrows = files.files if files.format == "arrow" else shared_arrow_files(root, files, columns.image, run_dir)
        out[split] = HfSplit(root, files, columns, labels, arrows)
    return out


def hf_listing(root: Path, image_column: str, label_column: str, train_split: str, val_split: str,
               progress_to=None) -> dict[str, tuple[list[str], list[tuple[HfRow, int]]]]:
    """make pack's listing: {split: (classes, [(row, label)])}, in the dataset's order."""
    out = {}
    for split, (files, columns, labels) in read_splits(root, image_column, label_column, train_split,
                                                       val_split).items():
        arrows = files.files if files.format == "arrow" else \
            arrow_files(root, files, columns.image, quiet=progress_to is None, stream=progress_to)
        dataset = HfSplit(root, files, columns, labels, arrows)
        out[split] = (labels.classes, [(dataset.row(i), dataset.labels[i]) for i in range(len(dataset))])
    return out
