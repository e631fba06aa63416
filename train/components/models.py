"""Models: a small built-in CNN, torchvision classifiers by name, or a user's `package.module:factory`; and which of
their parameters train.

  build_model(spec, num_classes)      the network, untrained, every parameter trainable
  trainable_model(spec, num_classes)  the network a run trains: frozen where --freeze says
  --freeze backbone                   every parameter but the classifier head (head_name; a linear probe)
  --freeze conv1,layer1               parameters whose names start with these prefixes

Frozen parameters get no gradient and no optimizer state, and their BatchNorm layers stay in evaluation mode, so their
running statistics do not move either.
"""

from __future__ import annotations

import difflib
import functools
import importlib
from collections.abc import Callable

import torch
import torch.utils.checkpoint
from torch import nn

from train.base import vision
from train.base.errors import ConfigError
from train.config.settings import Model


# torch.nn's batch and instance normalisation layers by their public classes (their common bases, _BatchNorm and
# _InstanceNorm, are private to torch): tests/unit/test_weights.py holds them against torch.nn's own, checked with torch
# 2.13.0, and fails on a torch that adds one.
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LazyBatchNorm1d, nn.LazyBatchNorm2d,
               nn.LazyBatchNorm3d, nn.SyncBatchNorm)
INSTANCE_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LazyInstanceNorm1d,
                  nn.LazyInstanceNorm2d, nn.LazyInstanceNorm3d)


class SmallCNN(nn.Module):
    """Three conv stages (width, 2x, 4x channels) with BatchNorm, then global pooling and a linear head."""

    def __init__(self, num_classes: int, width: int = 32):
        super().__init__()

        def stage(c_in: int, c_out: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True),
                nn.Conv2d(c_out, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True),
                nn.MaxPool2d(2))

        self.features = nn.Sequential(stage(3, width), stage(width, 2 * width), stage(2 * width, 4 * width))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def user_factory(spec: str, flag: str = "--model", takes: str = "num_classes and returns an nn.Module"):
    """The function `package.module:factory` names (--model's, --task's), imported: a module that cannot be imported,
    a name it lacks or something not callable is one line."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and not f"{module_name}.".startswith(f"{e.name}."):  # it exists, and imports what is not installed
            raise ConfigError(f"{flag} {spec}: {module_name} imports {e.name}, which is not installed here: install "
                              f"it (pip install {e.name.split('.')[0]}, or its package's name) where the run "
                              f"trains") from None
        raise ConfigError(f"{flag} {spec}: cannot import {module_name} ({e}): check the module path and "
                          f"that it is on PYTHONPATH") from None
    except ImportError as e:
        raise ConfigError(f"{flag} {spec}: cannot import {module_name} ({e}): check the module path and "
                          f"that it is on PYTHONPATH") from None
    except SyntaxError as e:
        raise ConfigError(f"{flag} {spec}: {e.filename}, line {e.lineno}: {e.msg} ({(e.text or '').strip()[:80]}): "
                          f"fix the file") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise ConfigError(f"{flag} {spec}: {module_name} has no attribute {attr!r}: name a function in it")
    if not callable(factory):
        raise ConfigError(f"{flag} {spec}: {attr} is a {type(factory).__name__}, not callable: "
                          f"name a function that takes {takes}")
    return factory


def user_model(spec: Model, num_classes: int, takes: str = "num_classes and returns an nn.Module") -> nn.Module:
    """The network --model package.module:factory makes for num_classes; anything but an nn.Module is one line."""
    model = user_factory(spec.model, takes=takes)(num_classes=num_classes)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {spec.model} returned a {type(model).__name__}, not an nn.Module: make the "
                          f"factory return a torch.nn.Module")
    return model


def build_model(spec: Model, num_classes: int) -> nn.Module:
    """The network the config's model section names (--model, --width), with a head of num_classes, untrained."""
    if spec.model == "cnn":
        return SmallCNN(num_classes, spec.width)
    if ":" in spec.model:
        return user_model(spec, num_classes)
    return _torchvision_models(spec.model).get_model(spec.model, weights=None, num_classes=num_classes)


def trainable_model(spec: Model, num_classes: int) -> nn.Module:
    """build_model's network as a run trains it (and as its plan and checks see it): frozen where --freeze says,
    before any optimizer has state for it."""
    model = build_model(spec, num_classes)
    freeze(model, frozen_names(spec, model, lambda: head_name(model, num_classes)))
    return model


