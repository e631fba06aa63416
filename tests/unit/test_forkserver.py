"""The fork server --spawn's workers come from (train/cluster/forkserver.py) is stopped when the launcher ends before
any worker: stop_fork_server, the one place that reaches into multiprocessing's fork server. A Python that changes what
it uses fails here."""

import multiprocessing
import multiprocessing.forkserver
import os

import pytest

from train.cluster.forkserver import stop_fork_server


def test_a_running_fork_server_is_stopped_and_reaped_and_a_new_one_can_start():
    multiprocessing.forkserver.set_forkserver_preload([])  # nothing to import: it starts at once
    multiprocessing.forkserver.ensure_running()
    pid = multiprocessing.forkserver._forkserver._forkserver_pid  # the server's process, where this Python keeps it
    try:
        os.kill(pid, 0)  # alive
        stop_fork_server()
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone, and reaped (a zombie would still take signal 0)
        multiprocessing.forkserver.ensure_running()  # forgotten: the next one starts afresh
        assert multiprocessing.forkserver._forkserver._forkserver_pid not in (None, pid)
    finally:
        stop_fork_server()
    stop_fork_server()  # none running: nothing to do
