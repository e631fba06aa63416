"""Where --spawn's workers come from: a fork server that imported torch and the trainer once.

A fresh interpreter per worker (the "spawn" start method) imports torch, and torch._dynamo (torch's own
optimizer imports it), in every worker: about 2 s of CPU each before any work, N times over on the same cores.
Forked from a server that imported them, a worker starts at once. python -m train starts the server right
after reading its flags; the launcher itself never imports torch: the checks that need it run in one more child
of the server (train/__main__.py's spawn_run), so torch is imported once per launch. The server never touches CUDA
(importing torch does not initialise it), so its children may, as torch requires of a start method: spawn or
forkserver, never fork. Standard library only: importing this imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal

# torch, and torch._dynamo, which no module imports but torch.optim's first optimizer loads (torch 2.13.0). Only
# imported, never called: a torch that no longer loads it costs its import here, one that renames it is skipped (the
# server ignores an ImportError), and tests/e2e/test_reproducibility.py (imported once, by the server) fails on either.
TORCH = ["torch", "torch._dynamo"]


def start_fork_server(preload=(), ignoring=()) -> None:
    """Start the server (once per process; later calls return at once), with torch and the modules of what its
    children run (`preload`: the caller names them, from above) imported. `ignoring`: signals the server ignores
    (make train's: those torchrun's agent passes on, so that one sent to the whole process group, a Ctrl-C or a
    scheduler's SIGTERM, cannot end it under its children while the agent waits for them to save); its children start
    with them ignored too, and set their own. Set to be ignored as the server starts (a child keeps what is ignored
    across exec), and given back to this process's handlers at once."""
    multiprocessing.get_context("forkserver").set_forkserver_preload([*TORCH, *preload])
    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in ignoring}
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def stop_fork_server() -> None:
    """A launcher that ends before it starts a worker (bad input): the server need not finish its imports
    while it holds the launcher's output open.

    multiprocessing has no public way to stop its fork server: this is the one place that reaches inside it
    (multiprocessing.forkserver._forkserver, its _forkserver_pid and _stop(), as multiprocessing's own tests stop it;
    checked against CPython 3.11.7, the same from 3.9 to 3.14). tests/unit/test_forkserver.py fails on a Python
    where they are gone."""
    server = multiprocessing.forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        server._stop()  # reaps it and forgets it
