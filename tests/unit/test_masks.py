"""Segmentation's data: the built-in shapes with masks (train/data/shapes.py)."""

import math

import pytest
import torch

from train.data import SHAPE_CLASSES, ShapeMasks, make_shape_masks, make_shapes
from train.data.loaders import in_memory


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
    assert images.dtype == masks.dtype == torch.uint8 and images.shape == (400, 3, 24, 24) and masks.shape == (400, 24,
                                                                                                              24)
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
