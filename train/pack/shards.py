"""make pack's shards and its journal (train/pack/command.py): each shard a USTAR tar of <key>.<ext> and <key>.cls
members with its .idx of offsets, written under a temporary name and renamed once complete; the journal records the
settings and each finished shard, so a stopped pack (kill -9, a lost node) continues from its finished shards."""

from __future__ import annotations

import array
import hashlib
import io
import json
import os
import re
import tarfile
from collections.abc import Iterator
from pathlib import Path

from train.base.errors import ConfigError
from train.base.progress import Progress
from train.data.folders import PACK_JOURNAL
from train.data.sources import listed_as
from train.files.rundir import atomic_write, file_digest, move_into_place, to_json
from train.pack.images import Workers

SPLITS = ("train", "val")
JOURNAL = PACK_JOURNAL
# What a pack writes in DST (and, with a leading dot and a .tmp ending, its temporary files)
OURS = re.compile(rf"({'|'.join(SPLITS)})(-\d{{6}}\.tar(\.idx)?|\.json)|index\.json|{re.escape(JOURNAL)}")
TEMPORARY = re.compile(r"\.(?P<name>.+)\.tmp(\.\d+)?")


def _member(tar: tarfile.TarFile, name: str, data: bytes) -> int:
    """Add one member; return the offset of its data in the tar file."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))
    return tar.offset - tarfile.BLOCKSIZE * ((len(data) + tarfile.BLOCKSIZE - 1) // tarfile.BLOCKSIZE)


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


def shards_to_keep(dst: Path, settings: dict) -> list[dict]:
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


def listing_digest(src: Path, splits: dict) -> str:
    digest = hashlib.sha256()
    for split, (_, samples) in splits.items():
        for reference, label in samples:
            digest.update(f"{split}\t{label}\t{listed_as(src, reference)}\n".encode())
    return digest.hexdigest()


def remove_temporary(dst: Path) -> None:
    """What a stopped pack was writing when it stopped: never a finished file."""
    for path in dst.iterdir():
        if (match := TEMPORARY.fullmatch(path.name)) and OURS.fullmatch(match["name"]):
            path.unlink()
