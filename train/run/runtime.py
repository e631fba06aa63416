"""A training or evaluation process's runtime: its device, CPU threads and determinism, and autocast
precision, set once at its start (`autocast`: the one place a forward pass takes it)."""

from __future__ import annotations

import logging
import os

import torch

from train.cluster.identity import Identity, identity, usable_cores
from train.config.settings import Data, Model
from train.report.hardware import mkl_reproducible
from train.run.preflight import check_precision

log = logging.getLogger("train")


def device_name(requested: str, ident: Identity) -> str:
    """torch.device's name of this process's device: a GPU per local rank where CUDA is asked for or there
    (checks.check_devices made sure it is), else the CPU."""
    if requested == "cpu" or not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{ident.local_rank}"


def configure_runtime(threads: int, deterministic: bool) -> None:
    """Threads (--threads; 0: a share of the cores) and determinism (--deterministic), before any tensor work."""
    if threads == 0:
        threads = 1 if deterministic else max(1, usable_cores() // identity().local_world_size)
    torch.set_num_threads(threads)
    # oneDNN (the CPU's convolutions and matmuls) may otherwise pick kernels that reduce with atomics; its
    # deterministic attribute keeps the kernels that sum in a fixed order for a given thread count. MKL's GEMM (a 1x1
    # convolution at a batch of 1) needs MKL_CBWR, which only takes before MKL's first call: train/__init__.py.
    torch.backends.mkldnn.deterministic = True
    if mkl_reproducible() is False:
        log.warning("MKL was started before trainbox set MKL_CBWR=AUTO,STRICT (torch did work before "
                    "`import train`), so two identical runs may differ in the last bits: set MKL_CBWR=AUTO,STRICT "
                    "in the environment, or import train before any tensor work")
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    else:
        torch.backends.cudnn.benchmark = True


# autocast's dtype of each precision a run can train in (None: autocast off)
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def precision_of(spec: Model, device_type: str) -> str:
    """The precision a run trains in on `device_type`: --precision, or with auto bf16 on a CUDA GPU that has it,
    else fp32. The one place "auto" is decided: the run (resolve_precision) and its plan (train/run/plan.py) ask
    here."""
    if spec.precision != "auto":
        return spec.precision
    cuda = device_type == "cuda" and torch.cuda.is_available()
    return "bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32"


def resolve_precision(spec: Model, data: Data, device: torch.device) -> str:
    """The precision this process trains or evaluates in on `device` (DTYPES[it]: autocast's dtype), checked."""
    check_precision(spec, data, on_cpu=device.type != "cuda")
    return precision_of(spec, device.type)


def autocast(device: torch.device, dtype: torch.dtype | None):
    """The context a forward pass runs in: autocast to `dtype` on the device's type, off for fp32 (None)."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)
