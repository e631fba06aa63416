"""--task segmentation: every pixel gets a class. torchvision's segmentation models, its reference's loss and metric.

  data      --dataset shapes: the built-in shapes with their pixel masks (background and the ten shapes, drawn by the
            same generator from the seed, no download); --dataset masks: DATA_DIR/{train,val}/images/* with
            DATA_DIR/{train,val}/masks/<stem>.png, a pixel's value its class, 255 ignored (the VOC/Cityscapes
            convention; train/data/masks.py, its checks before any worker starts)
  model     torchvision's segmentation models by name (--model lraspp_mobilenet_v3_large, the default;
            deeplabv3_mobilenet_v3_large, fcn_resnet50, ...), built without a download (no backbone weights), with
            their auxiliary head where they have one; the head: their classifier. Or a network of your own, --model
            package.module:factory (num_classes in; images in, N x C x H x W logits or {"out": ...} out)
  weights   --weights of the whole model (a segmentation run's model.pt, LRASPP_MobileNet_V3_Large_Weights.DEFAULT):
            the convolutions to the classes start anew where the class count differs; or a classifier's (its
            backbone's architecture: MobileNet_V3_Large_Weights.IMAGENET1K_V1, a classification run's model.pt) for
            the backbone alone, as torchvision's weights_backbone takes them (start_from)
  loss      cross-entropy over the labelled pixels (ignore index 255), summed, plus 0.5 x the auxiliary head's, as
            torchvision's references/segmentation trains; counted in labelled pixels, which vary from batch to batch:
            the trainer divides by the labelled pixels of the whole step, on every rank
  metric    mean IoU picks best.pt; the state: the loss sum, the labelled pixels, the images and the confusion matrix
            of the labelled pixels (rows: the true class), from which the pixel accuracy, the per-class IoU and their
            mean are computed as the reference's ConfusionMatrix does, but for one thing: a class absent from both the
            truth and the predictions of the whole validation set has no IoU and stays out of the mean (the
            reference's mean is then NaN)
  settings  --task-settings evaluation=whole: a masks folder's validation images scored whole, at their own sizes,
            the shorter side resized to --image-size (torchvision's reference protocol, its base size), one at a
            time; crop (the default): resized, then the centre --image-size crop, in batches
  CUDA      the models' upsampling and pooling have no deterministic CUDA backward (pytorch #149130): --deterministic
            on a GPU is refused, and a resumed run on CUDA equals an uninterrupted one to rounding, not bit for bit;
            on the CPU it is exact
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from train.base import vision
from train.base.errors import ConfigError
from train.components.models import user_model
from train.components.weights import fitted
from train.config.catalog import source
from train.config.settings import SEGMENTATION_MODEL, Model
from train.data.masks import SPLITS, check_mask_folder, mask_datasets
from train.data.shapes import ShapeMasks
from train.tasks.images import ImageTask

log = logging.getLogger("train")
IGNORE = 255  # a pixel of this value counts for nothing: torchvision's references/segmentation
DEFAULT_MODEL = SEGMENTATION_MODEL
WITH_AUX = ("deeplabv3_mobilenet_v3_large", "deeplabv3_resnet50", "deeplabv3_resnet101", "fcn_resnet50",
            "fcn_resnet101")  # an auxiliary head, trained at 0.5 as the reference trains it


@dataclasses.dataclass
class Settings:
    evaluation: str = "crop"  # crop: the centre --image-size crop; whole: every pixel, the image at its own size

    def __post_init__(self):
        if self.evaluation not in PROTOCOLS:
            raise ValueError(f"evaluation is crop or whole, not {self.evaluation!r}: pass evaluation=whole for "
                             f"torchvision's reference protocol")


PROTOCOLS = {"crop": "the shorter side resized to {size}, then the centre {size} x {size} crop scored, in batches",
             "whole": "whole images: the shorter side resized to {size}, every pixel scored, each image at its own "
                      "size, one at a time (torchvision's references/segmentation)"}


def models() -> list[str]:
    """torchvision's segmentation models by name."""
    return vision.models.list_models(module=vision.models.segmentation)


