"""Checkpoints: atomic writes by global rank 0, a checksum beside each, newest-valid lookup, safe loads.

Layout: RUN_DIR/checkpoints/step_00001500.pt with step_00001500.pt.crc32 beside it (its size and
CRC32, computed while the file streams out; sha256 sidecars of older runs are still checked). A file
counts only once it has been renamed into place and its size and checksum match, so a save killed
halfway, a truncated file or flipped bytes are never loaded; the newest checkpoint that verifies wins.
A sharded checkpoint is a folder, step_00001500.dcp (train/files/shards.py), listed, verified, pruned and
loaded here beside the files: a run may hold both kinds.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import queue
import re
import shutil
import threading
import zlib
from pathlib import Path

import torch

from train.base.errors import ConfigError
from train.files import shards
from train.files.rundir import atomic_file, atomic_write, file_crc32, file_digest, read_status
from train.files.writable import FULL_BYTES

log = logging.getLogger("train")

_NAME = re.compile(r"step_(\d{8})\.(pt|dcp)$")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


class SaveError(OSError):
    """A checkpoint could not be written; `needed` is its size in bytes (for the free-space check)."""

    def __init__(self, error: OSError, needed: int):
        super().__init__(error.errno, error.strerror or str(error))
        self.needed = needed


def remove_partial(run_dir: Path) -> int:
    """Delete temp files and folders left by a save that was killed (they are never loaded); return the bytes
    freed."""
    freed = 0
    for tmp in checkpoint_dir(run_dir).glob(".step_*.tmp*"):
        with contextlib.suppress(OSError):
            if shards.is_temp(tmp):
                freed += shards.size_of(tmp)
                shutil.rmtree(tmp)
            else:
                freed += tmp.stat().st_size
                tmp.unlink()
    return freed


class _ChecksumFile:
    """The file torch.save streams into: every chunk goes to disk and into a CRC32, with no copy in memory.
    A big chunk is checksummed on a helper thread while the main thread writes it (both release the GIL)."""

    BIG = 1 << 18

    def __init__(self, f):
        self.f, self.crc, self.size = f, 0, 0
        self.error: OSError | None = None  # torch.save reports a failed write as a RuntimeError
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._checksum_chunks, daemon=True)
        self._thread.start()

    def _checksum_chunks(self) -> None:
        while (chunk := self._todo.get()) is not None:
            self.crc = zlib.crc32(chunk, self.crc)
            self._done.put(True)

    def write(self, data) -> int:
        self.size += len(data)
        big = len(data) >= self.BIG
        if big:
            self._todo.put(data)  # checksummed while written; `data` stays valid until this call returns
        else:
            self.crc = zlib.crc32(data, self.crc)
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise
        finally:
            if big:
                self._done.get()

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:
        if self._thread.is_alive():
            self._todo.put(None)
            self._thread.join()

    def sidecar(self, name: str) -> bytes:
        return f"crc32:{self.crc:08x} size:{self.size}  {name}\n".encode()


def _state_bytes(state) -> int:
    """Roughly what a checkpoint of `state` takes on disk: its tensors' bytes."""
    if isinstance(state, torch.Tensor):
        return state.nelement() * state.element_size()
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(v) for v in state)
    return 0


def prepare(run_dir: Path) -> Path:
    """Before a save: the last pruning done, the checkpoints folder made, what a killed save left removed."""
    _wait_for_pruning()
    folder = checkpoint_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    remove_partial(run_dir)
    return folder


def save_checkpoint(run_dir: Path, step: int, state: dict, keep: int) -> Path:
    """Stream the state into a temp file while checksumming it, and move it into place (fsynced, the folder too:
    runfiles.atomic_file); then its sidecar the same way; then prune to the newest `keep`. Old checkpoints are
    removed only after the new one is complete, so a failed save loses nothing; a torn save never verifies."""
    path = prepare(run_dir) / f"step_{step:08d}.pt"
    out = None
    crc = torch.serialization.get_crc32_options()
    try:
        with atomic_file(path) as tmp:
            f = open(tmp, "wb")
            try:
                out = _ChecksumFile(f)
                torch.serialization.set_crc32_options(False)  # the zip's own CRCs would only repeat ours, slower
                torch.save(state, out)
                f.flush()
                os.fsync(f.fileno())
            finally:
                torch.serialization.set_crc32_options(crc)
                if out is not None:
                    out.close()
                with contextlib.suppress(OSError):  # after a failed write, that write's error is the one to say
                    f.close()
        atomic_write(sidecar_of(path), out.sidecar(path.name))  # a .pt without its sidecar never verifies
    except (OSError, RuntimeError) as e:
        path.unlink(missing_ok=True)  # a checkpoint without its sidecar would only be skipped
        cause = e if isinstance(e, OSError) else getattr(out, "error", None)
        if cause is None:
            raise
        raise SaveError(cause, _state_bytes(state) + (1 << 16)) from e
    prune(run_dir, path, keep)
    return path


