"""The per-image transforms of a file dataset, as torchvision's reference classification presets build them, on
uint8 tensors (normalisation happens on the training device: prepare_inputs), and what a caller of the
trained model does to an image before it (preprocessing, for make export).
"""

from __future__ import annotations

import torch

from train.base import vision
from train.config.catalog import source
from train.config.settings import Augmentation, Data, augmentation_recipe

# trainbox's own input normalisation: (x / 255 - MEAN) / STD on every channel (prepare_inputs), where the weights
# bring none of their own (components/weights.py: normalisation)
MEAN, STD = 0.5, 0.25


def eval_resize(size: int) -> int:
    """The evaluation's resize before its centre crop: size / 0.875 (256 for 224, as torchvision's references)."""
    return int(size / 0.875)


def train_size(data: Data, aug: Augmentation) -> int:
    """The side of a training image in pixels: the imagenet recipe's --train-crop-size (refused where it has no
    effect), else --image-size."""
    return aug.train_crop_size or data.image_size


def image_transforms(data: Data, aug: Augmentation, train: bool):
    """uint8 tensors (or PIL images) in, uint8 tensors out: normalisation happens on the training device.
    imagenet: torchvision's reference classification presets (RandomResizedCrop to --train-crop-size, flip,
    --auto-augment; eval: resize to --val-resize-size, centre crop to --val-crop-size, --interpolation);
    cifar: resize, padded random crop, flip, --auto-augment. --random-erase follows the normalisation, on the
    training device (train/components/augment.py), as the reference's preset has it after Normalize."""
    v2 = vision.v2
    size, mode = data.image_size, v2.InterpolationMode(aug.interpolation)
    if augmentation_recipe(data, aug) == "imagenet" and train:
        return CropFlip(train_size(data, aug), mode, auto_augment(aug))
    elif augmentation_recipe(data, aug) == "imagenet":
        resize, crop, _ = eval_steps(data, aug)
        steps = [v2.Resize(resize, interpolation=mode, antialias=True), v2.CenterCrop(crop)]
    else:
        steps = [v2.Resize(size, antialias=True), v2.CenterCrop(size)]
        if train:
            steps += [v2.RandomCrop(size, padding=size // 8), v2.RandomHorizontalFlip(),
                      *auto_augment(aug)]
    return v2.Compose([v2.ToImage(), *steps, v2.ToDtype(torch.uint8, scale=True)])


class CropFlip:
    """The imagenet recipe's training transform, equal to torchvision's `v2.Compose([ToImage(), RandomResizedCrop(size,
    interpolation, antialias=True), RandomHorizontalFlip(), *augment, ToDtype(uint8, scale=True)])` (`reference`;
    its repr is this one's): the same random draws in the same order, the same functional ops, the same pixels
    (tests/unit/test_data.py). It calls those ops directly, without v2's per-transform dispatch: about 0.15 ms
    of an image's 1.5 ms on one core."""

    def __init__(self, size: int, interpolation, augment: list):
        v2 = vision.v2
        self.crop = v2.RandomResizedCrop(size, interpolation=interpolation, antialias=True)
        self.augment = v2.Compose(augment) if augment else None
        self.reference = v2.Compose([v2.ToImage(), self.crop, v2.RandomHorizontalFlip(), *augment,
                                     v2.ToDtype(torch.uint8, scale=True)])

    def __call__(self, image) -> torch.Tensor:
        functional, crop = vision.v2.functional, self.crop
        if not isinstance(image, torch.Tensor):
            image = functional.pil_to_tensor(image)
        box = crop.make_params([image])  # top, left, height, width: RandomResizedCrop's own draws
        image = functional.resized_crop(image, **box, size=list(crop.size), interpolation=crop.interpolation,
                                        antialias=True)
        if torch.rand(1) < 0.5:  # RandomHorizontalFlip(p=0.5): applied when the draw is below p
            image = functional.horizontal_flip(image)
        return self.augment(image) if self.augment is not None else image

    def __repr__(self) -> str:
        return repr(self.reference)


def auto_augment(aug: Augmentation) -> list:
    """--auto-augment as torchvision's reference preset builds it, on uint8 images. Their rotations and shears
    on tensors take nearest or bilinear only: with --interpolation bicubic they resample bilinearly."""
    v2 = vision.v2
    mode = v2.InterpolationMode.BILINEAR
    return {"none": [], "ta_wide": [v2.TrivialAugmentWide(interpolation=mode)],
            "ra": [v2.RandAugment(interpolation=mode, magnitude=aug.ra_magnitude)],
            "augmix": [v2.AugMix(interpolation=mode, severity=aug.augmix_severity)],
            "imagenet": [v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET, interpolation=mode)]}[aug.auto_augment]


def eval_steps(data: Data, aug: Augmentation) -> tuple[int, int, str]:
    """The evaluation's (resize, centre crop, interpolation), the recipe's: imagenet: --val-resize-size or the crop
    / 0.875, --val-crop-size or --image-size, --interpolation; cifar and the built-in sets: --image-size, bilinear.
    (Named --weights make their own transforms the defaults of these flags: config._weights_sizes.)"""
    if source(data.dataset).in_memory or augmentation_recipe(data, aug) != "imagenet":
        return data.image_size, data.image_size, "bilinear"
    crop = aug.val_crop_size or data.image_size
    return aug.val_resize_size or eval_resize(crop), crop, aug.interpolation


def preprocessing(data: Data, aug: Augmentation, classes: list[str], mean: tuple, std: tuple) -> dict:
    """What a caller of the trained model does to an RGB image before it: the evaluation's own steps."""
    resize, crop, interpolation = eval_steps(data, aug)
    return {"resize": resize, "resize_of": "the shorter side", "interpolation": interpolation, "antialias": True,
            "center_crop": crop, "scale": 1 / 255, "mean": list(mean), "std": list(std), "channels": "RGB",
            "layout": "N x 3 x H x W float32", "classes": classes}


def prepare_inputs(x: torch.Tensor, device: torch.device, channels_last: bool, mean=MEAN, std=STD) -> torch.Tensor:
    """A batch of uint8 images onto the device (non-blocking from pinned memory), normalised there (mean and std:
    numbers, or per-channel tensors of shape 1 x 3 x 1 x 1 on the device)."""
    x = x.to(device, non_blocking=True).float().div_(255).sub_(mean).div_(std)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x
