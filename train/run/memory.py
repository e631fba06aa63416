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

from train.base.errors import OutOfMemory
from train.config.settings import Optimisation

_CPU = "can't allocate memory"


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or (isinstance(error, RuntimeError) and _CPU in str(error))


def out_of_memory(error: BaseException, where: str, device: torch.device, opt: Optimisation, sizes: list,
                  precision: str, checkpoint: Path | None, replicas: int = 0) -> OutOfMemory:
    """The one-line error for an allocation that failed `where` (e.g. "training step 1") on `device`, in the run's
    `precision` (as resolved: what --precision auto chose), with the run's batch (opt) and what its task says sizes a
    sample there (sizes: Task.sizes(where)); checkpoint: the run's newest, whose settings a resume keeps (None: the
    next start may change them); replicas: the workers that each hold the whole model (--parallel ddp; 0: none)."""
    text = str(error)
    cpu = re.search(r"tried to allocate (\d+) bytes", text)  # the CPU allocator's words
    cuda = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)
    asked = f"tried to allocate {_gib(int(cpu.group(1))) if cpu else cuda.group(1)}, " if cpu or cuda else ""
    return OutOfMemory(f"out of memory during {where} on {_device_memory(device, asked)}: "
                       + advice(opt, sizes, checkpoint, lower_precision(device, precision), replicas))


def lower_precision(device: torch.device, precision: str) -> str | None:
    """The precision below the run's that its GPU takes: bf16 where it has it, else fp16; None for a run in bf16 or
    fp16 already (what --precision auto chose included) or on a CPU."""
    if device.type != "cuda" or precision != "fp32":
        return None
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def advice(opt: Optimisation, sizes: list, checkpoint: Path | None, lower_precision: str | None,
           replicas: int = 0) -> str:
    """What lowers the memory a step (or an evaluation) needs, as the run's next start can take it: the batch, the
    settings its task says size a sample where memory ran out (the images' training crop or the evaluation's, a
    language model's context), a lower precision (lower_precision: the one this GPU takes, None where the run already
    trains below fp32 or on a CPU), and for a new run whose `replicas` (2 or more) workers each hold the whole model,
    its state sharded over them. A run with a checkpoint keeps its batch, sizes and precision on a resume
    (train/config/resume.py): those go to a new run from its weights."""
    accum = f", now {opt.grad_accum}," if checkpoint is None else ""  # a resume may have changed it: a new run sets it
    fixes = [f"a smaller --batch-size (now {opt.batch_size}; a larger --grad-accum{accum} keeps the global batch)",
             *(f"a smaller {flag} (now {value})" for flag, value in sizes)]
    if lower_precision:
        fixes.append(f"--precision {lower_precision}")
    if replicas > 1 and checkpoint is None:  # a sharded run takes no --weights yet: a new run from scratch alone
        fixes.append(f"--parallel fsdp (each of the {replicas} workers then holds 1/{replicas} of the model's "
                     f"parameters, gradients and optimizer state)")
    listed = " or ".join([", ".join(fixes[:-1]), fixes[-1]] if len(fixes) > 1 else fixes)
    if checkpoint is None:
        return f"use {listed}, then run the same command"
    fixed = ["--batch-size", *(flag for flag, _ in sizes)]
    return (f"the run's checkpoint fixes its {', '.join(fixed)} and --precision: run the same command on a "
            f"device with more memory, or start a new --run-dir from its weights (--weights {checkpoint}) with "
            f"{listed}")


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
