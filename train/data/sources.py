"""Every file source as what make pack packs: per split, its classes and its samples as (reference, label) pairs in the
source's fixed order, the order training reads it in. A reference is an image file's path (str), a tar member
(tar, offset, size, suffix) of another tool's WebDataset tars, or a row of a Hugging Face dataset (HfRow).

  imagefolder   SRC/train/<class>/*, SRC/val/<class>/*      the classes sorted, each one's images in os.walk's order
  csv           SRC/train.csv, SRC/val.csv (.tsv, .jsonl)   the rows' order (train/data/labelfiles.py)
  tars          SRC/train-*.tar, ... or SRC/train/*.tar     the tars sorted by name, their samples in tar order
                                                            (train/data/tars.py)
  hf            SRC/dataset_dict.json, SRC/train/*.arrow    the split's rows in the dataset's order
                (save_to_disk), or Parquet files            (train/data/hfrows.py, hfdisk.py: the layouts)

A folder with label files is read as one; else a Hugging Face dataset as one; else a folder with tars as tars; else as
an ImageFolder. A trainbox pack is not a source (it is packed already).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from train.base.errors import ConfigError, DataError
from train.data.folders import check_imagefolder, is_pack
from train.data.hfdisk import is_hf
from train.data.hfrows import HfRow, hf_listing
from train.data.labelfiles import Listing, has_label_files, read_labelfiles
from train.data.scan import scan_splits
from train.data.tarindex import DEFAULT_LABEL_KEY, has_split, load_split
from train.data.tars import classes_of

SPLITS = ("train", "val")
NAMED = 3  # the missing files a line names (then their count)
FILE_CHUNK = 4096  # rows a thread looks at in one task
Reference = str | tuple  # a file's path, (tar, offset, size, suffix), or an HfRow


def source_kind(src: Path, train_split: str = "train") -> str:
    if is_pack(src):
        raise ConfigError(f"{src} is a trainbox pack already (index.json, or an unfinished pack's journal): train on "
                          f"it with --dataset shards --data-dir {src}")
    if has_label_files(src):
        return "csv"
    if is_hf(src, train_split):
        return "hf"
    return "tars" if has_split(src, "train") else "imagefolder"


def check_knobs(kind: str, src: Path, path_column: str, label_column: str, label_key: str, hf_knobs: bool) -> None:
    """The knobs of one kind of source, given for another: one line. hf_knobs: a Hugging Face dataset's column or
    split named."""
    if kind != "csv" and path_column or kind not in ("csv", "hf") and label_column:
        raise ConfigError(f"--path-column and --label-column name the columns of label files (--label-column also a "
                          f"Hugging Face dataset's), and {src} has none (train.csv, .tsv or .jsonl): drop them")
    if kind != "hf" and hf_knobs:
        raise ConfigError(f"--image-column, --train-split and --val-split name the columns and splits of a Hugging "
                          f"Face dataset, and {src} is none (no dataset_dict.json, saved Dataset or Parquet files): "
                          f"drop them")
    if kind != "tars" and label_key != DEFAULT_LABEL_KEY:
        raise ConfigError(f"--label-key names the label of WebDataset tars, and {src} holds none: drop it")


def list_source(src: Path, counted=None, path_column: str = "", label_column: str = "",
                label_key: str = DEFAULT_LABEL_KEY, progress_to=None, image_column: str = "", train_split: str = "",
                val_split: str = "") -> tuple[str, dict]:
    """(kind, {split: (classes, [(reference, label)])}) of src, in its order. counted: called with the entries of
    each folder an ImageFolder's listing reads, or the label files' rows whose file is looked at (a progress line);
    every file a label file lists must be there (check_files_exist); progress_to: the stream of the tars' indexing
    line, or of a Parquet split's conversion (None: none)."""
    if not src.is_dir():
        raise ConfigError(f"SRC {src} is not a folder: give an ImageFolder, a folder of label files (train.csv, "
                          f"val.csv), of WebDataset tars or a Hugging Face dataset saved to disk")
    kind = source_kind(src, train_split or "train")
    check_knobs(kind, src, path_column, label_column, label_key, bool(image_column or train_split or val_split))
    if kind == "hf":
        return kind, hf_listing(src, image_column, label_column, train_split or "train", val_split, progress_to)
    if kind == "csv":
        listings = read_labelfiles(src, path_column, label_column)
        check_files_exist(listings, counted)
        return kind, {split: (listing.classes, [(listing.path(i), listing.labels[i]) for i in range(len(listing))])
                      for split, listing in listings.items()}
    if kind == "tars":
        indices = {split: load_split(src, split, label_key, quiet=progress_to is None, stream=progress_to)
                   for split in SPLITS}
        splits = {}
        for split, index in indices.items():
            classes, _ = classes_of(src, indices["train"], index, split)
            samples = []
            for shard, rows in enumerate(index.rows):
                tar, names = str(index.tars[shard]), index.member_names(shard)
                samples += [((tar, offset, size, "." + name.rsplit(".", 1)[1].lower()), label)
                            for (offset, size, label), name in zip(rows.tolist(), names, strict=True)]
            splits[split] = (classes, samples)
        return kind, splits
    check_imagefolder(src)
    return kind, scan_splits(src, SPLITS, counted)