def prune(run_dir: Path, newest: Path, keep: int) -> None:
    """After `newest` is in place: checkpoints of later steps exist only if resume skipped them as damaged, so they
    go, then the oldest past `keep`. Deleting big files takes a while: a thread does it, and any look at the folder
    waits for it."""
    existing = list_checkpoints(run_dir)
    later = [p for p in existing if _step(p) > _step(newest)]
    doomed = later + [p for p in existing if p not in later][:-keep]
    global _pruning
    _pruning = threading.Thread(target=_delete, args=(doomed,), name="checkpoint-prune")
    _pruning.start()


_pruning: threading.Thread | None = None


def _delete(paths: list[Path]) -> None:
    for old in paths:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
            continue
        for file in (old, *(old.with_name(old.name + kind) for kind in SIDECARS)):
            with contextlib.suppress(OSError):
                file.unlink()


def _wait_for_pruning() -> None:
    if _pruning is not None:
        _pruning.join()


def _step(path: Path) -> int:
    return int(_NAME.fullmatch(path.name).group(1))


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints (files, and sharded folders), oldest first (by step number)."""
    _wait_for_pruning()
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if _NAME.fullmatch(p.name)), key=lambda p: (_step(p), p.name))


SIDECARS = (".crc32", ".sha256")  # what this version writes; what earlier versions wrote


def sidecar_of(path: Path) -> Path:
    """The checksum file this version writes beside a checkpoint."""
    return path.with_name(path.name + SIDECARS[0])


def verify(path: Path) -> str | None:
    """None if `path` matches the size and checksum in its sidecar (a sharded folder: each of its files), else why
    not."""
    if path.is_dir():
        return shards.verify(path)
    sidecar = next((path.with_name(path.name + k) for k in SIDECARS if path.with_name(path.name + k).is_file()),
                   None)
    if sidecar is None:
        return "no checksum file beside it (the save did not finish)"
    fields = sidecar.read_text().split()
    if sidecar.suffix == ".sha256":
        ok = bool(fields) and file_digest(path) == fields[0]
    else:
        values = dict(field.split(":", 1) for field in fields if ":" in field)
        if str(path.stat().st_size) != values.get("size"):
            return f"size {path.stat().st_size} but {values.get('size')} was saved (file truncated)"
        ok = file_crc32(path) == values.get("crc32")
    return None if ok else "checksum mismatch (file corrupted)"


def newest_valid(run_dir: Path) -> Path | None:
    for path in reversed(list_checkpoints(run_dir)):
        problem = verify(path)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def load_checkpoint(path: Path, device: torch.device) -> dict:
    """weights_only=True: a checkpoint is data, never code. Anything else is refused, not executed. Of a sharded
    folder, its state.pt: every key but the model's and the optimizer's, which the workers read from the shards."""
    try:
        return shards.read_state(path, device) if path.is_dir() else torch.load(path, map_location=device,
                                                                                 weights_only=True)
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
        needed = shards.size_of(newest[0]) if newest[0].is_dir() else newest[0].stat().st_size
    last = read_status(run_dir)
    if last.get("state") == "failed":  # a save that failed for want of space noted what it needed
        needed = max(needed, int(last.get("needed_bytes", 0)))
    partial = sum(shards.size_of(p) if p.is_dir() else p.stat().st_size
                  for p in checkpoint_dir(run_dir).glob(".step_*.tmp*")) if checkpoint_dir(run_dir).is_dir() else 0
    free = shutil.disk_usage(run_dir).free + partial
    if needed and free < needed + FULL_BYTES:
        return (f"{run_dir} has {free / 2**20:.1f} MiB free but needs {(needed + FULL_BYTES) / 2**20:.1f} MiB to "
                f"train on (a checkpoint of {needed / 2**20:.1f} MiB, and {FULL_BYTES / 2**20:.0f} MiB for the run's "
                f"other files): free space on that disk (or move the run), then run the same command to resume")
    return None


def finished(status: dict, max_steps: int, model_written: bool, epochs: int = 0) -> bool:
    """A run that is done up to max_steps (or, given in epochs, up to the steps its --epochs came to) with its
    model.pt written: nothing to train, evaluate or write."""
    if epochs:
        max_steps = status.get("max_steps", -1) if status.get("epochs") == epochs else float("inf")
    return status.get("state") == "done" and status.get("step", -1) >= max_steps and model_written


def serialise(state_dict: dict) -> bytes:
    """A state dict as the bytes torch.save writes (for an atomic write of model.pt and its kin)."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    return buffer.getvalue()
