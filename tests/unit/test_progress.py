"""train/progress.py on a real terminal (a pty) and in a log (a file), and the first fetch of named weights
(train/weights.py) showing it, from a real HTTP server on 127.0.0.1."""

import hashlib
import http.server
import os
import pty
import re
import threading
import time
from types import SimpleNamespace

import pytest

from train.errors import ConfigError
from train.progress import Progress
from train.weights import fetch

LINE = r"copying: {done}/10 files \({share}%\), [0-9.]+ files/s, 0:[0-9]{{2}} left"


def test_in_a_log_a_plain_line_every_few_seconds(tmp_path):
    with open(tmp_path / "log", "w") as log:
        progress = Progress(10, "copying", unit="files", stream=log, every=0.05)
        for _ in range(10):
            time.sleep(0.06)
            progress.update(1)
        progress.close()
    lines = (tmp_path / "log").read_text().splitlines()
    assert len(lines) == 11 and "\r" not in "".join(lines)
    for done, line in enumerate(lines[:-1], 1):
        assert re.fullmatch(LINE.format(done=done, share=done * 10), line), line
    assert re.fullmatch(r"copying: 10/10 files in 0:0[0-9], [0-9.]+ files/s", lines[-1]), lines[-1]


def test_a_short_wait_says_nothing_and_the_default_is_every_5_s_in_a_log(tmp_path, monkeypatch):
    monkeypatch.delenv("TRAINBOX_PROGRESS_EVERY", raising=False)
    with open(tmp_path / "log", "w") as log:
        progress = Progress(3, "copying", unit="files", stream=log)
        assert progress.every == 5.0
        for _ in range(3):
            progress.update(1)
        progress.close()
    assert (tmp_path / "log").read_text() == ""
    monkeypatch.setenv("TRAINBOX_PROGRESS_EVERY", "60")
    assert Progress(3, "copying", stream=open(os.devnull, "w")).every == 60.0


def test_on_a_terminal_one_line_redrawn_in_place():
    controller, terminal = pty.openpty()
    with open(terminal, "w") as screen:
        progress = Progress(10, "copying", unit="files", stream=screen, every=0)
        assert progress.live and Progress(1, "x", stream=screen).every == 0.5
        for _ in range(10):
            progress.update(1)
        progress.close()
        shown = os.read(controller, 65536).decode()
    os.close(controller)
    redraws = shown.split("\r\x1b[K")
    assert redraws[0] == "" and len(redraws) == 12 and "\n" not in "".join(redraws[:-1])
    for done, line in enumerate(redraws[1:-1], 1):
        assert re.fullmatch(LINE.format(done=done, share=done * 10), line), line
    assert re.fullmatch(r"copying: 10/10 files in 0:00, [0-9.]+ files/s\r\n", redraws[-1]), redraws[-1]


class _Files(http.server.BaseHTTPRequestHandler):
    """Serves the bytes of `files` by name, in 64 KiB writes."""

    files: dict = {}

    def do_GET(self):  # http.server calls it by this name
        body = self.files.get(self.path.lstrip("/"))
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        for start in range(0, len(body), 1 << 16):
            self.wfile.write(body[start:start + (1 << 16)])

    def log_message(self, *args):
        pass


@pytest.fixture
def weights_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_first_fetch_of_named_weights_shows_its_progress(weights_server, tmp_path, monkeypatch, capsys):
    """A file named as torchvision names its weights (the SHA-256 prefix in the name), fetched into TORCH_HOME with
    a progress line per MB in a log (TRAINBOX_PROGRESS_EVERY=0), once: the cached copy is then only checked. A
    download that is not the file its name promises is refused, and leaves nothing."""
    server, url = weights_server
    body = os.urandom(5 * (1 << 20) + 12345)
    name = f"net-{hashlib.sha256(body).hexdigest()[:8]}.pth"
    _Files.files = {name: body, "other-0123abcd.pth": body}
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    monkeypatch.setenv("TRAINBOX_PROGRESS_EVERY", "0")
    path = fetch(SimpleNamespace(url=f"{url}/{name}"))
    assert path == tmp_path / "torch-home" / "hub" / "checkpoints" / name and path.read_bytes() == body
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 7, lines
    for done, line in enumerate(lines[:-1], 1):
        amount = f"{min(done * 1.048576, len(body) / 1e6):.1f}/{len(body) / 1e6:.1f}"
        assert re.fullmatch(rf"fetching {re.escape(name)}: {re.escape(amount)} MB \([0-9]+%\), [0-9.]+ MB/s, "
                            rf"0:00 left", line), line
    assert re.fullmatch(rf"fetching {re.escape(name)}: 5.3/5.3 MB in 0:00, [0-9.]+ MB/s", lines[-1]), lines[-1]
    fetch(SimpleNamespace(url=f"{url}/{name}"))  # cached: checked, not fetched again
    assert capsys.readouterr().err == ""

    with pytest.raises(ConfigError, match=r"^fetched other-0123abcd.pth from .*, but its SHA-256 does not start with "
                                          r"0123abcd \(a proxy or a cut connection\?\), refused: run again"):
        fetch(SimpleNamespace(url=f"{url}/other-0123abcd.pth"))
    assert sorted(p.name for p in path.parent.iterdir()) == [name]  # no partial file, no damaged one
