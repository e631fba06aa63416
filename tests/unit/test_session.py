"""Each attempt's keys under a name of its own, on a rendezvous store that outlives attempts."""

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from train.cluster.distributed import agree_on_session


def _agree(store_port: int, world: int, delays: dict[int, float]) -> dict[int, str]:
    """Every rank of one attempt, each a thread with its own client of the store, as torchrun's workers
    are clients of its agent's store."""
    sessions: dict[int, str] = {}

    def rank(r: int) -> None:
        time.sleep(delays.get(r, 0.0))
        client = dist.TCPStore("127.0.0.1", store_port, world, is_master=False, timeout=timedelta(seconds=20))
        sessions[r] = agree_on_session(client, r, world, timeout_s=20)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(sessions) == world, "an attempt did not agree within the time"
    return sessions


@pytest.mark.parametrize("late", [None, 0, 1])  # rank 0 late: rank 1 meets the old answer first; rank 1 late:
def test_each_attempt_on_a_shared_store_gets_a_name_of_its_own(late):  # rank 0 meets its old greeting first
    """A store that outlives its attempts, as torchrun's agent store does: attempt 2 starts with every key
    of attempt 1 still in it, and must neither reuse its name nor split between two."""
    server = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    first = _agree(server.port, 3, {})
    assert len(set(first.values())) == 1
    second = _agree(server.port, 3, {} if late is None else {late: 0.5})
    assert len(set(second.values())) == 1, second
    assert set(second.values()) != set(first.values())
