"""Label files: a split listed as rows of (image path, label) in DIR/train.csv and DIR/val.csv (or .tsv, or .jsonl),
and the class list files beside a dataset (classes.txt, classes.json), which the WebDataset tars of other tools use
too (train/data/tars.py).

  DIR/train.csv   path,label          a header, then one row per image; --path-column / --label-column name the
                  cat/001.jpg,cat     columns (default: the first of PATH_COLUMNS, LABEL_COLUMNS the header has)
  DIR/val.csv     /abs/dog.png,dog    a path is relative to DIR, or absolute
  DIR/classes.txt (optional)          one class name per line (or classes.json: a list of names)

Order: the file's rows, in the file's order. Classes: the class list file's, in its order, when there is one (a
label is then one of its names, or an index into it); else, when every training label is a whole number, the
indices themselves ("0" .. the largest); else the training file's label names, sorted. The same on every rank and
every resume: a pure function of the files.

Every row is checked before any worker starts (read_labelfiles, about a million rows a second): an empty label, a
label not in the class list, an index out of range, a path listed twice (in one split, or in both), a header without
the columns and a malformed line are one line naming the file, the line and the fix (ConfigError). Whether each
file exists is not asked: a NAS answers a million stats in minutes. A missing or unreadable file is one line naming
it and its line when the loader meets it (DataError), as an unreadable image of an ImageFolder is.
"""

from __future__ import annotations

import csv
import json
import os
from array import array
from itertools import accumulate
from pathlib import Path

import torch
from torch.utils.data import Dataset

from train.base.errors import ConfigError, DataError
from train.data.decode import as_tensor

SUFFIXES = (".csv", ".tsv", ".jsonl")
SHOWN = 8  # a header's names a line shows (then their count)
SEPARATORS, RENAMED = {",": "commas", "\t": "tabs", ";": "semicolons", "|": "bars"}, {",": ".csv", "\t": ".tsv"}
PATH_COLUMNS = ("path", "image", "file", "filename", "filepath")
LABEL_COLUMNS = ("label", "class", "category", "target")
CLASS_FILES = ("classes.txt", "classes.json")


def label_file(root: Path, split: str) -> Path:
    """DIR/SPLIT.csv, .tsv or .jsonl: exactly one of them."""
    found = [root / f"{split}{suffix}" for suffix in SUFFIXES if (root / f"{split}{suffix}").is_file()]
    if not found:
        raise ConfigError(f"{root} has no {split}.csv, {split}.tsv or {split}.jsonl: a csv dataset lists each split's "
                          f"images in one of them (a header such as path,label, then a row per image)")
    if len(found) > 1:
        raise ConfigError(f"{root} has {' and '.join(p.name for p in found)}: which lists the {split} split is "
                          f"unclear: keep one of them (move the others out of {root})")
    return found[0]


def has_label_files(root: Path) -> bool:
    return any((root / f"train{suffix}").is_file() for suffix in SUFFIXES)


def class_list(folder: Path) -> tuple[list[str], Path] | None:
    """The class names of classes.txt (one a line) or classes.json (a list of strings) in folder, in their order,
    and the file; None without either."""
    found = [folder / name for name in CLASS_FILES if (folder / name).is_file()]
    if not found:
        return None
    if len(found) > 1:
        raise ConfigError(f"{folder} has both classes.txt and classes.json: keep one of them")
    path = found[0]
    try:
        text = path.read_text(encoding="utf-8-sig")
        names = json.loads(text) if path.suffix == ".json" else text.rstrip().splitlines()  # no blank lines at the end
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"cannot read {path} ({e}): give one class name per line (classes.txt) or a JSON list of "
                          f"names (classes.json)") from None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{path} is not a JSON list of class names: write it as [\"cat\", \"dog\", ...]")
    names = [n.strip() for n in names]
    if not names or "" in names:
        where = f" (entry {names.index('') + 1})" if "" in names else ""
        raise ConfigError(f"{path} has an empty class name{where} or none at all: give one name per class")
    if len(set(names)) < len(names):
        twice = next(n for i, n in enumerate(names) if n in names[:i])
        raise ConfigError(f"{path} names the class {twice!r} twice: give each class once")
    return names, path


