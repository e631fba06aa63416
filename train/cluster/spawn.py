"""Local worker processes, for training and evaluation alike: --spawn N forks them from a server that imported
torch once (train/cluster/forkserver.py) and waits for all of them; GPUS=N with make picks how many. Standard library
only: python -m train --spawn N's launcher imports neither torch nor the trainer (its fork server does, once).

  run_check(job)             job (the checks that need torch) in one child of the fork server: its exit code
  spawn_workers(n, work)     n local workers, each running work() as its rank; signals passed on to them
  Job(module, function, *a)  work named by its module, so that the launcher need not import it to start it
  workers_for(gpus, visible) GPUS=... as (local workers, force the CPU)
  kill_loader_workers()      registered at exit by every worker: its DataLoader workers must not outlive it
  stop_with_launcher(...)    a worker whose launcher ends, however it ends (kill -9 too), stops as on SIGTERM
  as_forked_worker(rank)     first thing in a worker forked from the server (--spawn's, make train's torchrun's)
  release_workers()          make train's: nobody waits for the workers' return values (see train/launch.py)
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # its exit hook must be registered before ours (see kill_loader_workers)
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from train.base.errors import EXIT_BAD_INPUT, EXIT_STOPPED, ConfigError, end_process, run_exit_handlers
from train.cluster.forkserver import start_fork_server, stop_fork_server
from train.cluster.identity import free_port


class Job:
    """A function named by its module and name, with its arguments: pickled by name for the fork server's child,
    which imported the module already (the server's preload, which the caller names), so that the launcher never
    imports it."""

    def __init__(self, module: str, function: str, *args: Any) -> None:
        self.module, self.function, self.args = module, function, args

    def __call__(self) -> int:
        return getattr(importlib.import_module(self.module), self.function)(*self.args)


def run_check(check: Job) -> int:
    """`check` in one child of the fork server (the checks that need torch, before any worker): its exit code."""
    return _exit_code(_start(_checked, check))


def _start(target: Callable, *args: Any) -> multiprocessing.process.BaseProcess:
    """A child of the fork server, with this process's environment as it is now (the server's is as it was when it
    started) and the read end of its lifeline."""
    process = multiprocessing.get_context("forkserver").Process(target=target,
                                                                args=(dict(os.environ), lifeline(), *args))
    process.start()
    return process


_lifeline_ends: tuple[multiprocessing.connection.Connection, multiprocessing.connection.Connection] | None = None


def lifeline() -> multiprocessing.connection.Connection:
    """The read end of a pipe whose write end this launcher alone holds, for as long as it lives: its children read
    end-of-file the moment it ends, however it ends. Their parent, the fork server, outlives it (multiprocessing keeps
    the server until its last child ends), so a parent-death signal cannot tell them."""
    global _lifeline_ends
    if _lifeline_ends is None:
        _lifeline_ends = multiprocessing.Pipe(duplex=False)
    return _lifeline_ends[0]


def release_workers(count: int) -> None:
    """Tell the `count` workers on the lifeline that nobody waits for what they return (make train's agent is stopping
    them on a signal it passes on, and only waits for them to end): each ends, once its run has, without returning. A
    word each: the pipe's readers share it, and each reads one and stops reading."""
    if _lifeline_ends is not None:
        with contextlib.suppress(OSError):
            for _ in range(count):
                _lifeline_ends[1].send_bytes(b"released")


# Set in a worker once its launcher ended, or released it (release_workers): then nobody waits for its return value.
released = threading.Event()


def _exit_code(process: multiprocessing.process.BaseProcess) -> int:
    """A process's exit code once it ended; killed by signal N: 128 + N, as a shell says."""
    process.join()
    return process.exitcode if process.exitcode >= 0 else 128 - process.exitcode


def _checked(environ: dict[str, str], lifeline: multiprocessing.connection.Connection, check: Job) -> None:
    stop_with_launcher(lifeline)
    os.environ.clear()
    os.environ.update(environ)
    sys.exit(check())


def die_with_parent(sig: int) -> None:
    """Signal `sig` to this process when the one that forked it dies (0: none): prctl(PR_SET_PDEATHSIG), Linux only.
    --spawn's workers: SIGINT when their fork server dies, as torch.multiprocessing's workers have it."""
    _prctl(1, sig)  # 1: PR_SET_PDEATHSIG (<linux/prctl.h>)


def _prctl(option: int, value: int | bytes) -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(option, value)


_watching = False


def stop_with_launcher(lifeline: multiprocessing.connection.Connection | None = None) -> None:
    """When this worker's launcher ends, by any signal (SIGKILL too: the out-of-memory killer, `kill -9`, a lost
    session), SIGTERM to this worker: a run then stops at the next step every rank agrees on, saves its checkpoint
    and exits (train/cluster/distributed.py's StopSignal); one that is not training yet ends at once. Nobody is left to
    wait for it. --spawn's workers watch their lifeline (the launcher's pipe); torchrun's (no lifeline) their parent,
    the agent, through a pidfd (Linux); make train's, forked from a server as --spawn's, their lifeline too. A thread
    that waits in select: no cost while the launcher lives. Once per process: a second call does nothing."""
    global _watching
    if _watching:
        return
    _watching = True
    if lifeline is not None:
        launcher, what = lifeline, "the launcher"
    elif hasattr(os, "pidfd_open"):
        agent = os.getppid()
        what = f"torchrun (pid {agent})"
        try:
            launcher = os.pidfd_open(agent)
        except OSError:  # gone already
            launcher = None
        if launcher is not None and os.getppid() != agent:  # gone before its pidfd was open: that may be another's
            os.close(launcher)
            launcher = None
    else:
        return
    threading.Thread(target=_stop_when_gone, args=(launcher, what), name="trainbox-launcher-watch",
                     daemon=True).start()


