"""Photos at a camera's size (3000-4000 px), made here (no download), and what `make pack MAX_SIDE=512` gains.

The photos are a random 4:3 or 3:4 box of the sample photographs photos.py uses, enlarged so that the
longer side is 3000 to 4000 px, as a phone or a camera takes them, and saved as JPEG at quality 90-95.
Enlarged, they hold less detail than a camera's own (about 1 MB where a camera writes 3-5 MB), but their
decoding takes as long: it grows with the pixels.

The rows: the train pipeline (decode, RandomResizedCrop 224 + flip) on one core, as a loader worker runs it,
on the loose originals and on their shards packed with MAX_SIDE=512; and the pack's own images per second
with one worker and with every usable core.
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

import torch
from PIL import Image

from train.bench.arms import median, row
from train.bench.photos import images_per_s, resized_box, write_photos
from train.cli import parse_config
from train.cluster.identity import usable_cores
from train.data import ShardSplit, image_transforms, load_image
from train.data.decode import decode
from train.pack.command import pack

MAX_SIDE = 512


def make_camera_photos(root: Path, count: int, classes: int = 2, seed: int = 0,
                       longer: tuple[int, int] = (3000, 4000)) -> list[Path]:
    """count JPEGs under root/<class>/ (an ImageFolder split) with their longer side in `longer`, a pure
    function of the arguments."""
    def cut(source: Image.Image, rng: random.Random) -> tuple[Image.Image, int]:
        side = rng.randint(*longer)
        width, height = (side, side * 3 // 4) if rng.random() < 0.75 else (side * 3 // 4, side)
        largest = min(source.width, source.height * width / height)  # the widest box of that shape
        return resized_box(source, rng, width, height, rng.uniform(largest / 2, largest)), rng.randint(90, 95)
    return write_photos(root, count, classes, seed, f"{count}-{classes}-{seed}-{longer[0]}-{longer[1]}", cut)


def camera_rows(out: Path, size: dict, rounds: int) -> list[dict]:
    src = out / "camera"
    paths = make_camera_photos(src / "train", size["camera_photos"])
    make_camera_photos(src / "val", 2, seed=1)
    megabytes = sum(p.stat().st_size for p in paths) / len(paths) / 2**20
    cores = usable_cores()
    packed = {1: [], cores: []}
    for _ in range(rounds):  # the pack's throughput: every image read, resized, encoded and written
        for workers in packed:
            dst = out / f"camera-{MAX_SIDE}-{workers}"
            shutil.rmtree(dst, ignore_errors=True)
            start = time.perf_counter()
            pack(src, dst, workers=workers, max_side=MAX_SIDE)
            packed[workers].append((len(paths) + 2) / (time.perf_counter() - start))
    shards = ShardSplit(out / f"camera-{MAX_SIDE}-1", "train")
    cfg = parse_config(["--dataset", "imagefolder", "--image-size", "224"])
    transform = image_transforms(cfg.data, cfg.augmentation, True)

    def loose(path):
        return transform(load_image(str(path)))

    def small(i):
        return transform(decode(shards[i][0], shards.name(i)))

    for path in paths:  # into the page cache: the rows time decoding, not the disk
        path.read_bytes()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a DataLoader worker's setting
    speeds = {"loose": [], "packed": []}
    try:
        for _ in range(rounds):
            speeds["loose"].append(images_per_s(loose, paths))
            speeds["packed"].append(images_per_s(small, range(len(shards))))
    finally:
        torch.set_num_threads(threads)
    gain = [p / lo for p, lo in zip(speeds["packed"], speeds["loose"], strict=True)]
    scaling = [n / one for one, n in zip(packed[1], packed[cores], strict=True)]
    kilobytes = sum(int(rows[:, 1].sum()) for rows in shards.rows) / len(shards) / 1024
    return [
        row(f"camera-sized photos, train pipeline on one core: shards packed with MAX_SIDE={MAX_SIDE} / loose "
            f"originals (images/s)", gain,
            f"RandomResizedCrop 224 + flip; loose {median(speeds['loose']):.1f}/s ({len(paths)} JPEGs of 3000-4000 "
            f"px, {megabytes:.1f} MB each), packed {median(speeds['packed']):.1f}/s (512 px, {kilobytes:.0f} KB "
            f"each in the shards)"),
        row(f"make pack MAX_SIDE={MAX_SIDE} of camera-sized photos: images/s with {cores} workers / with 1",
            scaling, f"1 worker {median(packed[1]):.1f}/s, {cores} workers {median(packed[cores]):.1f}/s "
                     f"(read, decode, resize, encode, write)"),
    ]
