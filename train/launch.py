"""Starting the workers, after the checks (train/run/preflight.py) passed:

  start(cfg)                    python -m train: this process is the one worker (or its --dry-run's plan)
  check(cfg)                    the checks alone, as --spawn N's launcher has them made (train/cluster/spawn.py)
  python -m train.launch        make train and the container: GPUS=N picks the workers, N > 1 via torchrun
                                (in this process, with the flags the Slurm template uses too)

Each worker is train/run/worker.py's run_worker: its errors end there as one line and an exit code.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing.connection
import os
import signal
import sys
import threading
import traceback
import uuid
from pathlib import Path

import torch
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import elastic_launch

from train.base.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_STOPPED, ConfigError, OneLineParser, end_process, fail
from train.cli import parse_config
from train.cluster.forkserver import start_fork_server, stop_fork_server
from train.cluster.identity import identity, is_main
from train.cluster.jobs import PASSED_ON, TORCHRUN_ENV, JobError, torchrun_flags
from train.cluster.spawn import (as_forked_worker, die_with_parent, lifeline, release_workers, released,
                                 stop_with_launcher, workers_for)
from train.config.settings import Config
from train.files.rundir import default_run_dir, failed_in_this_launch, launch_run_dir, read_status, to_json
from train.run.plan import Plan, dry_run
from train.run.preflight import preflight
from train.run.worker import run_worker


def start(cfg: Config) -> int:
    """python -m train, once the config parsed (--spawn N's launcher: train/__main__.py's spawn_run)."""
    try:
        task = preflight(cfg)
        if cfg.run.dry_run:
            return print_plan(dry_run(cfg, cfg.launch.spawn or identity().world_size))
    except ConfigError as e:
        return fail(e)
    return run_worker(cfg, task)


def check(cfg: Config) -> int:
    """The checks of a --spawn N run, in a child of its fork server: 0, or the mistake's line and EXIT_BAD_INPUT."""
    try:
        preflight(cfg)
    except ConfigError as e:
        return fail(e)
    return 0


def print_plan(plan: Plan) -> int:
    """--dry-run: the plan (dry_run's) as JSON on stdout (global rank 0's; every worker of a launch has the same), and
    nothing else."""
    if is_main():
        print(to_json(plan.to_dict(), indent=1), flush=True)
    return 0


# ---------------------------------------------------------------- python -m train.launch (make train)

def launch_main(argv: list[str]) -> int:
    """python -m train.launch --gpus N -- TRAINER ARGS: the `make train` path."""
    parser = OneLineParser(prog="python -m train.launch")
    parser.add_argument("--gpus", default=os.environ.get("GPUS", ""),
                        help="workers: GPU count, 0 for CPU; empty: all GPUs or 1 CPU (default: $GPUS)")
    parser.add_argument("--max-restarts", default=os.environ.get("MAX_RESTARTS", ""),
                        help="torchrun --max-restarts: a crashed worker restarts all of them from the newest "
                             "checkpoint (default: $MAX_RESTARTS, else 3)")
    parser.add_argument("trainer_args", nargs=argparse.REMAINDER)
    try:
        ns = parser.parse_args(argv)
    except ConfigError as e:
        return fail(e)
    args = [a for a in ns.trainer_args if a != "--"] if ns.trainer_args[:1] == ["--"] else ns.trainer_args
    try:
        torchrun_flags(ns.max_restarts)  # MAX_RESTARTS, checked before anything starts
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        nprocs, cpu_only = workers_for(ns.gpus, visible)
        if cpu_only and "--device" not in args:
            args += ["--device", "cpu"]
        cfg = parse_config(args)
        if cfg.launch.spawn:
            raise ConfigError("--spawn is for python -m train; with make use GPUS=N")
        task = preflight(cfg, nprocs)
        if cfg.run.dry_run:
            return print_plan(dry_run(cfg, nprocs))
    except (ConfigError, JobError) as e:
        return fail(e)
    if not cfg.run.run_dir:
        cfg = cfg.replace(run_dir=default_run_dir())
        args += ["--run-dir", cfg.run.run_dir]
    where = "CPU (gloo)" if cpu_only else "GPU (nccl)"
    if nprocs == 1:
        print(f"trainbox: 1 worker on {where}", file=sys.stderr, flush=True)
        return run_worker(cfg, task if cfg.run.run_dir == task.cfg.run.run_dir else None)
    print(f"trainbox: {nprocs} workers on {where} via torchrun", file=sys.stderr, flush=True)
    return run_torchrun(nprocs, ns.max_restarts, args, Path(cfg.run.run_dir))


