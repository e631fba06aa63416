"""Checkpoints: atomic writes by global rank 0, a checksum beside each, newest-valid lookup, safe loads.

Layout: RUN_DIR/checkpoints/step_00001500.pt with step_00001500.pt.sha256 beside it. A file counts
only once it has been renamed into place and its checksum matches, so a save killed halfway, a
truncated file or flipped bytes are never loaded; the newest checkpoint that verifies wins.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path

import torch

log = logging.getLogger("train")

_NAME = re.compile(r"step_(\d{8})\.pt$")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write to a temp file, fsync, rename over `path`, fsync the folder. On failure nothing is left."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class SaveError(OSError):
    """A checkpoint could not be written; `needed` is its size in bytes (for the free-space check)."""

    def __init__(self, error: OSError, needed: int):
        super().__init__(error.errno, error.strerror or str(error))
        self.needed = needed


def remove_partial(run_dir: Path) -> int:
    """Delete temp files left by a save that was killed (they are never loaded); return the bytes freed."""
    freed = 0
    for tmp in checkpoint_dir(run_dir).glob(".step_*.tmp.*"):
        with contextlib.suppress(OSError):
            freed += tmp.stat().st_size
            tmp.unlink()
    return freed


def save_checkpoint(run_dir: Path, step: int, state: dict, keep: int) -> Path:
    """Serialise in memory, then write atomically with its sha256 sidecar; prune to the newest `keep`.
    Old checkpoints are removed only after the new one is complete, so a failed save loses nothing."""
    folder = checkpoint_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    remove_partial(run_dir)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    path = folder / f"step_{step:08d}.pt"
    try:
        atomic_write(path, data)
        atomic_write(path.with_name(path.name + ".sha256"),
                     f"{hashlib.sha256(data).hexdigest()}  {path.name}\n".encode())
    except OSError as e:
        path.unlink(missing_ok=True)  # a checkpoint without its checksum would only be skipped later
        raise SaveError(e, len(data)) from e
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
        old.with_name(old.name + ".sha256").unlink(missing_ok=True)
    return path


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint files, oldest first (by step number)."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if _NAME.fullmatch(p.name)), key=lambda p: p.name)


def verify(path: Path) -> str | None:
    """None if `path` matches its checksum, else why not."""
    sidecar = path.with_name(path.name + ".sha256")
    if not sidecar.is_file():
        return "no checksum file beside it (the save did not finish)"
    expected = sidecar.read_text().split()[0] if sidecar.read_text().strip() else ""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        return "checksum mismatch (file truncated or corrupted)"
    return None


def newest_valid(run_dir: Path) -> Path | None:
    for path in reversed(list_checkpoints(run_dir)):
        problem = verify(path)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def load_checkpoint(path: Path, device: torch.device) -> dict:
    """weights_only=True: a checkpoint is data, never code. Anything else is refused, not executed."""
    from train.config import ConfigError  # noqa: PLC0415

    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        why = next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line or "Unsupported" in line),
                   "not plain tensors and containers")
        raise ConfigError(f"{path} is not a weights-only checkpoint, refused without running it ({why.rstrip('.')}): "
                          f"move it out of the run directory") from None


def space_problem(run_dir: Path) -> str | None:
    """Why the next checkpoint cannot fit in run_dir, or None. Checked at start-up, so a run whose disk
    filled up fails in seconds on every restart instead of training up to the save that fails again."""
    if not run_dir.is_dir():
        return None
    needed = 0
    newest = list_checkpoints(run_dir)[-1:]
    if newest:
        needed = newest[0].stat().st_size
    try:
        last = json.loads((run_dir / "status.json").read_text())
        if last.get("state") == "failed":
            needed = max(needed, int(last.get("needed_bytes", 0)))
    except (OSError, ValueError):
        pass
    partial = sum(p.stat().st_size for p in checkpoint_dir(run_dir).glob(".step_*.tmp.*")) \
        if checkpoint_dir(run_dir).is_dir() else 0
    free = shutil.disk_usage(run_dir).free + partial
    if needed and free < needed + (1 << 20):
        return (f"{run_dir} has {free / 2**20:.1f} MiB free but a checkpoint needs {needed / 2**20:.1f} MiB: "
                f"free space on that disk (or move the run), then run the same command to resume")
    return None


def write_status(run_dir: Path, state: str, step: int, **extra) -> None:
    """RUN_DIR/status.json: starting | running | stopped | failed | done, for scripts that decide whether
    to resume (the Slurm template requeues only 'stopped')."""
    record = {"state": state, "step": step, **extra}
    atomic_write(run_dir / "status.json", (json.dumps(record) + "\n").encode())
