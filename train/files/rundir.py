"""The run directory: its name (launch_run_dir: --run-dir, else runs/<start time>, a torchrun launch's own start) and
its small files, each written and read here alone (standard library only: the cluster jobs and the host tools read
them with the host's python3 too).

  status.json      the run's state for scripts that decide whether to resume (write_status, read_status)
  manifest.json    what the latest start ran on, earlier starts under "previous" (write_manifest, read_json)
  metrics.jsonl    one JSON record per line, flushed at once (MetricsFile; read_metrics: a line cut short is
                   skipped)
  config.json      the config as given; classes.json the class names in label order; plan.json what the run
                   derived from them (write_run_files, read_config, read_classes)

Every write is atomic (but a failure's record on a full disk, where no temporary file fits: write_status): a temp
file, fsync, rename over the file, fsync of the folder (`atomic_file`, the one way files are written across trainbox;
`file_digest` the one way a file's SHA-256 is read). Every JSON file is strict JSON (to_json): a figure that is not
finite (a diverged loss) is written as null, never as NaN or Infinity, which strict parsers reject. Where the run
directory cannot be made or written, train/files/writable.py names the cause and its fix in one line.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

from train.files.writable import FULL_ERRNOS

STATES = ("starting", "running", "stopped", "failed", "done")


def finite(value):
    """value with every float that is not finite (NaN, +-Infinity) replaced by None, in dicts, lists and tuples."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def to_json(value, indent: int | None = None) -> str:
    """Strict JSON (RFC 8259): a figure that is not finite becomes null."""
    return json.dumps(finite(value), indent=indent, allow_nan=False)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def move_into_place(tmp: Path, path: Path) -> None:
    """The file `tmp`, written whole, takes `path`'s name: fsynced, renamed over it, the folder fsynced. A crash leaves
    the old file or the new one, never a torn one."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_file(path: Path, suffix: str = "") -> Iterator[Path]:
    """How every file of trainbox is written: under a temporary name beside `path` (the block writes it there; suffix:
    an ending its writer needs, such as .png), then moved into place (move_into_place) once the block ends. On failure
    nothing is left."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}{suffix}")
    try:
        yield tmp
        move_into_place(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write(path: Path, data: bytes) -> None:
    """`data` as the file `path`, atomically (atomic_file)."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def file_crc32(path: Path) -> str:
    """A file's CRC32, as the checkpoints' checksum files write it (8 hex digits)."""
    crc = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def file_digest(path: Path, algorithm: str = "sha256") -> str:
    """The hex digest of a file's bytes (SHA-256 unless another algorithm is named)."""
    with open(path, "rb") as f:
        if hasattr(hashlib, "file_digest"):  # Python 3.11 and later
            return hashlib.file_digest(f, algorithm).hexdigest()
        digest = hashlib.new(algorithm)
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
        return digest.hexdigest()


def status_record(state: str, step: int, env, **extra) -> dict:
    """What status.json says: starting (before the first step) | running | stopped (at a checkpoint, on a
    signal) | failed | done, for scripts that decide whether to resume (the Slurm template requeues only
    'stopped', and only what this attempt of the job wrote: see train/cluster/jobs.py after)."""
    if state not in STATES:
        raise ValueError(f"status {state!r} is not one of {STATES}")
    record = {"state": state, "step": step, **extra}
    if "SLURM_JOB_ID" in env:
        record["slurm_job_id"] = env["SLURM_JOB_ID"]
        record["slurm_restart_count"] = int(env.get("SLURM_RESTART_COUNT", "0"))
    return record


def write_status(run_dir: Path, state: str, step: int, **extra) -> None:
    """status.json, stamped with the time it was written ("updated", ISO 8601 with the UTC offset): a live run writes
    it at every log line, so a script tells a run that trains from one that died. A failure is recorded on a full disk
    too, where no temporary file fits: over the old record, in the space it holds."""
    record = {**status_record(state, step, os.environ, **extra), "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    data = (to_json(record) + "\n").encode()
    try:
        atomic_write(run_dir / "status.json", data)
    except OSError as e:
        if state != "failed" or e.errno not in FULL_ERRNOS or not _overwrite(run_dir / "status.json", data):
            raise


def _overwrite(path: Path, data: bytes) -> bool:
    """`data` over the file `path` where it fits in the blocks the file holds (a full disk gives no more), or False.
    Not atomic (a crash midway tears the file, which then reads as none): for a record a full disk must not silence."""
    with contextlib.suppress(OSError), open(path, "r+b") as f:
        if len(data) <= os.fstat(f.fileno()).st_blocks * 512:
            f.write(data)
            f.truncate()
            f.flush()
            os.fsync(f.fileno())
            return True
    return False


def read_json(path: Path) -> dict:
    """A JSON file of the run directory, or {} when it is missing or unreadable."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_status(run_dir: Path) -> dict:
    return read_json(run_dir / "status.json")


def failed_since(run_dir: Path, when: float) -> bool:
    """Whether status.json records an error that a restart cannot mend (exit code 2), written after `when`."""
    status = read_status(run_dir)
    with contextlib.suppress(OSError):
        return status.get("state") == "failed" and status.get("exit_code") == 2 and \
            (run_dir / "status.json").stat().st_mtime >= when
    return False


def failed_in_this_launch(run_dir: Path, env) -> bool:
    """Whether this process is a torchrun restart after this very launch (TORCHELASTIC_RUN_ID) ended on an error
    that a restart cannot mend: status.json says failed with exit code 2 and names the launch. torchrun restarts
    a worker group on any non-zero exit; such an attempt refuses at once, before any import of torch or any
    rendezvous, and torchrun ends non-zero once its restarts are spent. A crash (exit 1, a kill) is not such an
    error: its restart resumes. The same command run again is a new launch, and tries again."""
    if int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0 or "TORCHELASTIC_RUN_ID" not in env:
        return False
    status = read_status(run_dir)
    return status.get("state") == "failed" and status.get("exit_code") == 2 and \
        status.get("launch") == env["TORCHELASTIC_RUN_ID"]


def write_manifest(run_dir: Path, manifest: dict) -> None:
    """manifest.json describes the latest start; earlier starts of the same run are kept under 'previous'."""
    path = run_dir / "manifest.json"
    old = read_json(path)
    previous = old.pop("previous", []) + [old] if old else []
    atomic_write(path, (to_json({**manifest, "previous": previous}, indent=2) + "\n").encode())


def write_run_files(run_dir: Path, config: dict, classes: list[str], plan: dict, description: dict | None = None) -> None:
    """config.json (the config as given), classes.json (label i is name i), task.json (what the task says its data is,
    whole: classes, a vocabulary, a context, ...) and plan.json (what the run derived)."""
    atomic_write(run_dir / "config.json", (to_json(config, indent=2) + "\n").encode())
    atomic_write(run_dir / "classes.json", (to_json(classes) + "\n").encode())
    atomic_write(run_dir / "task.json", (to_json(description or {"classes": classes}, indent=1) + "\n").encode())
    atomic_write(run_dir / "plan.json", (to_json(plan, indent=1) + "\n").encode())


def read_description(run_dir: Path) -> dict | None:
    """task.json (the task's description of its data, for make evaluate and make export), or None for a run from
    before it (its classes.json says the classes alone)."""
    description = read_json(run_dir / "task.json")
    return description or None


def read_config(run_dir: Path) -> dict:
    """config.json, or {} when it is missing or unreadable."""
    return read_json(run_dir / "config.json")


def read_classes(run_dir: Path) -> list[str] | None:
    """classes.json's class names, or None when it is missing or unreadable."""
    try:
        classes = json.loads((run_dir / "classes.json").read_text())
    except (OSError, ValueError):
        return None
    return classes if isinstance(classes, list) else None


class MetricsFile:
    """metrics.jsonl, appended a line at a time (line-buffered: each record reaches the file at once). Opened for
    a resume at resume_step, it first drops what a crashed or stopped attempt logged after that step."""

    def __init__(self, run_dir: Path, resume_step: int = 0):
        path = run_dir / "metrics.jsonl"
        if path.exists():
            kept = [line for line in path.read_text().splitlines() if _step_of(line) <= resume_step]
            atomic_write(path, "".join(line + "\n" for line in kept).encode())
        self._file = open(path, "a", buffering=1)

    def append(self, record: dict) -> None:
        self._file.write(to_json(record) + "\n")

    def close(self) -> None:
        self._file.close()


def _step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")  # a line cut short by a crash


def read_metrics(run_dir: Path, kind: str | None = None, strict: bool = False) -> list[dict]:
    """metrics.jsonl's records (of one kind), in order; a line being written or cut short by a crash is skipped.
    strict (the tests, of a run that ended): a missing file or a damaged line raises instead."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        if strict:
            raise
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            if strict:
                raise
            continue
        if kind is None or record.get("kind") == kind:
            records.append(record)
    return records


def default_run_dir(started: float | None = None) -> str:
    """runs/<start time>, the run directory when --run-dir is not given."""
    return time.strftime("runs/%Y%m%d-%H%M%S", time.localtime(started))


def launch_run_dir(given: str) -> str:
    """--run-dir (given), else runs/<start time>. Under torchrun that is the start of torchrun itself (this worker's
    parent), so the attempts it restarts after a failure resume the same run instead of starting new ones."""
    if given:
        return given
    return default_run_dir(process_start_time(os.getppid()) if "TORCHELASTIC_RUN_ID" in os.environ else None)


def process_start_time(pid: int | str = "self") -> float:
    """When this process (or pid) started (Unix time), from /proc; the import of this module elsewhere."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED


_IMPORTED = time.time()