class Segmentation(ImageTask):
    name = "segmentation"
    metric = "miou"
    higher_is_better = True
    variable_count = True  # the labelled pixels of a batch
    stand_in_classes = 21  # before the data is read: VOC's count
    classes_from = "DATA_DIR/classes.txt, one name per line, or masks whose largest value is the run's"
    Settings = Settings

    @property
    def whole(self) -> bool:
        return self.settings is not None and self.settings.evaluation == "whole"

    # ---------------------------------------------------------------- data and model

    def check(self, run_dir=None, train: bool = True) -> None:
        cfg = self.cfg
        if self.name not in source(cfg.data.dataset).tasks:
            raise ConfigError(f"--dataset {cfg.data.dataset} holds no pixel masks: --task segmentation trains on "
                              f"--dataset shapes (built in) or masks (DATA_DIR/train/images and DATA_DIR/train/masks, "
                              f"and the same under val/)")
        if cfg.model.model not in models() and ":" not in cfg.model.model:
            raise ConfigError(f"--model {cfg.model.model} is not a segmentation model of torchvision: pass one of "
                              f"{', '.join(models())} (default {DEFAULT_MODEL}), or package.module:factory")
        if cfg.run.deterministic and cfg.launch.device != "cpu" and torch.cuda.is_available():
            raise ConfigError("--deterministic with --task segmentation on a GPU: the models' upsampling and pooling "
                              "have no deterministic CUDA backward (pytorch #149130): drop --deterministic (a resume "
                              "on CUDA then equals an uninterrupted run to rounding), or train on --device cpu")
        if cfg.data.dataset == "masks":
            check_mask_folder(Path(cfg.data.data_dir), SPLITS if train else ("val",))
        elif self.whole:
            raise ConfigError("--task-settings evaluation=whole scores images at their own sizes, and the built-in "
                              "shapes are all --image-size: drop it, or train on --dataset masks")

    def datasets(self, run_dir=None, train: bool = True) -> tuple:
        cfg = self.cfg
        if cfg.data.dataset == "shapes":
            size, seed = cfg.data.image_size, cfg.run.seed
            train_set = ShapeMasks(cfg.data.train_samples, size, seed * 2 + 1) if train else None
            val_set = ShapeMasks(cfg.data.val_samples, size, seed * 2 + 2)
        else:
            train_set, val_set = mask_datasets(cfg.data, train, self.whole)
        self.description = {"classes": list((train_set if train_set is not None else val_set).classes)}
        return train_set, val_set

    def network(self, spec: Model) -> nn.Module:
        if ":" in spec.model:  # a network of the user's: images in, N x C x H x W logits out (or {"out": ...})
            return user_model(spec, self.num_classes, takes="num_classes and returns a segmentation nn.Module")
        aux = {"aux_loss": True} if spec.model in WITH_AUX else {}
        return vision.models.get_model(spec.model, weights=None, weights_backbone=None, num_classes=self.num_classes,
                                       **aux)

    def head(self, model: nn.Module) -> str:
        return "classifier" if isinstance(getattr(model, "classifier", None), nn.Module) else super().head(model)

    def start_from(self, state: dict, model: nn.Module, sized: bool = True) -> dict:
        """Weights of the whole model (a segmentation run's model.pt, torchvision's COCO_WITH_VOC_LABELS_V1), their
        heads' convolutions to the classes started anew where the class count differs; or a classifier's weights
        (ImageNet's MobileNet_V3_Large_Weights, a classification run of the backbone's architecture) for the
        backbone alone, as torchvision's weights_backbone takes them, every head started anew."""
        own = model.state_dict()
        if any(k.startswith("backbone.") for k in own) and not any(k.startswith("backbone.") for k in state):
            state = {**{k: v for k, v in own.items() if not k.startswith("backbone.")}, **backbone_of(state, own)}
            log.info("--weights %s: the backbone's; the heads initialised anew", self.cfg.model.weights)
        heads = [f"{name}.{kind}" for name, m in model.named_modules() if isinstance(m, nn.Conv2d)
                 and m.out_channels == self.num_classes and not name.startswith("backbone.")
                 for kind in ("weight", "bias")]
        return fitted(self.cfg.model, state, model, heads, sized)

    # ---------------------------------------------------------------- a step

    def inputs(self, batch, device: torch.device) -> tuple:
        x, mask = batch
        if isinstance(x, list):  # whole images of their own sizes (evaluation=whole): each a batch of one
            return ([self.images(image[None], device) for image in x],
                    [m[None].to(device, non_blocking=True).long() for m in mask])
        return self.images(x, device), mask.to(device, non_blocking=True).long()

    def forward(self, model: nn.Module, inputs, target):
        return [model(x) for x in inputs] if isinstance(inputs, list) else model(inputs)

    def loss(self, output: dict | torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        output = heads(output)
        logits = output.get("out")
        if not isinstance(logits, torch.Tensor) or logits.dim() != 4 or logits.shape[1] != self.num_classes or \
                logits.shape[2:] != target.shape[1:]:
            got = f"{list(logits.shape)}" if isinstance(logits, torch.Tensor) else f"a {type(logits).__name__}"
            raise ConfigError(f"--model {self.cfg.model.model} gives {got} for a batch of masks "
                              f"{list(target.shape)}, and --task segmentation takes N x C x H x W logits (C = "
                              f"{self.num_classes} classes, H x W the mask's): make the network return them (or "
                              f"{{'out': logits}})")
        total = F.cross_entropy(output["out"], target, ignore_index=IGNORE, reduction="sum")
        if "aux" in output:
            total = total + 0.5 * F.cross_entropy(output["aux"], target, ignore_index=IGNORE, reduction="sum")
        return total, self.count(target)

    def count(self, target: torch.Tensor) -> torch.Tensor:
        return (target != IGNORE).sum()

    def example(self, batch_size: int, device: torch.device) -> tuple:
        size = self.cfg.data.image_size
        x = torch.zeros(batch_size, 3, size, size, device=device)
        x = x.contiguous(memory_format=torch.channels_last) if self.cfg.model.channels_last else x
        return x, torch.zeros(batch_size, size, size, dtype=torch.long, device=device)

    # ---------------------------------------------------------------- evaluation

    def metric_state(self, device: torch.device, detail: bool = False) -> torch.Tensor:
        """The loss sum, the labelled pixels, the images, then the C x C confusion matrix (rows: the true class)."""
        return torch.zeros(3 + self.num_classes ** 2, dtype=torch.float64, device=device)

    def update(self, state: torch.Tensor, output: dict, target: torch.Tensor) -> None:
        if isinstance(output, list):  # whole images, one at a time
            for one, mask in zip(output, target, strict=True):
                self.update(state, one, mask)
            return
        output = {k: v.float() for k, v in heads(output).items()}
        total, count = self.loss(output, target)
        n = self.num_classes
        labelled = (target >= 0) & (target < n)  # the reference's ConfusionMatrix: 255 and stray values left out
        cells = n * target[labelled] + output["out"].argmax(1)[labelled]
        state[0] += total
        state[1] += count
        state[2] += len(target)
        state[3:] += torch.bincount(cells, minlength=n * n).to(state.dtype)

    def scores(self, state: torch.Tensor, detail: bool = False) -> dict:
        total, count, images = state[:3].tolist()
        if not count:
            raise ConfigError(f"the validation set's masks label no pixel ({int(images)} images, every pixel 255 after "
                              f"the centre crop to --image-size): an evaluation of nothing has no figures; give it "
                              f"masks with classes")
        n = self.num_classes
        h = state[3:].view(n, n)
        diagonal = h.diag()
        union = h.sum(1) + h.sum(0) - diagonal
        iou = [(d / u) if u else math.nan for d, u in zip(diagonal.tolist(), union.tolist(), strict=True)]
        seen = [v for v in iou if not math.isnan(v)]
        scores = {"loss": total / count, "miou": sum(seen) / len(seen) if seen else math.nan,
                  "pixel_accuracy": (diagonal.sum() / h.sum()).item() if h.sum() else math.nan,
                  "samples": int(images)}
        if detail:
            scores["iou"] = {name: (None if math.isnan(v) else v) for name, v in zip(self.classes, iou, strict=True)}
            scores["confusion"] = h.long().cpu().tolist()
        return scores

    def summary(self, scores: dict) -> str:
        return (f"loss {scores['loss']:.4f}, mIoU {100 * scores['miou']:.2f}%, pixel accuracy "
                f"{100 * scores['pixel_accuracy']:.2f}%")

    # ---------------------------------------------------------------- records

    def facts(self) -> dict:
        aux = " + 0.5 x the auxiliary head's" if self.cfg.model.model in WITH_AUX else ""
        return {**super().facts(), "loss": f"CrossEntropyLoss(ignore_index={IGNORE}){aux}, summed over the labelled "
                                          f"pixels, divided by those of the step",
                "bit_exact_resume": "on the CPU; on CUDA to rounding only (upsampling and pooling have no "
                                    "deterministic CUDA backward)",
                "evaluation": PROTOCOLS["whole" if self.whole else "crop"].format(size=self.cfg.data.image_size)}

    def source(self, train_set, val_set) -> dict:
        if self.cfg.data.dataset == "shapes":
            return {"kind": "shapes masks", "order": "made in memory from the seed", "classes_from": "the shapes"}
        val = val_set.describe()
        return {"kind": "masks", **({"train": train_set.describe()["from"]} if train_set is not None else {}),
                "val": val["from"], "order": val["order"], "classes_from": val["classes_from"]}

    def input_steps(self, train_set, val_set) -> dict:
        mean, std = self.norm
        def transform(dataset) -> str:
            return repr(getattr(dataset, "transform", None) or "none: images and masks made in memory")
        return {"normalize": {"mean": list(mean), "std": list(std)}, "train_size": self.cfg.data.image_size,
                "train_transform": transform(train_set), "eval_transform": transform(val_set)}

    def exportable(self, model: nn.Module) -> nn.Module:
        return _Logits(model)

    def export_io(self) -> tuple:
        size = self.cfg.data.image_size
        mean, std = self.norm
        return torch.zeros(2, 3, size, size), {"input": "images", "output": "logits"}, {
            "image_size": size, "output": "N x C x H x W logits: a pixel's class is the argmax over C",
            "scale": 1 / 255, "mean": list(mean), "std": list(std), "channels": "RGB",
            "layout": "N x 3 x H x W float32", "classes": self.classes, "ignore_index": IGNORE}

    def pictures(self, model: nn.Module, val_set, device: torch.device, count: int = 4) -> list[tuple]:
        """make evaluate's report: the first images of the validation set, with their true and predicted masks."""
        shown = []
        model.eval()
        with torch.inference_mode():
            for i in range(min(count, len(val_set))):
                image, mask = val_set[i]
                x, _ = self.inputs((image[None], mask[None]), device)
                shown.append((image, mask, heads(model(x))["out"].argmax(1)[0].cpu()))
        return shown

    def report(self, record: dict, result: dict, pictures: list | None = None) -> tuple:
        """Per-class IoU, worst first, and the pictures: each image beside its true and its predicted mask."""
        from train.report import figure as figures  # noqa: PLC0415 - matplotlib: the evaluation command's alone

        record.update({"iou": result["iou"], "classes": self.classes, "confusion": result["confusion"]})
        return figures.segmentation_figure(record, pictures or []), [
            f"loss {result['loss']:.4f}, mIoU {100 * result['miou']:.2f}%, pixel accuracy "
            f"{100 * result['pixel_accuracy']:.2f}%",
            "lowest IoU: " + ", ".join(f"{k} {100 * v:.1f}%" for v, k in sorted(
                (v, k) for k, v in result["iou"].items() if v is not None)[:5])]


class _Logits(nn.Module):
    """A segmentation model as make export ships it: images in, the main head's logits out (no dict, no aux)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return heads(self.model(x))["out"]


def heads(output: dict | torch.Tensor) -> dict:
    """A model's output as torchvision's segmentation models give it: {"out": logits, "aux": logits} (a network of
    the user's may return the logits alone)."""
    return output if isinstance(output, dict) else {"out": output}


def backbone_of(state: dict, own: dict) -> dict:
    """A classifier's state_dict as the backbone of a segmentation model (own: its state_dict): torchvision builds
    that backbone from the classifier (a MobileNet's `features`, a ResNet but its pooling and fc), so `features.N.*`
    becomes `backbone.N.*` and `layer1.*` `backbone.layer1.*`; the classifier's head has no place and is left out."""
    mapped = {}
    for key, value in state.items():
        name = next((n for n in (f"backbone.{key}", f"backbone.{key.removeprefix('features.')}") if n in own), None)
        if name is not None:
            mapped[name] = value
    return mapped
