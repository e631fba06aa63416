"""Out of memory, as one line: where it happened, what the device has, and the flags that lower a step's need.

An allocation that fails (CUDA's OutOfMemoryError, the CPU allocator's "can't allocate memory") is the most
common first failure of a new job: a batch or an image size too large for the device. A restart cannot mend
it, so it ends the run with exit code 2 (train/launch.py), not a traceback and not a restart loop.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from train.config import Config
from train.errors import OutOfMemory

_CPU = "can't allocate memory"


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or (isinstance(error, RuntimeError) and _CPU in str(error))


def out_of_memory(error: BaseException, where: str, device: torch.device, cfg: Config) -> OutOfMemory:
    """The one-line error for an allocation that failed `where` (e.g. "training step 1") on `device`."""
    text = str(error)
    cpu = re.search(r"tried to allocate (\d+) bytes", text)  # the CPU allocator's words
    cuda = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)
    asked = f"tried to allocate {_gib(int(cpu.group(1))) if cpu else cuda.group(1)}, " if cpu or cuda else ""
    opt = cfg.optimisation
    fixes = [f"a smaller --batch-size (now {opt.batch_size}; a larger --grad-accum, now {opt.grad_accum}, keeps the "
             f"global batch)", f"a smaller --image-size (now {cfg.data.image_size})"]
    if device.type == "cuda" and cfg.model.precision in ("auto", "fp32"):
        fixes.append("--precision bf16")
    return OutOfMemory(f"out of memory during {where} on {_device_memory(device, asked)}: use "
                       + ", ".join(fixes[:-1]) + " or " + fixes[-1] + ", then run the same command")


def _device_memory(device: torch.device, asked: str) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return (f"GPU {index} ({props.name}; {asked}it has {_gib(props.total_memory)}, "
                f"{_gib(torch.cuda.memory_reserved(index))} held by this process)")
    return f"the CPU ({asked}this machine has {_gib(host_memory())})"


def host_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its cgroup's limit where that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            value = limit.read_text().strip()
        except OSError:
            continue
        if value.isdigit():
            total = min(total, int(value))
    return total


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
