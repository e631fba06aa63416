"""How a run can end: the exit codes, and the errors that carry one line (the cause and the fix)."""

import argparse
import atexit
import contextlib
import gc
import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import NoReturn

from train.base.watchdog import watchdog

EXIT_DONE = 0  # finished (or already finished): model.pt written
EXIT_FAILED = 1  # a crash, or a worker lost its peers (one died, hung or was stopped): rerun to resume
EXIT_BAD_INPUT = 2  # bad input or a condition the message names (disk full, bad image): fix it, then rerun
EXIT_STOPPED = 75  # a signal stopped the run after it saved a checkpoint; run again to resume


class ConfigError(ValueError):
    """A user mistake in flags, a config file, the data or the run directory: one line, cause and fix."""


class DataError(ConfigError):
    """A dataset file that cannot be read, met by one rank while training: one line naming the file."""


class OutOfMemory(ConfigError):
    """The device (or the host) ran out of memory on one rank: one line naming where, the memory the device
    has and the flags that lower what a step needs (train/run/memory.py)."""


class UserCodeError(DataError):
    """An exception raised inside a user's own code (the package of a --task or --model package.module:factory): its
    traceback is theirs to read, said once, from the rank that met it first; the run ends with exit code 2, as a
    restart would meet it again. str() is the one line (status.json's); `trace` the traceback."""

    def __init__(self, line: str, trace: str):
        super().__init__(line)
        self.trace = trace


def user_code_error(error: BaseException, specs) -> UserCodeError | None:
    """`error` as a UserCodeError where its traceback (or a DataLoader worker's, carried in its message) passes through
    the package of one of `specs` (package.module:factory; other specs are ignored), else None."""
    places = [place for spec in specs if ":" in spec for place in _package_places(spec.split(":")[0].split(".")[0])]
    if not places or isinstance(error, ConfigError):
        return None
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if os.path.realpath(f.filename).startswith(tuple(places))]
    if not frames and not any(place in str(error) for place in places):
        return None
    where = f"{frames[-1].filename}:{frames[-1].lineno}, in {frames[-1].name}" if frames else "a DataLoader worker"
    if "Original Traceback" in str(error):  # a DataLoader worker's: its last line names the type and the message
        headline = next((line.strip() for line in str(error).splitlines()[::-1] if line.strip()), type(error).__name__)
    else:
        message = next(iter(str(error).splitlines()), "").strip()
        headline = f"{type(error).__name__}{': ' + message if message else ''}"
    line = f"{headline} (raised in your code, {where}: its traceback above): fix it there, then run the same command"
    return UserCodeError(line, "".join(traceback.format_exception(error)))


@contextlib.contextmanager
def users_code(specs):
    """Within it, an exception raised in the user's own code (user_code_error) leaves as a UserCodeError."""
    try:
        yield
    except Exception as e:
        found = user_code_error(e, specs)
        if found is None:
            raise
        raise found from None


def _package_places(top: str) -> list[str]:
    """Where a top-level package (its folders) or module (its file) lies: as imported, or for one whose import failed
    (a module that raises as it loads is not kept), where the import system finds it, without running it."""
    module = sys.modules.get(top)
    if module is not None:
        folders, file = list(getattr(module, "__path__", []) or []), getattr(module, "__file__", None)
    else:
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            return []
        folders, file = list(spec.submodule_search_locations or []), spec.origin if spec.has_location else None
    if folders:
        return [os.path.join(os.path.realpath(f), "") for f in folders]
    return [os.path.realpath(file)] if file else []


class OneLineParser(argparse.ArgumentParser):
    """argparse for every command of the project: a mistake on its command line (an unknown flag, a bad value) is a
    ConfigError of one line naming --help, which the command says as every other mistake (`fail`: exit code 2),
    instead of argparse's usage and message."""

    def error(self, message: str):
        raise ConfigError(f"{message} (see {self.prog} --help)")


class PeerGaveUp(ConfigError):
    """Another rank ended on an error that a restart cannot mend (its own line says which): this rank ends
    with the same exit code and says nothing more."""