def _stop_when_gone(launcher: multiprocessing.connection.Connection | int | None, what: str) -> None:
    if launcher is not None:
        multiprocessing.connection.wait([launcher])  # readable: end-of-file on the pipe, the pidfd's process ended
    if not isinstance(launcher, int | None):
        with contextlib.suppress(EOFError, OSError):
            launcher.recv_bytes()  # release_workers's word: the launcher lives on, and stops this worker itself
            released.set()
            return
    released.set()
    if os.environ.get("LOCAL_RANK", "0") == "0":  # into train.log too, once the run has one (train/report/metrics.py)
        logging.getLogger("train").warning("%s ended: its workers stop as on SIGTERM (a checkpoint if training, then "
                                           "exit)", what)
    os.kill(os.getpid(), signal.SIGTERM)


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


def as_forked_worker(rank: int) -> None:
    """What a worker forked from the fork server does first. A child of the server inherits "forkserver" as its
    default start method; its DataLoader workers would then come from yet another server and import torch and
    torchvision each: the platform's default, as under torchrun or srun, forks them from this worker. Its command
    line and its environment in /proc are the server's: its name (ps, top, /proc/PID/comm) says its rank,
    "train-rank3"."""
    multiprocessing.set_start_method(None, force=True)
    _prctl(15, f"train-rank{rank}".encode()[:15])  # 15: PR_SET_NAME (<linux/prctl.h>)


def _spawned(environ: dict[str, str], lifeline: multiprocessing.connection.Connection, local_rank: int,
             work: Callable[[], int], nprocs: int) -> None:
    die_with_parent(signal.SIGINT)
    as_forked_worker(local_rank)
    os.environ.clear()  # the launcher's environment now, not as it was when the fork server started
    os.environ.update(environ, RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nprocs),
                      LOCAL_WORLD_SIZE=str(nprocs), TRAINBOX_LAUNCHER="spawn")
    stop_with_launcher(lifeline)
    try:
        code = work()
    except KeyboardInterrupt:  # SIGINT: the fork server is gone (above), or Ctrl-C before the trainer took it
        return
    except Exception:  # noqa: BLE001 - the traceback, then exit code 1
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
    start_fork_server()  # train/cluster/forkserver.py: its caller started it already, with what work() needs
    processes = [_start(_spawned, rank, work, nprocs) for rank in range(nprocs)]

    def forward(signum, _frame):
        for process in processes:
            if process.is_alive() and signum != signal.SIGINT:  # Ctrl-C already reaches the whole group
                os.kill(process.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
        signal.signal(sig, forward)
    # Wait for all; if one fails, stop the rest now rather than after the collective timeout. The run's
    # code is the first failure's (the workers stopped here would only report this kill); a crash
    # outranks a clean stop (75); a worker killed by signal N reports 128 + N, as a shell does. After an
    # error a restart cannot mend (2), the others are given a moment: they lose contact with it at once,
    # read its line and end with the same code (rank 0 records it in status.json).
    waiting = {p.sentinel: p for p in processes}
    failed, deadline = None, None
    while waiting:
        ready = multiprocessing.connection.wait(list(waiting), timeout=None if deadline is None else
                                                max(0.0, deadline - time.monotonic()))
        if not ready:
            for other in waiting.values():
                other.kill()
            deadline = None
        for sentinel in ready:
            code = _exit_code(waiting.pop(sentinel))
            if failed is None and code not in (0, EXIT_STOPPED):
                failed = code
                if code == EXIT_BAD_INPUT:
                    deadline = time.monotonic() + 30
                    continue
                for other in waiting.values():
                    other.kill()  # not SIGTERM: that asks for a checkpoint, which needs the dead rank
    return failed if failed is not None else max(p.exitcode for p in processes)


def workers_for(gpus: str, visible: int) -> tuple[int, bool]:
    """(local workers, force CPU) for GPUS=... ('' means all visible GPUs, or one CPU worker)."""
    if gpus.strip() == "":
        return max(1, visible), visible == 0
    if gpus.strip().startswith("-") and gpus.strip()[1:].isdecimal():
        raise ConfigError(f"GPUS={gpus.strip()}: a count of workers cannot be negative: give 0 for the CPU or a "
                          f"positive count (GPUS=1, GPUS=4, ...)")
    if not gpus.strip().isdecimal():  # not isdigit(): "²" is a digit that int() refuses
        raise ConfigError(f"GPUS={gpus!r} is not a number: use GPUS=0 (CPU), GPUS=1, GPUS=4, ...")
    n = int(gpus)
    if n == 0:
        return 1, True
    if visible and n > visible:
        raise ConfigError(f"GPUS={n} but {visible} GPU(s) visible: set GPUS<={visible} or CUDA_VISIBLE_DEVICES")
    return n, visible == 0
