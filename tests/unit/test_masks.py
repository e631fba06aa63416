"""Segmentation's data: the built-in shapes with masks (train/data/shapes.py) and the folder format of images and PNG
masks (train/data/masks.py): its listing, decoding, joint transforms, per-sample seeds, its check and its flags."""

import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from train.base import vision
from train.base.errors import ConfigError
from train.cli import parse_config
from train.data import (SHAPE_CLASSES, ShapeMasks, check_mask_folder, make_shape_masks, make_shapes, mask_datasets,
                        mask_transforms)
from train.data.masks import DEFECTS, MaskSplit, read_mask
from train.loading import SeededSample, build_train_loader, build_val_loader, in_memory, sampling


def make_shapes_before(n: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """make_shapes as it was before make_shape_masks shared its drawing (commit 8641401), verbatim."""
    g = torch.Generator().manual_seed(seed)

    def u(*shape):
        return torch.rand(*shape, generator=g)

    labels = torch.randint(0, 10, (n,), generator=g)
    coords = (torch.arange(size, dtype=torch.float32) + 0.5) / size  # pixel centres in [0, 1]
    y, x = coords.view(1, size, 1), coords.view(1, 1, size)
    r = (0.14 + 0.16 * u(n)).view(n, 1, 1)  # shape radius
    cx = (0.5 + (u(n) - 0.5) * 0.5).view(n, 1, 1)
    cy = (0.5 + (u(n) - 0.5) * 0.5).view(n, 1, 1)
    dx, dy = x - cx, y - cy
    dist = torch.sqrt(dx**2 + dy**2)
    period = (0.12 + 0.12 * u(n)).view(n, 1, 1)
    phase = u(n).view(n, 1, 1) * 2 * math.pi

    def wave(t):
        return torch.sin(2 * math.pi * t / period + phase) > 0

    masks = torch.stack([
        dist < r,                                                           # disk
        (dx.abs() < r * 0.85) & (dy.abs() < r * 0.85),                      # square
        (dist < r) & (dist > r * 0.55),                                     # ring
        ((dx.abs() < r * 0.3) & (dy.abs() < r)) | ((dy.abs() < r * 0.3) & (dx.abs() < r)),  # plus
        (dy < r * 0.8) & (dy > -r) & (dx.abs() < (dy + r) * 0.55),          # triangle
        dx.abs() + dy.abs() < r * 1.1,                                      # diamond
        wave(y).expand(n, size, size),                                      # horizontal stripes
        wave(x).expand(n, size, size),                                      # vertical stripes
        wave(x) ^ wave(y),                                                  # checkerboard
        (((dx - dy).abs() < r * 0.25) | ((dx + dy).abs() < r * 0.25)) & (dist < r * 1.2),  # x-cross
    ], dim=1)
    mask = masks[torch.arange(n), labels].unsqueeze(1).float()  # n x 1 x H x W
    fg, bg = u(n, 3, 1, 1), u(n, 3, 1, 1)
    # Keep foreground and background apart in brightness so every image is legible.
    fg = torch.where((fg - bg).abs().mean(1, keepdim=True) < 0.25, 1 - bg, fg)
    images = mask * fg + (1 - mask) * bg + 0.12 * torch.randn(n, 3, size, size, generator=g)
    return (images.clamp(0, 1) * 255).round().to(torch.uint8), labels


TEXTURES = [SHAPE_CLASSES.index(name) for name in ("h-stripes", "v-stripes", "checker")]


@pytest.mark.parametrize("n, size, seed", [(300, 32, 0), (64, 16, 7), (16, 64, 3)])
def test_make_shapes_is_bit_identical_to_what_it_was(n, size, seed):
    images, labels = make_shapes(n, size, seed)
    before_images, before_labels = make_shapes_before(n, size, seed)
    assert torch.equal(images, before_images) and torch.equal(labels, before_labels)


def test_shape_masks_are_drawn_from_the_seed_by_make_shapes_own_draws():
    images, masks = make_shape_masks(400, 24, seed=5)
    again, masks_again = make_shape_masks(400, 24, seed=5)
    other, other_masks = make_shape_masks(400, 24, seed=6)
    assert torch.equal(images, again) and torch.equal(masks, masks_again)
    assert not torch.equal(masks, other_masks) and not torch.equal(images, other)
    assert images.dtype == masks.dtype == torch.uint8
    assert images.shape == (400, 3, 24, 24) and masks.shape == (400, 24, 24)
    shapes_images, labels = make_shapes(400, 24, seed=5)
    # Each mask is its image's shape: background 0 and the label + 1 of make_shapes's image of that seed, nothing else
    for mask, label in zip(masks, labels, strict=True):
        assert mask.unique().tolist() == [0, label.item() + 1]
    assert set(masks.unique().tolist()) == set(range(11))
    # The same draws: every image but the textures' (confined to a disc) is make_shapes's own
    textured = torch.isin(labels, torch.tensor(TEXTURES))
    assert 0 < textured.sum() < 400 and torch.equal(images[~textured], shapes_images[~textured])
    assert not torch.equal(images[textured], shapes_images[textured])
    # Background in every image (a texture covers make_shapes's whole image, here a disc of it)
    assert (masks == 0).flatten(1).float().mean(1).min() > 0.5


def test_shape_masks_mark_where_the_image_shows_its_shape():
    """Each pixel is nearer (in colour) to the mean of the region its mask puts it in than to the other region's: the
    noise (0.12 per channel against a foreground kept 0.25 from the background) misplaces about 0.6 % of the pixels
    (seeds 0 to 3: 0.5 to 0.7 %, no image over 25 %); a mask one pixel off misplaces 5 %, another image's 35 %."""
    images, masks = make_shape_masks(200, 32, seed=2)
    x, foreground = images.float().flatten(2), (masks > 0).flatten(1)
    agree = []
    for image, fg in zip(x, foreground, strict=True):
        fg_mean, bg_mean = image[:, fg].mean(1, keepdim=True), image[:, ~fg].mean(1, keepdim=True)
        nearer_fg = (image - fg_mean).norm(dim=0) < (image - bg_mean).norm(dim=0)
        agree.append((nearer_fg == fg).float().mean())
    agree = torch.stack(agree)
    assert agree.mean() > 0.985 and agree.min() > 0.6, (agree.mean(), agree.min())


def test_shape_masks_is_a_tensor_dataset_the_trainer_holds_on_its_device():
    dataset = ShapeMasks(20, 16, seed=1)
    images, masks = make_shape_masks(20, 16, seed=1)
    assert dataset.classes == ["background", *SHAPE_CLASSES]
    held = in_memory(dataset)
    assert held is not None and torch.equal(held[0], images) and torch.equal(held[1], masks)
    image, mask = dataset[3]
    assert image.shape == (3, 16, 16) and mask.shape == (16, 16) and mask.long().max() <= 10


# ---------------------------------------------------------------- the folder format

BLOCK = 16  # the source images are blocks of BLOCK px, each block a value of its own


def block_pair(height: int, width: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """An image whose pixels encode its mask: block b (row-major) has the mask value 3 b + offset (gaps between the
    values: a blend of two would show) and the grey image value 2 x that + 4 (never 0, the crop's padding)."""
    ys, xs = torch.arange(height) // BLOCK, torch.arange(width) // BLOCK
    mask = ((ys.view(-1, 1) * math.ceil(width / BLOCK) + xs.view(1, -1)) * 3 + offset).to(torch.uint8)
    return (mask * 2 + 4).expand(3, height, width).contiguous(), mask


def save_pair(root: Path, split: str, stem: str, image: torch.Tensor, mask: torch.Tensor, suffix: str = ".png",
              mode: str = "L") -> None:
    for part in ("images", "masks"):
        (root / split / part).mkdir(parents=True, exist_ok=True)
    Image.fromarray(image.permute(1, 2, 0).numpy()).save(root / split / "images" / f"{stem}{suffix}")
    saved = Image.fromarray(mask.numpy())
    if mode == "P":  # as VOC ships its masks: palette indices
        saved = saved.convert("P")
        saved.putpalette([v % 256 for i in range(256) for v in (i * 7, i * 13, i * 29)])
        saved.putdata(mask.flatten().tolist())
    saved.save(root / split / "masks" / f"{stem}.png")


def block_folder(root: Path, shape=(40, 48), count: int = 3) -> Path:
    for split in ("train", "val"):
        for i in range(count):
            save_pair(root, split, f"b{i}", *block_pair(*shape, offset=i))
    return root


def masks_config(root: Path, size: int = 32):
    return parse_config(["--dataset", "masks", "--data-dir", str(root), "--image-size", str(size)])


def test_a_mask_folder_lists_decodes_and_names_its_classes(tmp_path):
    """Images in name order, decoded as PIL's convert("RGB") makes them (grey JPEG, palette PNG), masks as their
    values (a palette PNG's indices); the classes from classes.txt, else 0 .. the largest training value."""
    image, mask = block_pair(16, 24)
    save_pair(tmp_path, "train", "z", image, mask)
    save_pair(tmp_path, "train", "a", image, mask + 1, suffix=".jpg", mode="P")
    Image.fromarray(image[0].numpy()).save(tmp_path / "train" / "images" / "a.jpg")  # a grey JPEG
    save_pair(tmp_path, "val", "v", image, mask)
    grey = tmp_path / "val" / "images" / "w.png"
    Image.fromarray(image[0].numpy()).convert("P").save(grey)
    Image.fromarray(mask.numpy()).save(tmp_path / "val" / "masks" / "w.png")
    check_mask_folder(tmp_path)
    train, val = mask_datasets(masks_config(tmp_path).data)
    assert [p.name for p, _ in train.samples] == ["a.jpg", "z.png"] and len(val) == 2
    largest = int(mask.max()) + 1
    assert train.classes == val.classes == [str(v) for v in range(largest + 1)]
    assert train.describe()["classes_from"].startswith("the values 0 .. the largest")
    raw = MaskSplit(tmp_path, "train", train.classes, "", None)
    for index, (image_path, mask_file) in enumerate(raw.samples):
        decoded, values = raw[index]
        with Image.open(image_path) as opened:
            assert torch.equal(decoded, vision.v2.functional.pil_to_tensor(opened.convert("RGB")))
        assert values.dtype == torch.uint8 and values.shape == (16, 24)
    assert torch.equal(raw[0][1], mask + 1) and torch.equal(read_mask(raw.samples[0][1]), mask + 1)  # the P indices
    (tmp_path / "classes.txt").write_text("".join(f"c{v}\n" for v in range(20)))
    train, val = mask_datasets(masks_config(tmp_path).data, train=False)
    assert train is None and val.classes == [f"c{v}" for v in range(20)] and val.describe()["kind"] == "masks"
    image, mask = val[0]
    assert image.shape == (3, 32, 32) and mask.shape == (32, 32) and image.dtype == mask.dtype == torch.uint8


def interior(mask: torch.Tensor, radius: int = 2) -> torch.Tensor:
    """The pixels whose every neighbour within radius holds their own value (and not the padding's 255)."""
    padded = torch.nn.functional.pad(mask.int()[None, None], [radius] * 4, value=-1)[0, 0]
    same = torch.ones_like(mask, dtype=torch.bool)
    h, w = mask.shape
    for dy in range(2 * radius + 1):
        for dx in range(2 * radius + 1):
            same &= padded[dy:dy + h, dx:dx + w] == mask.int()
    return same & (mask != 255)


def test_the_image_and_its_mask_move_together(tmp_path):
    """After the training transforms (random resize, flip, crop, padding) of many seeds, each mask still encodes its
    image: inside a region the image shows the mask's value exactly; the padding is 255 in the mask where the image
    is 0; the mask holds source values alone (nearest neighbour); any draw the two did not share breaks it."""
    train, val = mask_datasets(masks_config(block_folder(tmp_path, count=1)).data)
    sample = SeededSample(train)
    source_values = set(block_pair(40, 48)[1].unique().tolist())
    padded = flipped = inside_count = shown = 0
    for seed in range(40):
        image, mask = sample[(0, seed)]
        assert image.shape == (3, 32, 32) and mask.shape == (32, 32) and image.dtype == mask.dtype == torch.uint8
        assert set(mask.unique().tolist()) <= source_values | {255}
        pad = mask == 255
        assert torch.equal(pad, (image == 0).all(0))
        padded += bool(pad.any())
        inside = interior(mask)
        inside_count, shown = inside_count + inside.sum(), shown + (~pad).sum()
        assert torch.equal(image[:, inside], (mask[inside].int() * 2 + 4).to(torch.uint8).expand(3, -1))
        flipped += bool((mask[:, 1:].int() - mask[:, :-1].int())[~pad[:, 1:] & ~pad[:, :-1]].lt(0).any())
    assert padded > 5 and flipped > 5  # the draws did reach a crop smaller than the image, and a flip
    assert inside_count > 0.3 * shown, (inside_count, shown)  # most of what the crops show is compared
    image, mask = val[0]  # the evaluation: the shorter side to 32 px (40 x 48 -> 32 x 38), the centre 32 px
    inside = interior(mask)
    assert (mask != 255).all() and inside.sum() > 0.3 * mask.numel(), inside.sum()
    assert torch.equal(image[:, inside], (mask[inside].int() * 2 + 4).to(torch.uint8).expand(3, -1))


def test_the_transforms_are_the_per_sample_seeds_and_a_resume_sees_the_same_batches(tmp_path):
    cfg = masks_config(block_folder(tmp_path, count=8)).replace(num_workers=0)
    train, _ = mask_datasets(cfg.data)
    sample = SeededSample(train)
    a, b, c = sample[(3, 11)], sample[(3, 11)], sample[(3, 12)]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1]) or not torch.equal(a[0], c[0])
    assert [str(t) for t in mask_transforms(cfg.data.image_size, True).transforms] == [
        "RandomResize(min_size=16, max_size=65, interpolation=bilinear, antialias=True)",
        "RandomHorizontalFlip(p=0.5)", "RandomCrop(size=(32, 32), pad_if_needed=True, padding_mode=constant)"]
    loader, sampler = build_train_loader(train, sampling(cfg.replace(batch_size=2)), cfg.data, rank=0, world_size=1,
                                         pin_memory=False)
    sampler.set_epoch(1)
    whole = list(loader)
    sampler.set_epoch(1, start=2)  # resumed after its first batch of 2
    resumed = list(loader)
    assert len(whole) == 4 and len(resumed) == 3
    for (image, mask), (image_again, mask_again) in zip(whole[1:], resumed, strict=True):
        assert torch.equal(image, image_again) and torch.equal(mask, mask_again)
    assert whole[0][0].shape == (2, 3, 32, 32) and whole[0][1].shape == (2, 32, 32)
    sampler.set_epoch(2)
    assert not all(torch.equal(x[1], y[1]) for x, y in zip(whole, list(loader), strict=True))


