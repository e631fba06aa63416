"""Which mask is an image's, in a --dataset masks folder (train/data/masks.py): both folders listed with their
subfolders as ImageFolder lists a class folder (scan.FolderScan: links followed and held to what the folders say), and
each image paired with the mask of its path under masks/, or of Cityscapes' names (mask_names)."""

from __future__ import annotations

from pathlib import Path

from train.data.scan import FolderScan

CITYSCAPES_IMAGE = "_leftImg8bit"  # Cityscapes' images: <city>/<base>_leftImg8bit.png
CITYSCAPES_MASKS = ("_gtFine_labelTrainIds", "_gtFine_labelIds")  # ... and their masks, in the order they are taken


def split_listing(root: Path, split: str) -> tuple[list[Path], list[Path]]:
    """(the images of the split, every image-named file of its masks folder): each folder and its subfolders in
    ImageFolder's order (folders sorted by path, each one's files by name; scan.FolderScan's), links followed and held
    to what the folders say (a broken link, a link cycle or a file reached twice refused in one line); a folder that is
    missing lists nothing."""
    return scan_folder(root / split / "images")[1], scan_folder(root / split / "masks")[1]


def scan_folder(folder: Path) -> tuple[FolderScan | None, list[Path]]:
    if not folder.is_dir():
        return None, []
    scan = FolderScan(folder)
    files = scan.images(scan.top, scan.real_top)
    scan.check_linked_images()
    scan.raise_refused()
    return scan, [Path(f) for f in files]


def split_pairs(root: Path, split: str) -> list[tuple[Path, Path]]:
    """(image, mask) of every image of the split that has one, in the images' order (pair_up's rule)."""
    return pair_up(root, split, *split_listing(root, split))[0]


def mask_names(key: str) -> list[str]:
    """Where the mask of the image `key` (its path under images/, without its suffix) may be under masks/, in order:
    the same path with .png; for a Cityscapes image (<base>_leftImg8bit), <base>_gtFine_labelTrainIds.png (the 19
    training classes, 255 ignored), then <base>_gtFine_labelIds.png."""
    names = [f"{key}.png"]
    if key.endswith(CITYSCAPES_IMAGE):
        base = key.removesuffix(CITYSCAPES_IMAGE)
        names += [f"{base}{suffix}.png" for suffix in CITYSCAPES_MASKS]
    return names


def _key(path: Path, folder: Path) -> str:
    """A file's path under `folder`, without its suffix, with "/" between its parts."""
    return path.relative_to(folder).with_suffix("").as_posix()


def pair_up(root: Path, split: str, images: list[Path], masks: list[Path]) -> tuple[list, list, list, list]:
    """(pairs (image, mask) in the images' order, images without a mask, masks of no image, images sharing a key):
    mask_names' rule. A Cityscapes image's other annotation files (<base>_gtFine_color.png, ..._instanceIds.png) are
    its own, no orphans."""
    image_dir, mask_dir = root / split / "images", root / split / "masks"
    by_name = {_key(mask, mask_dir) + mask.suffix: mask for mask in masks}
    pairs, missing, twice, keys, claimed = [], [], [], {}, set()
    for image in images:
        key = _key(image, image_dir)
        if key in keys:
            twice.append(f"{image} and {keys[key].name}")
            continue
        keys[key] = image
        name = next((n for n in mask_names(key) if n in by_name), None)
        if name is None:
            missing.append(image)
            continue
        claimed.add(name)
        pairs.append((image, by_name[name]))
    cityscapes = {key.removesuffix(CITYSCAPES_IMAGE) for key in keys if key.endswith(CITYSCAPES_IMAGE)}
    orphans = [mask for name, mask in by_name.items() if name not in claimed and mask.suffix == ".png" and
               name.split("_gtFine_")[0] not in cityscapes]
    return pairs, missing, orphans, twice
