"""Real photographs at ImageNet sizes, made here (no download), and the decode + augmentation rows.

The photos are cut from the sample photographs scikit-image ships (an astronaut, a cat, coffee, a rocket,
the Hubble deep field, a retina, tissue, a motorcycle): a random 4:3 or 3:4 box of a photo, from 500 x 375
(or 375 x 500, ImageNet's typical photo) up to the largest that fits, resampled to that size (so pixels are
the camera's own or downscaled, as ImageNet's; only the photos smaller than that are enlarged) and saved as
JPEG at quality 75-95. Decode cost depends on content, so never noise or flat colours.

The rows time one loader worker's work (one core, one thread, as a DataLoader worker runs): trainbox's
pipeline (torchvision.io decode into a uint8 tensor, the recipe's transforms v2 on it; normalisation
happens later on the training device) against pytorch/examples' imagenet pipeline (PIL decode, the same
recipe on PIL images, ToTensor, Normalize) on the same files.
"""

from __future__ import annotations

import importlib.util
import random
import time
from pathlib import Path

import torch
from PIL import Image
from torchvision import transforms

from train.base.errors import ConfigError
from train.bench.arms import median, row
from train.cli import parse_config
from train.data import image_transforms, eval_resize, load_image

SOURCES = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "hubble_deep_field.jpg", "retina.jpg",
           "ihc.png", "motorcycle_left.png", "motorcycle_right.png")


def sample_photos() -> list[Path]:
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the image rows need scikit-image's sample photos: run `make setup` (or pip install "
                          "scikit-image)")
    folder = Path(next(iter(spec.submodule_search_locations))) / "data"
    return [folder / name for name in SOURCES]


def make_photos(root: Path, count: int, classes: int = 10, seed: int = 0) -> list[Path]:
    """count JPEGs under root/<class>/ (an ImageFolder split), a pure function of (count, classes, seed)."""
    def cut(source: Image.Image, rng: random.Random) -> tuple[Image.Image, int]:
        width, height = (500, 375) if rng.random() < 0.75 else (375, 500)
        largest = min(source.width, source.height * width / height)  # the widest box of that shape
        box_w = rng.uniform(width, largest) if largest > width else largest  # native or downscaled pixels
        photo = resized_box(source, rng, width, height, box_w)
        if rng.random() < 0.5:
            photo = photo.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return photo, rng.randint(75, 95)
    return write_photos(root, count, classes, seed, f"{count}-{classes}-{seed}", cut)


def write_photos(root: Path, count: int, classes: int, seed: int, tag: str, cut) -> list[Path]:
    """count JPEGs under root/<class>/, each cut(one of the sample photographs, the generator): (the photo, its
    JPEG quality); made once (the marker .complete-TAG says so)."""
    done = root / f".complete-{tag}"
    paths = [root / f"class{i % classes}" / f"{i:06d}.jpg" for i in range(count)]
    if done.exists():
        return paths
    rng = random.Random(seed)
    sources = [Image.open(path).convert("RGB") for path in sample_photos()]
    for i, path in enumerate(paths):
        photo, quality = cut(sources[i % len(sources)], rng)
        path.parent.mkdir(parents=True, exist_ok=True)
        photo.save(path, quality=quality)
    done.touch()
    return paths


def resized_box(source: Image.Image, rng: random.Random, width: int, height: int, box_w: float) -> Image.Image:
    """A box box_w wide of the source, of the shape width x height, at a random place, resampled to that size."""
    box_h = box_w * height / width
    x0, y0 = rng.uniform(0, source.width - box_w), rng.uniform(0, source.height - box_h)
    return source.resize((width, height), Image.Resampling.BICUBIC, box=(x0, y0, x0 + box_w, y0 + box_h))


def examples_pipeline(train: bool, size: int = 224):
    """pytorch/examples imagenet/main.py: PIL's loader and its train or val transforms."""
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    steps = [transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip()] if train else \
        [transforms.Resize(eval_resize(size)), transforms.CenterCrop(size)]
    pipeline = transforms.Compose([*steps, transforms.ToTensor(), normalize])

    def load(path: Path) -> torch.Tensor:
        with open(path, "rb") as f:
            return pipeline(Image.open(f).convert("RGB"))
    return load


def trainbox_pipeline(train: bool, size: int = 224):
    cfg = parse_config(["--dataset", "imagefolder", "--image-size", str(size)])
    transform = image_transforms(cfg.data, cfg.augmentation, train)
    return lambda path: transform(load_image(str(path)))


def images_per_s(load, paths: list[Path]) -> float:
    torch.manual_seed(0)
    start = time.perf_counter()
    for path in paths:
        load(path)
    return len(paths) / (time.perf_counter() - start)


def photo_rows(out: Path, size: dict, rounds: int) -> list[dict]:
    paths = make_photos(out / "photos" / "train", size["photos"])
    for path in paths:  # into the page cache: the rows time decoding, not the disk
        path.read_bytes()
    kb = sum(p.stat().st_size for p in paths) / len(paths) / 1024
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a DataLoader worker's setting
    rows = []
    try:
        for train, name in ((True, "train"), (False, "eval")):
            ours, theirs = trainbox_pipeline(train), examples_pipeline(train)
            speeds = {"trainbox": [], "examples": []}
            for _ in range(rounds):
                speeds["trainbox"].append(images_per_s(ours, paths))
                speeds["examples"].append(images_per_s(theirs, paths))
            ratios = [a / b for a, b in zip(speeds["trainbox"], speeds["examples"], strict=True)]
            recipe = "RandomResizedCrop 224 + flip" if train else f"resize {eval_resize(224)} + centre crop 224"
            rows.append(row(
                f"{name} pipeline, one loader worker: trainbox / pytorch/examples images/s (ImageNet-sized JPEGs)",
                ratios, f"{recipe}; trainbox {median(speeds['trainbox']):.0f}/s (torchvision.io + v2 on uint8), "
                f"examples {median(speeds['examples']):.0f}/s (PIL + ToTensor + Normalize); {len(paths)} photos, "
                f"{kb:.0f} KB each on average", ">= 1.8" if train else "", median(ratios) >= 1.8 if train else None))
    finally:
        torch.set_num_threads(threads)
    return rows
