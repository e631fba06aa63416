"""A process's runtime (train/run/runtime.py): the CPU's kernels sum in a fixed order for a given thread count, so that
two identical runs are bit-identical at every batch size, a per-worker batch of 1 included."""

import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO
from train.cli import parse_config
from train.report.hardware import mkl_reproducible
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


@pytest.mark.skipif(mkl_reproducible() is None, reason="this torch has no MKL")
def test_mkl_sums_the_same_way_every_time():
    """MKL_CBWR=AUTO,STRICT, set by `import train` before MKL's first call: without it, on a CPU with AVX-512, the
    1x1 convolution of a squeeze-and-excite block at a batch of 1 (a GEMM in MKL) gave 3 or 4 different input
    gradients in 200 identical backward passes on 2 threads, and a segmentation run at --batch-size 1 was not
    reproducible. With it: one."""
    assert mkl_reproducible()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    conv = torch.nn.Conv2d(576, 144, 1)
    x = torch.randn(1, 576, 1, 1, generator=g, requires_grad=True)
    grad_out = torch.randn(1, 144, 1, 1, generator=g)
    seen = set()
    for _ in range(200):
        x.grad = None
        conv(x).backward(grad_out)
        seen.add(x.grad.numpy().tobytes())
    torch.set_num_threads(threads)
    assert len(seen) == 1


@pytest.mark.skipif(mkl_reproducible() is None, reason="this torch has no MKL")
def test_a_process_that_started_mkl_before_importing_train_is_told_so():
    """In a process where torch multiplied before `import train` (a notebook), MKL_CBWR came too late: one line."""
    code = ("import torch; torch.ones(8, 8) @ torch.ones(8, 8); "
            "from train.run.runtime import configure_runtime; configure_runtime(1, False)")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": "."}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("\n") == 1 and "MKL was started before trainbox set MKL_CBWR=AUTO,STRICT" in proc.stderr
