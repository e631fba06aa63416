"""No silent hangs: a worker that makes no progress within its limit names the phase it was in, prints
every thread's stack and exits 1.

Two layers. faulthandler's timer (C, works even when Python is stuck holding the GIL) dumps the stacks
and exits 1 when the limit passes; a Python thread, half a second before that, prints the one line that
says which phase was stuck. Collectives and store waits fail earlier on their own (--timeout-s) with
a specific error; this catches what they do not: a connect that never completes, a hung file system,
a deadlocked loader.
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import sys
import threading
import time
from collections.abc import Iterator


class Watchdog:
    """One per process (`watchdog` below): `begin(label, limit_s)` starts a run whose phases it bounds,
    `enter(phase)` starts a bounded phase (`during` one inside it), `progress()` re-arms it (cheap: the timers are
    re-armed at most once a second), `pause()` ends it."""

    STUCK = "a peer died, hangs or cannot be reached (or this process is stuck)"

    def __init__(self):
        self.phase = "start-up"
        self.cause = self.STUCK  # what the line says a phase without progress means
        self.label = "rank ?"
        self.limit = math.inf
        self.armed_at = -math.inf
        # The bound of a run's phases, and of what its process does after its ranks have left (freeing the trainer,
        # its threads, its exit handlers: a second or two): begin() sets it from the run's --timeout-s.
        self.run_limit_s = 120.0
        self._thread: threading.Thread | None = None
        self._report = threading.Lock()
        self._reported = False  # this run's one error line is out (the watchdog's or the caller's)

    def begin(self, label: str, limit_s: float | None = None) -> None:
        """A run starts in this process (one per process under a launcher; several where python -m train's
        main is called again, as tests and notebooks do): its phase, its label, and its own error line.
        limit_s: the bound of its phases, and of what the process does after the run's ranks have left."""
        self.pause("start-up")
        with self._report:
            self.label, self._reported = label, False
        self.run_limit_s = limit_s or self.run_limit_s

    def enter(self, phase: str, limit_s: float | None = None, cause: str | None = None) -> None:
        """limit_s: the run's unless given; cause: what no progress in this phase means, where the caller knows
        better than STUCK."""
        self.phase, self.limit, self.cause = phase, limit_s or self.run_limit_s, cause or self.STUCK
        self._arm(time.monotonic())

    @contextlib.contextmanager
    def during(self, phase: str) -> Iterator[None]:
        """A phase inside the current one (an evaluation or a save inside training), bounded by the run's limit: the
        current one is entered again once the block ends, not when it raises (the error then names the inner
        phase)."""
        phase_outside, limit, cause = self.phase, self.limit, self.cause
        self.enter(phase)
        yield
        if limit == math.inf:
            self.pause(phase_outside)
        else:
            self.enter(phase_outside, limit)
        self.cause = cause

    def progress(self) -> None:
        now = time.monotonic()
        if now - self.armed_at >= 1.0:  # re-arming faulthandler starts a thread: at most once a second
            self._arm(now)

    def pause(self, phase: str | None = None) -> None:
        """Work that may legitimately take long (a download, a big dataset's listing): no limit. The
        phase keeps its name unless one is given (an error report still names where it happened)."""
        self.phase, self.limit = phase or self.phase, math.inf
        faulthandler.cancel_dump_traceback_later()

    def claim_report(self) -> bool:
        """A caller is about to report the error that ended its work: True if it should print its line
        (the watchdog is then disarmed and stays silent), False if the watchdog has named the phase
        already and is ending the process. Either way one line, never two."""
        with self._report:
            if self._reported:
                return False
            self._reported = True
        self.pause()
        return True

    def _arm(self, now: float) -> None:
        if self.limit == math.inf:
            return
        faulthandler.dump_traceback_later(self.limit, exit=True, file=sys.__stderr__)
        self.armed_at = now
        if self._thread is None:
            self._thread = threading.Thread(target=self._announce, name="trainbox-watchdog", daemon=True)
            self._thread.start()

    def _announce(self) -> None:
        """Print the phase line just before faulthandler prints the stacks and ends the process."""
        while True:
            limit, armed_at, cause = self.limit, self.armed_at, self.cause
            due = armed_at + limit - 0.5
            now = time.monotonic()
            if limit == math.inf:
                time.sleep(0.5)
            elif now < due:
                time.sleep(min(due - now, 1.0))
            elif (self.limit, self.armed_at) == (limit, armed_at):  # not re-armed meanwhile
                with self._report:
                    if self._reported:  # the caller reported the error first, and disarmed the timer
                        return
                    self._reported = True
                print(f"error: [{self.label}] no progress for {limit:.0f} s during {self.phase}: {cause}; every "
                      f"thread's stack follows and the process exits 1", file=sys.__stderr__, flush=True)
                while (self.limit, self.armed_at) == (limit, armed_at):
                    time.sleep(0.1)  # faulthandler ends the process; a re-arm meanwhile starts over
                with self._report:  # a near miss: the work went on, so a later error has its line again
                    self._reported = False


def watch_limit(timeout_s: float) -> float:
    """How long a phase may go without progress before the watchdog ends the process: torch's own
    timeouts (timeout_s) fire first where they can, with a more specific error."""
    return timeout_s + min(timeout_s, 60)


watchdog = Watchdog()