def first_few(names, shown: int = 3) -> str:
    """The first `shown` of names and how many more: a line that names what is wrong stays short whatever the
    dataset's size ("a, b, c and 4,997 more")."""
    names = list(names)
    more = len(names) - shown
    return ", ".join(map(str, names[:shown])) + (f" and {more:,} more" if more > 0 else "")


def one_line(error: Exception) -> str:
    """The message itself, also when a DataLoader worker re-raised it with its whole traceback."""
    text = str(error).strip()
    if "Original Traceback" in text:
        text = text.splitlines()[-1].split(": ", 1)[-1]
    return text


def fail(error: str | ConfigError) -> int:
    """A user's mistake, before anything started: one line on stderr (after its traceback, for an error raised in the
    user's own code), exit code 2. Under torchrun every worker meets it, and meets it again in every attempt torchrun
    restarts: it is said once per node and launch."""
    message = str(error)
    if not _said_in_this_launch(message):
        print(f"{getattr(error, 'trace', '')}error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _said_in_this_launch(message: str) -> bool:
    """Under torchrun: whether a worker of this node's torchrun (this process's parent) said `message` already.
    The first to create its marker (a file named by the launch, the torchrun process and the message) says it."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return False
    folder = Path(tempfile.gettempdir()) / f"trainbox-{os.getuid()}"
    marker = folder / hashlib.sha256(f"{run_id}\n{os.getppid()}\n{message}".encode()).hexdigest()[:32]
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return True
    except OSError:  # no temporary folder to write: say it
        return False
    return False


_ran_a_process_group = False


def note_process_group() -> None:
    """Called once this process joined a process group: it ends without the interpreter's teardown."""
    global _ran_a_process_group
    _ran_a_process_group = True


def end_process(code: int, returning: bool = False) -> NoReturn | None:
    """How every trainbox process ends. Python's last garbage collection walks every object torch made
    (0.5 to 1 s per process): frozen, they are skipped. In a process that joined a process group, the
    C++ teardown of what it leaves behind (the group itself after an error, a lost peer or a timeout;
    the rendezvous store and gloo's threads even after a clean end) can abort the process at exit
    ("terminate called without an active exception", exit 134) after it reported its result. Such a
    process waits for its threads as the interpreter would (a checkpoint prune), runs its exit handlers
    (logging, loader workers), flushes its output and leaves with its own code, without that teardown;
    its files were closed and fsynced before this.

    returning: a worker that torch's elastic agent forked (make train's: train/launch.py) ends a clean run (0) by
    returning, as the agent waits for its function's return value; multiprocessing then ends it without the teardown.
    Any other code ends it here, as it ends every process."""
    gc.freeze()
    dist = sys.modules.get("torch.distributed")
    if _ran_a_process_group or dist is not None and dist.is_available() and dist.is_initialized():
        # Bounded: a thread that never ends or an exit handler that hangs is named, its stacks printed, exit 1.
        watchdog.enter("the process's exit (joining its threads, its exit handlers)", watchdog.run_limit_s,
                       cause="a thread or an exit handler did not end")
        run_exit_handlers(join_threads=True)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        if returning and code == 0:
            watchdog.pause()
            return None
        os._exit(code)
    if returning and code == 0:
        return None
    sys.exit(code)


def run_exit_handlers(join_threads: bool) -> None:
    """What the interpreter runs at its exit before its own teardown, for a process that leaves without that teardown
    (os._exit): with join_threads, threading's exit hooks (a ThreadPoolExecutor's workers, which torch.compile makes,
    wait for work until these tell them to leave, so joining them first would never end) and the join of every thread
    that is not a daemon; then the atexit handlers (logging's, the loader workers' kill).

    CPython has no public call for either: this is the one place that runs threading._threading_atexits and
    atexit._run_exitfuncs() (checked against CPython 3.11.7, the same from 3.9 to 3.14). tests/unit/test_exit.py
    fails on a Python where they are gone."""
    if join_threads:
        for hook in getattr(threading, "_threading_atexits", ()):
            hook()
        for thread in threading.enumerate():
            if not thread.daemon and thread is not threading.current_thread():
                thread.join()
    atexit._run_exitfuncs()
