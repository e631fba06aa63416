"""Model factories for tests, loaded through --model tests.models:NAME like a user's own."""

from torch import nn


def tiny_groupnorm_cnn(num_classes: int) -> nn.Module:
    """No batch statistics: the loss of a batch does not depend on how it is split across workers."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, num_classes))


NOT_CALLABLE = 42


def crashes_on_rank_1(num_classes: int) -> nn.Module:
    """Rank 1 fails while building the model; rank 0 goes on into the first collective."""
    import os

    if os.environ.get("RANK") == "1":
        raise RuntimeError("deliberate failure on rank 1")
    return tiny_groupnorm_cnn(num_classes)
