"""The progress line (train/base/progress.py): redrawn in place on a terminal (a real pty too), periodic plain lines
elsewhere, never one per item, nothing for a short wait where the caller asks so; and the first fetch of named
weights (train/components/weights.py) showing it, from a real HTTP server on 127.0.0.1."""

import hashlib
import io
import os
import pty
import re
import select
import time
from types import SimpleNamespace

import pytest

from tests.helpers import FileServer
from train.base.errors import ConfigError
from train.base.progress import Progress, duration
from train.components.weights import fetch

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


def test_a_short_wait_says_nothing_where_asked_and_the_environment_sets_the_period(tmp_path, monkeypatch):
    monkeypatch.delenv("TRAINBOX_PROGRESS_EVERY", raising=False)
    with open(tmp_path / "log", "w") as log:
        progress = Progress("copying", total=3, unit="files", stream=log, last=None).start()
        assert progress.every == 5.0
        for _ in range(3):
            progress.update(1)
        progress.close()
    assert (tmp_path / "log").read_text() == ""  # shorter than one period: not a line
    monkeypatch.setenv("TRAINBOX_PROGRESS_EVERY", "60")
    assert Progress("copying", total=3, stream=open(os.devnull, "w")).every == 60.0


def test_every_zero_is_a_line_at_every_update_on_a_real_terminal_redrawn_in_place():
    controller, terminal = pty.openpty()
    with open(terminal, "w") as screen:
        progress = Progress("copying", total=10, unit="files", stream=screen, every=0, last=None).start()
        assert progress.redraw and Progress("x", total=1, stream=screen).every == 0.25
        for _ in range(10):
            progress.update(1)
        progress.close()
        shown = b""
        while select.select([controller], [], [], 0.5)[0]:  # all the terminal got, read as it comes
            shown += os.read(controller, 65536)
    os.close(controller)
    draws = shown.decode().split("\r")[1:-1]  # the last piece: the newline, which the terminal sends as \r\n
    assert len(draws) == 11 and all(d.startswith("copying: ") for d in draws), draws
    for done, line in enumerate(draws[:-1], 1):
        assert re.fullmatch(rf"copying: {done}/10 files \({done * 10}\.0%\), [\d.,]+ files/s, ETA \d+ s\x1b\[K",
                            line), line
    assert re.fullmatch(r"copying: 10/10 files \(100\.0%\), [\d.,]+ files/s, 0 s\x1b\[K", draws[-1]), draws[-1]


@pytest.fixture
def weights_server():
    with FileServer({}) as server:
        yield server, server.url


def test_the_first_fetch_of_named_weights_shows_its_progress(weights_server, tmp_path, monkeypatch, capsys):
    """A file named as torchvision names its weights (the SHA-256 prefix in the name), fetched into TORCH_HOME with
    a progress line per MB in a log (TRAINBOX_PROGRESS_EVERY=0), once: the cached copy is then only checked. A
    download that is not the file its name promises is refused, and leaves nothing."""
    server, url = weights_server
    body = os.urandom(5 * (1 << 20) + 12345)
    name = f"net-{hashlib.sha256(body).hexdigest()[:8]}.pth"
    server.files.update({name: body, "other-0123abcd.pth": body})
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    monkeypatch.setenv("TRAINBOX_PROGRESS_EVERY", "0")
    path = fetch(SimpleNamespace(url=f"{url}/{name}"))
    assert path == tmp_path / "torch-home" / "hub" / "checkpoints" / name and path.read_bytes() == body
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 7, lines
    for done, line in enumerate(lines[:-1], 1):
        amount = f"{min(done * 1.048576, len(body) / 1e6):.1f}/{len(body) / 1e6:.1f}"
        assert re.fullmatch(rf"fetching {re.escape(name)}: {re.escape(amount)} MB \([0-9.]+%\), [0-9.,]+ MB/s, "
                            rf"ETA \d+ s", line), line
    assert re.fullmatch(rf"fetching {re.escape(name)}: 5.3/5.3 MB \(100\.0%\), [0-9.,]+ MB/s, \d+ s", lines[-1]), \
        lines[-1]
    fetch(SimpleNamespace(url=f"{url}/{name}"))  # cached: checked, not fetched again
    assert capsys.readouterr().err == ""

    with pytest.raises(ConfigError, match=r"^fetched other-0123abcd.pth from .*, but its SHA-256 does not start with "
                                          r"0123abcd \(a proxy or a cut connection\?\), refused: run again"):
        fetch(SimpleNamespace(url=f"{url}/other-0123abcd.pth"))
    assert sorted(p.name for p in path.parent.iterdir()) == [name]  # no partial file, no damaged one
