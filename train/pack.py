"""Packed shards for big image datasets: `make pack SRC=... DST=...` (python -m train.pack SRC DST).

An ImageFolder (SRC/train/<class>/*, SRC/val/<class>/*) becomes tar shards in the WebDataset layout, which
other tools read as they are (webdataset, wids, tar):

  DST/train-000000.tar ...     members <key>.<ext> (the file's bytes, unchanged) and <key>.cls (class index)
  DST/train-000000.tar.idx     per sample: data offset, size, class (int64 x 3): random access, no scan
  DST/train.json               wids' shard index ({"__kind__": "wids-shard-index-v1", "shardlist": ...})
  DST/index.json               classes, and per shard its samples, bytes and SHA-256: written last

One file per shard instead of one per image: a NAS answers a few hundred opens instead of millions of
metadata round trips, and the dataset's length comes from index.json without listing a folder. Every file
is written under a temporary name and renamed when complete; index.json last, so a folder without it is
an unfinished pack. `python -m train.pack --verify DST` re-reads every shard: counts and checksums.

The `shards` dataset (train/data/folders.py, ShardSplit: --dataset shards --data-dir DST) reads a sample by its
offset, so the sampler, the per-sample seeds, exact mid-epoch resume and the validation split work as with
the loose files.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import tarfile
from pathlib import Path

import torch

from train.runfiles import atomic_write
from train.data import check_imagefolder, read_idx, read_index
from train.errors import ConfigError, fail

SHARD_BYTES = 256 * 2**20  # about 256 MiB per shard: a few seconds of reading, few enough files for a NAS
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm")


def _files(split_dir: Path) -> tuple[list[str], list[tuple[Path, int]]]:
    classes = sorted(d.name for d in split_dir.iterdir() if d.is_dir())
    samples = [(path, label) for label, name in enumerate(classes)
               for path in sorted((split_dir / name).rglob("*")) if path.suffix.lower() in IMAGE_SUFFIXES]
    return classes, samples


def _member(tar: tarfile.TarFile, name: str, data: bytes) -> int:
    """Add one member; return the offset of its data in the tar file."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))
    return tar.offset - tarfile.BLOCKSIZE * ((len(data) + tarfile.BLOCKSIZE - 1) // tarfile.BLOCKSIZE)


def pack_split(src: Path, dst: Path, split: str, shard_bytes: int = SHARD_BYTES) -> dict:
    classes, samples = _files(src / split)
    if not samples:
        raise ConfigError(f"{src / split} has no images: put images in {src / split}/<class>/")
    shards, start = [], 0
    while start < len(samples):
        name = f"{split}-{len(shards):06d}.tar"
        tmp = dst / f".{name}.tmp"
        rows, size = [], 0
        with open(tmp, "wb") as f:
            with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
                while start < len(samples) and (not rows or size < shard_bytes):
                    path, label = samples[start]
                    key = f"{start:09d}"
                    data = path.read_bytes()
                    offset = _member(tar, f"{key}{path.suffix.lower()}", data)
                    _member(tar, f"{key}.cls", str(label).encode())
                    rows.append((offset, len(data), label))
                    size, start = size + len(data), start + 1
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dst / name)
        atomic_write(dst / f"{name}.idx", torch.tensor(rows, dtype=torch.int64).numpy().tobytes())
        shards.append({"name": name, "samples": len(rows), "bytes": (dst / name).stat().st_size,
                       "sha256": _sha256(dst / name)})
    wids = {"__kind__": "wids-shard-index-v1", "wids_version": 1, "name": split,
            "shardlist": [{"url": s["name"], "nsamples": s["samples"]} for s in shards]}
    atomic_write(dst / f"{split}.json", json.dumps(wids, indent=1).encode())
    return {"classes": classes, "samples": len(samples), "shards": shards}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(2**22):
            digest.update(chunk)
    return digest.hexdigest()


def pack(src: Path, dst: Path, shard_bytes: int = SHARD_BYTES) -> dict:
    check_imagefolder(src)
    if (dst / "index.json").exists():
        raise ConfigError(f"{dst} already holds a pack: pick a new DST or delete it first")
    dst.mkdir(parents=True, exist_ok=True)
    index = {"format": "webdataset", "source": str(src),
             "splits": {split: pack_split(src, dst, split, shard_bytes) for split in ("train", "val")}}
    atomic_write(dst / "index.json", json.dumps(index, indent=1).encode())
    return index


def verify(root: Path) -> list[str]:
    """Every shard against index.json (SHA-256, size) and its .idx (members where the index says)."""
    problems = []
    for split, info in read_index(root)["splits"].items():
        for shard in info["shards"]:
            path = root / shard["name"]
            if not path.is_file():
                problems.append(f"{path} is missing")
            elif path.stat().st_size != shard["bytes"] or _sha256(path) != shard["sha256"]:
                problems.append(f"{path} is damaged (size or SHA-256 differs from index.json)")
            elif len(read_idx(path)) != shard["samples"]:
                problems.append(f"{path}.idx holds {len(read_idx(path))} samples, index.json {shard['samples']}")
        if sum(s["samples"] for s in info["shards"]) != info["samples"]:
            problems.append(f"{split}: the shards' counts do not add up to {info['samples']}")
    return problems


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.pack", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", nargs="?", help="the ImageFolder (SRC/train/<class>/*, SRC/val/<class>/*)")
    parser.add_argument("dst", help="the folder for the shards (new, or without index.json)")
    parser.add_argument("--shard-mb", type=int, default=SHARD_BYTES // 2**20, help="about this many MiB per shard")
    parser.add_argument("--verify", action="store_true", help="check DST's shards (counts, SHA-256) and exit")
    ns = parser.parse_args(argv)
    try:
        if ns.verify:
            problems = verify(Path(ns.dst))
            for problem in problems:
                print(f"error: {problem}", file=sys.stderr)
            if not problems:
                print(f"{ns.dst}: every shard complete and verified")
            return 1 if problems else 0
        if not ns.src:
            return fail("give the ImageFolder to pack: python -m train.pack SRC DST")
        if ns.shard_mb <= 0:
            return fail(f"--shard-mb must be > 0, got {ns.shard_mb}")
        index = pack(Path(ns.src), Path(ns.dst), ns.shard_mb * 2**20)
    except ConfigError as e:
        return fail(str(e))
    for split, info in index["splits"].items():
        print(f"{split}: {info['samples']} images of {len(info['classes'])} classes in {len(info['shards'])} shard(s)")
    print(f"packed into {ns.dst}: train with --dataset shards --data-dir {ns.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
