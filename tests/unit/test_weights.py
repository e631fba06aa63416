"""--normalize and --weights' statistics, the classifier head, --freeze: no trainer, no network."""

import pytest
import torch
from torchvision.transforms import v2

from train.base.errors import ConfigError
from train.cli import parse_config
from train.components.models import build_model, freeze, frozen_names, head_name
from train.components.weights import IMAGENET, normalisation
from train.tasks.factory import build_task
from train.data import prepare_inputs


@pytest.mark.parametrize("argv, expected", [
    ([], ((0.5,) * 3, (0.25,) * 3)),
    (["--normalize", "imagenet"], IMAGENET),
    (["--model", "resnet18", "--weights", "ResNet18_Weights.IMAGENET1K_V1"], IMAGENET),  # named: their own
    (["--model", "resnet18", "--weights", "DEFAULT"], IMAGENET),
    (["--weights", "runs/a/model.pt"], ((0.5,) * 3, (0.25,) * 3)),  # a file: trainbox's unless told
    (["--model", "resnet18", "--weights", "DEFAULT", "--normalize", "trainbox"], ((0.5,) * 3, (0.25,) * 3)),
])
def test_the_normalisation_follows_the_weights_unless_set(argv, expected):
    cfg = parse_config(argv)
    assert normalisation(cfg.data.normalize, cfg.model) == expected


def test_the_inputs_are_normalised_as_torchvision_normalize_does():
    from torchvision.models import ResNet18_Weights

    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    cfg = parse_config(["--model", "resnet18", "--weights", "ResNet18_Weights.DEFAULT"])
    ours = prepare_inputs(images, torch.device("cpu"), False, *build_task(cfg).normalisation_on(torch.device("cpu")))
    weights = ResNet18_Weights.DEFAULT.transforms()  # the published weights' own preprocessing
    theirs = v2.Normalize(weights.mean, weights.std)(images.float() / 255)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("model, head", [("cnn", "head.2"), ("resnet18", "fc"), ("mobilenet_v3_small", "classifier.3"),
                                         ("vit_b_16", "heads.head"), ("efficientnet_b0", "classifier.1")])
def test_the_classifier_head_is_found(model, head):
    with torch.device("meta"):
        built = build_model(parse_config(["--model", model]).model, 37)
    assert head_name(built, 37) == head


def test_a_frozen_backbone_keeps_its_batchnorm_statistics_in_training_mode():
    cfg = parse_config(["--freeze", "backbone", "--width", "8"])
    model = build_model(cfg.model, 10)
    names = frozen_names(cfg.model, model, lambda: head_name(model, 10))
    assert names and not any(n.startswith("head.2.") for n in names)
    freeze(model, names)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    model(torch.randn(8, 3, 16, 16)).sum().backward()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # running stats untouched by a training forward
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {"head.2.weight", "head.2.bias"}
    unfrozen = build_model(cfg.model, 10)
    unfrozen.train()
    unfrozen(torch.randn(8, 3, 16, 16))  # the control: without --freeze a training forward moves them
    assert not torch.equal(unfrozen.features[0][1].running_mean, torch.zeros(8))


def test_freeze_prefixes_and_their_mistakes():
    cfg = parse_config(["--freeze", "features.0,features.1", "--width", "8"])
    model = build_model(cfg.model, 10)
    names = frozen_names(cfg.model, model, lambda: head_name(model, 10))
    assert names and all(n.startswith(("features.0.", "features.1.")) for n in names)
    with pytest.raises(ConfigError, match="--freeze head.9: no parameter of --model cnn is named so"):
        bad = parse_config(["--freeze", "head.9"])
        model = build_model(bad.model, 10)
        frozen_names(bad.model, model, lambda: head_name(model, 10))


def test_named_weights_bring_their_own_evaluation_transforms():
    """resize, crop and interpolation of the weights' transforms (ResNet50's V2: 232, 224, bilinear), then the
    trainer's normalisation: the weights' own preprocessing on the same image, within one level of 255 (the
    trainer resizes uint8 with transforms v2, which rounds a few pixels one level apart from theirs)."""
    from torchvision.models import ResNet50_Weights

    from train.data import image_transforms, eval_steps

    cfg = parse_config(["--dataset", "imagefolder", "--image-size", "224", "--model", "resnet50",
                        "--weights", "ResNet50_Weights.IMAGENET1K_V2"])
    assert eval_steps(cfg.data, cfg.augmentation) == (232, 224, "bilinear")
    image = torch.randint(0, 256, (3, 300, 260), dtype=torch.uint8)
    ours = prepare_inputs(image_transforms(cfg.data, cfg.augmentation, False)(image)[None], torch.device("cpu"),
                          False,
                          *build_task(cfg).normalisation_on(torch.device("cpu")))
    theirs = ResNet50_Weights.IMAGENET1K_V2.transforms()(image)[None]
    level = 1 / 255 / min(IMAGENET[1])
    assert ours.shape == theirs.shape and (ours - theirs).abs().max() <= level + 1e-6
    assert (ours - theirs).abs().mean() < level / 4
    plain = parse_config(["--dataset", "imagefolder", "--image-size", "224"])
    # without them: the recipe's size / 0.875
    assert eval_steps(plain.data, plain.augmentation) == (256, 224, "bilinear")