# ---------------------------------------------------------------- check_mask_folder

def _break_split(root: Path) -> str:
    for mask in (root / "val" / "masks").iterdir():
        mask.unlink()
    (root / "val" / "masks").rmdir()
    return "split folders missing or without images (1): val/masks (missing)"


def _break_stem(root: Path) -> str:
    (root / "train" / "images" / "b0.jpg").write_bytes((root / "train" / "images" / "b0.png").read_bytes())
    return "images sharing a path but for their suffix (a mask names one image) (1): train/images/b0.png and b0.jpg"


def _break_missing(root: Path) -> str:
    (root / "train" / "masks" / "b1.png").unlink()
    return "images without a mask (1): train/images/b1.png"


def _break_orphan(root: Path) -> str:
    (root / "val" / "images" / "b2.png").unlink()
    return "masks without an image (1): val/masks/b2.png"


def _break_unreadable(root: Path) -> str:
    (root / "val" / "masks" / "b0.png").write_bytes(b"\x89PNG\r\n\x1a\n cut short")
    return "images or masks that cannot be read (1): val/masks/b0.png ("


def _break_format(root: Path) -> str:
    Image.new("RGB", (48, 40)).save(root / "val" / "masks" / "b2.png")
    return "masks that are not single-channel PNGs (mode L or P) (1): val/masks/b2.png (PNG RGB)"


