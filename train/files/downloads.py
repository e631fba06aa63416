"""What several processes fetch into one shared folder at once (local rank 0 of every node on one NAS: the
named weights in TORCH_HOME, CIFAR-10 in --data-dir), safely, standard library only. Each process writes under a
name of its own (`private_name`), checks what it wrote, then `publish`es it: the first complete copy takes the
name at once and whole, a later one is discarded. A reader never sees a half-written file or folder, and no
writer spoils another's. A process killed mid-way leaves its private file or folder (a hidden name beginning
with the final one's, ending in .partial), which nothing reads: delete it at will.
"""

from __future__ import annotations

import errno
import os
import secrets
import socket
from pathlib import Path


def private_name(path: Path) -> Path:
    """A hidden name beside `path` that no other process holds, on this node or another: the host, the process
    and 8 random hex digits (containers on two nodes may well share a process id)."""
    return path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}.partial")


def publish(new: Path, path: Path) -> bool:
    """Give the complete file or folder `new` the name `path` unless something has it already; whether `new`
    took it (when not, `new` stays for the caller to remove). A file is hard-linked: atomic on local file
    systems and NFS alike, and it never replaces a file that a reader may hold open (NFS would answer that
    reader with a stale handle); where the file system has no hard links (some FUSE and SMB mounts) it is
    renamed, unless the name is taken. A folder is renamed, which fails on a folder already there."""
    try:
        if new.is_dir():
            os.rename(new, path)
        else:
            os.link(new, path)
    except FileExistsError:
        return False
    except OSError as e:
        if new.is_dir() and e.errno == errno.ENOTEMPTY:
            return False
        if new.is_dir() or e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        if path.exists():
            return False
        os.replace(new, path)
    return True
