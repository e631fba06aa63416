"""A process's runtime (train/run/runtime.py): the CPU's kernels sum in a fixed order for a given thread count, so that
two identical runs are bit-identical at every batch size, a per-worker batch of 1 included."""

import torch

from train.cli import parse_config
from train.run.runtime import configure_runtime
from train.tasks.factory import build_task


def _steps(task, batch: int, steps: int = 3) -> dict:
    """`steps` SGD steps of the task's network at `batch` from the seed: its weights after them."""
    torch.manual_seed(0)
    task.describe({"classes": [str(i) for i in range(11)]})
    model = task.network(task.cfg.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    size = task.cfg.data.image_size
    for _ in range(steps):
        x = torch.randn(batch, 3, size, size, generator=g)
        target = torch.randint(0, 11, (batch, size, size) if task.name == "segmentation" else (batch,), generator=g)
        total, _ = task.loss(model(x), target)
        total.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_two_identical_runs_at_a_batch_of_one_on_two_threads_are_bit_identical():
    """oneDNN's deterministic attribute is set for every run (configure_runtime); without it, a CPU whose oneDNN picks
    a backward that reduces with atomics made two segmentation runs at --batch-size 1 differ in 272 of 319 tensors.
    Each task's network, 3 steps at batch 1 and 2 threads, twice: bit for bit."""
    threads = torch.get_num_threads()
    for flags in (["--task", "segmentation", "--image-size", "32"], ["--image-size", "32"]):
        cfg = parse_config([*flags, "--threads", "2", "--batch-size", "1"])
        torch.backends.mkldnn.deterministic = False
        configure_runtime(cfg.launch.threads, cfg.run.deterministic)
        assert torch.backends.mkldnn.deterministic and torch.get_num_threads() == 2
        task = build_task(cfg)
        first, second = _steps(task, 1), _steps(task, 1)
        assert all(torch.equal(first[k], second[k]) for k in first), flags
    torch.set_num_threads(threads)
