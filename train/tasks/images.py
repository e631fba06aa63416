"""What the built-in tasks share: images and a class count. Their inputs are uint8 images from the loader, normalised
on the training device (--normalize's mean and std), and their model has a head of the classes' count."""

from __future__ import annotations

import torch

from train.components.models import stages
from train.components.weights import normalisation
from train.config.settings import Config
from train.data import prepare_inputs
from train.tasks.task import Task


class ImageTask(Task):
    """A task of images and classes: the normalisation, the inputs on the device, the class count."""

    stand_in_classes = 1000  # before the data is read (the checks on the meta device): a head of this many

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.norm = normalisation(cfg.data.normalize, cfg.model)
        self._norm_on: dict = {}

    @property
    def num_classes(self) -> int:
        return len(self.classes) or self.stand_in_classes

    def normalisation_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The input's mean and std as 1 x 3 x 1 x 1 tensors on the device (made once per device)."""
        if device not in self._norm_on:
            self._norm_on[device] = tuple(torch.tensor(v, device=device).view(1, 3, 1, 1) for v in self.norm)
        return self._norm_on[device]

    def blocks(self, model: torch.nn.Module) -> list[str]:
        """The network's stages (components/models.py's stages: a ResNet's layer1 to layer4, a ViT's encoder layers,
        the built-in CNN's three), or [] for a network of another shape: sharded as one."""
        return stages(model)

    def sizes(self, where: str) -> list[tuple[str, object]]:
        """The images' size where it was spent: the training crop, or the evaluation's."""
        aug, size = self.cfg.augmentation, self.cfg.data.image_size
        if where.startswith("evaluation"):
            return [("--val-crop-size", aug.val_crop_size) if aug.val_crop_size else ("--image-size", size)]
        return [("--train-crop-size", aug.train_crop_size) if aug.train_crop_size else ("--image-size", size)]

    def images(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A batch of uint8 images on the device, normalised, in the model's memory format."""
        return prepare_inputs(x, device, self.cfg.model.channels_last, *self.normalisation_on(device))
