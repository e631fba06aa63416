"""Processes from /proc, for the tests and the chaos drill: who started whom, in which session, with what
environment. Standard library only."""

from __future__ import annotations

import os
from pathlib import Path


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat after the command name: state, parent, process group, session, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _where(field: int, value: int) -> list[int]:
    """The processes whose /proc/PID/stat field (after the command name) equals value."""
    out = []
    for pid in pids():
        try:
            if int(_stat(pid)[field]) == value:
                out.append(pid)
        except (OSError, IndexError, ValueError):
            continue
    return out


def children(pid: int) -> list[int]:
    """Direct child processes of pid."""
    return _where(1, pid)


def descendants(pid: int) -> list[int]:
    """pid's children, their children, and so on (torchrun starts its workers in sessions of their own)."""
    parents = {}
    for child in pids():
        try:
            parents[child] = int(_stat(child)[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = [], [pid]
    while frontier:
        frontier = [c for c, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def in_session(sid: int) -> list[int]:
    """Processes of a session (a launcher started with start_new_session), orphans included."""
    return _where(3, sid)


def environ(pid: int) -> dict:
    """pid's environment ({} once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def parent_of(pid: int) -> int | None:
    try:
        return int(_stat(pid)[1])
    except (OSError, IndexError, ValueError):
        return None


def rank_of(pid: int) -> str | None:
    """The rank of a trainer worker: RANK in its environment (torchrun's, srun's), or for one forked from a fork server
    (--spawn's, make train's), whose /proc environment is the server's, its name (train/cluster/spawn.py's
    as_forked_worker): "train-rank3". None for any other process (a worker's DataLoader workers included)."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        parent = Path(f"/proc/{_stat(pid)[1]}/comm").read_text().strip()
    except (OSError, IndexError):
        return None
    if name.startswith("train-rank"):
        return None if parent == name else name[len("train-rank"):]  # a DataLoader worker before torch names it
    return environ(pid).get("RANK")


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return _stat(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def describe(pid: int) -> str:
    """One line: pid, state, parent, the kernel function it waits in and its command line ('' once it is gone)."""
    try:
        stat, wchan = _stat(pid), Path(f"/proc/{pid}/wchan").read_text()
    except (OSError, IndexError):
        return ""
    return f"{pid} {stat[0]} parent {stat[1]} waits in {wchan or '-'}: {cmdline(pid)}"
