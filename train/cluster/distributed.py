"""The process group of the ranks train/cluster/identity.py names, from its start to leaving it together.

  init(device, timeout_s)      the group, under a name this attempt alone uses in the rendezvous store (a torchrun
                               restart never meets the dead attempt's keys); join_group: a tool's own group
  lost_peer(error)             whether an error means losing the other ranks (one died, hung or cannot be reached)
  on_main / broadcast_from_main / gather
                               rank 0's file I/O with every rank learning its error; small objects to every rank
  StopSignal                   SIGTERM, SIGUSR2 or a first Ctrl-C on any rank stops every rank after the same step
  wrap / teardown              the DDP wrapper; leaving the group together, after a clean run without the wrapper
  announce_unrecoverable       an error a restart cannot mend, said to the peers through the store
"""

from __future__ import annotations

import datetime
import signal
import sys
import time
import uuid
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous
from torch.nn.parallel import DistributedDataParallel as DDP

from train.base.errors import ConfigError, note_process_group
from train.base.watchdog import watch_limit, watchdog
from train.cluster.identity import Identity, from_environment, identity, is_main, peers_never_came, waiting_because


class PeersTimedOut(dist.DistStoreError):
    """Other ranks did not arrive at a rendezvous of this process's own (start-up, the end of the run): a wait on
    the store that timed out, as torch's own (DistStoreError)."""


# gloo's collectives raise a plain RuntimeError, without a type of torch.distributed's: checked with torch 2.13.0
# (tests/unit/test_lost_peer.py): a dead peer "[.../gloo/transport/tcp/pair.cc:N] Connection closed by peer ...",
# a silent one "[.../gloo/transport/tcp/unbound_buffer.cc:N] Timed out waiting Nms for recv operation ...", the
# next collective on a pair such a timeout closed "Application timeout caused pair closure". Everything else is
# typed: the store (DistNetworkError: its host is gone or cannot be reached; DistStoreError: a wait timed out, a
# rendezvous host waiting for its clients) and NCCL (DistBackendError, C10D_NCCL_CHECK in torch's NCCLUtils.hpp).
GLOO_LOST_PEER = ("/gloo/transport/", "caused pair closure")


def lost_peer(error: BaseException) -> bool:
    """A failure to reach the other ranks (one died, hung, or cannot be reached), by torch.distributed's exception
    types (DistError and its subclasses, PeersTimedOut among them), and for gloo's untyped errors by where they
    come from (GLOO_LOST_PEER); not just any error whose text says "timeout" or "connection"."""
    if isinstance(error, dist.DistError):
        return True
    return type(error) is RuntimeError and any(mark in str(error) for mark in GLOO_LOST_PEER)


_control_group = None  # gloo group for small host-side agreements (stop flag) without device syncs
_session_store = None  # the store of this process's group: this attempt's namespace in the rendezvous store (init)
_wrappers: list[weakref.ref] = []  # the DistributedDataParallel wrappers `wrap` made (see teardown)


def init(device: torch.device, timeout_s: int) -> Identity:
    """Start the process group for this process (no-op for a single process).

    Every key this attempt puts in the rendezvous store lies under a name no earlier attempt used (see
    `agree_on_session`): under torchrun's shared store (restarts keep the store and its keys,
    pytorch/pytorch#135712) a restarted attempt never meets the dead attempt's addresses."""
    global _control_group, _session_store
    ident = identity()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the process group, so NCCL binds the right GPU
    if not ident.distributed or dist.is_initialized():
        return ident
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if ident.launcher == "env":  # perhaps left over in a shell: said before the wait, with how to train alone
        print(f"trainbox: {from_environment(ident, timeout_s)}", file=sys.stderr, flush=True)
    # A client's connect under torch 2.13 gives up well after timeout_s (4.6 s for 2 s, 11 s for 5 s here), where
    # the watchdog may end it first: for a rank from the environment its line then says what the error would.
    watchdog.enter(f"process-group set-up (rendezvous at {ident.master_addr}:{ident.master_port})",
                   watch_limit(timeout_s), waiting_because(ident) if ident.launcher == "env" else None)
    url = f"tcp://{ident.master_addr}:{ident.master_port}" if ident.launcher == "slurm" else "env://"
    try:
        store, _, _ = next(rendezvous(url, ident.global_rank, ident.world_size, timeout=timeout))
        store.set_timeout(timeout)
        session = agree_on_session(store, ident.global_rank, ident.world_size, timeout_s)
    except Exception as e:
        if ident.launcher == "env" and lost_peer(e):
            raise peers_never_came(ident, timeout_s, e) from e
        raise
    _session_store = dist.PrefixStore(f"trainbox/{session}/", store)
    kwargs = dict(backend=backend, store=_session_store, timeout=timeout, rank=ident.global_rank,
                  world_size=ident.world_size)
    if backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    note_process_group()
    _control_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    watchdog.pause("start-up")
    return ident


