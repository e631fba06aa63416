"""How a worker ends (train/worker.py), in this process: each error as its exit code and at most one line, said by
the rank that should say it; what counts as an error a restart cannot mend."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from train.cli import parse_config
from train.errors import EXIT_BAD_INPUT, EXIT_FAILED, ConfigError, DataError, OutOfMemory, PeerGaveUp
from train.identity import PeersNeverCame
from train.watchdog import watchdog
from train.worker import exit_code, unrecoverable


def _interrupted_while_saving() -> RuntimeError:
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("torch.save was interrupted") from None
    except RuntimeError as e:
        return e


def _first_is_false(error):
    error.first = False
    return error


@pytest.mark.parametrize("error, code, line", [
    (ConfigError("--lr must be positive: give --lr 0.1"), EXIT_BAD_INPUT,
     "error: --lr must be positive: give --lr 0.1"),
    (DataError("images/a.jpg cannot be read: delete it"), EXIT_BAD_INPUT,
     "error: [rank 0] images/a.jpg cannot be read: delete it"),
    (_first_is_false(OutOfMemory("out of memory")), EXIT_BAD_INPUT, None),  # another rank said it first
    (PeerGaveUp("a peer's line"), EXIT_BAD_INPUT, None),  # the peer said it
    (PeersNeverCame("rank 1 did not join"), EXIT_FAILED, "error: [rank 0] rank 1 did not join"),
    (dist.DistNetworkError("Connection reset by peer"), EXIT_FAILED,
     "error: [rank 0] lost contact with the other workers during training (Connection reset by peer)"),
    (KeyboardInterrupt(), 130, "error: [rank 0] interrupted by a second Ctrl-C during training"),
    (_interrupted_while_saving(), 130, "error: [rank 0] interrupted by a second Ctrl-C during training"),
    (RuntimeError("a bug"), None, None),  # a crash: it goes on as itself, with its traceback
])
def test_each_error_ends_the_worker_with_its_code_and_at_most_one_line(capsys, error, code, line):
    watchdog.begin("rank 0")
    watchdog.enter("training", 60)
    try:
        assert exit_code(error, 0) == code
    finally:
        watchdog.pause()
    errors = [text for text in capsys.readouterr().err.splitlines() if text.startswith("error:")]
    assert errors == ([] if line is None else [errors[0]]) and (line is None or errors[0].startswith(line)), errors


def test_once_the_watchdog_said_its_line_the_worker_says_none():
    watchdog.begin("rank 0")
    assert watchdog.claim_report()  # the watchdog's line is out: it ends the process
    assert exit_code(ConfigError("x"), 0) == EXIT_FAILED


def test_what_a_restart_cannot_mend():
    cfg, cpu = parse_config(["--preset", "debug"]), torch.device("cpu")
    assert str(unrecoverable(ConfigError("bad\nOriginal Traceback (most recent call last):\nValueError: why"), None,
                             cpu, cfg)) == "why"
    watchdog.enter("training", 60)
    try:
        oom = unrecoverable(torch.OutOfMemoryError("Tried to allocate 2.00 GiB"), SimpleNamespace(step=4), cpu, cfg)
    finally:
        watchdog.pause()
    assert isinstance(oom, OutOfMemory) and "training step 5" in str(oom)
    assert unrecoverable(RuntimeError("a crash"), None, cpu, cfg) is None  # a restart may mend it
