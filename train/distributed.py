"""Who am I: one function turns any launcher's environment into rank, world size and device.

Launchers understood, in this order:
  torchrun / spawn  RANK, WORLD_SIZE, LOCAL_RANK (+ MASTER_ADDR/MASTER_PORT), env:// rendezvous
  srun per task     SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID inside a job step; master = first node
  single            a plain `python -m train`: rank 0 of 1, no process group
Every other module asks `identity()` or `is_main()`; nobody reads RANK on their own.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

from train.slurm import expand_hostlist, master_port
from train.watchdog import watchdog


@dataclass(frozen=True)
class Identity:
    global_rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    launcher: str  # torchrun | spawn | slurm | single
    master_addr: str
    master_port: int

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.launcher != "single"


def _int(env, key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise RuntimeError(f"{key}={env[key]!r} is not an integer: fix the launcher environment") from None


class PeersTimedOut(RuntimeError):
    """Other ranks did not arrive at a rendezvous of this process's own (start-up, the end of the run)."""


def resolve_identity(env=None) -> Identity:
    """Turn the launcher's environment into an Identity. Pure: reads `env` (default os.environ) only."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = env.get("TRAINBOX_LAUNCHER", "torchrun")
        return Identity(
            global_rank=_int(env, "RANK"), local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            world_size=_int(env, "WORLD_SIZE"),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else _int(env, "WORLD_SIZE"),
            launcher=launcher, master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500)
    # srun sets SLURM_STEP_ID; a batch script alone has SLURM_PROCID=0 too but is not a step of N tasks.
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:
        nodes = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "localhost"))
        tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "1"))
        return Identity(
            global_rank=_int(env, "SLURM_PROCID"), local_rank=_int(env, "SLURM_LOCALID"),
            world_size=_int(env, "SLURM_NTASKS"), local_world_size=int(re.match(r"\d+", tasks_per_node).group()),
            launcher="slurm", master_addr=env.get("MASTER_ADDR", nodes[0]),
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else master_port(env["SLURM_JOB_ID"]))
    return Identity(0, 0, 1, 1, "single", "127.0.0.1", 0)


_identity: Identity | None = None
_control_group = None  # gloo group for small host-side agreements (stop flag) without device syncs
_session_store = None  # this attempt's namespace in the rendezvous store (see init)


def identity() -> Identity:
    global _identity
    if _identity is None:
        _identity = resolve_identity()
    return _identity


def is_main() -> bool:
    """Global rank 0: the one process that writes shared files (checkpoints, logs, model.pt)."""
    return identity().global_rank == 0


def pick_device(requested: str, ident: Identity) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda but no CUDA GPU is visible: use --device cpu or check the driver")
    count = torch.cuda.device_count()
    if ident.local_rank >= count:
        raise RuntimeError(f"local rank {ident.local_rank} needs GPU {ident.local_rank} but {count} are visible: "
                           f"start at most {count} workers per node or set CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", ident.local_rank)


def watch_limit(timeout_s: float) -> float:
    """How long a phase may go without progress before the watchdog ends the process: torch's own
    timeouts (timeout_s) fire first where they can, with a more specific error."""
    return timeout_s + min(timeout_s, 60)


def init(device: torch.device, timeout_s: int) -> Identity:
    """Start the process group for this process (no-op for a single process).

    Every key this attempt puts in the rendezvous store lies under a name no earlier attempt used (see
    `agree_on_session`): under torchrun's shared store (restarts keep the store and its keys,
    pytorch/pytorch#135712) a restarted attempt never meets the dead attempt's addresses."""
    global _control_group, _session_store
    ident = identity()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the process group, so NCCL binds the right GPU
    if not ident.distributed or dist.is_initialized():
        return ident
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    watchdog.enter(f"process-group set-up (rendezvous at {ident.master_addr}:{ident.master_port})",
                   watch_limit(timeout_s))
    url = f"tcp://{ident.master_addr}:{ident.master_port}" if ident.launcher == "slurm" else "env://"
    store, _, _ = next(rendezvous(url, ident.global_rank, ident.world_size, timeout=timeout))
    store.set_timeout(timeout)
    session = agree_on_session(store, ident.global_rank, ident.world_size, timeout_s)
    _session_store = dist.PrefixStore(f"trainbox/{session}/", store)
    kwargs = dict(backend=backend, store=_session_store, timeout=timeout, rank=ident.global_rank,
                  world_size=ident.world_size)
    if backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    _control_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    watchdog.pause("start-up")
    return ident


