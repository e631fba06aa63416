"""torchvision, in one place, for the runs that use it: its modules handed out on first use (vision.v2,
vision.io, vision.datasets, vision.models, vision.tv_tensors), and its models' weights by name. The import costs about
1.5 s of a process's start-up, and the built-in dataset and model need none of it. No trainbox module but the errors is
imported here, so the config may ask it for the named weights' sizes while it is parsed.

  from train.base import vision
  vision.v2.Resize(256)              # torchvision.transforms.v2, imported at this first use
"""

from __future__ import annotations

import difflib
import importlib
from pathlib import Path

from train.base.errors import ConfigError

MODULES = {"v2": "torchvision.transforms.v2", "io": "torchvision.io", "datasets": "torchvision.datasets",
           "models": "torchvision.models", "tv_tensors": "torchvision.tv_tensors"}


def __getattr__(name: str):
    """vision.v2 and the rest: the torchvision module, imported on first use (PEP 562)."""
    if name not in MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(MODULES[name])
    globals()[name] = module
    return module


def preload(*names: str) -> None:
    """Import these modules now: a process about to fork workers that use them, so that each need not."""
    for name in names:
        __getattr__(name)


def named_weights(model: str, weights: str):
    """The torchvision weights enum entry that --weights names for --model (DEFAULT: the model's default), or
    None for a file (an existing path, or one that looks like a path)."""
    if not weights or Path(weights).exists() or "/" in weights or weights.endswith((".pt", ".pth")):
        return None
    models = importlib.import_module("torchvision.models")
    own = models.get_model_weights(model) if model in models.list_models() else None
    if weights == "DEFAULT":
        if own is None:
            raise ConfigError(f"--weights DEFAULT: --model {model} is not a torchvision model with named weights: "
                              f"give a weights file")
        return own.DEFAULT
    try:
        entry = models.get_weight(weights)
    except (ValueError, KeyError, AttributeError):
        every = [f"{enum.__name__}.{e.name}" for enum in
                 ([own] if own else [models.get_model_weights(m) for m in models.list_models(module=models)])
                 for e in enum]
        close = difflib.get_close_matches(weights, every, n=3, cutoff=0.4)
        raise ConfigError(f"--weights {weights} is neither a file nor torchvision weights"
                          f"{' (close: ' + ', '.join(close) + ')' if close else ''}: give a file or a name such as "
                          f"{(close or every)[0]}") from None
    backbone = backbone_weights(model)
    if own is None or type(entry) not in (own, backbone):
        fits = (f"{own.__name__}.DEFAULT or {backbone.__name__}.DEFAULT (its backbone) fit it" if backbone else
                f"{own.__name__}.DEFAULT fits it" if own else "")
        raise ConfigError(f"--weights {weights} are weights of another architecture than --model {model}"
                          f"{': ' + fits if fits else ''}")
    return entry


def backbone_weights(model: str):
    """The weights enum of the classifier a torchvision segmentation model is built on (lraspp_mobilenet_v3_large:
    MobileNet_V3_Large_Weights, fcn_resnet50: ResNet50_Weights), taken for its backbone as weights_backbone takes
    them; None for any other model."""
    models = importlib.import_module("torchvision.models")
    if model not in models.list_models(module=models.segmentation):
        return None
    classifier = model.split("_", 1)[1]  # lraspp_mobilenet_v3_large: mobilenet_v3_large
    return models.get_model_weights(classifier) if classifier in models.list_models() else None


def evaluation_transforms(model: str, weights: str) -> tuple[int, int, str] | None:
    """The named weights' own evaluation transforms (their transforms()): (resize, crop, interpolation), or None
    for weights from a file."""
    entry = named_weights(model, weights)
    if entry is None:
        return None
    preset = entry.transforms()
    return preset.resize_size[0], preset.crop_size[0], preset.interpolation.value
