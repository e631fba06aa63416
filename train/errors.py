"""How a run can end: the exit codes, and the errors that carry one line (the cause and the fix)."""

import gc
import sys

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


def exit_quickly() -> None:
    """Called just before a process exits: Python's last garbage collection walks every object torch made,
    0.5 to 1 s of each process's exit. Frozen, they are skipped; atexit handlers still run, and files and
    everything else are released as usual."""
    gc.freeze()