def _break_format_jpeg(root: Path) -> str:
    Image.new("L", (48, 40)).save(root / "train" / "masks" / "b2.jpg")
    return "masks that are not single-channel PNGs (mode L or P) (1): train/masks/b2.jpg (not .png)"


def _break_size(root: Path) -> str:
    Image.new("L", (48, 41)).save(root / "val" / "masks" / "b1.png")
    return "masks of another size than their image (1): val/masks/b1.png (48x41, its image 48x40)"


def _break_value(root: Path) -> str:
    (root / "classes.txt").write_text("".join(f"c{v}\n" for v in range(30)))  # the masks reach 3 x 8 + 2 = 26
    image, mask = block_pair(40, 48, offset=2)
    mask[0, :3] = torch.tensor([30, 255, 35], dtype=torch.uint8)  # 30 and 35 are outside, 255 is ignored
    save_pair(root, "val", "b0", image, mask)
    return "masks with values that are neither 255 nor a class of 0 .. 29 (1): val/masks/b0.png (30, 35)"


def _break_value_without_classes(root: Path) -> str:
    image, mask = block_pair(40, 48, offset=2)
    mask[5, 5] = 27  # the training masks reach 3 x 8 + 2 = 26: the classes are 0 .. 26
    save_pair(root, "val", "b3", image, mask)
    return "masks with values that are neither 255 nor a class of 0 .. 26 (1): val/masks/b3.png (27)"


