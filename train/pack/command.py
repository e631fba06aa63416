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
member, label) in the source's own order: an ImageFolder's as torchvision's ImageFolder lists it, its links followed
and checked; a label file's rows in order; tars by sorted name, their samples in tar order; a Hugging Face dataset's
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
import os
import sys
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import TextIO


from train.base.errors import EXIT_FAILED, ConfigError, OneLineParser, fail
from train.base.progress import Progress
from train.cluster.identity import usable_cores
from train.data import read_idx, read_index
from train.data.scan import within
from train.data.sources import list_source
from train.data.tarindex import DEFAULT_LABEL_KEY
from train.files.rundir import atomic_write, file_digest, fsync_dir, to_json
from train.pack.images import QUALITY, Workers
from train.pack.shards import OURS, TEMPORARY, Journal, listing_digest, pack_split, remove_temporary, shards_to_keep

SHARD_BYTES = 256 * 2**20  # about 256 MiB per shard: a few seconds of reading, few enough files for a NAS
FILESYSTEMS_OWN = {"lost+found"}  # in a fresh filesystem's top folder: a DST may be one


def written_by_a_pack(name: str) -> bool:
    """Whether a file of DST is one a pack writes: its shards, indexes and journal, or their temporary files."""
    match = TEMPORARY.fullmatch(name)
    return bool(OURS.fullmatch(name) or match and OURS.fullmatch(match["name"]))


def check_destination(src: Path, dst: Path) -> None:
    """DST is not SRC nor inside it (both resolved, links too), and holds only what a pack writes: a new or empty
    folder, or a stopped pack's (shards_to_keep). Said before anything is listed or written."""
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
    settings = {"listing": listing_digest(src, splits), "shard_bytes": shard_bytes, "max_side": max_side,
                "quality": quality}
    kept = shards_to_keep(dst, settings)
    dst.mkdir(parents=True, exist_ok=True)
    remove_temporary(dst)
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
    parser = OneLineParser(prog="python -m train.pack", description=__doc__.split("\n\n")[0])
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
        return fail(e)
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
        return fail(e)
    except BrokenProcessPool:  # a worker killed: by the OOM killer on a huge image, or by hand
        print(f"error: a pack worker died (killed, or out of memory): run the same command to continue the pack "
              f"in {ns.dst}, with fewer WORKERS if memory is short", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"pack stopped: run the same command to continue it in {ns.dst}", file=sys.stderr)
        return 130
    print(summary(index, Path(ns.dst), workers))
    return 0

