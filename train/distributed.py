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
from dataclasses import dataclass

import torch
import torch.distributed as dist

from train.slurm import expand_hostlist, master_port


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


def init(device: torch.device, timeout_s: int) -> Identity:
    """Start the process group for this process (no-op for a single process)."""
    global _control_group
    ident = identity()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the process group, so NCCL binds the right GPU
    if not ident.distributed or dist.is_initialized():
        return ident
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = dict(backend=backend, timeout=timeout, rank=ident.global_rank, world_size=ident.world_size)
    if ident.launcher == "slurm":
        kwargs["init_method"] = f"tcp://{ident.master_addr}:{ident.master_port}"
    if backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    _control_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    return ident


def destroy_and_leave_together(timeout_s: float = 30.0) -> None:
    """destroy_process_group, then wait (on the rendezvous store, which outlives the groups) until every
    rank has destroyed its own. A rank that exits while a peer's gloo group still exists can make that
    peer abort ("terminate called without an active exception"): 6 of 20 two-rank runs aborted so
    without this wait, none of 20 with it (the bench's communication worker, 2 cores)."""
    from torch.distributed.distributed_c10d import _get_default_store  # noqa: PLC0415

    store, world = _get_default_store(), dist.get_world_size()
    dist.destroy_process_group()
    try:
        store.add("trainbox/left", 1)
        deadline = time.monotonic() + timeout_s
        while store.add("trainbox/left", 0) < world and time.monotonic() < deadline:
            time.sleep(0.01)
    except (RuntimeError, OSError):  # the store's host left: it saw every rank arrive first
        pass


def control_group():
    return _control_group


def teardown(clean: bool = True) -> None:
    """Leave the process group; after a clean run wait for every rank first, so none exits while a
    peer still talks to it. After an error, do not wait: the peers may never arrive."""
    global _control_group
    if dist.is_initialized() and clean:
        dist.barrier(group=_control_group)
        destroy_and_leave_together()
    # After an error the group is left to the process's exit: destroying it with a collective still in
    # flight (a peer gone, a timeout) can abort the process before it has reported the error.
    _control_group = None


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
