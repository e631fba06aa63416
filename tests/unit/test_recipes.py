"""The augmentation recipes against torchvision's own: the reference classification presets (ImageNet
sizes) and today's padded-crop recipe (CIFAR sizes), on the uint8 tensors the loader decodes."""

import inspect

import pytest
import torch
from torchvision import models
from torchvision import transforms as v1
from torchvision.transforms import v2

from train.cli import parse_config
from train.config.settings import augmentation_recipe
from train.data import eval_resize, image_transforms


def photo(h: int, w: int) -> torch.Tensor:
    """A smooth, non-symmetric uint8 image (a flip or an off-by-one crop changes it)."""
    y, x = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
    return (torch.stack([x, y, (x * 3 + y * 5) % 1]) * 255).round().to(torch.uint8)


def cfg(*args):
    return parse_config(["--dataset", "imagefolder", *map(str, args)])


def sections(*args):
    """The data and augmentation sections of cfg(*args): what the recipe and the transforms read."""
    config = cfg(*args)
    return config.data, config.augmentation


@pytest.mark.parametrize("size, expected", [(16, "cifar"), (32, "cifar"), (96, "cifar"), (128, "imagenet"),
                                            (224, "imagenet")])
def test_auto_picks_the_recipe_by_image_size_and_the_flag_overrides_it(size, expected):
    assert augmentation_recipe(*sections("--image-size", size)) == expected
    other = "cifar" if expected == "imagenet" else "imagenet"
    assert augmentation_recipe(*sections("--image-size", size, "--augment", other)) == other


def test_imagenet_training_is_the_reference_random_resized_crop_and_flip():
    ours = image_transforms(*sections("--image-size", 224), train=True)
    crop = next(t for t in ours.reference.transforms if isinstance(t, v2.RandomResizedCrop))
    defaults = inspect.signature(v1.RandomResizedCrop).parameters  # the reference recipe keeps them
    assert (crop.scale, crop.ratio) == (defaults["scale"].default, defaults["ratio"].default) == \
        ((0.08, 1.0), (3 / 4, 4 / 3))
    # torchvision's references/classification/presets.py, ClassificationPresetTrain with its defaults
    reference = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip(0.5)])
    image = photo(375, 500)
    for seed in range(8):
        torch.manual_seed(seed)
        mine = ours(image)
        torch.manual_seed(seed)
        theirs = reference(image)
        assert mine.shape == (3, 224, 224) and mine.dtype == torch.uint8
        assert torch.equal(mine, theirs), seed
    assert len({tuple(ours(image).flatten()[:50].tolist()) for _ in range(4)}) > 1  # it is random


@pytest.mark.parametrize("shape", [(3, 375, 500), (3, 500, 375), (3, 30, 900), (3, 900, 30), (3, 64, 64), (3, 7, 5)])
@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_the_training_transform_draws_and_computes_as_torchvisions_objects(shape, interpolation):
    """The same pixels as torchvision's v2 objects for tensors and PIL images of every shape (extreme ratios and
    images smaller than the crop take RandomResizedCrop's fallback), and the same draws: the generator ends
    where theirs does, so whatever comes next (the loader's next image, an --auto-augment policy) is the same."""
    from PIL import Image

    ours = image_transforms(*sections("--image-size", 160, "--interpolation", interpolation), train=True)
    mode = v2.InterpolationMode(interpolation)
    theirs = v2.Compose([v2.ToImage(), v2.RandomResizedCrop(160, interpolation=mode, antialias=True),
                         v2.RandomHorizontalFlip(), v2.ToDtype(torch.uint8, scale=True)])
    assert repr(ours) == repr(theirs)  # what the run's plan.json shows
    generator = torch.Generator().manual_seed(shape[1] * shape[2])
    image = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
    for given in (image, Image.fromarray(image.permute(1, 2, 0).numpy())):
        for seed in range(6):
            torch.manual_seed(seed)
            mine, after = ours(given), torch.rand(3)
            torch.manual_seed(seed)
            expected, expected_after = theirs(given), torch.rand(3)
            assert torch.equal(mine, expected) and mine.dtype == torch.uint8, (seed, shape)
            assert torch.equal(after, expected_after), (seed, shape)


def test_imagenet_evaluation_equals_torchvisions_packaged_preset():
    """ResNet-50's IMAGENET1K_V1 weights carry torchvision's eval preset: resize 256, centre crop 224."""
    preset = models.ResNet50_Weights.IMAGENET1K_V1.transforms()
    assert (preset.resize_size, preset.crop_size) == ([eval_resize(224)], [224]) == ([256], [224])
    image = photo(375, 500)
    ours = image_transforms(*sections("--image-size", 224), train=False)(image)
    mean, std = torch.tensor(preset.mean).view(3, 1, 1), torch.tensor(preset.std).view(3, 1, 1)
    theirs = ((preset(image) * std + mean) * 255).round()  # back to the uint8 levels it started from
    # The same geometry; the uint8 kernel (ours) and the float one (theirs) may round one level apart.
    difference = (ours.float() - theirs).abs()
    assert difference.max() <= 1 and difference.mean() < 0.1, (difference.max(), difference.mean())


def test_cifar_sizes_keep_the_padded_crop_recipe():
    ours = image_transforms(*sections("--image-size", 32), train=True)
    kinds = [type(t) for t in ours.transforms]
    assert v2.RandomResizedCrop not in kinds and v2.RandomCrop in kinds and v2.RandomHorizontalFlip in kinds
    crop = next(t for t in ours.transforms if isinstance(t, v2.RandomCrop))
    assert crop.padding == [4, 4, 4, 4]
    out = ours(photo(40, 48))
    assert out.shape == (3, 32, 32) and out.dtype == torch.uint8
    evaluation = image_transforms(*sections("--image-size", 32), train=False)(photo(40, 48))
    assert torch.equal(evaluation, v2.functional.center_crop(v2.functional.resize(photo(40, 48), 32), 32))
