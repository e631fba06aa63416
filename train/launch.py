"""Starting the workers, after the checks (train/run/preflight.py) passed:

  start(cfg)                    python -m train: this process is the one worker (or its --dry-run's plan)
  check(cfg)                    the checks alone, as --spawn N's launcher has them made (train/cluster/spawn.py)
  python -m train.launch        make train and the container: GPUS=N picks the workers, N > 1 via torchrun
                                (in this process, with the flags the Slurm template uses too)

Each worker is train/run/worker.py's run_worker: its errors end there as one line and an exit code.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from train.base.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_STOPPED, ConfigError, end_process, fail
from train.cli import parse_config
from train.cluster.identity import identity, is_main
from train.cluster.jobs import TORCHRUN_ENV, JobError, torchrun_flags
from train.cluster.spawn import workers_for
from train.config.settings import Config
from train.files.rundir import default_run_dir
from train.files.rundir import read_status, to_json
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
    parser = argparse.ArgumentParser(prog="python -m train.launch")
    parser.add_argument("--gpus", default=os.environ.get("GPUS", ""),
                        help="workers: GPU count, 0 for CPU; empty: all GPUs or 1 CPU (default: $GPUS)")
    parser.add_argument("--max-restarts", default=os.environ.get("MAX_RESTARTS", ""),
                        help="torchrun --max-restarts: a crashed worker restarts all of them from the newest "
                             "checkpoint (default: $MAX_RESTARTS, else 3)")
    parser.add_argument("trainer_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
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
    python -m train with the trainer's arguments."""
    return ["--standalone", f"--nproc-per-node={nprocs}", *torchrun_flags(max_restarts), "-m", "train", *trainer_args]


def run_torchrun(nprocs: int, max_restarts: str, trainer_args: list[str], run_dir: Path) -> int:
    """torchrun --standalone in this process; a run its workers stopped on a signal exits EXIT_STOPPED.

    In this process, not a child's: a signal to make train's process (docker stop, Ctrl-C) reaches torchrun itself,
    and its exceptions carry each worker's exit code. torch.distributed.run's get_args_parser and run are what the
    `torchrun` command runs (its entry point, main, is the two under @record, whose error files are for a training
    script's own exceptions); both are public by PyTorch's rule (a documented module without __all__, names without an
    underscore). Checked with torch 2.13.0; tests/unit/test_cluster.py parses torchrun_argv with torch's own parser."""
    for key, value in TORCHRUN_ENV.items():
        os.environ.setdefault(key, value)
    options = torchrun.get_args_parser().parse_args(torchrun_argv(nprocs, max_restarts, trainer_args))

    def stopped() -> bool:
        return read_status(run_dir).get("state") == "stopped"

    message = f"trainbox: stopped after saving a checkpoint in {run_dir}; run the same command to resume"
    try:
        torchrun.run(options)
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


if __name__ == "__main__":
    code = launch_main(sys.argv[1:])
    end_process(code)
