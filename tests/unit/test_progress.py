"""The progress line: redrawn in place on a terminal, periodic plain lines elsewhere, never one per item."""

import io
import re
import time

from train.progress import Progress, duration

LINE = re.compile(r"pack: ([\d,]+)/1,000 images \(\d+\.\d%\), [\d.,]+ images/s, ETA \d+ s")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_a_plain_line_every_few_seconds_and_not_one_per_item():
    out = io.StringIO()
    with Progress("pack", total=1000, unit="images", stream=out, every=0.1) as progress:
        for _ in range(10):
            progress.advance(50)  # many items between two lines: still one line per period
            time.sleep(0.05)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    periodic = [line for line in lines if LINE.fullmatch(line)]
    assert 3 <= len(periodic) <= 6, lines  # about 0.5 s at one line per 0.1 s
    done = [int(LINE.fullmatch(line)[1].replace(",", "")) for line in periodic]
    assert done == sorted(done) and 0 < done[-1] <= 500, lines
    assert re.fullmatch(r"pack: 500/1,000 images \(50\.0%\), \d+ images/s, 1 s", lines[-1]), lines
    assert len(lines) == len(periodic) + 1  # and nothing else


def test_a_stall_still_shows_a_line():
    out = io.StringIO()
    with Progress("pack", total=1000, unit="images", stream=out, every=0.05):
        time.sleep(0.3)  # no item done: the line still comes, and says so
    assert out.getvalue().count("pack: 0/1,000 images (0.0%), 0.0 images/s\n") >= 3, out.getvalue()


def test_on_a_terminal_the_line_is_redrawn_in_place():
    out = Terminal()
    started = time.monotonic()
    with Progress("pack", total=1000, unit="images", done=400, stream=out, every=0.05) as progress:
        for _ in range(4):
            progress.advance(100)
            time.sleep(0.06)
    elapsed = time.monotonic() - started
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # one line, ended when the work is
    draws = text.rstrip("\n").split("\r")[1:]
    assert len(draws) >= 3 and all(d.endswith("\x1b[K") for d in draws)  # each erases what the last left
    assert re.fullmatch(r"pack: 800/1,000 images \(80\.0%\), [\d,]+ images/s, 0 s\x1b\[K", draws[-1]), draws
    # the 400 done before this command count in the total, not in the rate: 400 in this command's time
    rate = float(re.search(r"([\d,]+) images/s", draws[-1])[1].replace(",", ""))
    assert 380 < rate * elapsed < 600, (draws[-1], elapsed)


def test_without_a_total_it_counts_and_durations_read_as_a_person_would():
    out = io.StringIO()
    with Progress("listing /data", unit="files", stream=out) as progress:
        progress.advance(12_345)
    assert re.fullmatch(r"listing /data: 12,345 files, [\d,]+ files/s, 0 s\n", out.getvalue())
    quick = io.StringIO()  # a step that the next sums up: only its periodic lines, none for a short one
    with Progress("listing /data", unit="files", stream=quick, last=False) as progress:
        progress.advance(12_345)
    assert quick.getvalue() == ""
    assert [duration(s) for s in (4.4, 65, 3600 * 4 + 125)] == ["4 s", "1 min 05 s", "4 h 02 min"]


def test_a_log_gets_a_line_every_5_seconds_and_a_terminal_a_redraw_4_times_a_second():
    assert Progress("pack", 10, stream=io.StringIO()).every == 5
    assert Progress("pack", 10, stream=Terminal()).every == 0.25
