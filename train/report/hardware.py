"""The GPUs' readings, through NVML: whether a driver answers (nvml, nvml_read), the device a process trains on as
NVML names it, a MIG slice included (nvml_device), its telemetry at every log line (GpuTelemetry), and the driver and
GPUs a run's manifest records (gpu_facts); and on the CPU, whether MKL sums the same way every time
(mkl_reproducible)."""

from __future__ import annotations

import ctypes
import itertools
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import pynvml
import torch

def nvml():
    """pynvml, initialised, or None where no NVIDIA driver answers (a CPU host, a container without it)."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    return pynvml


def nvml_read(read: str, *args):
    """pynvml's `read` (a function's name, nvmlDeviceGetCount say) of the driver, or None without one or where the
    driver refuses."""
    lib = nvml()
    try:
        return getattr(lib, read)(*args) if lib else None
    except pynvml.NVMLError:
        return None


@dataclass(frozen=True)
class NvmlDevice:
    """Where NVML finds one CUDA device: a whole GPU, or a MIG slice of one."""

    index: int | None = None  # the GPU in NVML's numbering (a MIG slice's parent GPU in the MIG-GPU-... form)
    mig_uuid: str | None = None  # a MIG slice by its own UUID (MIG-<uuid>), which NVML looks up itself
    instance: tuple[int, int] | None = None  # a MIG slice of GPU `index`: its GPU instance and compute instance


def nvml_device(visible: str | None, ordinal: int, gpu_uuids: Sequence[str]) -> NvmlDevice | None:
    """Which NVML device is CUDA device `ordinal` of this process, given CUDA_VISIBLE_DEVICES (`visible`, None
    when unset) and the host's GPU UUIDs in NVML's order; None where CUDA would not see it either.

    Follows torch 2.13.0's own reading (torch/cuda/__init__.py: `_parse_visible_devices`, then
    `_transform_uuid_to_ordinals` or `_device_count_nvml`'s trim). Numbers are read as C's strtoul reads them
    ('1gpu' is 1), and a negative or unreadable one ends the list, as does a number past the last GPU. A list
    that starts with GPU- holds GPU UUIDs, each a unique prefix of one ('GPU-8f2c'); it ends at the first entry
    without the prefix, or that matches no GPU or several. A list that starts with MIG- holds MIG slices and
    ends at the first entry without the prefix. A repeated entry, or one GPU named twice, leaves no device.
    torch maps no MIG slice to NVML; here a slice is MIG-<uuid> (NVML finds it by that UUID) or CUDA's older
    MIG-GPU-<gpu uuid>/<gpu instance id>/<compute instance id>."""
    if visible is None:
        return NvmlDevice(ordinal) if ordinal < len(gpu_uuids) else None
    prefix = next((p for p in ("GPU-", "MIG-") if visible.startswith(p)), None)
    if prefix:  # _parse_visible_devices: the entries while they carry the prefix; a repeat leaves none
        entries: list = list(itertools.takewhile(lambda entry: entry.startswith(prefix), visible.split(",")))
        if len(set(entries)) < len(entries):
            return None
    else:  # _parse_visible_devices: strtoul of each; a repeat leaves none, a negative ends the list
        entries = []
        for entry in visible.split(","):
            number = re.match(r"[+-]?[0-9]+", entry.strip())
            index = int(number[0]) if number else -1
            if index in entries:
                return None
            if index < 0:
                break
            entries.append(index)
    devices: list[NvmlDevice] = []
    for entry in entries:  # _transform_uuid_to_ordinals, _device_count_nvml: the first that fails ends the list
        device = _visible_device(entry, gpu_uuids)
        if device is None:
            break
        if device in devices:
            return None
        devices.append(device)
    return devices[ordinal] if ordinal < len(devices) else None


def _visible_device(entry: int | str, gpu_uuids: Sequence[str]) -> NvmlDevice | None:
    """One entry of CUDA_VISIBLE_DEVICES as an NVML device, or None where it ends the list."""
    def by_uuid(candidate: str) -> int | None:
        matches = [i for i, uuid in enumerate(gpu_uuids) if uuid.startswith(candidate)]
        return matches[0] if len(matches) == 1 else None

    if isinstance(entry, int):
        return NvmlDevice(entry) if entry < len(gpu_uuids) else None
    if entry.startswith("GPU-"):
        index = by_uuid(entry)
        return None if index is None else NvmlDevice(index)
    older = re.fullmatch(r"MIG-(GPU-[^/]+)/([0-9]+)/([0-9]+)", entry)
    if older:
        index = by_uuid(older[1])
        return None if index is None else NvmlDevice(index, instance=(int(older[2]), int(older[3])))
    return NvmlDevice(mig_uuid=entry)


class GpuTelemetry:
    """Utilisation, memory and power of this process's GPU through NVML; nothing, quietly, without a driver.

    The GPU is the one CUDA gives this process (`nvml_device`: CUDA_VISIBLE_DEVICES as numbers, GPU UUIDs or
    MIG slices). On a MIG slice the memory is the slice's own, the power the whole GPU's (every slice on it
    shares the board), and the utilisation is absent: NVML does not measure it on a GPU in MIG mode."""

    def __init__(self, device: torch.device):
        self.memory = self.board = None  # NVML handles: the memory's device, and the board's (utilisation, power)
        self.mig = False
        lib = nvml() if device.type == "cuda" else None
        if lib is None:
            return
        try:
            uuids = [lib.nvmlDeviceGetUUID(lib.nvmlDeviceGetHandleByIndex(i)) for i in range(lib.nvmlDeviceGetCount())]
            where = nvml_device(os.environ.get("CUDA_VISIBLE_DEVICES"), device.index or 0, uuids)
            if where is None:
                return
            if where.mig_uuid:
                self.memory = lib.nvmlDeviceGetHandleByUUID(where.mig_uuid)
                self.board = lib.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self.memory)
            else:
                self.board = lib.nvmlDeviceGetHandleByIndex(where.index)
                self.memory = self.board if where.instance is None else _mig_slice(lib, self.board, where.instance)
            self.mig = where.index is None or where.instance is not None
        except pynvml.NVMLError:  # a container without the GPU's NVML view, a slice gone: stay silent
            self.memory = self.board = None

    def read(self) -> dict[str, float]:
        """{'util': %, 'mem_mib': MiB used, 'power_w': W}, each where NVML reports it; {} without NVML."""
        if self.memory is None:
            return {}
        queries = {"util": lambda: pynvml.nvmlDeviceGetUtilizationRates(self.board).gpu,
                   "mem_mib": lambda: pynvml.nvmlDeviceGetMemoryInfo(self.memory).used / 2**20,
                   "power_w": lambda: pynvml.nvmlDeviceGetPowerUsage(self.board) / 1000}
        if self.mig:
            del queries["util"]
        values = {}
        for name, query in queries.items():
            try:
                values[name] = float(query())
            except pynvml.NVMLError:  # this GPU does not report it (power on some boards)
                pass
        return values


def _mig_slice(lib, gpu, instance: tuple[int, int]):
    """The MIG device of `gpu` with this GPU instance and compute instance id."""
    for i in range(lib.nvmlDeviceGetMaxMigDeviceCount(gpu)):
        try:
            handle = lib.nvmlDeviceGetMigDeviceHandleByIndex(gpu, i)
        except pynvml.NVMLError_NotFound:  # slot i holds no slice
            continue
        if (lib.nvmlDeviceGetGpuInstanceId(handle), lib.nvmlDeviceGetComputeInstanceId(handle)) == instance:
            return handle
    raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)


def gpu_facts() -> dict:
    lib = nvml()
    try:
        names = [lib.nvmlDeviceGetName(lib.nvmlDeviceGetHandleByIndex(i)) for i in range(lib.nvmlDeviceGetCount())]
        return {"driver": lib.nvmlSystemGetDriverVersion(), "gpus": names}
    except (AttributeError, pynvml.NVMLError):  # no driver (lib is None), or NVML refused a query
        return {"driver": None, "gpus": []}


# MKL's service function behind its documented mkl_cbwr_get, exported under this name by torch's CPU library (the
# one place trainbox reads MKL): the reproducibility mode now in force
_MKL_CBWR_ALL, _MKL_CBWR_STRICT = ~0, 0x10000


def mkl_reproducible() -> bool | None:
    """Whether MKL sums the same way every time (the MKL_CBWR that train/__init__.py sets, STRICT taken); None where
    this torch has no MKL."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        mode = lib.mkl_serv_cbwr_get(ctypes.c_int(_MKL_CBWR_ALL))
    except (OSError, AttributeError):
        return None  # another build of torch (MKL linked otherwise): nothing to read
    return bool(mode & _MKL_CBWR_STRICT)