def check_files_exist(listings: dict[str, Listing], counted=None, threads: int = 16) -> None:
    """Every listed file is there (make pack, which reads each of them: a stop at the first missing one would leave
    the others to one run each): the missing ones in one line, the first few with their file and line, all counted.
    A NAS answers stats one round trip at a time: `threads` ask at once. counted: called with each chunk's rows
    done (a progress line). The label files' own check (read_labelfiles) leaves this out: training reads a file when
    its row comes, and a million stats would hold up every start."""
    chunks = [(listing, start, min(start + FILE_CHUNK, len(listing))) for listing in listings.values()
              for start in range(0, len(listing), FILE_CHUNK)]

    def missing(chunk) -> list[tuple[Listing, int]]:
        listing, start, end = chunk
        return [(listing, i) for i in range(start, end) if not os.path.isfile(listing.path(i))]

    found = []
    with ThreadPoolExecutor(threads) as pool:
        for rows, (_, start, end) in zip(pool.map(missing, chunks), chunks, strict=True):
            found += rows
            if counted is not None:
                counted(end - start)
    if found:
        named = ", ".join(f"{listing.file} line {listing.lines[i]} ({listing.path(i)})" for listing, i in found[:NAMED])
        if len(found) == 1:
            raise ConfigError(f"the image listed on {named} is missing: correct the path on that line, restore the "
                              f"file or remove the line")
        raise ConfigError(f"{len(found):,} images the label files list are missing: {named}"
                          f"{', ...' if len(found) > NAMED else ''}: correct the paths on those lines, restore the "
                          f"files or remove the lines")


def name_of(reference: Reference) -> str:
    if isinstance(reference, HfRow):
        return reference.name()
    return reference if isinstance(reference, str) else f"{reference[0]} (the member at byte {reference[1]})"


def suffix_of(reference: Reference, data: bytes) -> str:
    """The member suffix the image (data) keeps in a pack: its file's (lowercase), its tar member's, or a row's (its
    path's, else by its first bytes)."""
    if isinstance(reference, HfRow):
        return reference.suffix(data)
    return Path(reference).suffix.lower() if isinstance(reference, str) else reference[3]


def read_reference(reference: Reference, then: str) -> bytes:
    """The image's bytes; a file or member that cannot be read is one line naming it (then: what to do after)."""
    if isinstance(reference, HfRow):
        return reference.image(then)
    try:
        if isinstance(reference, str):
            return Path(reference).read_bytes()
        tar, offset, size, _ = reference
        with open(tar, "rb") as f:
            f.seek(offset)
            data = f.read(size)
    except OSError as e:
        raise DataError(f"cannot read image {name_of(reference)} ({e}): check the file's permissions and storage, "
                        f"then {then}") from None
    if len(data) != size:
        raise DataError(f"{tar} is cut short (it changed after it was indexed): copy it again, then {then}")
    return data


def listed_as(src: Path, reference: Reference) -> str:
    """A reference as the listing digest records it: relative to SRC where it is inside it."""
    if isinstance(reference, str):
        return reference.removeprefix(os.path.join(str(src), ""))
    if isinstance(reference, HfRow):
        return f"{reference.split} row {reference.index} ({Path(reference.file).name} row {reference.row})"
    return f"{Path(reference[0]).relative_to(src)}:{reference[1]}:{reference[2]}"
