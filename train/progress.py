"""One progress line for the commands a user waits on (`make pack` first): what is done of the total, the rate
and the time left.

On a terminal the line is redrawn in place a few times a second. Elsewhere (CI logs, Slurm's output files) a
plain line is printed every few seconds, whatever the pace of the work: a log shows that the command is alive
without a line per item. Standard library only.

  with Progress("pack", total=len(files), unit="images") as progress:
      for path in files:
          ...
          progress.advance()
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

REDRAW_S = 0.25  # on a terminal: the line redrawn this often
PLAIN_S = 5.0  # elsewhere: one line this often


def duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds // 60 % 60:02d} min"


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """A context: the line is shown every `every` seconds from a thread of its own (so a stall shows too),
    and a last time on exit, with the elapsed time instead of the time left. `done`: the items
    finished before this command (a continued pack), counted in the total but not in the rate. last: the last
    line on exit (a step that the next one sums up, such as a listing, may leave it out; then a short step
    shows nothing). quiet: counts and shows nothing (for a caller that reports on its own)."""

    def __init__(self, label: str, total: int | None = None, unit: str = "items", done: int = 0,
                 stream: TextIO | None = None, every: float | None = None, last: bool = True, quiet: bool = False):
        self.label, self.total, self.unit, self.last, self.quiet = label, total, unit, last, quiet
        self.stream = stream or sys.stderr
        self.redraw = _is_terminal(self.stream)
        self.every = every if every is not None else REDRAW_S if self.redraw else PLAIN_S
        self.done = self.before = done
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name=f"progress-{label}", daemon=True)

    def advance(self, count: int = 1) -> None:
        self.done += count

    def line(self, final: bool = False) -> str:
        elapsed = time.monotonic() - self.started
        rate = (self.done - self.before) / elapsed if elapsed > 0 else 0.0
        if self.total:
            parts = [f"{self.label}: {self.done:,}/{self.total:,} {self.unit} ({100 * self.done / self.total:.1f}%)"]
        else:
            parts = [f"{self.label}: {self.done:,} {self.unit}"]
        parts.append(f"{rate:,.0f} {self.unit}/s" if rate >= 10 else f"{rate:.1f} {self.unit}/s")
        if final:
            parts.append(duration(elapsed))
        elif self.total and rate > 0:
            parts.append(f"ETA {duration((self.total - self.done) / rate)}")
        return ", ".join(parts)

    def show(self, final: bool = False) -> None:
        text = self.line(final)
        if self.redraw:  # back to the line's start, the line, and the rest of the old one erased
            text = f"\r{text}\x1b[K"
        self.stream.write(text + ("\n" if final or not self.redraw else ""))
        self.stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(self.every):
            self.show()

    def __enter__(self) -> Progress:
        self.started = time.monotonic()
        if not self.quiet:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if not self.quiet:
            self._stop.set()
            self._thread.join()
            if self.last:
                self.show(final=True)