BREAKS = [_break_split, _break_stem, _break_missing, _break_orphan, _break_unreadable, _break_format,
          _break_format_jpeg, _break_size, _break_value, _break_value_without_classes]


@pytest.mark.parametrize("breaks", BREAKS, ids=[b.__name__.removeprefix("_break_") for b in BREAKS])
def test_each_defect_of_a_mask_folder_is_named_in_one_line(tmp_path, breaks):
    root = block_folder(tmp_path)
    check_mask_folder(root)
    named = breaks(root)
    with pytest.raises(ConfigError) as e:
        check_mask_folder(root)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{root} is not a folder of images and masks as --dataset masks ")
    assert named in line
    assert [kind for kind in DEFECTS.values() if kind.split(" {")[0] in line] == \
        [next(kind for kind in DEFECTS.values() if named.startswith(kind.split(" {")[0]))]  # that kind alone
    assert line.endswith(": give each image of DATA_DIR/<split>/images a mask of its path and size in "
                         "DATA_DIR/<split>/masks, a single-channel PNG whose pixels are class indices "
                         "(DATA_DIR/classes.txt's lines) or 255 (ignored)")
    assert line.count(" (1): ") == 1  # that defect alone


def test_every_kind_of_defect_goes_into_one_bounded_line(tmp_path):
    root = block_folder(tmp_path)
    named = [breaks(root) for breaks in (_break_stem, _break_missing, _break_orphan, _break_unreadable,
                                         _break_format_jpeg, _break_size, _break_value_without_classes)]
    image, mask = block_pair(40, 48)
    mask[-1, -1] = 30
    save_pair(root, "val", "b4", image, mask)
    for i in range(1000):
        (root / "train" / "images" / f"x{i:04d}.jpg").touch()  # images without a mask: only listed, never opened
    with pytest.raises(ConfigError) as e:
        check_mask_folder(root, ("train", "val", "test"))
    line = str(e.value)
    assert "\n" not in line and len(line) < 1500, len(line)
    assert ("images without a mask (1,001): train/images/b1.png, train/images/x0000.jpg, train/images/x0001.jpg "
            "and 998 more") in line
    assert "split folders missing or without images (2): test/images (missing), test/masks (missing)" in line
    assert "neither 255 nor a class of 0 .. 26 (2): val/masks/b3.png (27), val/masks/b4.png (30)" in line
    for kind in named:
        assert kind.split(" (1): ")[0] in line
    assert [kind for kind in DEFECTS.values() if kind.split(" {")[0] not in line] == []


