"""A worker's life around its Trainer, and how it ends: every error becomes an exit code (train/base/errors.py).

  run_worker(cfg)     python -m train's one worker (or each of --spawn's, each of torchrun's): run(cfg), its errors
                      as one line and an exit code; a worker lost to its peers prints where it was and its stack
  run(cfg)            the runtime, the process group, the run's parts (train/run/build.py) and its Trainer (or nothing,
                      for a run already finished), and leaving together
  unrecoverable(...)  whether an error is one a restart cannot mend (exit code 2), and its line
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import signal
import sys
import traceback
from pathlib import Path

import torch

from train.base.errors import (EXIT_BAD_INPUT, EXIT_DONE, EXIT_FAILED, EXIT_STOPPED, ConfigError, DataError,
                               OutOfMemory, PeerGaveUp, fail, one_line, user_code_error)
from train.base.watchdog import watch_limit, watchdog
from train.cluster.distributed import (StopSignal, announce_unrecoverable, broadcast_from_main, init, lost_peer,
                                       peer_unrecoverable, teardown)
from train.cluster.identity import PeersNeverCame, first_line, identity, is_main
from train.cluster.spawn import kill_loader_workers, stop_with_launcher
from train.config.settings import Config
from train.files import checkpoint_io as ckpt
from train.files import rundir, writable
from train.files.rundir import launch_run_dir, process_start_time
from train.report.tracker import catch_up_tracking
from train.run.build import build
from train.run.memory import is_out_of_memory, out_of_memory
from train.run.runtime import configure_runtime, device_name, resolve_precision
from train.run.trainer import Trainer
from train.tasks.factory import build_task
from train.tasks.task import Task


def run_worker(cfg: Config, task: Task | None = None) -> int:
    """Train as the rank the environment says this process is; every error becomes an exit code."""
    faulthandler.enable(sys.__stderr__)  # a crash in C (segfault, abort) still prints every thread's stack
    atexit.register(kill_loader_workers)
    if identity().launcher == "torchrun":  # --spawn's workers watch their launcher already (train/cluster/spawn.py)
        stop_with_launcher()
    rank = identity().global_rank
    try:
        code = run(cfg, task)
        watchdog.pause()  # run()'s objects are freed: the end of the run is over (a notebook lives on unwatched)
    except (Exception, KeyboardInterrupt) as e:
        code = exit_code(e, rank)
        if code is None:  # neither a run's error nor a lost peer: a crash, with its traceback
            raise
        return code
    if code == EXIT_STOPPED and "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun reports any non-zero worker as a failure (exit 1, never 75) and would restart it under
        # --max-restarts: a stop is a clean end for it. train.launch and the Slurm template read
        # status.json ("stopped") and exit 75.
        return 0
    return code


def exit_code(error: BaseException, rank: int) -> int | None:
    """The exit code of a worker that `error` ended, its line said (once, by the rank that should say it); None for
    a crash, which goes on as itself."""
    if _interrupted(error):  # a second Ctrl-C (StopSignal): now, without the checkpoint the first asked for
        if watchdog.claim_report():
            print(f"error: [rank {rank}] interrupted by a second Ctrl-C during {watchdog.phase}: stopped without "
                  f"saving; run the same command to resume from the newest checkpoint", file=sys.stderr)
        return 128 + signal.SIGINT
    if not watchdog.claim_report():  # the watchdog named the phase and is printing the stacks
        traceback.print_exception(error, file=sys.stderr)
        return EXIT_FAILED
    if isinstance(error, (DataError, OutOfMemory)):  # the rank that met it says so (the first, if several)
        if getattr(error, "first", True):  # an error raised in the user's own code: its traceback first
            print(f"{getattr(error, 'trace', '')}error: [rank {rank}] {one_line(error)}", file=sys.stderr)
    elif isinstance(error, ConfigError) and not isinstance(error, PeerGaveUp):  # every rank raised it; one says so
        if is_main():  # once per launch: a refusal before the run folder is made cannot stop torchrun's restarts
            fail(one_line(error))
    if isinstance(error, ConfigError):
        return EXIT_BAD_INPUT  # under torchrun too: its restarts refuse at once (train/__main__.py)
    if isinstance(error, PeersNeverCame):  # a rank from the environment alone: the line names its variables
        print(f"error: [rank {rank}] {error}", file=sys.stderr)
        return EXIT_FAILED
    if not lost_peer(error):
        return None
    _report_lost_peer(rank, error)
    return EXIT_FAILED


def _interrupted(error: BaseException | None) -> bool:
    """A KeyboardInterrupt, also one that a library turned into another error while unwinding (torch.save)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _report_lost_peer(rank: int, error: Exception) -> None:
    print(f"error: [rank {rank}] lost contact with the other workers during {watchdog.phase} "
          f"({first_line(error)}): another worker died, hung or was stopped (its output says which), or "
          f"cannot be reached; run the same command to resume from the newest checkpoint. This rank's stack "
          f"at the failure:", file=sys.stderr)
    traceback.print_exception(error, file=sys.stderr)
    faulthandler.dump_traceback(sys.__stderr__, all_threads=True)


