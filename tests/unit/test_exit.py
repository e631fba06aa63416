"""How a process that joined a process group ends (errors.end_process): the interpreter's exit hooks, its threads and
its exit handlers run (errors.run_exit_handlers, the one place that reaches into CPython for them), then os._exit. A
Python that drops what it uses fails here. Run in a fresh interpreter of its own: the handlers are that process's."""

import subprocess
import sys

from tests.helpers import REPO

PROBE = """if True:
    import atexit, concurrent.futures, os, threading, time
    from train.base.errors import run_exit_handlers

    atexit.register(lambda: print("exit handler", flush=True))
    pool = concurrent.futures.ThreadPoolExecutor(1)  # its worker waits for work until threading's exit hook
    pool.submit(lambda: None).result()
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread ended", flush=True))).start()
    run_exit_handlers(join_threads={join})
    print("handlers ran", flush=True)
    os._exit(0)
"""


def _run(join: bool) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(join=join)], cwd=REPO, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_the_threads_end_and_the_exit_handlers_run_before_the_process_leaves():
    assert _run(join=True) == ["thread ended", "exit handler", "handlers ran"]


def test_a_forked_worker_runs_its_exit_handlers_alone():
    """train/cluster/spawn.py's spawned worker after a SystemExit: the handlers, not a join of its threads."""
    assert _run(join=False)[:2] == ["exit handler", "handlers ran"]