def agree_on_session(store, rank: int, world: int, timeout_s: float) -> str:
    """A name that every rank of this attempt shares and no earlier attempt used, agreed on a store that
    may still hold an earlier attempt's keys. Rank 0 draws it; every other rank posts a fresh random
    nonce, and takes the name only from an answer that echoes its own nonce, which no earlier attempt
    can have written. Rank 0 echoes until each rank has confirmed under the new name. (torchrun stops
    every worker of an attempt before it starts the next, so no earlier writer is alive.)"""
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        session = uuid.uuid4().hex
        ready, hellos, echoed = f"trainbox/{session}/ready", [f"trainbox/hello/{r}" for r in range(1, world)], {}
        while store.add(ready, 0) < world - 1:
            posted = store.multi_get(hellos) if store.check(hellos) else \
                [store.get(key) if store.check([key]) else None for key in hellos]
            for r, nonce in enumerate(posted, start=1):
                if nonce and echoed.get(r) != nonce:
                    store.set(f"trainbox/ack/{r}", nonce + b" " + session.encode())
                    echoed[r] = nonce
            if time.monotonic() > deadline:
                missing = world - 1 - store.add(ready, 0)
                raise PeersTimedOut(f"timed out: {missing} of {world - 1} other ranks did not arrive within "
                                    f"{timeout_s} s")
            time.sleep(0.005)
        return session
    nonce = uuid.uuid4().hex.encode()
    store.set(f"trainbox/hello/{rank}", nonce)
    ack = f"trainbox/ack/{rank}"
    while True:
        answer = store.get(ack) if store.check([ack]) else b""
        if answer.startswith(nonce + b" "):
            session = answer.split(b" ", 1)[1].decode()
            store.add(f"trainbox/{session}/ready", 1)
            return session
        if time.monotonic() > deadline:
            raise PeersTimedOut(f"timed out: rank 0 did not answer within {timeout_s} s")
        time.sleep(0.005)


def destroy_and_leave_together(timeout_s: float = 30.0) -> None:
    """destroy_process_group, then wait (on the rendezvous store, which outlives the groups) until every
    rank has destroyed its own. A rank that exits while a peer's gloo group still exists can make that
    peer abort ("terminate called without an active exception"): 6 of 20 two-rank runs aborted so
    without this wait, none of 20 with it (the bench's communication worker, 2 cores). Past timeout_s
    a rank that never arrived is an error, not a silent wait."""
    from torch.distributed.distributed_c10d import _get_default_store  # noqa: PLC0415

    store, world = _session_store or _get_default_store(), dist.get_world_size()
    dist.destroy_process_group()
    deadline = time.monotonic() + timeout_s
    try:
        arrived = store.add("trainbox/left", 1)
        while arrived < world and time.monotonic() < deadline:
            time.sleep(0.01)
            arrived = store.add("trainbox/left", 0)
    except (RuntimeError, OSError):  # the store's host left: it saw every rank arrive first
        return
    if arrived < world:
        raise PeersTimedOut(f"timed out: {world - arrived} of {world} ranks did not reach the end of the run "
                            f"within {timeout_s} s")


def control_group():
    return _control_group


def teardown(clean: bool, timeout_s: float) -> None:
    """Leave the process group; after a clean run wait for every rank first, so none exits while a
    peer still talks to it. After an error, do not wait: the peers may never arrive."""
    global _control_group, _session_store
    if dist.is_initialized() and clean:
        watchdog.enter("the end of the run (leaving together)", watch_limit(timeout_s))
        dist.barrier(group=_control_group)
        destroy_and_leave_together(timeout_s)
        watchdog.pause()
    # After an error the group is left to the process's exit: destroying it with a collective still in
    # flight (a peer gone, a timeout) can abort the process before it has reported the error.
    _control_group = _session_store = None


def gather(value) -> list:
    """Every rank's value (plain Python objects), on every rank."""
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=_control_group)
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
