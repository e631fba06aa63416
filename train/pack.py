"""Packed shards for big image datasets: `make pack SRC=... DST=...` (python -m train.pack SRC DST).

A source (an ImageFolder: SRC/train/<class>/*, SRC/val/<class>/*; label files: SRC/train.csv and val.csv, or .tsv,
.jsonl; another tool's WebDataset tars: SRC/train-*.tar, SRC/val-*.tar or SRC/train/, SRC/val/; a Hugging Face dataset
saved to disk, or its Parquet files) becomes tar shards in the WebDataset layout, which other tools read as they are
(webdataset, wids, tar):

  DST/train-000000.tar ...     members <key>.<ext> (the image's bytes) and <key>.cls (class index)
  DST/train-000000.tar.idx     per sample: data offset, size, class (int64 x 3): random access, no scan
  DST/train.json               wids' shard index ({"__kind__": "wids-shard-index-v1", "shardlist": ...})
  DST/index.json               classes, per shard its samples, bytes and SHA-256, the settings (max_side,
                               quality) and the source (its folder and kind): written last

One file per shard instead of one per image: a NAS answers a few hundred opens instead of millions of
metadata round trips, and the dataset's length comes from index.json without listing a folder.

SRC is listed as training lists it (train/data/sources.py: each source's classes, and its images as (file or tar
member, label) in the source's own order: an ImageFolder's as torchvision's ImageFolder lists it, its links held to
the folder; a label file's rows in order; tars by sorted name, their samples in tar order; a Hugging Face dataset's
rows in order, its training split and its validation split packed as train and val). DST is neither SRC nor
inside it (both resolved), and holds nothing but a pack's own files: a new or empty folder, or a stopped pack's,
which is continued.

--workers N processes read the images (and resize them) while this process writes the shards in the
folder's order, so the shards are the same bytes whatever N. --max-side N re-encodes (JPEG, --quality) every
image whose longer side is over N, resized to N by torchvision's Resize (bilinear, antialiased); the others
keep their own bytes. A progress line shows the images done, their rate and the time left.

Every file is written under a temporary name and renamed when complete; DST/.pack-journal.jsonl records
the settings and each finished shard. A pack stopped at any moment (kill -9, a lost node) continues from
its finished shards when the same command runs again; index.json comes last, so a folder without it is an
unfinished pack. `python -m train.pack --verify DST` re-reads every shard: counts and checksums.

The `shards` dataset (train/data/folders.py, ShardSplit: --dataset shards --data-dir DST) reads a sample by its
offset, so the sampler, the per-sample seeds, exact mid-epoch resume and the validation split work as with
the loose files.
"""

from __future__ import annotations

import argparse
import array
import hashlib
import io
import json
import multiprocessing
import os
import re
import signal
import sys
import tarfile
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import TextIO

import torch
from PIL import Image

from train import vision
from train.data import read_idx, read_index
from train.data.decode import as_tensor, decode
from train.data.folders import PACK_JOURNAL
from train.data.scan import within
from train.data.sources import list_source, listed_as, name_of, read_reference, suffix_of
from train.data.tarindex import DEFAULT_LABEL_KEY
from train.identity import usable_cores
from train.errors import EXIT_FAILED, ConfigError, DataError, fail
from train.progress import Progress
from train.runfiles import atomic_write, file_digest, fsync_dir, move_into_place, to_json

SHARD_BYTES = 256 * 2**20  # about 256 MiB per shard: a few seconds of reading, few enough files for a NAS
SPLITS = ("train", "val")
QUALITY = 90  # the JPEG quality of a resized image unless --quality says otherwise
CHUNK = 8  # images per task handed to a worker: few round trips for small files, little memory for big ones
JOURNAL = PACK_JOURNAL
# What a pack writes in DST (and, with a leading dot and a .tmp ending, its temporary files)
OURS = re.compile(rf"({'|'.join(SPLITS)})(-\d{{6}}\.tar(\.idx)?|\.json)|index\.json|{re.escape(JOURNAL)}")
TEMPORARY = re.compile(r"\.(?P<name>.+)\.tmp(\.\d+)?")
FILESYSTEMS_OWN = {"lost+found"}  # in a fresh filesystem's top folder: a DST may be one