def run(cfg: Config, task: Task | None = None) -> int:
    """Train according to cfg as the rank the environment says this process is (task: the preflight's, built in this
    process already; else built here). Returns the exit code."""
    ident = identity()
    watchdog.begin(f"rank {ident.global_rank}", limit_s=watch_limit(cfg.launch.timeout_s))
    configure_runtime(cfg.launch.threads, cfg.run.deterministic)
    device = torch.device(device_name(cfg.launch.device, ident))
    # a mistake (fp16 on a CPU) is refused before the group starts
    precision = resolve_precision(cfg.model, cfg.data, device)
    init(device, cfg.launch.timeout_s)
    stop = StopSignal()
    clean, code, tracker, trainer, run_dir = False, None, None, None, None
    try:
        # rank 0's: nodes start apart
        run_dir = Path(broadcast_from_main(launch_run_dir(cfg.run.run_dir) if is_main() else None))
        if already_finished(run_dir, cfg.run.max_steps, cfg.run.epochs):
            tracker = catch_up_tracking(cfg.tracking, run_dir, cfg.run.max_steps)
            code = EXIT_DONE
        else:
            parts = build(cfg, run_dir, device, precision, task)
            tracker = parts.tracker  # held from here: whatever fails next, the finally below ends its MLflow run
            trainer = Trainer(parts, stop)
            code = trainer.train()
            trainer.release()
        clean = True
        return code
    except Exception as e:
        if _interrupted(e):  # a second Ctrl-C that a library made into another error: stopped, not failed
            raise
        error = unrecoverable(e, trainer, device, cfg, precision, run_dir, task)
        if error is None:  # a crash or a lost peer, which a restart may mend: its traceback goes on as itself
            record_crash(e, run_dir, trainer)
            raise
        end_unrecoverable(error, run_dir, trainer)
        raise error from None
    finally:
        try:
            stop.close(wait=clean, ended=clean and code == EXIT_DONE and ident.launcher != "single")
            teardown(clean, cfg.launch.timeout_s)
        finally:
            watchdog.pause()
            if tracker is not None:  # after the group is gone: no rank waits for rank 0's uploads
                outcome = {EXIT_DONE: "FINISHED", EXIT_STOPPED: "KILLED"}.get(code, "FAILED")
                # A stop or a failure leaves within the launchers' grace periods (torchrun's, compose's).
                tracker.close(outcome, cfg.launch.timeout_s if outcome == "FINISHED" else min(cfg.launch.timeout_s, 30))
            # This frame's objects (the trainer, its loaders and their workers) are freed as it returns, after the
            # peers have left: bounded too. The caller ends the phase once it has them back (run_worker). An error
            # keeps its phase's name for its line, and the process's exit is bounded (errors.end_process).
            if clean:
                watchdog.enter("the end of the run (freeing the trainer)",
                               cause="freeing the trainer's objects (its loaders' workers, what the process group "
                                     "left) did not end")


def already_finished(run_dir: Path, max_steps: int, epochs: int) -> bool:
    """A restart after the run ended (a worker lost during shutdown), or the same command again: the run's
    figures stand, and nothing is evaluated or written again (rank 0 decides for all). max_steps, epochs: the run's
    length as given (--max-steps, --epochs)."""
    status = rundir.read_status(run_dir) if is_main() else {}
    finished = is_main() and ckpt.finished(status, max_steps, (run_dir / "model.pt").is_file(), epochs)
    done = broadcast_from_main(finished if is_main() else None)
    if done and is_main():
        longer = "--epochs" if epochs else "--max-steps"
        print(f"trainbox: {run_dir} already finished at step {status['step']} (model.pt written): nothing to "
              f"do; pass a larger {longer} to train on, or a new --run-dir", file=sys.stderr)
    return done


