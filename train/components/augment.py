"""The batch-level augmentations of torchvision's reference recipes, on the training device: v2.RandomErasing
per image after normalisation (where the reference's preset applies it), then v2.MixUp or v2.CutMix (one of
them at random per batch, as the reference's collate function does), with soft targets for the loss.

Each micro-batch draws from its own seed, made of the run's seed, the step, the micro-batch and the rank,
on a forked CPU generator (the transforms draw their parameters there, wherever the images are): the same
batch is augmented the same way whenever it is trained, across a resume or a restart, and the global RNG
streams are left as they were."""

from __future__ import annotations

import torch

from train.base import vision
from train.config.settings import Augmentation


def batch_seed(seed: int, step: int, micro: int, rank: int) -> int:
    """The seed of one micro-batch's augmentation, from the run's --seed and where the batch stands."""
    return ((seed * 1_000_003 + step) * 1_009 + micro) * 10_007 + rank


class BatchAugment:
    def __init__(self, aug: Augmentation, num_classes: int):
        v2 = vision.v2  # torchvision, only where a recipe asks for it
        self.erase = v2.RandomErasing(p=aug.random_erase) if aug.random_erase > 0 else None
        mixers = ([v2.MixUp(alpha=aug.mixup_alpha, num_classes=num_classes)] if aug.mixup_alpha > 0 else []) + \
            ([v2.CutMix(alpha=aug.cutmix_alpha, num_classes=num_classes)] if aug.cutmix_alpha > 0 else [])
        self.mix = v2.RandomChoice(mixers) if mixers else None

    def __repr__(self) -> str:
        parts = ([f"{self.erase!r} on each image"] if self.erase is not None else []) + \
            ([f"{self.mix!r} on the batch"] if self.mix is not None else [])
        return ", then ".join(parts)

    @staticmethod
    def wanted(aug: Augmentation) -> bool:
        return aug.random_erase > 0 or aug.mixup_alpha > 0 or aug.cutmix_alpha > 0

    def __call__(self, x: torch.Tensor, y: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(images, labels) -> (images, labels or soft targets), under `seed`."""
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            if self.erase is not None:
                x = torch.stack([self.erase(image) for image in x])
            if self.mix is not None:
                x, y = self.mix(x, y)
        return x, y
