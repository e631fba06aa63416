"""--dataset masks: images and their segmentation masks on disk, the VOC and Cityscapes conventions.

  DATA_DIR/train/images/<path>.jpg (.png, ...)          DATA_DIR/train/masks/<path>.png
  DATA_DIR/train/images/<city>/<base>_leftImg8bit.png   DATA_DIR/train/masks/<city>/<base>_gtFine_labelTrainIds.png
                                                        (else <base>_gtFine_labelIds.png: Cityscapes' names)
  DATA_DIR/val/images/...                               DATA_DIR/val/masks/...
  DATA_DIR/classes.txt (optional)                       one class name per line: line i names the value i
                                                        (or classes.json, a list of names, as label files)

<path> is the image's path under images/, subfolders and all, without its suffix (maskpairs.py). Both folders are read
as ImageFolder reads a class folder (scan.FolderScan: subfolders in order, links followed wherever they lead; a broken
link, a link cycle, a file reached twice, or an image of both splits through links, refused in one line).
A mask is a single-channel PNG of its image's size (mode L, or P as VOC ships it: its palette indices are the values),
each pixel a class index or 255, ignored by the loss and the metric (torchvision's references/segmentation). Without
classes.txt the classes are the values 0 .. the largest in the training masks, named by their number.

check_mask_folder reads every mask's header and pixels and every image's header, before any worker starts, and names
every kind of defect in one line. The datasets (mask_datasets) read each pair when the loader asks for it: items
(uint8 3 x H x W image, uint8 H x W mask), transformed together (mask_transforms) under the per-sample seed that
train/loading/samplers.py's SeededSample sets, so a resume sees the same batches.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import Dataset

from train.base import vision
from train.base.errors import ConfigError, DataError, first_few
from train.config.settings import Data
from train.data.decode import load_image
from train.data.labelfiles import class_list
from train.data.maskpairs import pair_up, scan_folder, split_pairs
from train.data.scan import IMAGE_EXTENSIONS, FolderScan, how_many, images_in_both

SPLITS = ("train", "val")
IGNORE = 255  # a mask's value that the loss and the metric skip (and the crop's padding)
MASK_MODES = ("L", "P")
THREADS = 16  # a NAS answers one file at a time per request: this many ask at once

# Each kind of defect check_mask_folder names: what it is, in order of the line.
DEFECTS = {
    "split": "split folders missing or without images",
    "stem": "images sharing a path but for their suffix (a mask names one image)",
    "missing": "images without a mask",
    "orphan": "masks without an image",
    "unreadable": "images or masks that cannot be read",
    "format": "masks that are not single-channel PNGs (mode L or P)",
    "size": "masks of another size than their image",
    "value": "masks with values that are neither 255 nor {classes}",
}


def read_mask(path: Path) -> torch.Tensor:
    """A mask's values as a uint8 H x W tensor (a palette PNG's indices); DataError for a file that is no such mask."""
    try:
        with Image.open(path) as mask:
            if mask.format != "PNG" or mask.mode not in MASK_MODES:
                raise DataError(f"mask {path} is a {mask.format} image of mode {mask.mode}, not a single-channel PNG "
                                f"(mode L or P): write it as one, then run the same command to resume")
            mask.load()
            width, height = mask.size
            return torch.frombuffer(bytearray(mask.tobytes()), dtype=torch.uint8).view(height, width)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - PIL's plugins raise many kinds for a damaged file
        raise DataError(f"cannot read mask {path} ({str(e) or type(e).__name__}): replace the file, then run the same "
                        f"command to resume") from None


def _inspect(pair: tuple[Path, Path]) -> tuple[str | None, str, list[int]]:
    """(the defect kind or None, which file and what of it, the mask's values) of an image and its mask: the image's
    header alone, the mask's header and pixels."""
    image, mask = pair
    try:
        with Image.open(image) as opened:
            image_size = opened.size
    except Exception as e:  # noqa: BLE001 - as read_mask
        return "unreadable", f"{image} ({str(e) or type(e).__name__})", []
    try:
        with Image.open(mask) as opened:
            if opened.format != "PNG" or opened.mode not in MASK_MODES:
                return "format", f"{mask} ({opened.format} {opened.mode})", []
            values, mask_size = values_in(opened), opened.size
    except Exception as e:  # noqa: BLE001 - as read_mask
        return "unreadable", f"{mask} ({str(e) or type(e).__name__})", []
    if mask_size != image_size:
        (iw, ih), (mw, mh) = image_size, mask_size
        return "size", f"{mask} ({mw}x{mh}, its image {iw}x{ih})", values
    return None, "", values


def values_in(mask: Image.Image) -> list[int]:
    """The values a mode L or P mask holds (a palette's indices, not its colours), read from its histogram."""
    return [v for v, count in enumerate(mask.histogram()[:256]) if count]


def _values_of(masks: list[Path]) -> list[list[int]]:
    """The values each mask holds (its pixels read, THREADS at a time)."""
    def values(path: Path) -> list[int]:
        try:
            with Image.open(path) as mask:
                return values_in(mask) if mask.mode in MASK_MODES else []
        except Exception:  # noqa: BLE001 - check_mask_folder names it; the loader's read_mask stops on it
            return []

    with ThreadPoolExecutor(THREADS) as pool:
        return list(pool.map(values, masks, chunksize=64))


def mask_classes(root: Path, values: list[list[int]] | None = None) -> tuple[list[str], str]:
    """(the class names, where they come from): DATA_DIR/classes.txt (or classes.json) in its order, else the values
    0 .. the largest of the training masks (values: theirs, read already; else read here, or the validation masks'
    where there is no training split)."""
    listed = class_list(root)
    if listed is not None:
        names, path = listed
        if len(names) > IGNORE:
            raise ConfigError(f"{path} names {len(names)} classes, and a mask's pixel holds 0 .. 254 (255: ignored): "
                              f"give at most 255 classes")
        return names, f"{path.name}, in its order"
    if values is None:
        pairs = next((pairs for split in SPLITS if (pairs := split_pairs(root, split))), [])
        values = _values_of([mask for _, mask in pairs])
    largest = max((v for vs in values for v in vs if v != IGNORE), default=-1)
    return [str(v) for v in range(largest + 1)], "the values 0 .. the largest in the training masks, by number"


def check_mask_folder(root: Path, splits: tuple[str, ...] = SPLITS) -> None:
    """The folder as --dataset masks reads it, before any worker starts: every image's header and every mask's header
    and pixels (THREADS at a time). Every kind of defect found (DEFECTS) goes into one ConfigError line, each with its
    first few files (named from DATA_DIR) and its count."""
    found: dict[str, list[str]] = {kind: [] for kind in DEFECTS}
    pairs: dict[str, list[tuple[Path, Path]]] = {}
    scans: dict[str, FolderScan] = {}
    for split in splits:
        scan, images = scan_folder(root / split / "images")
        masks = scan_folder(root / split / "masks")[1]
        if scan is not None:
            scans[split] = scan
        for part in ("images", "masks"):
            if not (root / split / part).is_dir():
                found["split"].append(f"{root / split / part} (missing)")
        if (root / split / "images").is_dir() and not images:
            found["split"].append(f"{root / split / 'images'} (no {'/'.join(IMAGE_EXTENSIONS)} files)")
        pairs[split], missing, orphans, twice = pair_up(root, split, images, masks)
        found["stem"] += twice
        found["format"] += [f"{mask} (not .png)" for mask in masks if mask.suffix != ".png"]
        if (root / split / "images").is_dir():  # else named once, as a split folder missing
            found["orphan"] += map(str, orphans)
        if (root / split / "masks").is_dir():
            found["missing"] += map(str, missing)
        pairs[split] = pairs[split] if (root / split / "masks").is_dir() else []
    if "train" in scans and "val" in scans:  # an image of both splits, through links: scored on what it trained on
        total, shown = images_in_both(scans["train"], scans["val"])
        if total:
            raise ConfigError(f"{root}: {how_many(total, 'image is', 'images are')} in both train/images and "
                              f"val/images, reached through links ({'; '.join(shown)}): the model would be scored on "
                              f"images it trained on: remove those links from one of the splits")
    with ThreadPoolExecutor(THREADS) as pool:
        facts = {split: list(pool.map(_inspect, listed, chunksize=64)) for split, listed in pairs.items()}
    for kind, what, _ in (fact for split_facts in facts.values() for fact in split_facts):
        if kind is not None:
            found[kind].append(what)
    training = facts.get("train") or facts.get("val", [])
    classes, _ = mask_classes(root, [values for _, _, values in training])
    for split, split_facts in facts.items():
        for (_, mask), (_, _, values) in zip(pairs[split], split_facts, strict=True):
            outside = [v for v in values if v >= len(classes) and v != IGNORE]
            if outside:
                found["value"].append(f"{mask} ({first_few(outside)})")
    held = (f"a class of 0 .. {len(classes) - 1}" if classes else
            "a class (no classes.txt, and the training masks hold nothing but 255)")
    kinds = [f"{DEFECTS[kind].format(classes=held)} ({len(names):,}): {first_few(_named(names, root))}"
             for kind, names in found.items() if names]
    if kinds:
        raise ConfigError(f"{root} is not a folder of images and masks as --dataset masks reads it: "
                          f"{'; '.join(kinds)}: give each image of DATA_DIR/<split>/images a mask of its path and "
                          f"size in DATA_DIR/<split>/masks, a single-channel PNG whose pixels are class indices "
                          f"(DATA_DIR/classes.txt's lines) or 255 (ignored)")


def _named(names: list[str], root: Path) -> list[str]:
    """The paths in a defect's entries from DATA_DIR (the line names DATA_DIR once)."""
    prefix = os.path.join(str(root), "")
    return [name.replace(prefix, "") for name in names]


class MaskSplit(Dataset):
    """One split: item i is (uint8 3 x H x W image, uint8 H x W mask), the image decoded as decode.py decodes every
    image (as PIL's convert("RGB") makes it), the mask's values as they are; transform (mask_transforms) moves both
    together."""

    def __init__(self, root: Path, split: str, classes: list[str], classes_from: str, transform=None):
        self.root, self.split, self.transform = root, split, transform
        self.classes, self.classes_from = classes, classes_from
        self.samples = split_pairs(root, split)
        if not self.samples:
            raise ConfigError(f"{root / split / 'images'} holds no images with masks ({'/'.join(IMAGE_EXTENSIONS)}): "
                              f"--dataset masks needs DATA_DIR/train/images, DATA_DIR/val/images and their masks/")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image_path, path = self.samples[index]
        image, mask = load_image(str(image_path)), read_mask(path)
        if image.shape[1:] != mask.shape:
            raise DataError(f"mask {path} is {mask.shape[1]}x{mask.shape[0]} and its image {image_path} "
                            f"{image.shape[2]}x{image.shape[1]}: give the mask its image's size, then run the same "
                            f"command to resume")
        if self.transform is None:
            return image, mask
        tv_tensors = vision.tv_tensors
        image, mask = self.transform(tv_tensors.Image(image), tv_tensors.Mask(mask))
        return image.as_subclass(torch.Tensor), mask.as_subclass(torch.Tensor)

    def describe(self) -> dict:
        return {"kind": "masks", "from": f"{self.root / self.split}/images, masks/<path>.png (or Cityscapes' names)",
                "order": "the images in ImageFolder's order (folders by path, files by name)",
                "classes_from": self.classes_from}


def whole_images(items: list) -> tuple[list, list]:
    """A validation batch of images of their own sizes: (the images, their masks) as lists, scored one at a time."""
    return [image for image, _ in items], [mask for _, mask in items]


def mask_transforms(image_size: int, train: bool, whole: bool = False):
    """The image and its mask moved together (torchvision's v2 on a tv_tensors.Image and a tv_tensors.Mask: one draw
    of each random parameter for both; a mask resampled by nearest neighbour, v2's rule for masks), uint8 in and out,
    as torchvision's references/segmentation presets with --image-size as their base and crop size. Training: a random
    resize of the shorter side to 0.5x .. 2x --image-size, a horizontal flip half the time, a random crop of
    --image-size, padded where the image is smaller (the image with 0, the mask with 255: ignored). Where the reference
    pads the right and bottom alone (its PadIfSmaller) and so puts such an image in the crop's top left corner,
    v2.RandomCrop's pad_if_needed places it at a random offset. Evaluation: the shorter side resized to --image-size,
    then the centre crop of --image-size, so that the images of a batch stack; whole: the shorter side resized alone,
    every pixel of the image scored at its own size, as the reference evaluates (one at a time)."""
    v2, size = vision.v2, image_size
    if train:
        return v2.Compose([v2.RandomResize(int(0.5 * size), int(2.0 * size) + 1, antialias=True),  # both ends in
                           v2.RandomHorizontalFlip(),
                           v2.RandomCrop(size, pad_if_needed=True, fill={vision.tv_tensors.Mask: IGNORE, "others": 0})])
    if whole:
        return v2.Compose([v2.Resize(size, antialias=True)])
    return v2.Compose([v2.Resize(size, antialias=True), v2.CenterCrop(size)])


def mask_datasets(data: Data, train: bool = True, whole: bool = False) -> tuple[MaskSplit | None, MaskSplit]:
    """(the training split or None when train is False, the validation split) of --data-dir, with their transforms;
    the class names from mask_classes (without classes.txt, every training mask's pixels are read once here). whole:
    the validation images at their own sizes, batched as lists (whole_images)."""
    root = Path(data.data_dir)
    classes, classes_from = mask_classes(root)
    size = data.image_size
    val = MaskSplit(root, "val", classes, classes_from, mask_transforms(size, False, whole))
    if whole:
        val.collate = whole_images
    return (MaskSplit(root, "train", classes, classes_from, mask_transforms(size, True)) if train else None), val
