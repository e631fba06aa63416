"""What counts as losing the other ranks (train/cluster/distributed.py `lost_peer`), on the errors torch itself raises:
a real gloo group of two ranks in this process (each rank a thread with its own client of a real TCPStore, as
tests/unit/test_session.py's ranks are), real TCPStores. Also what torch 2.13 raises untyped, so that a torch
that types them shows here first."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroupGloo

from train.cluster.distributed import PeersTimedOut, agree_on_session, lost_peer


def _gloo_pair(timeout_s: float) -> tuple:
    """(store host, its client, [rank 0's group, rank 1's group]): two ranks of one real gloo group."""
    timeout = timedelta(seconds=timeout_s)
    host = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timeout, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", host.port, 2, False, timeout=timeout)
    groups = [None, None]

    def join(rank: int, store) -> None:
        groups[rank] = ProcessGroupGloo(dist.PrefixStore("group/", store), rank, 2, timeout)

    _together(lambda: join(0, host), lambda: join(1, client))
    return host, client, groups


def _together(*actions) -> None:
    threads = [threading.Thread(target=action) for action in actions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)


def _raised(action) -> BaseException:
    """The error action raised, without its traceback: the frames it holds (a test's gloo groups among their
    locals) go when the test returns, not at some later garbage collection."""
    with pytest.raises(Exception) as caught:
        action()
    error = caught.value
    del caught
    return error.with_traceback(None)


def _all_reduce(group) -> None:
    group.allreduce([torch.ones(4)]).wait()


def test_a_peer_that_died_in_a_gloo_collective():
    host, client, groups = _gloo_pair(10)
    _together(lambda: _all_reduce(groups[0]), lambda: _all_reduce(groups[1]))
    groups[1] = None  # rank 1's group goes with its connections, as a dead process's do
    started = time.monotonic()
    error = _raised(lambda: _all_reduce(groups[0]))
    assert time.monotonic() - started < 5  # the closed connection, not the timeout
    assert type(error) is RuntimeError and "Connection closed by peer" in str(error)  # untyped in torch 2.13
    assert lost_peer(error)


def test_a_peer_that_stops_answering_in_a_gloo_collective():
    host, client, groups = _gloo_pair(0.3)
    error = _raised(lambda: _all_reduce(groups[0]))  # rank 1 never joins it
    assert type(error) is RuntimeError and "Timed out waiting 300ms" in str(error)
    assert lost_peer(error)
    again = _raised(lambda: _all_reduce(groups[0]))  # the pair the timeout closed
    assert type(again) is RuntimeError and "caused pair closure" in str(again)
    assert lost_peer(again)


def test_the_stores_failures_are_torchs_own_types():
    timeout = timedelta(seconds=0.3)
    host = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timeout, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", host.port, 2, False, timeout=timeout)
    waited = _raised(lambda: client.get("never-set"))
    assert isinstance(waited, dist.DistStoreError)
    del host  # the store's host is gone (rank 0's process ended)
    gone = _raised(lambda: client.get("never-set"))
    assert isinstance(gone, dist.DistNetworkError)
    for error in (waited, gone):
        assert lost_peer(error), error
    # A rendezvous whose host cannot be reached (DistNetworkError) and a host whose clients never come
    # (DistStoreError) take a second each here: tests/e2e/test_restarts.py meets both in real processes.


def test_a_rendezvous_of_trainbox_own_that_times_out():
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=5), wait_for_workers=False)
    error = _raised(lambda: agree_on_session(store, 0, 2, timeout_s=0.1))  # rank 1 never arrives
    assert isinstance(error, PeersTimedOut) and isinstance(error, dist.DistStoreError)
    assert lost_peer(error)


class _Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        time.sleep(0.3)
        return index


def test_an_error_that_only_mentions_a_timeout_is_not_a_lost_peer():
    """A DataLoader that waited too long for its worker: 'timed out', a RuntimeError, and no peer involved. (Last in
    this module: the gloo groups above are gone with their threads before its worker is forked.)"""
    batches = iter(torch.utils.data.DataLoader(_Slow(), num_workers=1, timeout=0.1))
    error = _raised(batches.__next__)
    del batches  # its worker ends now (after its item), not whenever a later test collects it
    assert type(error) is RuntimeError and "DataLoader timed out" in str(error)
    assert not lost_peer(error)
    assert not lost_peer(RuntimeError("connection string is not valid"))