def stages(model: nn.Module) -> list[str]:
    """The blocks of an image network that --parallel fsdp shards one by one and --activation-checkpointing recomputes
    (Task.blocks): a ResNet's four stages (layer1 to layer4: a segmentation model's backbone too), a VisionTransformer's
    encoder layers, the children with parameters of a `features` or `trunk_output` Sequential (the built-in CNN's
    stages; ConvNeXt, Swin, EfficientNet, MobileNet, VGG, DenseNet) or of a segmentation model's
    IntermediateLayerGetter backbone; found where the network sits in the model (in a wrapper too). [] for any
    other: the model sharded as one."""
    for prefix, module in model.named_modules():
        at = f"{prefix}." if prefix else ""
        if all(isinstance(getattr(module, f"layer{i}", None), nn.Module) for i in range(1, 5)):
            return [f"{at}layer{i}" for i in range(1, 5)]
        layers = getattr(getattr(module, "encoder", None), "layers", None)
        if isinstance(layers, nn.Sequential) and hasattr(module, "heads"):  # torchvision's VisionTransformer
            return [f"{at}encoder.layers.{name}" for name, _ in layers.named_children()]
        chains = [(f"{at}{name}.", getattr(module, name)) for name in ("features", "trunk_output")
                  if isinstance(getattr(module, name, None), nn.Sequential)]
        if type(module).__name__ == "IntermediateLayerGetter":
            chains.append((at, module))
        for start, chain in chains:
            held = [f"{start}{name}" for name, child in chain.named_children() if any(True for _ in child.parameters())]
            if len(held) > 1:
                return held
    return []


def head_name(model: nn.Module, num_classes: int) -> str:
    """The classifier head: the last nn.Linear with num_classes outputs (fc, classifier.1, heads.head, ...)."""
    heads = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and m.out_features == num_classes]
    if not heads:
        raise ConfigError(f"--model {type(model).__name__} has no linear layer with {num_classes} outputs to take as "
                          f"its classifier head: give a model whose last layer is an nn.Linear")
    return heads[-1]


def frozen_names(spec: Model, model: nn.Module, head: Callable[[], str]) -> list[str]:
    """The parameter names --freeze selects (head: the name of the model's head module, asked for by backbone alone);
    a prefix that selects nothing is a mistake."""
    if not spec.freeze:
        return []
    names = [name for name, _ in model.named_parameters()]
    if spec.freeze == "backbone":
        name = head()
        kept = [n for n in names if n.startswith(f"{name}.")] if isinstance(name, str) and name else []
        if not kept:
            tops = sorted({n.rsplit(".", 2)[0] for n in names})[-3:]
            raise ConfigError(f"--freeze backbone: the head of --model {spec.model} is {name!r}, which names no module "
                              f"of it with parameters, so every parameter would be frozen: a task's head(model) "
                              f"returns the name of its head module (such as {', '.join(tops)})")
        return [n for n in names if n not in kept]
    chosen = []
    for prefix in (p.strip() for p in spec.freeze.split(",") if p.strip()):
        matched = [n for n in names if n == prefix or n.startswith(prefix + ".")]
        if not matched:
            close = difflib.get_close_matches(prefix, sorted({n.rsplit(".", 1)[0] for n in names}), n=3)
            raise ConfigError(f"--freeze {prefix}: no parameter of --model {spec.model} is named so"
                              f"{' (close: ' + ', '.join(close) + ')' if close else ''}: give name prefixes such as "
                              f"{names[0].split('.')[0]}, or backbone")
        chosen += matched
    return chosen


def recompute_in_backward(block: nn.Module) -> None:
    """--activation-checkpointing: the block keeps only its input and runs its forward again in the backward (torch's
    checkpoint, non-reentrant); the module, its name and its hooks stay as they were."""
    block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False)


def freeze(model: nn.Module, names: list[str]) -> None:
    """No gradient for these parameters; BatchNorm layers whose parameters are all frozen stay in eval mode."""
    frozen = set(names)
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    for name, module in model.named_modules():
        own = [f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False)]
        if isinstance(module, BATCH_NORMS) and own and frozen.issuperset(own):
            module.register_forward_pre_hook(_stay_in_eval)


def _stay_in_eval(module: nn.Module, _inputs) -> None:
    module.training = False  # its running statistics belong to the frozen weights


def check_model_spec(spec: Model) -> None:
    """Fail early (before workers start) on a --model that cannot be built."""
    if ":" in spec.model:
        user_factory(spec.model)
    elif spec.model != "cnn":
        _torchvision_models(spec.model)


def _torchvision_models(name: str):
    """torchvision.models, once `name` is known to be one of its classification models."""
    if name not in vision.models.list_models(module=vision.models):
        raise ConfigError(f"--model {name!r} is not cnn, a torchvision classification model "
                          f"(e.g. resnet18, resnet50, mobilenet_v3_small) or package.module:factory: pass one of those")
    return vision.models