def test_a_folder_without_its_splits_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"split folders missing or without images \(4\): train/images \(missing\), "
                                          r"train/masks \(missing\), val/images \(missing\) and 1 more"):
        check_mask_folder(tmp_path)
    (tmp_path / "val" / "images").mkdir(parents=True)
    (tmp_path / "val" / "masks").mkdir()
    with pytest.raises(ConfigError, match=r"split folders missing or without images \(1\): val/images \(no "
                                          r"\.jpg/\.jpeg/\.png/\.ppm/\.bmp/\.pgm/\.tif/\.tiff/\.webp files\)"):
        check_mask_folder(tmp_path, ("val",))


# ---------------------------------------------------------------- folders as teams hold them


def test_subfolders_are_read_by_the_same_path_and_by_cityscapes_names(tmp_path):
    """images/<city>/<base>_leftImg8bit.png with masks/<city>/<base>_gtFine_labelTrainIds.png (else _labelIds), the
    other annotation files of Cityscapes beside them (no orphans), and a plain same-path rule in subfolders: every
    sample read, in ImageFolder's order."""
    image, mask = block_pair(40, 48)
    for split, city in (("train", "aachen"), ("train", "bremen"), ("val", "lindau")):
        for i in range(2):
            base = f"{city}_{i:06d}_000019"
            (tmp_path / split / "images" / city).mkdir(parents=True, exist_ok=True)
            (tmp_path / split / "masks" / city).mkdir(parents=True, exist_ok=True)
            Image.fromarray(image.permute(1, 2, 0).numpy()).save(tmp_path / split / "images" / city /
                                                               f"{base}_leftImg8bit.png")
            Image.fromarray(mask.numpy()).save(tmp_path / split / "masks" / city / f"{base}_gtFine_labelIds.png")
            if i == 0:  # the training ids, taken before the label ids
                Image.fromarray((mask + 1).numpy()).save(tmp_path / split / "masks" / city /
                                                       f"{base}_gtFine_labelTrainIds.png")
            Image.new("RGB", (48, 40)).save(tmp_path / split / "masks" / city / f"{base}_gtFine_color.png")
            (tmp_path / split / "masks" / city / f"{base}_gtFine_polygons.json").write_text("{}")
    save_pair(tmp_path, "train", "plain", image, mask)
    (tmp_path / "train" / "images" / "more").mkdir()
    (tmp_path / "train" / "masks" / "more").mkdir()
    save_pair(tmp_path, "train", "more/deep", image, mask)
    check_mask_folder(tmp_path)
    train, val = mask_datasets(masks_config(tmp_path).data)
    listed = [str(p.relative_to(tmp_path / "train" / "images")) for p, _ in train.samples]
    assert listed == ["plain.png", "aachen/aachen_000000_000019_leftImg8bit.png",
                      "aachen/aachen_000001_000019_leftImg8bit.png", "bremen/bremen_000000_000019_leftImg8bit.png",
                      "bremen/bremen_000001_000019_leftImg8bit.png", "more/deep.png"]
    assert [m.name for _, m in train.samples][1:3] == ["aachen_000000_000019_gtFine_labelTrainIds.png",
                                                       "aachen_000001_000019_gtFine_labelIds.png"]
    assert len(train) == 6 and len(val) == 2  # 8 of 8: nothing skipped
    (tmp_path / "train" / "images" / "bremen" / "lost_leftImg8bit.png").write_bytes(
        (tmp_path / "train" / "images" / "plain.png").read_bytes())
    with pytest.raises(ConfigError, match=r"images without a mask \(1\): train/images/bremen/lost_leftImg8bit.png"):
        check_mask_folder(tmp_path)