def written_by_a_pack(name: str) -> bool:
    """Whether a file of DST is one a pack writes: its shards, indexes and journal, or their temporary files."""
    match = TEMPORARY.fullmatch(name)
    return bool(OURS.fullmatch(name) or match and OURS.fullmatch(match["name"]))


def check_destination(src: Path, dst: Path) -> None:
    """DST is not SRC nor inside it (both resolved, links too), and holds only what a pack writes: a new or empty
    folder, or a stopped pack's (continued). Said before anything is listed or written."""
    real_src, real_dst = os.path.realpath(src), os.path.realpath(dst)
    if within(real_dst, real_src):
        where = "is SRC" if real_dst == real_src else "is inside SRC"
        resolved = "" if (str(src), str(dst)) == (real_src, real_dst) else f" ({real_dst} in {real_src})"
        raise ConfigError(f"DST {dst} {where} {src}{resolved}: the shards would be written into the folder they are "
                          f"made from: pick a DST outside SRC")
    if dst.exists() and not dst.is_dir():
        raise ConfigError(f"DST {dst} is a file: pick a folder (new, or empty) for the shards")
    if dst.is_symlink() and not dst.exists():
        raise ConfigError(f"DST {dst} is a broken link (it names {os.readlink(dst)}): create that folder, or pick "
                          f"another DST")
    foreign = sorted(p.name for p in dst.iterdir() if not written_by_a_pack(p.name) and p.name not in
                     FILESYSTEMS_OWN) if dst.is_dir() else []
    if foreign:
        raise ConfigError(f"DST {dst} holds {len(foreign)} file(s) a pack did not write ({', '.join(foreign[:3])}"
                          f"{', ...' if len(foreign) > 3 else ''}): pick a new or empty DST, or move them out")


def _member(tar: tarfile.TarFile, name: str, data: bytes) -> int:
    """Add one member; return the offset of its data in the tar file."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))
    return tar.offset - tarfile.BLOCKSIZE * ((len(data) + tarfile.BLOCKSIZE - 1) // tarfile.BLOCKSIZE)


# ---------------------------------------------------------------- one image, in a worker

def shrink(image: torch.Tensor, max_side: int) -> torch.Tensor:
    """A uint8 image (C x H x W) with its longer side brought down to max_side: torchvision's
    Resize(size=None, max_size=max_side), bilinear and antialiased."""
    return vision.v2.functional.resize(image, size=None, max_size=max_side, antialias=True)


def _longer_side(data: bytes, path: str) -> int:
    """From the image's header (PIL reads no pixels for it); decoded where PIL cannot read the header."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return max(image.size)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return max(decode(as_tensor(data), path).shape[1:])


def prepared(reference, max_side: int | None, quality: int | None) -> tuple[bytes, str, bool]:
    """The image as its shard holds it: (bytes, member suffix, whether it was resized). Without max_side, or
    with its longer side at most max_side, the file's (or tar member's) own bytes; else decoded as training decodes
    it, shrunk and encoded as a JPEG. reference: a file's path, or a tar member (train/data/sources.py)."""
    reference = str(reference) if isinstance(reference, Path) else reference
    data, name = read_reference(reference, "run the same command to continue the pack"), name_of(reference)
    if not data:  # a shard would hold an empty sample, which no decoder reads
        raise DataError(f"cannot read image {name} (an empty file, 0 bytes): replace the file, then run the same "
                        f"command to continue the pack")
    if max_side is None or _longer_side(data, name) <= max_side:
        return data, suffix_of(reference, data), False
    image = shrink(decode(as_tensor(data), name), max_side)
    return bytes(vision.io.encode_jpeg(image, quality=quality).numpy()), ".jpg", True


def prepare_chunk(references: list, max_side: int | None, quality: int | None) -> list[tuple[bytes, str, bool]]:
    return [prepared(reference, max_side, quality) for reference in references]


def _worker_start() -> None:
    torch.set_num_threads(1)  # one core per worker: WORKERS=N uses N cores
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the pack in its main process alone


