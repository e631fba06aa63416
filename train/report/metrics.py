"""What a run reports: console progress, TensorBoard scalars, metrics.jsonl, GPU telemetry, the manifest.

Only global rank 0 writes; other ranks get a MetricsWriter that does nothing.
"""

from __future__ import annotations

import itertools
import logging
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pynvml
import torch
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter

from train.cluster.identity import identity, is_main
from train.config.settings import Run
from train.files.rundir import FULL_ERRNOS, MetricsFile

log = logging.getLogger("train")


class MetricsWriter:
    """metrics.jsonl (one JSON object per line, flushed at once) plus TensorBoard scalars and MLflow."""

    def __init__(self, run_dir: Path | None, tensorboard: bool, resume_step: int = 0, tracker=None):
        self.active = run_dir is not None
        self.tracker = tracker  # MLflow (train/report/tracker.py), when the run is tracked
        self._jsonl = None
        self._tb = None
        if not self.active:
            return
        self._jsonl = MetricsFile(run_dir, resume_step)  # drops what an attempt logged after the resume's step
        if tensorboard:
            # purge_step drops events logged after the checkpoint we resumed from (a stop after it).
            # Its own thread writes the events to disk every 5 s: nothing waits on the file in the loop.
            self._tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step or None, flush_secs=5)

    def write(self, step: int, kind: str, values: dict) -> None:
        if not self.active:
            return
        now = round(time.time(), 3)
        self._jsonl.append({"step": step, "kind": kind, "time": now, **values})
        if self.tracker is not None:
            self.tracker.log(step, kind, values, now)
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()


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


class LogWindow:
    """What a log line reports: the mean loss, speed, step time and the fraction of it spent waiting for
    data, over the steps since the last line, averaged over the ranks."""

    def __init__(self, device: torch.device, samples_per_step: int):
        self.device, self.samples_per_step = device, samples_per_step
        self.reset()

    def reset(self) -> None:
        # the loss's sum, its count and the micro-batches that counted nothing: on the device, no sync
        self.loss = torch.zeros(3, dtype=torch.float64, device=self.device)
        self.steps, self.wait, self.start = 0, 0.0, time.perf_counter()

    def add(self, sums: list[torch.Tensor], counts: list) -> None:
        """One optimizer step: its micro-batches' loss sums and the items each sums over (the task's loss)."""
        for total, count in zip(sums, counts, strict=True):
            self.loss[0] += total
            self.loss[1] += count
            self.loss[2] += count == 0
        self.steps += 1

    def report(self, world: int) -> dict:
        """The window's figures (every rank calls it on the same step: an all-reduce); starts a new one. The loss:
        the mean over every item the window's steps trained on, on every rank (None where they counted nothing);
        empty_batches: the micro-batches of every rank that counted nothing (a crop of ignored pixels alone)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - self.start
        totals = torch.cat([self.loss, torch.tensor([self.wait], dtype=torch.float64, device=self.device)])
        if dist.is_initialized():
            dist.all_reduce(totals)
        loss_sum, count, empty, wait = totals.tolist()
        values = {"loss": loss_sum / count if count else None,  # None: every micro-batch counted nothing
                  "samples_per_s": self.steps * self.samples_per_step / elapsed,
                  "step_time_s": elapsed / self.steps, "data_wait_frac": wait / world / elapsed,
                  "empty_batches": int(empty)}
        self.reset()
        return values


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def gpu_facts() -> dict:
    lib = nvml()
    try:
        names = [lib.nvmlDeviceGetName(lib.nvmlDeviceGetHandleByIndex(i)) for i in range(lib.nvmlDeviceGetCount())]
        return {"driver": lib.nvmlSystemGetDriverVersion(), "gpus": names}
    except (AttributeError, pynvml.NVMLError):  # no driver (lib is None), or NVML refused a query
        return {"driver": None, "gpus": []}


def build_manifest(run: Run, ident, device: torch.device, hostnames: list[str], resumed_from: int | None) -> dict:
    """manifest.json: where and with what the run trains (its --seed and --deterministic from the Run section)."""
    commit = os.environ.get("TRAINBOX_GIT_COMMIT") or _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    nccl = None
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            nccl = None
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv,
        "git_commit": commit,
        "git_dirty": bool(status) if status is not None else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": nccl,
        **gpu_facts(),
        "device": str(device),
        "launcher": ident.launcher,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "world_size": ident.world_size,
        "local_world_size": ident.local_world_size,
        "hostnames": hostnames,
        "seed": run.seed,
        "deterministic": run.deterministic,
        "threads": torch.get_num_threads(),
        "onednn_deterministic": torch.backends.mkldnn.deterministic,  # the CPU's kernels sum in a fixed order
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "image": os.environ.get("TRAINBOX_IMAGE"),
        "image_digest": os.environ.get("TRAINBOX_IMAGE_DIGEST"),
        "resumed_from_step": resumed_from,
    }


def setup_logging(run_dir: Path | None) -> None:
    log.handlers.clear()
    log.propagate = False
    log.setLevel(logging.INFO if is_main() else logging.WARNING)
    console = logging.StreamHandler()
    prefix = "" if is_main() else f"[rank {identity().global_rank}] "
    console.setFormatter(logging.Formatter(f"{prefix}%(asctime)s %(message)s", "%H:%M:%S"))
    log.addHandler(console)
    if run_dir is not None:
        handler = RunLog(run_dir / "train.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)


class RunLog(logging.FileHandler):
    """train.log. A line a full disk (or a used-up quota) keeps out is left out without logging's traceback of it: the
    writes of metrics.jsonl and status.json that follow each log line meet the same disk, and the run ends on the one
    line that says so (train/run/worker.py)."""

    def handleError(self, record: logging.LogRecord) -> None:
        if getattr(sys.exc_info()[1], "errno", None) not in FULL_ERRNOS:
            super().handleError(record)
