"""Local worker processes, for training and evaluation alike: --spawn N forks them from a server that imported
torch once (train/forkserver.py) and waits for all of them; GPUS=N with make picks how many.

  spawn_workers(n, work)     n local workers, each running work() as its rank; signals passed on to them
  workers_for(gpus, visible) GPUS=... as (local workers, force the CPU)
  kill_loader_workers()      registered at exit by every worker: its DataLoader workers must not outlive it
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # its exit hook must be registered before ours (see kill_loader_workers)
import os
import signal
import time
import traceback
from collections.abc import Callable

import torch.multiprocessing as mp

from train.distributed import free_port
from train.errors import EXIT_BAD_INPUT, EXIT_STOPPED, ConfigError, end_process, run_exit_handlers
from train.forkserver import start_fork_server


def kill_loader_workers() -> None:
    """DataLoader workers ignore SIGTERM (a preemption signal must not kill them before the save), so
    multiprocessing's own exit hook, which terminates and then joins them, could wait forever when a run
    ends on an error with a worker still alive. Registered after that hook, this runs first."""
    with contextlib.suppress(Exception):
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the DataLoader's handler would report the kill
        for child in multiprocessing.active_children():  # this process's children: its loader workers
            with contextlib.suppress(Exception):
                child.kill()
                child.join(5)


def _spawned(local_rank: int, work: Callable[[], int], nprocs: int, environ: dict[str, str]) -> None:
    os.environ.clear()  # the launcher's environment now, not as it was when the fork server started
    os.environ.update(environ, RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nprocs),
                      LOCAL_WORLD_SIZE=str(nprocs), TRAINBOX_LAUNCHER="spawn")
    try:
        code = work()
    except Exception:  # noqa: BLE001 - torch.multiprocessing would keep the traceback to itself
        traceback.print_exc()
        code = 1
    try:
        end_process(code)
    finally:  # it raised SystemExit: a fork server's child then leaves with os._exit, without exit handlers
        run_exit_handlers(join_threads=False)


def spawn_workers(nprocs: int, work: Callable[[], int]) -> int:
    """Start nprocs local workers, each running work() as its rank (python -m train --spawn, python -m
    train.evaluate --spawn), and wait for all of them; signals are passed on to them."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    start_fork_server()  # train/forkserver.py: python -m train started it already
    context = mp.start_processes(_spawned, args=(work, nprocs, dict(os.environ)), nprocs=nprocs, join=False,
                                 start_method="forkserver")

    def forward(signum, _frame):
        for process in context.processes:
            if process.is_alive() and signum != signal.SIGINT:  # Ctrl-C already reaches the whole group
                os.kill(process.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
        signal.signal(sig, forward)
    # Wait for all; if one fails, stop the rest now rather than after the collective timeout. The run's
    # code is the first failure's (the workers stopped here would only report this kill); a crash
    # outranks a clean stop (75); a worker killed by signal N reports 128 + N, as a shell does. After an
    # error a restart cannot mend (2), the others are given a moment: they lose contact with it at once,
    # read its line and end with the same code (rank 0 records it in status.json).
    waiting = {p.sentinel: p for p in context.processes}
    failed, deadline = None, None
    while waiting:
        ready = multiprocessing.connection.wait(list(waiting), timeout=None if deadline is None else
                                                max(0.0, deadline - time.monotonic()))
        if not ready:
            for other in waiting.values():
                other.kill()
            deadline = None
        for sentinel in ready:
            process = waiting.pop(sentinel)
            process.join()
            code = process.exitcode if process.exitcode >= 0 else 128 - process.exitcode
            if failed is None and code not in (0, EXIT_STOPPED):
                failed = code
                if code == EXIT_BAD_INPUT:
                    deadline = time.monotonic() + 30
                    continue
                for other in waiting.values():
                    other.kill()  # not SIGTERM: that asks for a checkpoint, which needs the dead rank
    return failed if failed is not None else max(p.exitcode for p in context.processes)


def workers_for(gpus: str, visible: int) -> tuple[int, bool]:
    """(local workers, force CPU) for GPUS=... ('' means all visible GPUs, or one CPU worker)."""
    if gpus.strip() == "":
        return max(1, visible), visible == 0
    if gpus.strip().startswith("-") and gpus.strip()[1:].isdigit():
        raise ConfigError(f"GPUS={gpus.strip()}: a count of workers cannot be negative: give 0 for the CPU or a "
                          f"positive count (GPUS=1, GPUS=4, ...)")
    if not gpus.strip().isdigit():
        raise ConfigError(f"GPUS={gpus!r} is not a number: use GPUS=0 (CPU), GPUS=1, GPUS=4, ...")
    n = int(gpus)
    if n == 0:
        return 1, True
    if visible and n > visible:
        raise ConfigError(f"GPUS={n} but {visible} GPU(s) visible: set GPUS<={visible} or CUDA_VISIBLE_DEVICES")
    return n, visible == 0