@pytest.mark.parametrize("link, line", [
    ("broken", r"train/images/b1.png is a broken link \(it names .*nowhere.png, which does not exist\): remove it"),
    ("loop", r"train/images/b1.png is a link cycle \(links that lead to each other, never to a file\): remove the "
             r"link"),
    ("leak", r"1 image is in both train/images and val/images, reached through links \(.*val/images/b1.png.* the model "
             r"would be scored on images it trained on"),
    ("mask", r"train/masks/b1.png is a broken link"),
])
def test_a_link_that_breaks_loops_or_leaks_is_one_line_as_imagefolder_refuses_it(tmp_path, link, line):
    root = block_folder(tmp_path)
    image = root / "train" / "images" / "b1.png"
    if link == "broken":
        image.unlink()
        image.symlink_to(root / "nowhere.png")
    if link == "loop":
        image.unlink()
        image.symlink_to(image)
    if link == "leak":
        (root / "val" / "images" / "b1.png").unlink()
        (root / "val" / "images" / "b1.png").symlink_to(image)
    if link == "mask":
        (root / "train" / "masks" / "b1.png").unlink()
        (root / "train" / "masks" / "b1.png").symlink_to(root / "gone.png")
    with pytest.raises(ConfigError, match=line) as refused:
        check_mask_folder(root)
    assert "\n" not in str(refused.value)


# ---------------------------------------------------------------- its flags

@pytest.mark.parametrize("argv", [["--augment", "imagenet"], ["--auto-augment", "ta_wide"], ["--decode", "gpu"],
                                  ["--train-crop-size", "24"], ["--val-resize-size", "36"], ["--val-crop-size", "24"],
                                  ["--interpolation", "bicubic"], ["--ra-magnitude", "5"], ["--augmix-severity", "2"],
                                  ["--download"], ["--path-column", "file"], ["--label-column", "y"],
                                  ["--label-key", "y"], ["--image-column", "img"], ["--train-split", "t"],
                                  ["--val-split", "v"], ["--train-samples", "100"]])
