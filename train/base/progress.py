"""One progress line for the commands a user waits on (make pack, make evaluate, the first fetch of named weights):
what is done of the total, the rate and the time left.

On a terminal the line is redrawn in place a few times a second. Elsewhere (CI logs, Slurm's output files, a pipe)
a plain line is printed every few seconds, whatever the pace of the work: a log shows that the command is alive
without a line per item. TRAINBOX_PROGRESS_EVERY=S sets the seconds between lines (0: a line at every update),
e.g. 60 for long Slurm logs. Standard library only, no trainbox module: any command may use it.

  with Progress("pack", total=len(files), unit="images") as progress:
      for path in files:
          ...
          progress.update()

  progress = Progress("evaluating model.pt", total=len(loader), unit="batches", last=None).start()
  ...
  progress.close()
"""

from __future__ import annotations

import os
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


def amount(value: float) -> str:
    """A count as a person reads it: whole numbers with thousands separators, fractions (MB) with one decimal."""
    return f"{value:,.0f}" if float(value).is_integer() or abs(value) >= 100 else f"{value:,.1f}"


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """The line is shown every `every` seconds from a thread of its own (so a stall shows too), and a last time at
    the end (close, or the end of a `with`), with the elapsed time instead of the time left.

    done: the items finished before this command (a continued pack), counted in the total but not in the rate.
    last: the last line at the end: True always, None only where a line was shown already (a short wait then
    prints nothing), False never (a step the next one sums up). quiet: counts and shows nothing (another rank,
    or a caller that reports on its own)."""

    def __init__(self, label: str, total: float | None = None, unit: str = "items", done: float = 0,
                 stream: TextIO | None = None, every: float | None = None, last: bool | None = True,
                 quiet: bool = False):
        self.label, self.total, self.unit, self.last, self.quiet = label, total, unit, last, quiet
        self.stream = stream or sys.stderr
        self.redraw = _is_terminal(self.stream)
        if every is None:
            every = float(os.environ.get("TRAINBOX_PROGRESS_EVERY") or (REDRAW_S if self.redraw else PLAIN_S))
        self.every = every
        self.done = self.before = done
        self.shown = False
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name=f"progress-{label}", daemon=True)
        self._lock = threading.Lock()

    def update(self, count: float = 1) -> None:
        self.done += count
        if self.every == 0 and not self.quiet:  # a line at every update
            self.show()

    advance = update

    def line(self, final: bool = False) -> str:
        elapsed = time.monotonic() - self.started
        rate = (self.done - self.before) / elapsed if elapsed > 0 else 0.0
        if self.total:
            parts = [f"{self.label}: {amount(self.done)}/{amount(self.total)} {self.unit} "
                     f"({100 * self.done / self.total:.1f}%)"]
        else:
            parts = [f"{self.label}: {amount(self.done)} {self.unit}"]
        parts.append(f"{rate:,.0f} {self.unit}/s" if rate >= 10 else f"{rate:.1f} {self.unit}/s")
        if final:
            parts.append(duration(elapsed))
        elif self.total and rate > 0:
            parts.append(f"ETA {duration((self.total - self.done) / rate)}")
        return ", ".join(parts)

    def show(self, final: bool = False) -> None:
        with self._lock:
            text = self.line(final)
            if self.redraw:  # back to the line's start, the line, and the rest of the old one erased
                text = f"\r{text}\x1b[K"
            self.stream.write(text + ("\n" if final or not self.redraw else ""))
            self.stream.flush()
            self.shown = True

    def _tick(self) -> None:
        while not self._stop.wait(self.every):
            self.show()

    def start(self) -> Progress:
        self.started = time.monotonic()
        if not self.quiet and self.every > 0:
            self._thread.start()
        return self

    def close(self) -> None:
        if self.quiet:
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.last or (self.last is None and self.shown):
            self.show(final=True)

    def __enter__(self) -> Progress:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
