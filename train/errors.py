"""How a run can end: the exit codes, and the errors that carry one line (the cause and the fix)."""

import atexit
import gc
import os
import sys
from typing import NoReturn

EXIT_DONE = 0  # finished (or already finished): model.pt written
EXIT_FAILED = 1  # a crash, or a worker lost its peers (one died, hung or was stopped): rerun to resume
EXIT_BAD_INPUT = 2  # bad input or a condition the message names (disk full, bad image): fix it, then rerun
EXIT_STOPPED = 75  # a signal stopped the run after it saved a checkpoint; run again to resume


class ConfigError(ValueError):
    """A user mistake in flags, a config file, the data or the run directory: one line, cause and fix."""


class DataError(ConfigError):
    """A dataset file that cannot be read, met by one rank while training: one line naming the file."""


def fail(message: str) -> int:
    """A user's mistake, before anything started: one line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def end_process(code: int) -> NoReturn:
    """How every trainbox process ends. Python's last garbage collection walks every object torch made
    (0.5 to 1 s per process): frozen, they are skipped. A process group still alive here was left by an
    error (a lost peer, a timeout): its C++ teardown can abort the process ("terminate called without an
    active exception", exit 134) after the error was reported, so such a process runs its exit handlers,
    flushes its output and leaves with its own code, without that teardown."""
    gc.freeze()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)
    sys.exit(code)