def test_settings_that_masks_does_not_read_are_refused(argv):
    with pytest.raises(ConfigError, match=rf"^{' '.join(argv)} has no effect with --dataset masks .*: drop it"):
        parse_config(["--dataset", "masks", *argv])


def test_the_settings_masks_reads_are_taken():
    cfg = parse_config(["--dataset", "masks", "--data-dir", "d", "--image-size", "64", "--num-workers", "2"])
    assert (cfg.data.dataset, cfg.data.image_size, cfg.data.num_workers) == ("masks", 64, 2)
    # Named weights leave --image-size alone: their own transforms are a classifier's sizes, or a segmenter's resize
    cfg = parse_config(["--dataset", "masks", "--model", "lraspp_mobilenet_v3_large",
                        "--weights", "LRASPP_MobileNet_V3_Large_Weights.DEFAULT"])
    assert (cfg.data.image_size, cfg.augmentation.val_resize_size) == (32, 0)


def test_whole_image_evaluation_scores_every_pixel_of_each_image_at_its_own_size(tmp_path):
    """--task-settings evaluation=whole: each validation image's shorter side resized to --image-size and every pixel
    scored, the image at its own size, one at a time, as torchvision's references/segmentation evaluates: the confusion
    matrix equals the reference's ConfusionMatrix over the same model's predictions, image by image; the plan says
    which protocol. The default crops; the built-in shapes and an unknown protocol are refused in one line."""
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as TF

    from train.run.validate import validate
    from train.tasks.factory import build_task

    shapes = [(40, 48), (30, 20), (52, 36)]
    for i, shape in enumerate(shapes):
        for split in ("train", "val"):
            save_pair(tmp_path, split, f"b{i}", *block_pair(*shape, offset=i))
    flags = ["--task", "segmentation", "--dataset", "masks", "--data-dir", str(tmp_path), "--image-size", "16",
             "--batch-size", "1"]
    task = build_task(parse_config([*flags, "--task-settings", "evaluation=whole"]))
    task.check()
    _, val_set = task.datasets(train=False)
    n, cpu = task.num_classes, torch.device("cpu")
    torch.manual_seed(0)
    model = torch.nn.Conv2d(3, n, 3, padding=1)
    loader = build_val_loader(val_set, task.cfg.data, 1, 0, 1, False, cpu, task.collate)  # batches of 2, then 1
    scores = validate(model, loader, task, cpu, None, detail=True)
    reference = torch.zeros(n, n, dtype=torch.int64)
    with torch.inference_mode():
        for image_path, mask_path in val_set.samples:  # the reference's eval preset: RandomResize(base, base)
            image = TF.pil_to_tensor(Image.open(image_path).convert("RGB"))
            image = TF.resize(image, 16, antialias=True)
            mask = TF.resize(read_mask(mask_path)[None], 16, interpolation=InterpolationMode.NEAREST)[0].long()
            predicted = model(task.images(image[None], cpu)).argmax(1)[0]
            k = (mask >= 0) & (mask < n)  # references/segmentation/utils.py ConfusionMatrix.update
            reference += torch.bincount(n * mask[k] + predicted[k], minlength=n ** 2).reshape(n, n)
    assert scores["confusion"] == reference.tolist() and scores["samples"] == 3
    assert reference.sum() == sum(16 * round(16 * max(s) / min(s)) for s in shapes) != 3 * 16 * 16  # not crops
    assert task.facts()["evaluation"].startswith("whole images: the shorter side resized to 16, every pixel scored")
    cropped = build_task(parse_config(flags))
    assert cropped.settings.evaluation == "crop" and cropped.facts()["evaluation"].startswith("the shorter side "
                                                                                              "resized to 16, then")
    with pytest.raises(ConfigError, match="^--task-settings evaluation=whole scores images at their own sizes, and "
                                          "the built-in shapes are all --image-size: drop it"):
        build_task(parse_config(["--task", "segmentation", "--task-settings", "evaluation=whole"])).check()
    with pytest.raises(ConfigError, match="evaluation is crop or whole, not 'tiles'"):
        build_task(parse_config([*flags, "--task-settings", "evaluation=tiles"]))
