"""The built-in datasets, made in memory from the seed (no download, no files):

- shapes: 10 classes of procedurally drawn shapes and textures with random position, size, colours and noise.
  It needs a real model to learn. For segmentation (make_shape_masks, ShapeMasks) the same shapes with a mask each:
  the background and the ten shapes.
- synthetic: random images and labels (1000 classes), for measuring speed: nothing to learn, nothing to load.

The trainer moves them to its device once and cuts batches there (loaders.TensorLoader): batches never wait.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import Dataset, TensorDataset


NUM_SHAPE_CLASSES = 10


SYNTHETIC_CLASSES = 1000


SHAPE_CLASSES = ("disk", "square", "ring", "plus", "triangle", "diamond",
                 "h-stripes", "v-stripes", "checker", "x-cross")

# make_shape_masks's shapes lie within this many radii of their centre (the triangle reaches 1.27, the square 1.21)
CONFINED = 1.3


def make_shapes(n: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n images (uint8, n x 3 x size x size) of 10 classes, a pure function of (n, size, seed)."""
    images, labels, _ = draw_shapes(n, size, seed, confined=False)
    return images, labels


def make_shape_masks(n: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The shapes for segmentation: n images (uint8, n x 3 x size x size) and their masks (uint8, n x size x size:
    0 the background, k + 1 the pixels of SHAPE_CLASSES[k]), a pure function of (n, size, seed). The same draws as
    make_shapes's images of that seed, each shape held within CONFINED radii of its centre: the textures (stripes,
    checker), which fill make_shapes's whole image, become discs of texture, so every image has background; the
    other shapes lie within that disc already, their images make_shapes's own."""
    images, labels, regions = draw_shapes(n, size, seed, confined=True)
    return images, (regions * (labels + 1).view(n, 1, 1)).to(torch.uint8)


def draw_shapes(n: int, size: int, seed: int, confined: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(images, labels, the region each image's shape covers: n x size x size bool), every draw from one generator
    seeded with `seed`, in one order; confined: each region cut to the disc of CONFINED radii."""
    g = torch.Generator().manual_seed(seed)

    def u(*shape):
        return torch.rand(*shape, generator=g)

    labels = torch.randint(0, NUM_SHAPE_CLASSES, (n,), generator=g)
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
    region = masks[torch.arange(n), labels]  # n x H x W
    if confined:
        region = region & (dist < r * CONFINED)
    mask = region.unsqueeze(1).float()  # n x 1 x H x W
    fg, bg = u(n, 3, 1, 1), u(n, 3, 1, 1)
    # Keep foreground and background apart in brightness so every image is legible.
    fg = torch.where((fg - bg).abs().mean(1, keepdim=True) < 0.25, 1 - bg, fg)
    images = mask * fg + (1 - mask) * bg + 0.12 * torch.randn(n, 3, size, size, generator=g)
    return (images.clamp(0, 1) * 255).round().to(torch.uint8), labels, region


class ShapesDataset(Dataset):
    """In-memory images and labels; the trainer moves them to its device once, so batches never wait."""

    def __init__(self, n: int, size: int, seed: int):
        self.images, self.labels = make_shapes(n, size, seed)
        self.classes = list(SHAPE_CLASSES)

    def to(self, device: torch.device) -> ShapesDataset:
        self.images, self.labels = self.images.to(device), self.labels.to(device)
        return self

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Its images and labels, as a TensorDataset's: the loaders hold them on the device and cut batches there."""
        return self.images, self.labels

    @tensors.setter
    def tensors(self, tensors: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.images, self.labels = tensors

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], self.labels[index]


class ShapeMasks(TensorDataset):
    """make_shape_masks's images and masks, items (uint8 3 x H x W image, uint8 H x W mask): the trainer holds them on
    its device and cuts batches there (train/loading/loaders.py: in_memory); a mask's values index `classes`."""

    def __init__(self, n: int, size: int, seed: int):
        super().__init__(*make_shape_masks(n, size, seed))
        self.classes = ["background", *SHAPE_CLASSES]


class SyntheticDataset(ShapesDataset):
    """Random images and labels (1000 classes), for measuring speed: nothing to learn, nothing to load."""

    def __init__(self, n: int, size: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)
        self.labels = torch.randint(0, SYNTHETIC_CLASSES, (n,), generator=g)
        self.classes = [str(i) for i in range(SYNTHETIC_CLASSES)]
