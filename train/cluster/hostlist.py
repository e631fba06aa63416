"""Slurm hostlists ('gpu[01-03,7],login1') as host names, standard library only (the batch shell's bare python3 runs
it from the checkout, through train/cluster/jobs.py): Slurm's own scontrol where it answers, else the same grammar here.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess


class JobError(ValueError):
    """Bad input of a launch: one line, the cause and the fix."""


MAX_RANGE = 64 * 1024  # hosts in one bracket range, as Slurm's hostlist.c allows (larger is a mistake)


def expand_hostlist(hostlist: str, env=None) -> list[str]:
    """The host names of a Slurm hostlist such as 'gpu[01-03,7],login1' or 'rack[1-2]-gpu[1-4]', in Slurm's
    order. Slurm's own `scontrol show hostnames` answers where it can (it reads the node's slurm.conf, no
    daemon, a few milliseconds); elsewhere `parse_hostlist` does. env: the job's environment (SLURM_CONF),
    default os.environ. A list that names no host, or that neither understands, is a JobError."""
    hosts = None if "[" not in hostlist else scontrol_hostnames(hostlist, env)
    if hosts is None:
        hosts = parse_hostlist(hostlist)
    if not hosts:
        raise JobError(f"hostlist {hostlist!r} names no host: check SLURM_JOB_NODELIST")
    return hosts


def scontrol_hostnames(hostlist: str, env=None) -> list[str] | None:
    """`scontrol show hostnames HOSTLIST`, or None where it cannot answer: no scontrol, no Slurm configuration
    (it then fails at once), or a list it calls invalid (it says so on stderr and still exits 0)."""
    env = os.environ if env is None else env
    scontrol = shutil.which("scontrol", path=env.get("PATH", os.defpath))
    # A SLURM_CONF that names a missing file makes scontrol retry it for 60 s before it fails.
    if not scontrol or hostlist.startswith("-") or (env.get("SLURM_CONF") and not os.path.isfile(env["SLURM_CONF"])):
        return None
    try:
        out = subprocess.run([scontrol, "show", "hostnames", hostlist], env=dict(env), capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    hosts = out.stdout.split()
    return hosts if out.returncode == 0 and hosts and "Invalid hostlist" not in out.stderr else None


def parse_hostlist(hostlist: str) -> list[str]:
    """Slurm's hostlist grammar without Slurm (src/common/hostlist.c, one-dimensional clusters): entries split
    by commas or white space, outside brackets; in an entry, each bracket holds numbers and ranges split by
    commas ('a[1,3,5-7]'), a range as wide as its first number ('a[01-10]': a01 ... a10); text around the
    brackets stays ('rack1-gpu[1-4].ib', a suffix Slurm reads since 23.02.5). Several brackets in one name
    give every combination in scontrol's order: the last bracket varies fastest, then the first, the second,
    ..., the one before the last slowest (hostlist.c's recursion). A malformed list is a JobError."""
    entries, depth, start = [], 0, 0
    for i, char in enumerate(hostlist + ","):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth not in (0, 1):
            raise JobError(f"hostlist {hostlist!r}: unbalanced or nested brackets at {hostlist[:i + 1]!r}: "
                            "write ranges as name[1-4,7]")
        if depth == 0 and (char == "," or char.isspace()):
            entries.append(hostlist[start:i])
            start = i + 1
    if depth:
        raise JobError(f"hostlist {hostlist!r}: a '[' is not closed: write ranges as name[1-4,7]")
    hosts = []
    for entry in filter(None, entries):
        texts = re.split(r"\[([^\]]*)\]", entry)  # text, bracket, text, bracket, ..., text
        values = [_bracket_values(hostlist, body) for body in texts[1::2]]
        order = [*range(len(values) - 2, -1, -1), len(values) - 1] if values else []
        for combination in itertools.product(*(values[i] for i in order)):
            chosen = dict(zip(order, combination, strict=True))
            hosts.append("".join(text + (chosen[i] if i in chosen else "") for i, text in enumerate(texts[::2])))
    return hosts


def _bracket_values(hostlist: str, body: str) -> list[str]:
    """The numbers of one bracket, '01-03,7' -> ['01', '02', '03', '7']."""
    values = []
    for part in body.split(","):
        m = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", part)
        if not m or (m[2] and int(m[2]) < int(m[1])) or int(m[2] or m[1]) - int(m[1]) >= MAX_RANGE:
            raise JobError(f"hostlist {hostlist!r}: {part!r} in [{body}] is not a number or a range lo-hi "
                            f"(lo <= hi, at most {MAX_RANGE} hosts): write ranges as name[1-4,7]")
        values += [f"{n:0{len(m[1])}d}" for n in range(int(m[1]), int(m[2] or m[1]) + 1)]
    return values