class Workers:
    """`count` processes that prepare the images (read, and resize with max_side), handed back in order;
    with count 1, this process at one thread. A few chunks per worker are in flight, not the whole split."""

    def __init__(self, count: int, max_side: int | None, quality: int | None):
        self.count, self.max_side, self.quality = count, max_side, quality
        self.pool: ProcessPoolExecutor | None = None
        self.threads = torch.get_num_threads()

    def __enter__(self) -> Workers:
        if self.count > 1:
            if self.max_side:
                vision.preload("io", "v2")
            # Forked (a fast start): every worker is started by the first submit, before any thread runs here.
            self.pool = ProcessPoolExecutor(self.count, mp_context=multiprocessing.get_context("fork"),
                                            initializer=_worker_start)
            self.pool.submit(int).result()
        else:
            torch.set_num_threads(1)
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
        torch.set_num_threads(self.threads)

    def prepared(self, references: list) -> Iterator[tuple[bytes, str, bool]]:
        step = max(1, min(CHUNK, len(references) // (4 * self.count)))  # a few chunks per worker, even for a few
        chunks = (references[i:i + step] for i in range(0, len(references), step))
        if self.pool is None:
            for chunk in chunks:
                yield from prepare_chunk(chunk, self.max_side, self.quality)
            return
        pending: deque = deque()
        try:
            for chunk in chunks:
                pending.append(self.pool.submit(prepare_chunk, chunk, self.max_side, self.quality))
                if len(pending) >= 2 * self.count:
                    yield from pending.popleft().result()
            while pending:
                yield from pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


# ---------------------------------------------------------------- the journal: continuing a stopped pack

def _settings_differ(was: dict, now: dict) -> list[str]:
    """What differs between a stopped pack's settings and this command's, as the knobs name it."""
    differ = []
    for key, knob in (("max_side", "MAX_SIDE"), ("quality", "QUALITY")):
        if was.get(key) != now[key]:
            before = f"{knob}={was[key]}" if was.get(key) is not None else f"no {knob}"
            differ.append(f"{before} (now {now[key] if now[key] is not None else 'none'})")
    if was.get("shard_bytes") != now["shard_bytes"]:
        differ.append(f"--shard-mb {was.get('shard_bytes', 0) / 2**20:g} (now {now['shard_bytes'] / 2**20:g})")
    if was.get("listing") != now["listing"]:
        differ.append("another listing of SRC (images added, removed or renamed since)")
    return differ


def read_journal(dst: Path) -> tuple[dict, list[dict]]:
    """(settings, finished shards in order) from DST's journal; a line cut short by a kill is not a shard."""
    settings, *lines = (dst / JOURNAL).read_text().split("\n")
    shards = []
    for line in lines:
        try:
            shards.append(json.loads(line))
        except ValueError:
            break
    return json.loads(settings), shards


def _intact(dst: Path, shard: dict) -> bool:
    """A finished shard still as the journal recorded it (by size: the SHA-256 is for --verify)."""
    tar, idx = dst / shard["name"], dst / f"{shard['name']}.idx"
    return tar.is_file() and tar.stat().st_size == shard["bytes"] and idx.is_file() and \
        idx.stat().st_size == 24 * shard["samples"]


def continued(dst: Path, settings: dict) -> list[dict]:
    """The shards a stopped pack in DST finished, to keep; nothing for a new DST. A stopped pack of other
    settings, or shards that no journal explains, stop the pack with one line before anything is written."""
    if not (dst / JOURNAL).is_file():
        if dst.is_dir() and any(OURS.fullmatch(p.name) for p in dst.iterdir()):
            raise ConfigError(f"{dst} holds shards but no record of the pack that wrote them (.pack-journal.jsonl): "
                              f"pick a new DST, or delete the shards first")
        return []
    try:
        was, shards = read_journal(dst)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{dst / JOURNAL} cannot be read ({e}): pick a new DST, or delete DST's shards and "
                          f"the journal first") from None
    if differ := _settings_differ(was, settings):
        raise ConfigError(f"{dst} holds an unfinished pack made with {'; '.join(differ)}: run the command that "
                          f"started it to finish it, or pick a new DST")
    kept = []
    for shard in shards:  # up to the first that is gone or cut short: the pack redoes it and what follows
        if not _intact(dst, shard):
            break
        kept.append(shard)
    return kept


class Journal:
    """DST/.pack-journal.jsonl: the settings on its first line, then one line per finished shard, appended
    and fsynced once the shard and its .idx are in place. Removed after index.json is written."""

    def __init__(self, dst: Path, settings: dict, kept: list[dict]):
        self.path = dst / JOURNAL
        atomic_write(self.path, "".join(to_json(r) + "\n" for r in [settings, *kept]).encode())

    def add(self, shard: dict) -> None:
        with open(self.path, "a") as f:
            f.write(to_json(shard) + "\n")
            f.flush()
            os.fsync(f.fileno())


# ---------------------------------------------------------------- the pack

def write_shard(dst: Path, name: str, items: Iterator[tuple[bytes, str, bool, int, int]]) -> dict:
    """One shard from items (bytes, suffix, resized, sample index, label): under a temporary name, fsynced,
    renamed; then its .idx. Returns its record."""
    tmp = dst / f".{name}.tmp"
    rows, resized = [], 0
    with open(tmp, "wb") as f:
        with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for data, suffix, was_resized, index, label in items:
                key = f"{index:09d}"
                offset = _member(tar, f"{key}{suffix}", data)
                _member(tar, f"{key}.cls", str(label).encode())
                rows.append((offset, len(data), label))
                resized += was_resized
        f.flush()
        os.fsync(f.fileno())
    move_into_place(tmp, dst / name)
    atomic_write(dst / f"{name}.idx", array.array("q", [v for r in rows for v in r]).tobytes())
    return {"name": name, "samples": len(rows), "bytes": (dst / name).stat().st_size,
            "sha256": file_digest(dst / name), "resized": resized}


def pack_split(dst: Path, split: str, samples: list[tuple[object, int]], kept: list[dict], shard_bytes: int,
               workers: Workers, journal: Journal, progress: Progress) -> list[dict]:
    """The split's shards after those kept from a stopped pack, cut at about shard_bytes each."""
    shards = [s for s in kept if s["name"].startswith(f"{split}-")]
    start = sum(s["samples"] for s in shards)
    images = workers.prepared([path for path, _ in samples[start:]])

    def items():  # one shard's: at least one image, then until shard_bytes
        nonlocal start
        count = size = 0
        while start < len(samples) and (count == 0 or size < shard_bytes):
            data, suffix, resized = next(images)
            yield data, suffix, resized, start, samples[start][1]
            count, size, start = count + 1, size + len(data), start + 1
            progress.advance()

    while start < len(samples):
        shard = write_shard(dst, f"{split}-{len(shards):06d}.tar", items())
        journal.add(shard)
        shards.append(shard)
    wids = {"__kind__": "wids-shard-index-v1", "wids_version": 1, "name": split,
            "shardlist": [{"url": s["name"], "nsamples": s["samples"]} for s in shards]}
    atomic_write(dst / f"{split}.json", to_json(wids, indent=1).encode())
    return shards


def _listing_digest(src: Path, splits: dict) -> str:
    digest = hashlib.sha256()
    for split, (_, samples) in splits.items():
        for reference, label in samples:
            digest.update(f"{split}\t{label}\t{listed_as(src, reference)}\n".encode())
    return digest.hexdigest()


def _remove_temporary(dst: Path) -> None:
    """What a stopped pack was writing when it stopped: never a finished file."""
    for path in dst.iterdir():
        if (match := TEMPORARY.fullmatch(path.name)) and OURS.fullmatch(match["name"]):
            path.unlink()


def pack(src: Path, dst: Path, shard_bytes: int = SHARD_BYTES, workers: int = 1, max_side: int | None = None,
         quality: int | None = None, progress_to: TextIO | None = None, progress_every: float | None = None,
         path_column: str = "", label_column: str = "", label_key: str = DEFAULT_LABEL_KEY, image_column: str = "",
         train_split: str = "", val_split: str = "") -> dict:
    """Pack src into dst (or continue a stopped pack there); returns the index. progress_to: a stream for the
    progress line (None: none). path_column, label_column: label files' columns; label_key: tars' labels;
    image_column, label_column, train_split, val_split: a Hugging Face dataset's."""
    if (dst / "index.json").exists():
        raise ConfigError(f"{dst} already holds a pack: pick a new DST or delete it first")
    check_destination(src, dst)
    with Progress(f"listing {src}", unit="files", stream=progress_to, every=progress_every, last=False,
                  quiet=progress_to is None) as listing:
        kind, splits = list_source(src, listing.advance, path_column, label_column, label_key, progress_to,
                                   image_column, train_split, val_split)
    for split, (_, samples) in splits.items():
        if not samples:
            raise ConfigError(f"{src / split} has no images: put images in {src / split}/<class>/")
    quality = (quality or QUALITY) if max_side else None
    settings = {"listing": _listing_digest(src, splits), "shard_bytes": shard_bytes, "max_side": max_side,
                "quality": quality}
    kept = continued(dst, settings)
    dst.mkdir(parents=True, exist_ok=True)
    _remove_temporary(dst)
    journal = Journal(dst, settings, kept)
    total, done = sum(len(s) for _, s in splits.values()), sum(s["samples"] for s in kept)
    if kept and progress_to:
        print(f"continuing the pack in {dst}: {done:,} of {total:,} images already in {len(kept)} shard(s)",
              file=progress_to)
    index = {"format": "webdataset", "source": str(src), "source_kind": kind, "max_side": max_side, "quality": quality,
             "splits": {}}
    with Workers(workers, max_side, quality) as prepare, \
            Progress("pack", total, "images", done, progress_to, progress_every, quiet=progress_to is None) as progress:
        for split, (classes, samples) in splits.items():
            shards = pack_split(dst, split, samples, kept, shard_bytes, prepare, journal, progress)
            index["splits"][split] = {"classes": classes, "samples": len(samples), "shards": shards,
                                      "resized": sum(s["resized"] for s in shards)}
    atomic_write(dst / "index.json", to_json(index, indent=1).encode())
    journal.path.unlink()
    fsync_dir(dst)
    return index


def verify(root: Path) -> list[str]:
    """Every shard against index.json (SHA-256, size) and its .idx (members where the index says)."""
    problems = []
    for split, info in read_index(root)["splits"].items():
        for shard in info["shards"]:
            path = root / shard["name"]
            if not path.is_file():
                problems.append(f"{path} is missing")
            elif path.stat().st_size != shard["bytes"] or file_digest(path) != shard["sha256"]:
                problems.append(f"{path} is damaged (size or SHA-256 differs from index.json)")
            elif len(read_idx(path)) != shard["samples"]:
                problems.append(f"{path}.idx holds {len(read_idx(path))} samples, index.json {shard['samples']}")
        if sum(s["samples"] for s in info["shards"]) != info["samples"]:
            problems.append(f"{split}: the shards' counts do not add up to {info['samples']}")
    return problems


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ConfigError(f"{message}: see python -m train.pack --help")


def check_knobs(ns: argparse.Namespace) -> None:
    if not ns.src:
        raise ConfigError("give the dataset to pack: python -m train.pack SRC DST")
    if ns.shard_mb <= 0:
        raise ConfigError(f"--shard-mb must be > 0, got {ns.shard_mb:g}")
    if ns.workers is not None and ns.workers < 1:
        raise ConfigError(f"WORKERS={ns.workers}: give 1 or more processes, or leave it unset for every usable "
                          f"core ({usable_cores()})")
    if ns.max_side is not None and ns.max_side < 1:
        raise ConfigError(f"MAX_SIDE={ns.max_side}: give the longest side to keep in pixels (e.g. 512), or leave "
                          f"it unset to keep the images as they are")
    if ns.quality is not None and not 1 <= ns.quality <= 100:
        raise ConfigError(f"QUALITY={ns.quality}: give a JPEG quality from 1 to 100 (default {QUALITY})")
    if ns.quality is not None and ns.max_side is None:
        raise ConfigError(f"QUALITY={ns.quality} applies to the images MAX_SIDE resizes: set MAX_SIDE too, or "
                          f"drop QUALITY")


def summary(index: dict, dst: Path, workers: int) -> str:
    lines = [f"{split}: {info['samples']} images of {len(info['classes'])} classes in {len(info['shards'])} shard(s)"
             for split, info in index["splits"].items()]
    if index["max_side"]:
        resized = sum(info["resized"] for info in index["splits"].values())
        lines.append(f"{resized} image(s) resized to a longer side of {index['max_side']} px (JPEG quality "
                     f"{index['quality']}), the others kept as they were")
    lines.append(f"packed into {dst} by {workers} worker(s): train with --dataset shards --data-dir {dst}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = _OneLineParser(prog="python -m train.pack", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", nargs="?", help="the source: an ImageFolder (SRC/train/<class>/*, SRC/val/<class>/*), "
                                               "label files (SRC/train.csv, SRC/val.csv; .tsv, .jsonl), another "
                                               "tool's WebDataset tars (SRC/train-*.tar, SRC/val-*.tar) or a Hugging "
                                               "Face dataset (save_to_disk's folder, or Parquet files)")
    parser.add_argument("dst", help="the folder for the shards (new, or a stopped pack's to continue it)")
    parser.add_argument("--workers", type=int, help="processes that read and resize the images (default: every "
                                                    "usable core)")
    parser.add_argument("--max-side", type=int, help="re-encode every image whose longer side is over this many "
                                                     "pixels, resized down to it (default: keep every image)")
    parser.add_argument("--quality", type=int, help=f"the JPEG quality of the resized images (default {QUALITY})")
    parser.add_argument("--shard-mb", type=float, default=SHARD_BYTES // 2**20,
                        help="about this many MiB per shard")
    parser.add_argument("--path-column", default="", help="label files: the column of image paths (default: the "
                                                          "first of path, image, file, filename, filepath)")
    parser.add_argument("--label-column", default="", help="label files: the column of labels (default: the first of "
                                                           "label, class, category, target); a Hugging Face "
                                                           "dataset's (default: label, else labels)")
    parser.add_argument("--image-column", default="", help="a Hugging Face dataset: the column of images (default: "
                                                           "image, else img)")
    parser.add_argument("--train-split", default="", help="a Hugging Face dataset: the split packed as train "
                                                          "(default: train)")
    parser.add_argument("--val-split", default="", help="a Hugging Face dataset: the split packed as val (default: "
                                                        "the first of validation, val, test)")
    parser.add_argument("--label-key", default=DEFAULT_LABEL_KEY,
                        help="tars: the label's member suffix, else its key in the sample's .json")
    parser.add_argument("--verify", action="store_true", help="check DST's shards (counts, SHA-256) and exit")
    try:
        ns = parser.parse_args(argv)
    except ConfigError as e:
        return fail(str(e))
    try:
        if ns.verify:
            problems = verify(Path(ns.dst))
            for problem in problems:
                print(f"error: {problem}", file=sys.stderr)
            if not problems:
                print(f"{ns.dst}: every shard complete and verified")
            return 1 if problems else 0
        check_knobs(ns)
        workers = ns.workers or usable_cores()
        index = pack(Path(ns.src), Path(ns.dst), int(ns.shard_mb * 2**20), workers, ns.max_side, ns.quality,
                     progress_to=sys.stderr, path_column=ns.path_column, label_column=ns.label_column,
                     label_key=ns.label_key, image_column=ns.image_column, train_split=ns.train_split,
                     val_split=ns.val_split)
    except ConfigError as e:
        return fail(str(e))
    except BrokenProcessPool:  # a worker killed: by the OOM killer on a huge image, or by hand
        print(f"error: a pack worker died (killed, or out of memory): run the same command to continue the pack "
              f"in {ns.dst}, with fewer WORKERS if memory is short", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"pack stopped: run the same command to continue it in {ns.dst}", file=sys.stderr)
        return 130
    print(summary(index, Path(ns.dst), workers))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