def unrecoverable(error: Exception, trainer: Trainer | None, device: torch.device, cfg: Config, precision: str,
                  run_dir: Path | None, task: Task | None = None) -> ConfigError | None:
    """The error as one a restart cannot mend (a user's mistake, a bad file, out of memory, a full disk under
    run_dir, or a peer's such error), or None: a crash or a lost peer, which a restart may mend. One that a DataLoader
    worker re-raised (a bad image) carries the worker's traceback in its message: its line alone goes on, to the peers
    and status.json. Out of memory names what the run can change on its next start: the run's own config (a resume on
    other workers changes its --grad-accum) and whether a checkpoint fixes the rest."""
    if isinstance(error, ConfigError):
        return error if one_line(error) == str(error) else type(error)(one_line(error))
    full = writable.full_disk_problem(run_dir, error) if run_dir is not None else None
    if full is not None:  # a write between checkpoints (status.json, metrics.jsonl, TensorBoard's events)
        return ConfigError(full)
    if is_out_of_memory(error):
        if watchdog.phase == "training" and trainer is not None:
            where = f"training step {trainer.step + 1}"
        else:
            where = watchdog.phase if watchdog.phase != "start-up" else "start-up (the data and the model)"
        newest = ckpt.list_checkpoints(run_dir)[-1:] if run_dir is not None else []
        ran = trainer.parts.cfg if trainer else cfg  # as the run continued its checkpoint (resume.continued)
        task = trainer.parts.task if trainer else task or build_task(ran)
        replicas = identity().world_size if ran.model.parallel == "ddp" else 0
        return out_of_memory(error, where, device, ran.optimisation, task.sizes(where), precision,
                             newest[0] if newest else None, replicas)
    peer = peer_unrecoverable()
    if peer is None and trainer is not None:  # rank 0, the store's host, gave up: its status.json says why
        status = rundir.read_status(trainer.run_dir)
        peer = status.get("error") if status.get("state") == "failed" and \
            status.get("exit_code") == EXIT_BAD_INPUT else None
    if peer is not None:
        return PeerGaveUp(peer)
    if lost_peer(error):  # a peer died or hung, whatever code the collective was called from: a restart may mend it
        return None
    # the user's own code raised it: theirs to read, and a restart would meet it again
    return user_code_error(error, (cfg.run.task, cfg.model.model))


def record_crash(error: Exception, run_dir: Path | None, trainer: Trainer | None) -> None:
    """status.json "failed" with the error's first line and exit code 1, by rank 0, for an error that is neither the
    user's mistake nor the user's code (those: end_unrecoverable): a crash, or a lost peer. A restart resumes and
    records its own state; nothing else is touched. A second Ctrl-C (raised as itself, or as the error a library made
    of it while unwinding) is no failure: the run was stopped, and its status stays as it was."""
    if not is_main() or run_dir is None or not run_dir.is_dir() or _interrupted(error):
        return
    step = trainer.step if trainer else rundir.read_status(run_dir).get("step", -1)
    with contextlib.suppress(OSError):
        rundir.write_status(run_dir, "failed", step, error=f"{type(error).__name__}: {first_line(error)}",
                            exit_code=EXIT_FAILED)


def end_unrecoverable(error: ConfigError, run_dir: Path | None, trainer: Trainer | None) -> None:
    """Every rank ends with exit code 2: this rank's line goes to its peers (a peer blocked in a collective with it
    reads it there once this rank has exited), rank 0 records it in status.json with the torchrun launch it
    happened in, whose restarts then refuse at once (rundir.failed_in_this_launch). Nothing already saved is
    touched."""
    if not isinstance(error, PeerGaveUp):  # every rank may meet it: one of them prints it
        first = announce_unrecoverable(str(error))
        if first is None:  # rank 0 ended before this rank said it: its line was said if it recorded a failure
            first = run_dir is None or not rundir.failed_since(run_dir, process_start_time())
        error.first = first
    if is_main() and run_dir is not None and run_dir.is_dir():
        last = rundir.read_status(run_dir)
        kept = {k: v for k, v in last.items() if k not in ("state", "step", "slurm_job_id", "slurm_restart_count")} \
            if last.get("state") == "failed" else {}  # a failed save's own record (the space it needed) stays
        with contextlib.suppress(OSError):
            rundir.write_status(run_dir, "failed", trainer.step if trainer else last.get("step", -1),
                                  **{"error": str(error), **kept, "exit_code": EXIT_BAD_INPUT},
                                  **({"launch": os.environ["TORCHELASTIC_RUN_ID"]}
                                     if "TORCHELASTIC_RUN_ID" in os.environ else {}))