def _column(names: list[str], given: str, defaults: tuple[str, ...], what: str, flag: str, file: Path) -> str:
    lowered = {n.strip().lower(): n for n in names}
    found = (given if given in names else None) if given else next((lowered[n] for n in defaults if n in lowered), None)
    if found is not None:
        return found
    shown = ", ".join(names[:SHOWN])[:200] + (f" and {len(names) - SHOWN:,} more" if len(names) > SHOWN else "")
    ours = "\t" if file.suffix == ".tsv" else ","
    theirs = next((s for s in SEPARATORS if s in names[0]), ours) if len(names) == 1 else ours
    if theirs != ours and file.suffix != ".jsonl":  # one field another separator splits (a .tsv of commas)
        fix = f"rename it {file.stem}{RENAMED[theirs]}" if theirs in RENAMED else f"save it with {SEPARATORS[ours]}"
        raise ConfigError(f"{file} line 1: the header ({shown}) is one field: its fields are separated by "
                          f"{SEPARATORS[theirs]}, and a {file.suffix} file's by {SEPARATORS[ours]}: {fix}")
    raise ConfigError(f"{file} line 1: the header ({shown}) " + (
        f"has no column {given!r} ({flag}): name the {what} column as the header does" if given else
        f"has none of {', '.join(defaults)} for the {what}: name that column, or pass {flag} NAME (the first line "
        f"must be a header)"))


def _rows(file: Path, path_column: str, label_column: str):
    """(line, path, label) of each row; a malformed line or a header without the columns is one line."""
    reader = None
    try:
        with open(file, newline="", encoding="utf-8-sig") as f:
            if file.suffix == ".jsonl":
                yield from _json_rows(f, file, path_column, label_column)
                return
            reader = csv.reader(f, delimiter="\t" if file.suffix == ".tsv" else ",")
            header = next(reader, None)
            if not header:
                raise ConfigError(f"{file} is empty: give a header (e.g. path,label) and a row per image")
            columns = [h.strip() for h in header]
            p = columns.index(_column(columns, path_column, PATH_COLUMNS, "image paths", "--path-column", file))
            lab = columns.index(_column(columns, label_column, LABEL_COLUMNS, "labels", "--label-column", file))
            for record in reader:
                if len(record) != len(header):
                    if not record:
                        continue  # a blank line
                    raise ConfigError(f"{file} line {reader.line_num}: {len(record)} fields where the header has "
                                      f"{len(header)}: quote a field that holds the separator, or fix the line")
                yield reader.line_num, record[p], record[lab]
    except csv.Error as e:  # a NUL byte, a field over csv's limit of 131,072 characters
        raise ConfigError(f"{file} line {reader.line_num if reader else 1}: malformed ({e}): fix that line") \
            from None
    except UnicodeDecodeError:
        raise ConfigError(f"{file} is not UTF-8 text: save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"cannot read {file} ({e.strerror}): check its permissions and the storage") from None


def _json_rows(f, file: Path, path_column: str, label_column: str):
    keys = None
    for line, text in enumerate(f, 1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"{file} line {line}: not JSON ({e}): give one JSON object per line") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{file} line {line}: not a JSON object: give one object per line, such as "
                              f"{{\"path\": \"cat/1.jpg\", \"label\": \"cat\"}}")
        if keys is None:  # the first object names the columns, as a header would
            names = list(row)
            keys = (_column(names, path_column, PATH_COLUMNS, "image paths", "--path-column", file),
                    _column(names, label_column, LABEL_COLUMNS, "labels", "--label-column", file))
        try:
            path, label = row[keys[0]], row[keys[1]]
        except KeyError as e:
            raise ConfigError(f"{file} line {line}: no {e.args[0]!r} key: give every line the same keys") from None
        if isinstance(label, bool) or not isinstance(label, (str, int)) or not isinstance(path, str):
            raise ConfigError(f"{file} line {line}: the path must be a string and the label a class name or an "
                              f"integer index, got {path!r} and {label!r}")
        yield line, path, str(label)


def _is_index(label: str) -> bool:
    return label.isascii() and label.isdigit()


class Listing:
    """One split of a label file: classes, and per row its full path, label and line, stored compactly (three arrays
    and one string, not a million small objects: every loader worker holds a copy)."""

    def __init__(self, file: Path, classes: list[str], classes_from: str, paths: list[str], labels: list[int],
                 lines: list[int]):
        self.file, self.classes, self.classes_from = file, classes, classes_from
        self.text = "".join(paths)
        self.ends = array("q", accumulate(map(len, paths)))
        self.labels, self.lines = array("q", labels), array("q", lines)

    def __len__(self) -> int:
        return len(self.ends)

    def path(self, index: int) -> str:
        return self.text[self.ends[index - 1] if index else 0:self.ends[index]]


def _classes(raw: list[str], lines: list[int], file: Path, listed: tuple[list[str], Path] | None):
    """(classes, where they come from) of the training file's labels (raw)."""
    if listed is not None:
        return listed[0], f"{listed[1].name}, in its order"
    indices = [_is_index(label) for label in raw]
    if all(indices):
        return [str(i) for i in range(max(map(int, raw)) + 1)], "integer labels (the indices: 0 .. the largest)"
    if any(indices):
        first = indices.index(not indices[0])
        above = "indices" if indices[0] else "class names"
        raise ConfigError(f"{file} line {lines[first]}: the label {raw[first]!r} mixes with the {above} above: give "
                          f"every row a class name, or every row an index (with the names in classes.txt)")
    return sorted(set(raw)), f"the label names of {file.name}, sorted"


