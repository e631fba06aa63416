"""What a run reports: console progress, TensorBoard scalars, metrics.jsonl, the logging window, the manifest (the
GPUs' readings: train/report/hardware.py).

Only global rank 0 writes; other ranks get a MetricsWriter that does nothing.
"""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter

from train.cluster.identity import identity, is_main
from train.config.settings import Run
from train.files.rundir import MetricsFile
from train.files.writable import FULL_ERRNOS
from train.report.hardware import gpu_facts, mkl_reproducible

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
        "mkl_reproducible": mkl_reproducible(),  # and MKL's (MKL_CBWR=AUTO,STRICT; None: no MKL)
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