def torchrun_argv(nprocs: int, max_restarts: str, trainer_args: list[str]) -> list[str]:
    """What `torchrun` would be given on a command line: --standalone, N workers, the flags every launch shares, and
    python -m train with the trainer's arguments; and the fork server as the start method, which torchrun uses for a
    function's workers (run_torchrun's), as this process starts them."""
    return ["--standalone", f"--nproc-per-node={nprocs}", *torchrun_flags(max_restarts), "--start-method=forkserver",
            "-m", "train", *trainer_args]


# What make train's fork server imports, beside torch: what this module imports that its workers run. Not this module
# itself: multiprocessing runs a child's main module (this one, under python -m) anew in the child, which a server that
# imported it would see as a clash (runpy's RuntimeWarning); its own lines are quick once these are imported.
WORKER_PRELOAD = ["torch.distributed.run", "train.cli", "train.run.plan", "train.run.preflight", "train.run.worker"]


def run_torchrun(nprocs: int, max_restarts: str, trainer_args: list[str], run_dir: Path) -> int:
    """torchrun --standalone in this process, its workers forked from a server that imported torch and the trainer
    once; a run its workers stopped on a signal exits EXIT_STOPPED.

    In this process, not a child's: a signal to make train's process (docker stop, Ctrl-C) reaches torchrun itself,
    and its exceptions carry each worker's exit code. torch.distributed.run's get_args_parser and config_from_args,
    and torch.distributed.launcher.api's elastic_launch, are what the `torchrun` command runs (its run(), less the
    command: the workers are `launched_worker`, started by the fork server as a restart restarts them, in well under a
    second instead of an `import torch` each); all public by PyTorch's rule (documented modules without __all__, names
    without an underscore). Checked with torch 2.13.0; tests/unit/test_cluster.py parses torchrun_argv with torch's
    own parser."""
    for key, value in TORCHRUN_ENV.items():
        os.environ.setdefault(key, value)
    options = torchrun.get_args_parser().parse_args(torchrun_argv(nprocs, max_restarts, trainer_args))
    # --standalone, as torchrun's run() sets it; config_from_args also sets OMP_NUM_THREADS, as for torchrun's workers
    options.rdzv_backend, options.rdzv_endpoint, options.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, _, _ = torchrun.config_from_args(options)
    # now: the workers start from the environment the server starts with
    start_fork_server(WORKER_PRELOAD, ignoring=[getattr(signal, name) for name in PASSED_ON])
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_failure_line)
    _release_on_signal(nprocs)
    try:
        return _run_agent(config, trainer_args, run_dir)
    finally:  # every worker has ended: the server may still be importing (an early failure) and hold the output
        stop_fork_server()


def _failure_line(record: logging.LogRecord) -> bool:
    """torch's agent logs a worker function's failure with the traceback of its own wait for it (a
    ProcessExitedException, no frame of the worker's): the line alone, as it logs a command's failure; the worker said
    why above."""
    record.exc_info = record.exc_text = None
    return True