def join_group(backend: str, rank: int, world: int, timeout: datetime.timedelta | None = None, **options) -> None:
    """A process group for a tool that starts its ranks itself (make doctor, make bench, the tests): `world` ranks
    meeting at MASTER_ADDR:MASTER_PORT (env://, rank 0 hosts the store), as init_process_group would make it, but with
    the store kept here, for the ranks to leave together on it (destroy_and_leave_together)."""
    global _session_store
    kwargs = {"timeout": timeout} if timeout is not None else {}
    store, _, _ = next(rendezvous("env://", rank, world, **kwargs))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kwargs, **options)
    _session_store = store


def agree_on_session(store, rank: int, world: int, timeout_s: float) -> str:
    """A name that every rank of this attempt shares and no earlier attempt used, agreed on a store that
    may still hold an earlier attempt's keys. Rank 0 draws it; every other rank posts a fresh random
    nonce, and takes the name only from an answer that echoes its own nonce, which no earlier attempt
    can have written. Rank 0 echoes until each rank has confirmed under the new name. (torchrun stops
    every worker of an attempt before it starts the next, so no earlier writer is alive.)"""
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        session = uuid.uuid4().hex
        ready, hellos, echoed = f"trainbox/{session}/ready", [f"trainbox/hello/{r}" for r in range(1, world)], {}
        while store.add(ready, 0) < world - 1:
            posted = store.multi_get(hellos) if store.check(hellos) else \
                [store.get(key) if store.check([key]) else None for key in hellos]
            for r, nonce in enumerate(posted, start=1):
                if nonce and echoed.get(r) != nonce:
                    store.set(f"trainbox/ack/{r}", nonce + b" " + session.encode())
                    echoed[r] = nonce
            if time.monotonic() > deadline:
                missing = world - 1 - store.add(ready, 0)
                raise PeersTimedOut(f"timed out: {missing} of {world - 1} other ranks did not arrive within "
                                    f"{timeout_s} s")
            time.sleep(0.005)
        return session
    nonce = uuid.uuid4().hex.encode()
    store.set(f"trainbox/hello/{rank}", nonce)
    ack = f"trainbox/ack/{rank}"
    while True:
        answer = store.get(ack) if store.check([ack]) else b""
        if answer.startswith(nonce + b" "):
            session = answer.split(b" ", 1)[1].decode()
            store.add(f"trainbox/{session}/ready", 1)
            return session
        if time.monotonic() > deadline:
            raise PeersTimedOut(f"timed out: rank 0 did not answer within {timeout_s} s")
        time.sleep(0.005)


def destroy_and_leave_together(timeout_s: float = 30.0) -> None:
    """destroy_process_group, then wait (on the rendezvous store, which outlives the groups) until every
    rank has destroyed its own. A rank that exits while a peer's gloo group still exists can make that
    peer abort ("terminate called without an active exception"): 6 of 20 two-rank runs aborted so
    without this wait, none of 20 with it (the bench's communication worker, 2 cores). Rank 0, which
    hosts the store outside torchrun, leaves last, once every rank has seen the count complete (a rank
    still reading it would otherwise meet a closed socket). Past timeout_s a rank that never arrived is
    an error, not a silent wait. The store is the one this module made the group on (init, join_group)."""
    store, world, rank = _session_store, dist.get_world_size(), dist.get_rank()
    dist.destroy_process_group()
    if world == 1:  # no one to wait for
        return
    if store is None:
        raise RuntimeError("a process group made without train.cluster.distributed (init or join_group) has no store to "
                           "leave together on")
    deadline = time.monotonic() + timeout_s
    try:
        arrived = _count_up(store, "trainbox/left", world, deadline)
        if arrived == world and rank == 0:
            arrived = _count_up(store, "trainbox/left-seen", world, deadline)
        elif arrived == world:
            store.add("trainbox/left-seen", 1)
    except (RuntimeError, OSError):  # the store's host left: it saw every rank arrive first
        return
    if arrived < world:
        raise PeersTimedOut(f"timed out: {world - arrived} of {world} ranks did not reach the end of the run "
                            f"within {timeout_s} s")


def _count_up(store, key: str, world: int, deadline: float) -> int:
    """Add this rank to the count under key, then wait until it reaches world (or the deadline)."""
    arrived = store.add(key, 1)
    while arrived < world and time.monotonic() < deadline:
        time.sleep(0.01)
        arrived = store.add(key, 0)
    return arrived


def wrap(model: torch.nn.Module, device: torch.device, **options) -> DDP:
    """DistributedDataParallel(model), on the device's GPU if it has one. After a clean run, teardown
    refuses to leave the group while the wrapper lives: its owner drops it first, with every peer still
    there."""
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **options)
    _wrappers.append(weakref.ref(ddp))
    return ddp


def wrappers_alive() -> int:
    """How many of the DistributedDataParallel wrappers that `wrap` made are still alive."""
    return sum(ref() is not None for ref in _wrappers)


