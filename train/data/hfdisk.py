"""A Hugging Face dataset on disk (--dataset hf): where each split's files are, which columns hold the image and the
label, and each split's labels and classes, read with pyarrow alone (no `datasets`: train/data/hfrows.py reads the
images, train/data/hfcache.py makes Arrow files of Parquet ones).

  DIR/dataset_dict.json, DIR/SPLIT/...            DatasetDict.save_to_disk: each split a saved Dataset
  DIR/SPLIT/state.json, DIR/SPLIT/data-*.arrow     saved Datasets, a folder each (dataset_dict.json optional)
  DIR/state.json, DIR/data-*.arrow                 one saved Dataset: a single split (what an evaluation reads)
  DIR/SPLIT/*.parquet, DIR/data/SPLIT/*.parquet    Parquet, a folder per split (the Hub's conversion: default/train/)
  DIR/[data/][NAME-]SPLIT[-00000-of-00002].parquet Parquet named by its split (push_to_hub's data/train-00000-of-...)

A saved Dataset's rows are its state.json's Arrow files in their order; a Parquet split's, its files sorted by name.
The columns' features (Image, ClassLabel with its names) come from the schema's "huggingface" metadata, which
`datasets` writes into every Arrow and Parquet file, else from dataset_info.json; without them, from the types.
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from train.base.errors import ConfigError
from train.cluster.identity import first_line

IMAGE_COLUMNS = ("image", "img")
LABEL_COLUMNS = ("label", "labels")
SHARD_TAIL = re.compile(r"-\d+(?:-of-\d+)?(?:-[0-9a-f]{6,})?$")  # -00000-of-00004, and the old -<fingerprint>
WHOLE = ""  # the one split of a single saved Dataset


def arrow_error(error: BaseException) -> str:
    """A pyarrow error as a line's part: its first line, without the control characters its messages may carry
    (a corrupt Parquet footer's ends in a newline, or names a byte such as 0x0f as itself)."""
    return "".join(c for c in first_line(error) if c.isprintable())


def arrow():
    """pyarrow, with ipc, parquet and compute, imported on first use: only --dataset hf pays for it (0.15 s)."""
    for name in ("pyarrow.ipc", "pyarrow.parquet", "pyarrow.compute"):
        importlib.import_module(name)
    return importlib.import_module("pyarrow")


@dataclass(frozen=True)
class SplitFiles:
    name: str  # the split's own name (WHOLE for a single saved Dataset)
    format: str  # "arrow" (save_to_disk) or "parquet"
    files: tuple[Path, ...]


def _saved(folder: Path, name: str) -> SplitFiles:
    """A saved Dataset: its state.json's Arrow files, in order (else data-*.arrow sorted)."""
    try:
        listed = [f["filename"] for f in json.loads((folder / "state.json").read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        listed = sorted(p.name for p in folder.glob("data-*.arrow"))
    files = tuple(folder / name for name in listed)
    missing = [f for f in files if not f.is_file()]
    if not files or missing:
        what = f"{missing[0].name} is missing" if missing else "no Arrow file"
        raise ConfigError(f"{folder} is an incomplete saved Dataset ({what}): save it again with save_to_disk")
    return SplitFiles(name, "arrow", files)


def _parquet_splits(root: Path) -> dict[str, SplitFiles]:
    found: dict[str, dict[Path, list[Path]]] = {}
    for base in (root, root / "data"):
        for path in sorted(base.glob("*.parquet")) if base.is_dir() else ():
            found.setdefault(SHARD_TAIL.sub("", path.name[:-len(".parquet")]).rsplit("-", 1)[-1], {}) \
                .setdefault(base, []).append(path)
        folders = sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")) \
            if base.is_dir() else []
        for folder in folders if base != root else [f for f in folders if f.name != "data"]:
            if files := sorted(folder.glob("*.parquet")):
                found.setdefault(folder.name, {}).setdefault(folder, files)
    splits = {}
    for split, places in found.items():
        if len(places) > 1:
            where = " and ".join(str(p) for p in places)
            raise ConfigError(f"{root}: the {split} split has Parquet files in {where}: which are the split is "
                              f"unclear: keep one layout")
        splits[split] = SplitFiles(split, "parquet", tuple(*places.values()))
    return splits


def find_splits(root: Path) -> dict[str, SplitFiles]:
    """Every split of the dataset in root, by its name; {} where root holds none of the layouts above."""
    if (root / "dataset_dict.json").is_file():
        try:
            names = json.loads((root / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"cannot read {root}/dataset_dict.json ({e}): save the DatasetDict again") from None
        return {name: _saved(root / name, name) for name in names}
    if (root / "state.json").is_file():
        return {WHOLE: _saved(root, WHOLE)}
    if saved := {p.name: _saved(p, p.name) for p in sorted(root.iterdir()) if (p / "state.json").is_file()}:
        return saved
    return _parquet_splits(root)


def is_hf(root: Path, train_split: str = "train") -> bool:
    """Whether root holds a Hugging Face dataset, by a few looks: make pack tells the sources apart by it, and an
    ImageFolder's class folders are not listed."""
    if not root.is_dir():
        return False
    if (root / "dataset_dict.json").is_file() or (root / "state.json").is_file() or \
            any((p / "state.json").is_file() for p in root.iterdir() if p.is_dir()):
        return True
    return any(any(folder.glob("*.parquet")) for folder in (root, root / "data", root / train_split,
                                                             root / "data" / train_split) if folder.is_dir())


def schema_of(split: SplitFiles, file: Path | None = None):
    pa = arrow()
    path = file or split.files[0]
    try:
        if split.format == "parquet":
            return pa.parquet.read_schema(path)
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_stream(source).schema
    except (OSError, pa.ArrowException) as e:
        raise ConfigError(f"cannot read {path} ({arrow_error(e)}): a damaged or incomplete file: copy or save it "
                          f"again") from None


def features_of(split: SplitFiles, schema) -> dict:
    """The `datasets` features of the split's columns: the schema's "huggingface" metadata, else dataset_info.json."""
    meta = (schema.metadata or {}).get(b"huggingface")
    info = split.files[0].parent / "dataset_info.json"
    try:
        if meta:
            return json.loads(meta)["info"]["features"] or {}
        return json.loads(info.read_text()).get("features") or {} if info.is_file() else {}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}


@dataclass(frozen=True)
class Columns:
    image: str
    image_kind: str  # "struct" (an Image feature's {bytes, path}), "bytes" or "path"
    label: str
    label_kind: str  # "index" (integers: ClassLabel, or the classes' indices) or "name" (strings)
    names: tuple[str, ...] | None  # a ClassLabel's names, in its order


def _pick(columns: list[str], given: str, defaults: tuple[str, ...], typed: list[str], what: str, flag: str,
          where: str) -> str:
    if given:
        if given in columns:
            return given
        raise ConfigError(f"{where} has no column {given!r} ({flag}; it has: {', '.join(columns)}): name the {what} "
                          f"column as the dataset does")
    found = next((name for name in defaults if name in columns), None) or (typed[0] if len(typed) == 1 else None)
    if found is None:
        raise ConfigError(f"{where} has none of the columns {', '.join(defaults)} for the {what} (it has: "
                          f"{', '.join(columns)}): pass {flag} NAME")
    return found


def columns_of(split: SplitFiles, root: Path, image_column: str, label_column: str) -> Columns:
    pa = arrow()
    schema = schema_of(split)
    features = features_of(split, schema)
    names = schema.names
    where = f"the {split.name or 'one'} split of {root}"

    def typed(kind: str) -> list[str]:
        return [n for n in names if isinstance(features.get(n), dict) and features[n].get("_type") == kind]

    image = _pick(names, image_column, IMAGE_COLUMNS, typed("Image"), "images", "--image-column", where)
    label = _pick(names, label_column, LABEL_COLUMNS, typed("ClassLabel"), "labels", "--label-column", where)
    types = pa.types
    kind = schema.field(image).type
    if types.is_struct(kind) and {kind.field(i).name for i in range(kind.num_fields)} & {"bytes", "path"}:
        image_kind = "struct"
    elif types.is_binary(kind) or types.is_large_binary(kind):
        image_kind = "bytes"
    elif types.is_string(kind) or types.is_large_string(kind):
        image_kind = "path"
    else:
        raise ConfigError(f"the column {image!r} of {where} holds {kind}, not images (an Image feature, bytes or "
                          f"paths): name the image column with --image-column")
    kind = schema.field(label).type
    if not (types.is_integer(kind) or types.is_string(kind) or types.is_large_string(kind)):
        raise ConfigError(f"the column {label!r} of {where} holds {kind}, not one class per image (a ClassLabel, an "
                          f"integer or a class name): name the label column with --label-column")
    feature = features.get(label)
    listed = feature.get("names") if isinstance(feature, dict) and feature.get("_type") == "ClassLabel" else None
    return Columns(image, image_kind, label, "index" if types.is_integer(kind) else "name",
                   tuple(map(str, listed)) if listed else None)


def _values(split: SplitFiles, column: str, kind: str, root: Path) -> tuple[object, list[int]]:
    """The split's labels (a pyarrow ChunkedArray, its files in order) and each file's row count; every file must
    have the first one's label type."""
    pa = arrow()
    chunks, counts = [], []
    for path in split.files:
        try:
            if split.format == "parquet":
                table = pa.parquet.read_table(path, columns=[column])
            else:
                with pa.memory_map(str(path)) as source:
                    table = pa.ipc.open_stream(source).read_all().select([column])
        except (OSError, KeyError, pa.ArrowException) as e:
            raise ConfigError(f"cannot read the column {column!r} of {path} ({arrow_error(e)}): every file "
                              f"of a split needs the same columns: copy or save it again") from None
        values = table.column(column)
        is_int = pa.types.is_integer(values.type)
        if is_int != (kind == "index"):
            raise ConfigError(f"{path}: the column {column!r} holds {values.type} where the {split.name or 'one'} "
                              f"split of {root} starts with {'integers' if kind == 'index' else 'names'}: give every "
                              f"file the same label type")
        chunks += (pa.compute.cast(values, pa.int64()) if is_int else pa.compute.cast(values, pa.string())).chunks
        counts.append(table.num_rows)
    if not sum(counts):
        raise ConfigError(f"the {split.name or 'one'} split of {root} has no rows: give it images")
    return pa.chunked_array(chunks, pa.int64() if kind == "index" else pa.string()), counts


def _first(mask) -> int:
    return arrow().compute.index(mask, True).as_py()


@dataclass
class Labels:
    """One split's labels as class indices, its classes in order, and where they come from."""
    split: SplitFiles
    counts: list[int]  # rows per file
    labels: torch.Tensor  # int64, one per row
    classes: list[str]
    classes_from: str


def read_labels(root: Path, split: SplitFiles, cols: Columns, train: Labels | None = None) -> Labels:
    """The split's labels, every one checked; its classes are the training split's (train), else its own."""
    pc = arrow().compute
    values, counts = _values(split, cols.label, cols.label_kind, root)
    where = f"the {split.name or 'one'} split of {root}"
    if values.null_count:
        raise ConfigError(f"row {_first(pc.is_null(values))} of {where} has no label ({cols.label!r} is empty): label "
                          f"it, or remove the row")
    if train is not None:
        classes, source = train.classes, train.classes_from
    elif cols.names:
        classes, source = list(cols.names), f"the ClassLabel names of the column {cols.label!r}, in their order"
    elif cols.label_kind == "index":
        top = pc.max(values).as_py()
        classes, source = [str(i) for i in range(max(top, 0) + 1)], "the integer labels (0 .. the largest)"
    else:
        classes = sorted(pc.unique(values).to_pylist())
        source = f"the label names of the {split.name} split, sorted"
        if "" in classes:
            raise ConfigError(f"row {_first(pc.equal(values, ''))} of {where} has an empty label: label it, or remove "
                              f"the row")
    if cols.label_kind == "index":
        low = pc.less(values, 0)
        if pc.any(low).as_py():
            row = _first(low)
            unlabelled = " (-1: a ClassLabel's 'no label', as the Hub's unlabelled test splits have)" \
                if values[row].as_py() == -1 else ""
            raise ConfigError(f"row {row} of {where} has the label {values[row].as_py()}{unlabelled}: label it, or "
                              f"pick another split with {'--val-split' if train else '--train-split'}")
        high = pc.greater_equal(values, len(classes))
        if pc.any(high).as_py():
            row = _first(high)
            raise ConfigError(f"row {row} of {where}: the label {values[row].as_py()} names no class ({len(classes)}, "
                              f"from {source}): fix the label")
        indices = values
    else:
        indices = pc.index_in(values, value_set=arrow().array(classes))
        if indices.null_count:
            row = _first(pc.is_null(indices))
            raise ConfigError(f"row {row} of {where}: the label {values[row].as_py()!r} is not one of the classes "
                              f"({source}): fix the label")
    labels = torch.from_numpy(pc.cast(indices, arrow().int64()).to_numpy().copy())
    return Labels(split, counts, labels, classes, source)
