"""How a process that joined a process group ends (errors.end_process): the interpreter's exit hooks, its threads and
its exit handlers run (errors.run_exit_handlers, the one place that reaches into CPython for them), then os._exit. A
Python that drops what it uses fails here. And a stop signal after its run ended. Run in a fresh interpreter of its
own: the handlers are that process's."""

import json
import os
import signal
import subprocess
import sys

from tests.helpers import REPO
from train.cluster.identity import free_port

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


ENDED = """if True:
    import os, signal
    import train.cluster.identity
    from train.__main__ import main

    def train_to_the_end(run_dir):
        train.cluster.identity._identity = None  # who this process is, read from its environment again
        code = main(["--preset", "debug", "--max-steps", "2", "--eval-every", "2", "--log-every", "1", "--device",
                     "cpu", "--run-dir", run_dir])
        print("ended", code, flush=True)

    train_to_the_end({launched!r})  # a launched worker (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: launcher env)
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGUSR2)
    print("still here", flush=True)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        del os.environ[key]
    train_to_the_end({alone!r})  # the same process, now alone
    os.kill(os.getpid(), signal.SIGTERM)
    print("survived", flush=True)
"""


def test_a_stop_signal_after_the_run_ended_cannot_kill_a_launched_worker(tmp_path):
    """A worker whose run is done (status.json says so) ignores SIGTERM and SIGUSR2 through the rest of its shutdown:
    killed by one there, its launcher would restart it (and on another node wait out torchrun's exit barrier). A
    process that lives on after the run (one started alone: a notebook, a test) gets its default handlers back: the
    same process, its next run alone, is killed by the SIGTERM."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    probe = ENDED.format(launched=str(tmp_path / "launched"), alone=str(tmp_path / "alone"))
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout.splitlines()) == (-signal.SIGTERM, ["ended 0", "still here", "ended 0"]), \
        proc.stderr[-2000:]
    for name in ("launched", "alone"):
        assert json.loads((tmp_path / name / "status.json").read_text())["state"] == "done"