def teardown(clean: bool, timeout_s: float) -> None:
    """Leave the process group; after a clean run wait for every rank first, so none exits while a
    peer still talks to it. After an error, do not wait: the peers may never arrive."""
    global _control_group, _session_store
    if dist.is_initialized() and clean:
        if wrappers_alive():
            # Its reducer (and under --compile the compiled module it wraps) would be freed after the peers
            # left, when the frame that holds it ends: a finished run's last rank has hung there.
            raise RuntimeError(f"{wrappers_alive()} DistributedDataParallel wrapper(s) still alive at the end of "
                               f"the run: drop them before leaving the group (Trainer.release)")
        watchdog.enter("the end of the run (leaving together)", watch_limit(timeout_s))
        dist.barrier(group=_control_group)
        destroy_and_leave_together(timeout_s)
        watchdog.pause()
    # After an error the group is left to the process's exit: destroying it with a collective still in
    # flight (a peer gone, a timeout) can abort the process before it has reported the error.
    _control_group = _session_store = None
    _wrappers.clear()


def announce_unrecoverable(message: str) -> bool | None:
    """This rank ends on an error that a restart cannot mend (out of memory, a bad file): its line goes to
    the rendezvous store, where a peer that then loses contact with it (blocked in a collective with it)
    reads it (`peer_unrecoverable`) instead of reporting a lost peer. True if no other rank had announced
    one (this rank's line is the one to print), None if the store's host (rank 0) is gone: it ended first,
    on its own error or a peer's (its status.json says)."""
    if _session_store is None:
        return True
    try:
        _session_store.set(f"trainbox/unrecoverable/{identity().global_rank}", message)
        return _session_store.add("trainbox/unrecoverable", 1) == 1
    except (RuntimeError, OSError):  # the store's host is gone
        return None


def peer_unrecoverable() -> str | None:
    """The line of a peer that ended on an error a restart cannot mend, from the store, or None (none did,
    or the store's host, rank 0, is gone: the trainer then reads rank 0's status.json)."""
    if _session_store is None:
        return None
    try:
        _session_store.set_timeout(datetime.timedelta(seconds=5))  # its host may be a node that died
        if _session_store.add("trainbox/unrecoverable", 0) == 0:
            return None
        for rank in range(identity().world_size):
            key = f"trainbox/unrecoverable/{rank}"
            if _session_store.check([key]):
                return _session_store.get(key).decode()
    except (RuntimeError, OSError):
        return None
    return None


def broadcast_from_main(value):
    """Rank 0's value on every rank (plain Python objects)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=_control_group)
    return box[0]


T = TypeVar("T")


def on_main(action: Callable[[], T], failed: Callable[[OSError], str]) -> T | None:
    """Rank 0 does the file I/O (`action`); every rank learns whether it failed and raises the same
    one-line ConfigError (`failed` turns the OSError into it, on rank 0), so none waits for a rank that
    gave up. Rank 0's result, or None on the other ranks."""
    result, error = None, None
    if is_main():
        try:
            result = action()
        except OSError as e:
            error = failed(e)
    error = broadcast_from_main(error)
    if error:
        raise ConfigError(error)
    return result


class StopSignal:
    """SIGTERM, SIGUSR2 or a first Ctrl-C on any rank stops every rank after the same step.

    Each step starts an async all-reduce (MAX, on the gloo control group, so no device sync) of the
    local flag and reads the previous step's result: all ranks see the same answer on the same step."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None
        self._work = None
        self._buffer = None
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        if self.received and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the checkpoint
        self.received = signal.Signals(signum).name

    def agreed(self) -> bool:
        if not dist.is_initialized():
            return self.received is not None
        stop = False
        if self._work is not None:
            self._work.wait()
            stop = self._buffer.item() > 0
        self._buffer = torch.tensor([1.0 if self.received else 0.0])
        self._work = dist.all_reduce(self._buffer, op=dist.ReduceOp.MAX, group=_control_group, async_op=True)
        return stop

    def close(self, wait: bool, ended: bool = False) -> None:
        """The handlers removed. ended: the run is done (status.json says so) in a process that ends with it (a
        launched worker): SIGTERM and SIGUSR2 have nothing left to stop and are ignored from here, so one
        that comes during the shutdown cannot turn a finished worker into a killed one, which its launcher would
        restart (and, on another node, wait out torchrun's exit barrier for)."""
        if self._work is not None and wait:  # after an error the peers may be gone: do not wait
            self._work.wait()
        self._work = None
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_IGN if ended and sig != signal.SIGINT else signal.SIG_DFL)


def ordered_allreduce_hook(group, bucket):
    """Gradient averaging whose summation order is rank 0 + rank 1 + ... for every element, whatever
    DDP's bucket layout: results stay bit-identical when buckets are rebuilt after a restart."""
    tensor = bucket.buffer()
    world = dist.get_world_size(group)
    parts = [torch.empty_like(tensor) for _ in range(world)]
    future = dist.all_gather(parts, tensor, group=group, async_op=True).get_future()

    def combine(_):
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total.div_(world)

    return future.then(combine)


def gather(value) -> list:
    """Every rank's value (plain Python objects), on every rank."""
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=_control_group)
    return out