def _labels(raw: list[str], lines: list[int], file: Path, classes: list[str], source: str) -> list[int]:
    index = {name: i for i, name in enumerate(classes)}
    try:
        return [index[label] for label in raw]
    except KeyError:
        pass
    for label, line in zip(raw, lines, strict=True):  # the first row that did not map: say why
        if label in index:
            continue
        if _is_index(label) and int(label) < len(classes) and not source.startswith("the label names"):
            continue
        if _is_index(label) and not source.startswith("the label names"):
            raise ConfigError(f"{file} line {line}: the class index {label} is out of range ({len(classes)} classes, "
                              f"0-{len(classes) - 1}, from {source}): fix the index")
        raise ConfigError(f"{file} line {line}: the label {label!r} is not one of the classes ({source}): fix the "
                          f"label, or add the class to classes.txt")
    return [index[label] if label in index else int(label) for label in raw]


def read_split(root: Path, split: str, path_column: str = "", label_column: str = "",
               classes: tuple[list[str], str] | None = None,
               seen: dict[str, int] | None = None) -> tuple[Listing, dict[str, int]]:
    """One split's label file, every row checked, and its rows' lines by full path. classes: (names, where from) of
    the training split, which this split's labels must name; without them this split sets them. seen: the training
    split's lines by full path, which this split must not list again."""
    file = label_file(root, split)
    prefix = os.path.join(str(root), "")
    paths, raw, lines, where = [], [], [], {}
    for line, path, label in _rows(file, path_column, label_column):
        path, label = path.strip(), label.strip()
        if not path or not label or "\0" in path:
            what = "label is empty" if path and not label else "path is empty" if not path else "path holds a NUL byte"
            raise ConfigError(f"{file} line {line}: the {what}: give every row a path and a label, or remove the line")
        full = path if path.startswith("/") else prefix + path
        if "/." in full or "//" in full:
            full = os.path.normpath(full)
        if full in where:
            raise ConfigError(f"{file} lines {where[full]} and {line} both list {full}: it would count twice: remove "
                              f"one of the lines")
        where[full] = line
        paths.append(full)
        raw.append(label)
        lines.append(line)
    if not paths:
        raise ConfigError(f"{file} lists no image: give a row (path and label) per image")
    for full, line in where.items() if seen else ():
        if full in seen:
            raise ConfigError(f"{file} line {line} lists {full}, which the training split lists too (line "
                              f"{seen[full]}): the model would be scored on an image it trained on: remove it from "
                              f"one of them")
    names, source = classes or _classes(raw, lines, file, class_list(root))
    return Listing(file, names, source, paths, _labels(raw, lines, file, names, source), lines), where


def read_labelfiles(root: Path, path_column: str = "", label_column: str = "",
                    splits: tuple[str, ...] = ("train", "val")) -> dict[str, Listing]:
    """Each split's listing, every row checked; the classes from the training split, read also where only the
    validation split is asked for (an evaluation), unless the folder has no training file."""
    if not root.is_dir():
        raise ConfigError(f"{root} is not a folder: point --data-dir at the folder of train.csv and val.csv")
    first = "train" if "train" in splits or has_label_files(root) else splits[0]
    head, seen = read_split(root, first, path_column, label_column)
    listings = {first: head}
    for split in splits:
        if split != first:
            listings[split] = read_split(root, split, path_column, label_column, (head.classes, head.classes_from),
                                         seen)[0]
    return {split: listings[split] for split in splits}


def check_labelfiles(root: Path, path_column: str = "", label_column: str = "") -> None:
    """Both splits, every row (preflight: before any worker starts)."""
    read_labelfiles(root, path_column, label_column)


class LabelFileSplit(Dataset):
    """One split of a label file as a source of (bytes, label): item i is the file of row i, read here (decoded by
    the Decoded or FileBytes wrapper around it); name(i) says the file and its line."""

    def __init__(self, listing: Listing):
        self.listing, self.classes = listing, listing.classes

    def __len__(self) -> int:
        return len(self.listing)

    def name(self, index: int) -> str:
        return f"{self.listing.path(index)} ({self.listing.file.name} line {self.listing.lines[index]})"

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path = self.listing.path(index)
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise DataError(f"cannot read image {path}, listed on line {self.listing.lines[index]} of "
                            f"{self.listing.file} ({e.strerror}): correct the path on that line, restore the file or "
                            f"remove the line, then run the same command to resume") from None
        return as_tensor(data), self.listing.labels[index]

    def describe(self) -> dict:
        return {"kind": "csv", "from": f"{self.listing.file} ({len(self):,} rows)",
                "order": "the label file's rows, in its order", "classes_from": self.listing.classes_from}