def _run_agent(config, trainer_args: list[str], run_dir: Path) -> int:
    """torchrun's agent, with launched_worker as its workers, to the end of the run: make train's exit code."""
    from train import launch  # noqa: PLC0415 - launched_worker by its module's name (python -m runs this as __main__)

    def stopped() -> bool:
        return read_status(run_dir).get("state") == "stopped"

    message = f"trainbox: stopped after saving a checkpoint in {run_dir}; run the same command to resume"
    try:
        elastic_launch(config, launch.launched_worker)(list(trainer_args), lifeline())
    except (SignalException, ChildFailedError) as e:
        codes = {f.exitcode for f in getattr(e, "failures", {}).values()}
        if stopped() and codes <= {0, EXIT_STOPPED}:
            print(message, file=sys.stderr)
            return EXIT_STOPPED
        # The workers named the problem above (the rest were stopped by torchrun): restarting cannot fix it.
        if EXIT_BAD_INPUT in codes and all(c == EXIT_BAD_INPUT or c < 0 for c in codes):
            print(f"trainbox: the workers stopped on the error above (exit {EXIT_BAD_INPUT})", file=sys.stderr)
            return EXIT_BAD_INPUT
        what = f"worker exit codes {sorted(codes)}" if codes else f"signal ({type(e).__name__})"
        print(f"trainbox: torchrun failed ({what}, restarts used up); the errors above say why; run the same "
              f"command to resume from the newest checkpoint in {run_dir}", file=sys.stderr)
        return EXIT_FAILED
    if stopped():  # the workers stopped on a signal and exited 0 so that torchrun would not restart them
        print(message, file=sys.stderr)
        return EXIT_STOPPED
    if read_status(run_dir).get("state") == "failed":  # they exited 0 on an error a restart cannot mend
        print(f"trainbox: the workers stopped on the error above (exit {EXIT_BAD_INPUT})", file=sys.stderr)
        return read_status(run_dir).get("exit_code", EXIT_BAD_INPUT)
    return 0


def launched_worker(trainer_args: list[str], launcher: multiprocessing.connection.Connection) -> None:
    """A worker of make train's torchrun (run_torchrun), forked from the fork server with torchrun's environment for
    its rank: `python -m train TRAINER ARGS`, as torchrun's own workers run it. In a session of its own, as those
    (torchrun passes a Ctrl-C at make's terminal on to it once), and with no parent-death signal (torch's child
    wrapper sets one; the server outlives the launcher while a child of its lives): it stops when the launcher ends,
    however it ends, through its lifeline (stop_with_launcher), as --spawn's workers do."""
    die_with_parent(0)
    os.setsid()
    for name in PASSED_ON:  # as a fresh interpreter has them (the server ignores them)
        signal.signal(getattr(signal, name), signal.default_int_handler if name == "SIGINT" else signal.SIG_DFL)
    as_forked_worker(int(os.environ["RANK"]))
    stop_with_launcher(launcher)
    sys.argv = [str(Path(__file__).with_name("__main__.py")), *trainer_args]  # what manifest.json records
    try:
        cfg = parse_config(trainer_args)
        code = EXIT_BAD_INPUT if failed_in_this_launch(Path(launch_run_dir(cfg.run.run_dir)), os.environ) else \
            start(cfg)
    except ConfigError as e:
        code = fail(e)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except Exception:  # noqa: BLE001 - a crash: its traceback, then exit code 1, as an interpreter ends on it
        traceback.print_exc()
        code = EXIT_FAILED
    # A clean end (0) is returned to the agent, which reads every worker's value and only then lets them end; one that
    # stops them on a signal (or a launcher that ended) never will: they end at once, or once released.
    threading.Thread(target=_exit_when_released, name="trainbox-released", daemon=True).start()
    end_process(code, returning=not released.is_set())


def _exit_when_released() -> None:
    released.wait()
    os._exit(0)


def _release_on_signal(nprocs: int) -> None:
    """make train's launcher: when torchrun's agent gets a signal it passes on, it stops the workers with it and waits
    for them to end, not for their return values: they are told so on their lifeline (release_workers). The agent's
    handlers are torch's own; Python's wakeup file descriptor names each signal they catch, to a thread here."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write)
    passed_on = {getattr(signal, name) for name in PASSED_ON}

    def relay() -> None:
        while True:
            if set(os.read(read, 64)) & passed_on:
                release_workers(nprocs)

    threading.Thread(target=relay, name="trainbox-release-on-signal", daemon=True).start()


if __name__ == "__main__":
    code = launch_main(sys.argv[1:])
    end_process(code)