def every_classification_weight() -> list[tuple[str, str]]:
    """(model, weights name) for every entry of every classification weights enum in torchvision."""
    from torchvision import models

    return [(m, f"{models.get_model_weights(m).__name__}.{e.name}") for m in models.list_models(module=models)
            for e in models.get_model_weights(m)]


def test_every_classification_weights_enum_is_covered():
    from torchvision import models

    entries = every_classification_weight()
    assert len(entries) == sum(len(models.get_model_weights(m)) for m in models.list_models(module=models)) > 100
    assert ("efficientnet_v2_l", "EfficientNet_V2_L_Weights.IMAGENET1K_V1") in entries
    assert ("vgg16", "VGG16_Weights.IMAGENET1K_FEATURES") in entries


@pytest.mark.parametrize("model, weights", every_classification_weight())
def test_named_weights_bring_their_own_statistics_and_sizes(model, weights):
    """Each classification weights entry in torchvision (nothing is downloaded: the enum knows its transforms):
    the normalisation is its transforms()' mean and std (EfficientNet-V2-L's 0.5, VGG16 FEATURES' 1/255 std), and
    on image files its resize, crop and interpolation are the evaluation's, the export's and the image size's
    defaults."""
    from torchvision import models

    from train.data import eval_steps, preprocessing

    preset = models.get_weight(weights).transforms()
    cfg = parse_config(["--dataset", "imagefolder", "--model", model, "--weights", weights])
    assert normalisation(cfg.data.normalize, cfg.model) == (tuple(preset.mean), tuple(preset.std))
    assert cfg.data.image_size == preset.crop_size[0]
    data, aug = cfg.data, cfg.augmentation
    assert eval_steps(data, aug) == (preset.resize_size[0], preset.crop_size[0], preset.interpolation.value)
    # what model.pt2.json tells a caller
    exported = preprocessing(data, aug, ["a"], *normalisation(data.normalize, cfg.model))
    assert (exported["resize"], exported["center_crop"], exported["interpolation"], exported["mean"],
            exported["std"]) == (preset.resize_size[0], preset.crop_size[0], preset.interpolation.value,
                                 list(preset.mean), list(preset.std))


@pytest.mark.parametrize("argv, expected", [
    ([], (224, 232, 224, "bilinear")),  # the weights' own: ResNet50 V2 evaluates 232 -> 224
    (["--image-size", "160"], (160, 232 * 160 // 224, 160, "bilinear")),  # the user's size, the weights' ratio
    (["--val-resize-size", "256"], (224, 256, 224, "bilinear")),
    (["--val-crop-size", "192", "--val-resize-size", "220"], (224, 220, 192, "bilinear")),
    (["--interpolation", "bicubic"], (224, 232, 224, "bicubic")),
    (["--dataset", "shapes"], (32, 256, 32, "bilinear")),  # built-in: made at --image-size, no files to resize
])
def test_sizes_the_user_gives_win_over_the_weights_defaults(argv, expected):
    from train.data import eval_steps

    dataset = [] if "--dataset" in argv else ["--dataset", "imagefolder"]
    cfg = parse_config([*dataset, "--model", "resnet50", "--weights", "ResNet50_Weights.IMAGENET1K_V2", *argv])
    resize, crop, interpolation = eval_steps(cfg.data, cfg.augmentation)
    if cfg.data.dataset == "shapes":
        assert (cfg.data.image_size, crop) == (expected[0], expected[2])
        return
    assert (cfg.data.image_size, resize, crop, interpolation) == expected


def test_a_cifar_run_from_named_weights_trains_and_evaluates_at_one_size():
    """--dataset cifar10 --weights ResNet50_Weights.DEFAULT: the training crop and the evaluation's are both the
    weights' 224 (upsampled CIFAR), or both the user's --image-size: never 32 px trained and 224 px evaluated."""
    from train.data import image_transforms, eval_steps

    image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)
    for argv, size in (([], 224), (["--image-size", "32"], 32)):
        cfg = parse_config(["--dataset", "cifar10", "--model", "resnet50", "--weights", "DEFAULT", *argv])
        data, aug = cfg.data, cfg.augmentation
        assert image_transforms(data, aug, True)(image).shape[-1] == \
            image_transforms(data, aug, False)(image).shape[-1] == size
        assert eval_steps(data, aug)[1] == size


def _subclasses(cls: type) -> set[type]:
    found = set(cls.__subclasses__())
    return found.union(*(_subclasses(sub) for sub in found))


@pytest.mark.parametrize("base, public", [("batchnorm._BatchNorm", "BATCH_NORMS"),
                                          ("instancenorm._InstanceNorm", "INSTANCE_NORMS")])
def test_the_public_normalisation_classes_are_every_layer_of_torchs_private_base(base, public):
    """--freeze (BatchNorm in eval mode) and --norm-weight-decay name torch.nn's layers by their public classes: each
    layer of torch.nn built on the private base is one of them (or made from one), and each of them is such a layer.
    A torch that moves the base or adds a layer fails here."""
    import importlib

    from train.components import models

    module, name = base.split(".")
    private = getattr(importlib.import_module(f"torch.nn.modules.{module}"), name)
    layers = {c for c in _subclasses(private) if c.__module__.startswith("torch.nn.")}
    chosen = getattr(models, public)
    assert layers and all(issubclass(layer, chosen) for layer in layers), layers
    assert set(chosen) <= layers
