"""The watchdog and a caller reporting the same failure print one error line between them, never two."""

from __future__ import annotations

import threading
import time

from train.base.watchdog import Watchdog


def _overdue(watchdog: Watchdog) -> None:
    """As if the phase's limit had run out (without arming faulthandler, which would end this process)."""
    watchdog.phase, watchdog.label = "process-group set-up", "rank 1"
    watchdog.limit, watchdog.armed_at = 1.0, time.monotonic() - 5


def _wait_for_the_line(capfd, watchdog: Watchdog) -> str:
    """What the announcing thread wrote, once its whole line is out. The line follows the thread's flag at
    once; reading while it is being written could lose its first bytes (capfd truncates what it read), so
    the read waits for the flag and a moment more."""
    deadline = time.monotonic() + 10
    while not watchdog._reported and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    err = capfd.readouterr().err
    while not err.endswith("\n") and time.monotonic() < deadline:
        time.sleep(0.05)
        err += capfd.readouterr().err
    return err


def test_a_caller_that_reports_first_silences_the_watchdog(capfd):
    watchdog = Watchdog()
    _overdue(watchdog)
    assert watchdog.claim_report()
    _overdue(watchdog)  # still overdue after the claim: the announcement must stay silent anyway
    watchdog._announce()  # returns at once
    assert capfd.readouterr().err == ""
    assert not watchdog.claim_report()


def test_a_watchdog_that_named_the_phase_first_keeps_the_caller_silent(capfd):
    watchdog = Watchdog()
    _overdue(watchdog)
    threading.Thread(target=watchdog._announce, daemon=True).start()
    err = _wait_for_the_line(capfd, watchdog)
    assert err.startswith("error: [rank 1] no progress for 1 s during process-group set-up"), err
    assert not watchdog.claim_report()
    watchdog.pause()  # lets the announcing thread go back to idling


def test_after_a_near_miss_a_later_error_has_its_line_again(capfd):
    """The phase line was out, then the work went on (a step in the last half second): the next error is
    reported by its caller, in its own line."""
    watchdog = Watchdog()
    _overdue(watchdog)
    threading.Thread(target=watchdog._announce, daemon=True).start()
    _wait_for_the_line(capfd, watchdog)
    deadline = time.monotonic() + 10
    watchdog.limit, watchdog.armed_at = 100.0, time.monotonic()  # re-armed, as progress() does
    while watchdog._reported and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watchdog.claim_report()


def test_each_run_in_a_process_has_its_own_error_line():
    """python -m train's main called again in one process (tests, a notebook): the second run's error is
    reported by its caller, not taken for the first run's."""
    watchdog = Watchdog()
    watchdog.begin("rank 0")
    assert watchdog.claim_report()
    assert not watchdog.claim_report()  # the same run: its one line is out
    watchdog.begin("rank 0")
    assert watchdog.label == "rank 0" and watchdog.phase == "start-up"
    assert watchdog.claim_report()


def test_a_phase_whose_caller_knows_what_no_progress_means_says_that(capfd):
    """A rank from the environment alone, in its set-up (train/cluster/distributed.py): not 'a peer died'."""
    watchdog = Watchdog()
    watchdog.enter("process-group set-up", 1e6, "this process is rank 1 of 2 because RANK=1 ... are set")
    _overdue(watchdog)
    threading.Thread(target=watchdog._announce, daemon=True).start()
    err = _wait_for_the_line(capfd, watchdog)
    watchdog.pause()
    assert err == ("error: [rank 1] no progress for 1 s during process-group set-up: this process is rank 1 of 2 "
                   "because RANK=1 ... are set; every thread's stack follows and the process exits 1\n"), err
    watchdog.enter("training", 1e6)  # the next phase says what it always says
    assert watchdog.cause == Watchdog.STUCK
    watchdog.pause()


def test_a_phase_inside_another_gives_the_outer_phase_back_with_its_limit():
    from train.base.watchdog import Watchdog

    watchdog = Watchdog()
    watchdog.begin("rank 0", limit_s=50.0)
    watchdog.enter("training")
    try:
        with watchdog.during("evaluation at step 10"):
            assert (watchdog.phase, watchdog.limit) == ("evaluation at step 10", 50.0)
        assert (watchdog.phase, watchdog.limit, watchdog.cause) == ("training", 50.0, Watchdog.STUCK)
        try:
            with watchdog.during("the checkpoint save of step 20"):
                raise OSError("disk full")
        except OSError:
            pass
        assert watchdog.phase == "the checkpoint save of step 20"  # the error names where it happened
    finally:
        watchdog.pause()


def test_a_phase_inside_an_unbounded_one_leaves_no_timer_behind():
    """A save outside training (a test, a notebook): once it ends, nothing may end the process later."""
    import subprocess
    import sys

    from tests.helpers import REPO

    probe = ("import time\nfrom train.base.watchdog import watchdog\nwatchdog.begin('rank 0', limit_s=1.0)\n"
             "with watchdog.during('the checkpoint save of step 1'):\n    pass\ntime.sleep(2.5)\nprint('alive')\n")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert (proc.returncode, proc.stdout) == (0, "alive\n"), proc.stderr[-2000:]
