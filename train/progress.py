"""How far a long wait has got, on stderr: done/total, the rate and the time left. On a terminal, one line redrawn
in place twice a second; elsewhere (CI logs, Slurm files, a pipe) a plain line every 5 s, so that a log keeps a
line every few seconds rather than thousands of redraws. A wait shorter than that prints nothing. Standard library
only, no trainbox module: any command may use it.

  progress = Progress(len(loader), "evaluating model.pt", unit="batches")
  for batch in loader:
      ...
      progress.update(1)
  progress.close()    # the last line: how much, how long, how fast (only when a line was shown)

TRAINBOX_PROGRESS_EVERY=S sets the seconds between lines (0: every update), e.g. 60 for long Slurm logs.
"""

from __future__ import annotations

import os
import sys
import time

EVERY_S = {True: 0.5, False: 5.0}  # on a terminal, elsewhere
CLEAR = "\r\x1b[K"  # back to the start of the line, and erase it


class Progress:
    def __init__(self, total: float, label: str, unit: str = "", stream=None, every: float | None = None):
        self.total, self.label, self.unit = total, label, unit
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty()
        if every is None:
            every = float(os.environ.get("TRAINBOX_PROGRESS_EVERY") or EVERY_S[self.live])
        self.every, self.done, self.shown = every, 0.0, False
        self.start = self.last = time.monotonic()

    def update(self, n: float = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self._write(self._line(now), end="")

    def close(self) -> None:
        """The last line (how much, in how long, how fast), where the wait was long enough to show a line."""
        if self.shown:
            elapsed = time.monotonic() - self.start
            self._write(f"{self.label}: {self._amount(self.done)}{self._of()} {self.unit} in {_clock(elapsed)}, "
                        f"{self._amount(self.done / max(elapsed, 1e-9))} {self.unit}/s".replace("  ", " "), end="\n")

    def _line(self, now: float) -> str:
        rate = self.done / max(now - self.start, 1e-9)
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        left = f", {_clock((self.total - self.done) / rate)} left" if self.total and rate > 0 else ""
        return (f"{self.label}: {self._amount(self.done)}{self._of()} {self.unit}{share}, "
                f"{self._amount(rate)} {self.unit}/s{left}").replace("  ", " ")

    def _of(self) -> str:
        return f"/{self._amount(self.total)}" if self.total else ""

    def _amount(self, value: float) -> str:
        return f"{value:.0f}" if abs(value) >= 100 or float(value).is_integer() else f"{value:.1f}"

    def _write(self, line: str, end: str) -> None:
        """On a terminal, over the line shown before; elsewhere, a line of its own."""
        self.stream.write(CLEAR + line + end if self.live else line + "\n")
        self.stream.flush()
        self.shown = True


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"
