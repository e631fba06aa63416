"""--task classification (the default): images and class labels, cross-entropy, top-1 and top-5 accuracy.

  data      the built-in shapes (and synthetic), CIFAR-10, an ImageFolder, label files, tars, a Hugging Face dataset
            (train/data/), the class names in label order (classes.json)
  model     a classifier of --model with a head of the classes' count (train/components/models.py); its head: the last
            nn.Linear with that many outputs
  loss      cross-entropy with --label-smoothing, summed over the images (Mixup/CutMix's soft targets too), counted
            in images: the trainer's mean over a step's images equals torchvision's reference's
  metric    top-1 accuracy picks best.pt; the state: the loss sum, the correct images, the images and the correct in
            the top 5 (and make evaluate's confusion matrix, rows the true class), summed across ranks
  augment   --random-erase, --mixup-alpha, --cutmix-alpha (train/components/augment.py)
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from train.base.errors import ConfigError
from train.components.augment import BatchAugment
from train.components.models import build_model, check_model_spec, head_name
from train.components.weights import fitted
from train.config.catalog import source
from train.config.settings import Model
from train.data import (build_datasets, check_cifar, check_hf, check_imagefolder, check_labelfiles, check_shards,
                        class_names, eval_steps, preprocessing, source_of, train_size)
from train.tasks.images import ImageTask

def criterion_of(label_smoothing: float) -> str:
    """The loss a run trains with and its evaluations report (plan.json's "loss", the evaluation records' criterion)."""
    return f"CrossEntropyLoss(label_smoothing={label_smoothing})"


class Classification(ImageTask):
    name = "classification"
    metric = "accuracy"
    higher_is_better = True

    @property
    def label_smoothing(self) -> float:
        return self.cfg.regularisation.label_smoothing

    # ---------------------------------------------------------------- data and model

    def check(self, run_dir=None, train: bool = True) -> None:
        """The data's checks before any worker starts (the built-in sets need none; file datasets are counted by the
        workers, once loaded)."""
        data = self.cfg.data
        root = Path(data.data_dir)
        if not train:  # make evaluate: its validation set is read, and checked, by the loader
            return
        held = source(data.dataset)
        if self.name not in held.tasks:
            raise ConfigError(f"--dataset {data.dataset} holds {held.holds}, not labelled images: pass --task "
                              f"{held.tasks[0]}, or a dataset of labelled images")
        checks = {
            "cifar10": lambda: check_cifar(root, data.download),
            "imagefolder": lambda: check_imagefolder(root),
            # every row, in seconds for a million; whether each file exists: the loader's
            "csv": lambda: check_labelfiles(root, data.path_column, data.label_column),
            # a pack's index, or another tool's tars indexed once (and cached; run_dir: where those in a folder that
            # cannot be written are indexed)
            "shards": lambda: check_shards(root, data.label_key, run_dir),
            # the layout, the columns and every label (the label column alone is read)
            "hf": lambda: check_hf(root, data.image_column, data.label_column, data.train_split, data.val_split),
        }
        checks.get(data.dataset, lambda: None)()
        check_model_spec(self.cfg.model)

    def datasets(self, run_dir=None, train: bool = True) -> tuple:
        train_set, val_set, _ = build_datasets(self.cfg, train=train, run_dir=run_dir)
        self.description = {"classes": class_names(train_set if train_set is not None else val_set)}
        return train_set, val_set

    def network(self, spec: Model) -> nn.Module:
        return build_model(spec, self.num_classes)

    def head(self, model: nn.Module) -> str:
        return head_name(model, self.num_classes)

    def start_from(self, state: dict, model: nn.Module, sized: bool = True) -> dict:
        head = self.head(model)
        return fitted(self.cfg.model, state, model, [f"{head}.weight", f"{head}.bias"], sized)

    # ---------------------------------------------------------------- a step

    def inputs(self, batch, device: torch.device) -> tuple:
        x, y = batch
        return self.images(x, device), y.to(device, non_blocking=True)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        total = F.cross_entropy(output, target, reduction="sum", label_smoothing=self.label_smoothing)
        return total, target.shape[0]

    def count(self, target: torch.Tensor) -> int:
        return target.shape[0]

    def example(self, batch_size: int, device: torch.device) -> tuple:
        size = train_size(self.cfg.data, self.cfg.augmentation)
        x = torch.zeros(batch_size, 3, size, size, device=device)
        x = x.contiguous(memory_format=torch.channels_last) if self.cfg.model.channels_last else x
        return x, torch.zeros(batch_size, dtype=torch.long, device=device)

    def augment(self):
        aug = self.cfg.augmentation
        return BatchAugment(aug, self.num_classes) if BatchAugment.wanted(aug) else None

    # ---------------------------------------------------------------- evaluation

    def metric_state(self, device: torch.device, detail: bool = False) -> torch.Tensor:
        """The loss sum, the correct, the images, the correct in the top 5; with detail the C x C confusion matrix
        after them (rows: the true class, columns: the predicted one). float64: exact for counts up to 2**53."""
        return torch.zeros(4 + (self.num_classes ** 2 if detail else 0), dtype=torch.float64, device=device)

    def update(self, state: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> None:
        state[0] += F.cross_entropy(output.float(), target, reduction="sum", label_smoothing=self.label_smoothing)
        predicted = output.argmax(1)
        state[1] += (predicted == target).sum()
        state[2] += target.numel()
        if self.num_classes > 5:
            state[3] += (output.topk(5, dim=1).indices == target[:, None]).any(1).sum()
        if len(state) > 4:
            state[4:].index_put_((target * self.num_classes + predicted,), torch.ones_like(target, dtype=state.dtype),
                                 accumulate=True)

    def scores(self, state: torch.Tensor, detail: bool = False) -> dict:
        loss, correct, count, in_top5 = state[:4].tolist()
        top5 = self.num_classes > 5
        scores = {"loss": loss / count, "accuracy": correct / count, **({"top5": in_top5 / count} if top5 else {}),
                  "samples": int(count)}
        if detail:
            c = self.num_classes
            scores["confusion"] = state[4:].view(c, c).long().cpu().tolist()
        return scores

    def summary(self, scores: dict) -> str:
        top5 = f", top-5 {100 * scores['top5']:.2f}%" if "top5" in scores else ""
        return f"loss {scores['loss']:.4f}, accuracy {100 * scores['accuracy']:.2f}%{top5}"

    # ---------------------------------------------------------------- records

    def report(self, record: dict, result: dict, pictures: list | None = None) -> tuple:
        """make evaluate's report: per-class accuracy, the most confused pairs and the confusion matrix into the record;
        the figure (train/report/figure.py: the labelled matrix, per-class accuracy worst first, the pairs); the lines
        of the summary."""
        from train.report import figure as figures  # noqa: PLC0415 - matplotlib: the evaluation command's alone

        classes, confusion = self.classes, torch.tensor(result["confusion"])
        per_class = {name: (confusion[i, i] / row).item() if (row := confusion[i].sum()) else None
                     for i, name in enumerate(classes)}
        record.update({"criterion": criterion_of(self.label_smoothing), "per_class_accuracy": per_class,
                       "confused_pairs": figures.confused_pairs(result["confusion"], classes), "classes": classes,
                       "confusion": result["confusion"]})
        top5 = f", top-5 {100 * result['top5']:.2f}%" if "top5" in result else ""
        lines = [f"loss {result['loss']:.4f}, top-1 {100 * result['accuracy']:.2f}%{top5}"]
        worst = sorted((v, k) for k, v in per_class.items() if v is not None)[:5]
        lines.append("lowest per-class accuracy: " + ", ".join(f"{k} {100 * v:.1f}%" for v, k in worst))
        if record["confused_pairs"]:
            pairs = [(f"{r['true']} -> {r['predicted']}", r["count"], 100 * r["share_of_true"])
                     for r in record["confused_pairs"]]
            width = max(len(pair) for pair, _, _ in pairs)
            lines.append("most confused (true -> predicted: images, share of the true class):")
            lines += [f"  {pair:<{width}}  {count:>6}  {share:5.1f}%" for pair, count, share in pairs]
        return figures.figure(record), lines

    def facts(self) -> dict:
        return {**super().facts(), "loss": criterion_of(self.label_smoothing)}

    def export_io(self) -> tuple:
        """An input of the evaluation's centre crop; images in, logits out; the preprocessing and the classes."""
        data, aug = self.cfg.data, self.cfg.augmentation
        size = eval_steps(data, aug)[1]
        return torch.zeros(2, 3, size, size), {"input": "images", "output": "logits"}, \
            {"image_size": size, **preprocessing(data, aug, self.classes, *self.norm)}

    def source(self, train_set, val_set) -> dict:
        return source_of(self.cfg.data, train_set, val_set)

    def input_steps(self, train_set, val_set) -> dict:
        mean, std = self.norm
        size = self.cfg.data.image_size
        return {"normalize": {"mean": list(mean), "std": list(std)},
                "train_size": train_size(self.cfg.data, self.cfg.augmentation),
                "train_transform": _transform_of(train_set, size), "eval_transform": _transform_of(val_set, size)}


def _transform_of(dataset, image_size: int) -> str:
    """The repr of the transform the dataset applies to each image (through its wrappers)."""
    while dataset is not None:
        transform = getattr(dataset, "transform", None)
        if transform is not None:
            return repr(transform)
        dataset = getattr(dataset, "source", None)
    return f"none: images made in memory at {image_size} px"

