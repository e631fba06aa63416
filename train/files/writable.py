"""A run directory that cannot be made or written, one line per cause and its fix (standard library only, as
rundir.py): `run_dir_problem` asks the file system before anything is written (the checks), `write_problem` reads the
error a write met (the worker), as `full_disk_problem` does for a running run's writes on a full disk."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import struct
from pathlib import Path

FULL_BYTES = 1 << 20  # less free than this and a new run could not write its first files
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # a full disk, a used-up quota: every restart meets it again


def run_dir_problem(run_dir: Path, room: bool = True) -> str | None:
    """Why this process could not make or write run_dir, from what the file system says, without writing
    anything; None where nothing stands in the way. The line is write_problem's for the error a write would meet.
    room: also the free space a new run's first files need (a resumed run's checkpoint needs more: the checks
    ask checkpoint.space_problem first)."""
    folder = _nearest_existing(run_dir)
    if not folder.is_dir():
        return write_problem(run_dir, OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)))
    if os.statvfs(folder).f_flag & os.ST_RDONLY:
        return write_problem(run_dir, OSError(errno.EROFS, os.strerror(errno.EROFS)))
    if not os.access(folder, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        return write_problem(run_dir, OSError(errno.EACCES, os.strerror(errno.EACCES)))
    if room and _free_bytes(folder) < FULL_BYTES:
        return write_problem(run_dir, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    return None


def full_disk_problem(run_dir: Path, error: BaseException) -> str | None:
    """write_problem's line for an error of a running run's write that met a full disk or a used-up quota in run_dir
    (it names a file there, or none while that disk is full: an append); None for any other error."""
    if not isinstance(error, OSError) or error.errno not in FULL_ERRNOS:
        return None
    if error.filename is None:
        here = error.errno == errno.EDQUOT or _free_bytes(_nearest_existing(run_dir)) < FULL_BYTES
    else:
        here = os.path.realpath(error.filename).startswith(os.path.realpath(run_dir) + os.sep)
    return write_problem(run_dir, error) if here else None


def write_problem(run_dir: Path, error: OSError) -> str:
    """The line for an error met making or writing run_dir (or a file in it): the cause, named by the error's
    errno and what the file system says of the folder that stops it, and the fix for that cause."""
    folder = _nearest_existing(run_dir)
    where = f"run directory {run_dir}"
    if not folder.is_dir():  # mkdir met a file (EEXIST), or a file on the way (ENOTDIR)
        what = "is a file, not a folder" if folder == run_dir else f"cannot be made: {folder} is a file, not a folder"
        return f"{where} {what}: pass a --run-dir that is a folder or a new path (it is made), or move the file"
    mount = _mount_point(folder)
    if error.errno == errno.EROFS:
        return (f"{where} is on a read-only file system ({mount} is mounted read-only): pass a --run-dir on a "
                f"writable disk, or mount {mount} read-write")
    if error.errno in FULL_ERRNOS:
        full = "your disk quota there is used up" if error.errno == errno.EDQUOT else \
            f"its disk is full ({_free_bytes(folder) / 2**20:.1f} MiB free on {mount})"
        return (f"{where}: {full}: free space on {mount}, or pass a --run-dir on another disk; then run the same "
                f"command (a run resumes from its newest checkpoint)")
    if error.errno in (errno.EACCES, errno.EPERM):
        return _refused(run_dir, folder, error)
    return (f"{where} could not be written ({error.strerror or error}): check that disk (`dmesg` names a failing "
            f"one), or pass a --run-dir on another")


def _refused(run_dir: Path, folder: Path, error: OSError) -> str:
    """The permission line: an immutable folder, another owner (the one cause chown mends), or a mode that leaves
    its own owner without write access."""
    uid, gid = os.geteuid(), os.getegid()
    where, st = f"run directory {run_dir}", folder.stat()
    if _immutable(folder):
        return (f"{where} cannot be written: {folder} is immutable (chattr +i), for root too: `chattr -i {folder}` "
                f"as root, or pass another --run-dir")
    if st.st_uid != uid and uid != 0:
        hint = " (from the host: `make env`, then the container runs as you)" if Path("/.dockerenv").exists() else ""
        return (f"{where} is not writable by uid {uid}: {folder} belongs to uid {st.st_uid}: give uid {uid} write "
                f"access (as root: chown -R {uid}:{gid} {folder}){hint}, or pass a writable --run-dir")
    if st.st_uid == uid and not st.st_mode & stat.S_IWUSR:
        return (f"{where} is not writable: {folder} belongs to uid {uid} itself but its mode "
                f"{stat.filemode(st.st_mode)} leaves out write: `chmod u+w {folder}`, or pass another --run-dir")
    return (f"{where} is not writable by uid {uid} ({error.strerror or error}; {folder} belongs to uid {st.st_uid}, "
            f"mode {stat.filemode(st.st_mode)}): a rule beyond its owner and mode refuses it (an ACL, a security "
            f"policy, a network file system that maps uid {uid} to another user): pass a --run-dir on another disk")


def _nearest_existing(path: Path) -> Path:
    """path, or the nearest folder above it that exists (os.path.exists: a folder this process may not enter
    counts as missing, so the walk stops at the folder that refuses it)."""
    while not os.path.exists(path) and path != path.parent:
        path = path.parent
    return path


def _free_bytes(folder: Path) -> int:
    """What this process may still write there (root may use the blocks a file system reserves for it)."""
    fs = os.statvfs(folder)
    return (fs.f_bfree if os.geteuid() == 0 else fs.f_bavail) * fs.f_frsize


def _mount_point(folder: Path) -> str:
    """The mount point folder lies under (/proc/self/mounts: the last, topmost mount of the longest prefix)."""
    path, best = os.path.realpath(folder), "/"
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[1])  # \040: a space
            if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best = point
    return best


def _immutable(folder: Path) -> bool:
    """Whether folder carries the immutable attribute (chattr +i: no one, root included, may write in it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return False
    try:
        flags = fcntl.ioctl(fd, 0x80086601, b"\0" * 8)  # FS_IOC_GETFLAGS
        return bool(struct.unpack("i", flags[:4])[0] & 0x10)  # FS_IMMUTABLE_FL
    except OSError:  # a file system without attributes
        return False
    finally:
        os.close(fd)
