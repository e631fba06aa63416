"""Model factories for tests, loaded through --model tests.models:NAME like a user's own."""

import torch
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


def wide_mlp(num_classes: int) -> nn.Module:
    """About 20 M parameters: a checkpoint of about 240 MB, slow enough to write that a kill lands mid-save."""
    return nn.Sequential(nn.AdaptiveAvgPool2d(16), nn.Flatten(), nn.Linear(768, 4096), nn.ReLU(),
                         nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, num_classes))


class _HangsInForward(nn.Module):
    """Trains normally for 30 forward passes, then blocks forever in Python (a stuck rank)."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.net = tiny_groupnorm_cnn(num_classes)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > 30:
            import threading

            threading.Event().wait()  # never set
        return self.net(x)


def hangs_after_30_steps(num_classes: int) -> nn.Module:
    return _HangsInForward(num_classes)


class _NeedsTooMuchMemory(nn.Module):
    """Trains normally until `when` says otherwise, then asks the real allocator for a blown-up activation
    (the input upsampled 4096 times: terabytes), as a batch of images too large for the device does."""

    def __init__(self, num_classes: int, when):
        super().__init__()
        self.net = tiny_groupnorm_cnn(num_classes)
        self.when, self.calls = when, 0

    def forward(self, x):
        self.calls += self.training and bool(x.any())  # not the trainer's settling pass, on a batch of zeros
        if self.when(self):
            x = nn.functional.interpolate(x, scale_factor=4096)
        return self.net(x)


def out_of_memory_at_step_3(num_classes: int) -> nn.Module:
    return _NeedsTooMuchMemory(num_classes, lambda m: m.training and m.calls >= 3)


def out_of_memory_in_evaluation(num_classes: int) -> nn.Module:
    return _NeedsTooMuchMemory(num_classes, lambda m: not m.training)


def out_of_memory_on_rank_1_at_step_3(num_classes: int) -> nn.Module:
    """Rank 1 alone (a larger batch of variable-size images on one GPU): rank 0 waits for it in the all-reduce."""
    import os

    rank_1 = os.environ.get("RANK") == "1"
    return _NeedsTooMuchMemory(num_classes, lambda m: rank_1 and m.training and m.calls >= 3)


class _PausesInItsFirstEvaluation(nn.Module):
    """The built-in CNN's numbers; the first rank to evaluate in a run whose TRAINBOX_TEST_MARKER file does not
    exist yet writes its rank there and pauses 10 s, so that a test can kill it there, surely inside it."""

    def __init__(self, num_classes: int):
        super().__init__()
        from train.components.models import SmallCNN

        self.net = SmallCNN(num_classes, width=8)

    def forward(self, x):
        import os
        import time
        from pathlib import Path

        marker = os.environ.get("TRAINBOX_TEST_MARKER")
        if not self.training and marker and not Path(marker).exists():
            try:
                with open(marker, "x") as f:  # one rank only: the first to get here
                    f.write(os.environ.get("RANK", "0"))
            except FileExistsError:
                return self.net(x)
            time.sleep(10)
        return self.net(x)


def pauses_in_its_first_evaluation(num_classes: int) -> nn.Module:
    return _PausesInItsFirstEvaluation(num_classes)


class _BranchesOnItsInput(nn.Module):
    """A branch on the value of its input: a graph that torch.export cannot capture."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.net = tiny_groupnorm_cnn(num_classes)

    def forward(self, x):
        if x.mean() > 0:
            x = x * 2
        return self.net(x)


def branches_on_its_input(num_classes: int) -> nn.Module:
    return _BranchesOnItsInput(num_classes)


class _HasNoOnnxOperator(nn.Module):
    """A modified Bessel function (torch.special.i0) of its input: torch.export captures it, ONNX has no operator
    for it."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.net = tiny_groupnorm_cnn(num_classes)

    def forward(self, x):
        return self.net(torch.special.i0(x) - 1)


def has_no_onnx_operator(num_classes: int) -> nn.Module:
    return _HasNoOnnxOperator(num_classes)


class _FreedSlowly(nn.Module):
    """Trains normally; freeing it, after the run, never ends (a destructor that waits forever)."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.net = tiny_groupnorm_cnn(num_classes)

    def forward(self, x):
        return self.net(x)

    def __del__(self):
        import threading

        threading.Event().wait()  # never set


def never_freed(num_classes: int) -> nn.Module:
    return _FreedSlowly(num_classes)


def leaves_a_thread(num_classes: int) -> nn.Module:
    """Starts a thread that never ends and that the process must wait for (not a daemon)."""
    import threading

    threading.Thread(target=threading.Event().wait, name="never-ends", daemon=False).start()
    return tiny_groupnorm_cnn(num_classes)


class _InDouble(nn.Module):
    """A network in float64, its input cast on the way in. Two runs that sum the same numbers in another order (more
    workers, accumulation) then differ by float64's rounding, about 1e-16 a step and well under 1e-9 after tens of
    steps on any CPU, where a wrong sample moves the weights by far more (3e-3 and up, measured in
    tests/e2e/test_reproducibility.py): their tests compare tightly on every machine. float32's rounding, amplified
    over 27 steps, reached 3e-5 on values near 0.2 on one CPU and not on another."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net.double()

    def forward(self, x):
        return self.net(x.double())


def small_cnn_in_double(num_classes: int) -> nn.Module:
    """The debug preset's built-in CNN (with BatchNorm), in float64."""
    from train.components.models import SmallCNN

    return _InDouble(SmallCNN(num_classes, width=8))


def tiny_groupnorm_cnn_in_double(num_classes: int) -> nn.Module:
    return _InDouble(tiny_groupnorm_cnn(num_classes))


def tiny_segmenter_in_double(num_classes: int) -> nn.Module:
    """A segmentation network without batch statistics, in float64: each pixel's logits (N x C x H x W)."""
    return _InDouble(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
                                   nn.Conv2d(8, num_classes, 1)))


def tiny_segmenter_with_batchnorm_in_double(num_classes: int) -> nn.Module:
    """A segmentation network with BatchNorm's running statistics, in float64."""
    return _InDouble(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                   nn.Conv2d(8, num_classes, 1)))


def gpt_tiny_in_double(vocab: int) -> nn.Module:
    """--task lm's gpt-tiny in float64 (token ids stay integers): runs that sum in another order agree to rounding."""
    from train.components.gpt import SIZES, Gpt

    return Gpt(SIZES["gpt-tiny"], vocab).double()
