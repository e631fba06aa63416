"""The index of another tool's WebDataset tars (train/data/tars.py reads them by it): where the tars are, each one's
samples (offset, size and label of its image; tarfile gives the offsets from the members' headers), made once in a
process per usable core with a progress line, and cached beside the tars (DIR/.trainbox-index/) or, where their
folder cannot be written, in the run folder (RUN_DIR/data-index/); used again while every tar keeps its size and
modification time.

  DIR/.trainbox-index/SPLIT.json    the format, the label key, each tar's name, size, modification time and samples
  DIR/.trainbox-index/SPLIT.idx     per sample: offset, size, label (int64 x 3), the tars one after another
  DIR/.trainbox-index/SPLIT.names   per sample: its image member's name, one a line
  DIR/.trainbox-index/.SPLIT.lock   held by the process that indexes: the others that start at once wait for it

The .json is written last (each file whole, under a temporary name first): it makes the other two valid. One tar's
samples are read, and the tar checked whole, in train/data/tarread.py.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import multiprocessing
import os
import socket
import sys
from contextlib import contextmanager
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from train.base.errors import ConfigError
from train.base.progress import Progress
from train.cluster.distributed import broadcast_from_main
from train.cluster.identity import is_main, usable_cores
from train.data.tarread import index_tar
from train.files.rundir import atomic_write, to_json

CACHE = ".trainbox-index"  # beside the tars
FALLBACK = "data-index"  # in the run folder, where the tars' folder cannot be written
FORMAT = 2  # 2: a tar cut short is refused (1 indexed the members before the cut)
SPLITS = ("train", "val")
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


def has_split(root: Path, split: str) -> bool:
    return any(root.glob(f"{split}-*.tar")) or (root / split).is_dir() and any((root / split).glob("*.tar"))


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


def file_stats(root: Path, files: list[Path]) -> list[dict]:
    """Each file's name under root, size and modification time: what a cache of the files' index is checked against."""
    out = []
    for file in files:
        stat = file.stat()
        out.append({"name": str(file.relative_to(root)), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    return out


def cache_dirs(root: Path, run_dir: Path | None) -> list[Path]:
    """Beside the files, then in the run folder: not where the run folder's parent is missing (a NAS not mounted:
    the run's own check says so; making the folders there would hide it)."""
    beside = [root / CACHE]
    if run_dir is None or not run_dir.absolute().parent.is_dir():
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


@contextmanager
def indexing(folders: list[Path], split: str, root: Path, quiet: bool, stream):
    """The first of `folders` that can hold the split's index, held by this process alone (a POSIX lock on
    .SPLIT.lock in it: the processes that start at once, on one node or several, wait for the first one's index
    instead of indexing too; the system releases it when its process ends, killed or not); None where no folder
    can be written. Where the file system has no locks, the folder comes without one."""
    for folder in folders:
        lock = folder / f".{split}.lock"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            continue  # a read-only NAS folder: the next place
        try:
            _lock(fd, lock, f"indexing the {split} split of {root}", quiet, stream)
            yield folder
        finally:
            os.close(fd)  # and with it the lock
        return
    yield None


def _lock(fd: int, lock: Path, doing: str, quiet: bool, stream) -> None:
    """The lock file `lock` (open as fd) locked, after a line naming the process that holds it, if one does."""
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not quiet:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                print(f"waiting for {holder}, which is {doing} ({lock})", file=stream or sys.stderr, flush=True)
            fcntl.lockf(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} pid {os.getpid()}".encode(), 0)
    except OSError:
        pass  # no locks on this file system (or no room to name the holder): each process indexes, or goes on


def load_split(root: Path, split: str, label_key: str, run_dir: Path | None = None, quiet: bool = False,
               stream=None) -> TarIndex:
    """The split's index: from a cache that matches the tars, else indexed and cached (beside the tars, else in the
    run folder, else kept in memory), by one process of those that start at once."""
    tars = find_tars(root, (split,))[split]
    stats = file_stats(root, tars)
    folders = cache_dirs(root, run_dir)
    for folder in folders:
        cached = _read_cache(folder, root, split, tars, stats, label_key)
        if cached is not None:
            return cached
    with indexing(folders, split, root, quiet, stream) as held:
        cached = held and _read_cache(held, root, split, tars, stats, label_key)  # made while this one waited
        if cached:
            return cached
        index = index_split(root, tars, label_key, quiet, stream)
        for folder in folders[folders.index(held):] if held else []:
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
    cached = _read_cache(Path(where), root, split, tars, file_stats(root, tars), label_key) if where else None
    return cached or load_split(root, split, label_key, run_dir, quiet=True)
