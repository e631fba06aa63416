"""Entry points: `python -m train` (one process, or --spawn N) and `python -m train.launch --gpus N`.

Everything a user can get wrong is checked here, before any worker or process group starts.
"""

from __future__ import annotations

import argparse
import atexit
import json
import multiprocessing.connection
import os
import re
import signal
import sys
import time
import traceback
from pathlib import Path

from train.config import MODEL_KEYS, Config, ConfigError, parse_config

EXIT_FAILED = 1  # a crash, or a worker lost its peers (one died, hung or was stopped): rerun to resume
EXIT_BAD_INPUT = 2  # bad input or a condition the message names (disk full, bad image): fix it, then rerun
EXIT_STOPPED = 75  # a signal stopped the run after it saved a checkpoint; run again to resume


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _writable_or_creatable(path: Path) -> bool:
    while not path.exists():
        path = path.parent
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def preflight(cfg: Config, world: int | None = None) -> None:
    """Checks that need no process group; raise ConfigError with one line. world: the workers about to
    start, when the caller knows (the launcher); else from the launch environment."""
    import torch  # noqa: PLC0415 - keeps `--help` and config errors fast

    from train import checkpoint  # noqa: PLC0415
    from train.data import check_imagefolder  # noqa: PLC0415
    from train.distributed import resolve_identity  # noqa: PLC0415
    from train.models import check_model_spec  # noqa: PLC0415

    problem = visible_devices_problem(os.environ.get("CUDA_VISIBLE_DEVICES"), host_gpu_count())
    if problem:
        raise ConfigError(problem)
    cuda = torch.cuda.is_available()
    if cfg.device == "cuda" and not cuda:
        shown = f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']})" \
            if "CUDA_VISIBLE_DEVICES" in os.environ else ""
        raise ConfigError(f"--device cuda but no CUDA GPU is visible{shown}: use --device cpu, or check the "
                          f"driver and CUDA_VISIBLE_DEVICES")
    on_cpu = cfg.device == "cpu" or not cuda
    if on_cpu and cfg.precision in ("fp16", "bf16"):
        raise ConfigError(f"--precision {cfg.precision} needs a CUDA GPU: use --precision fp32 (or auto) on CPU")
    if on_cpu and cfg.sync_bn:
        raise ConfigError("--sync-bn needs CUDA GPUs (SyncBatchNorm has no CPU implementation): drop it on CPU")
    if cfg.spawn and ("RANK" in os.environ or "SLURM_STEP_ID" in os.environ and "SLURM_PROCID" in os.environ):
        raise ConfigError("--spawn inside torchrun or srun would start workers twice: drop --spawn")
    if cfg.dataset == "cifar10" and not cfg.download and not (Path(cfg.data_dir) / "cifar-10-batches-py").is_dir():
        raise ConfigError(f"CIFAR-10 not found under {cfg.data_dir}: pass --download or point --data-dir at it")
    if cfg.dataset == "imagefolder":
        check_imagefolder(Path(cfg.data_dir))
    check_model_spec(cfg)
    ident = resolve_identity()
    world = world or cfg.spawn or ident.world_size
    if cfg.dataset in ("shapes", "synthetic") and (cfg.train_samples // world) // cfg.batch_size // cfg.grad_accum == 0:
        # Also checked by the workers for every dataset; here it fails before torchrun would restart it.
        raise ConfigError(f"{cfg.train_samples} training samples are fewer than one step needs "
                          f"({world} workers x {cfg.batch_size} x {cfg.grad_accum}): "
                          f"lower --batch-size or --grad-accum")
    # The process that will listen on the rendezvous port: the --spawn parent, or rank 0 of an srun step.
    port = os.environ.get("MASTER_PORT") if cfg.spawn else \
        str(ident.master_port) if ident.launcher == "slurm" and ident.global_rank == 0 else None
    if port is not None:
        if not port.isdigit() or not port_free(int(port)):
            fix = "unset MASTER_PORT so a free one is picked" if cfg.spawn else "set MASTER_PORT to a free port"
            raise ConfigError(f"rendezvous port {port} is in use on this host (or not a port number): {fix}, "
                              f"or choose another")
    if cfg.run_dir:
        run_dir = Path(cfg.run_dir)
        if run_dir.is_absolute() and not run_dir.parent.exists():
            raise ConfigError(f"{run_dir.parent} does not exist (is the NAS mounted?): create it, or pass a "
                              f"--run-dir inside an existing folder")
        if not _writable_or_creatable(run_dir):
            raise ConfigError(f"run directory {run_dir} is not writable: pass a writable --run-dir")
        saved = run_dir / "config.json"
        if saved.is_file():
            try:
                previous = json.loads(saved.read_text())
            except ValueError:
                previous = {}
            for key in MODEL_KEYS:
                if key in previous and previous[key] != getattr(cfg, key):
                    raise ConfigError(f"{run_dir} holds a run with {key}={previous[key]!r}, this one has "
                                      f"{key}={getattr(cfg, key)!r}: use a new --run-dir or the same {key}")
        problem = checkpoint.space_problem(run_dir)
        if problem:
            raise ConfigError(problem)


def port_free(port: int) -> bool:
    import socket  # noqa: PLC0415

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def host_gpu_count() -> int | None:
    """GPUs the driver has, whatever CUDA_VISIBLE_DEVICES says (NVML); None without an NVIDIA driver."""
    try:
        import pynvml  # noqa: PLC0415

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no library, no driver: a CPU host
        return None
    try:
        return pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()


def visible_devices_problem(value: str | None, host_gpus: int | None) -> str | None:
    """CUDA_VISIBLE_DEVICES naming a GPU index the host does not have (CUDA would silently drop it and
    every GPU after it). An empty value hides all GPUs on purpose; UUIDs are left to CUDA."""
    if not value or host_gpus is None:
        return None
    for item in (v.strip() for v in value.split(",")):
        if item.isdigit() and int(item) >= host_gpus:
            return (f"CUDA_VISIBLE_DEVICES={value} names GPU {item} but this host has {host_gpus} "
                    f"(0-{host_gpus - 1}): fix CUDA_VISIBLE_DEVICES or unset it")
    return None


def _last_line(error: Exception) -> str:
    """The message itself, also when a DataLoader worker re-raised it with its whole traceback."""
    text = str(error).strip()
    if "Original Traceback" in text:
        text = text.splitlines()[-1].split(": ", 1)[-1]
    return text


def _lost_peer(error: BaseException) -> bool:
    """A failed collective: a peer died (connection reset/closed) or stopped answering (timeout)."""
    import torch.distributed as dist  # noqa: PLC0415

    text = str(error).lower()
    return isinstance(error, getattr(dist, "DistError", ())) or (isinstance(error, RuntimeError) and any(
        k in text for k in ("gloo", "nccl", "connection", "timed out", "timeout", "pair closure", "by peer")))


def _kill_loader_workers() -> None:
    """DataLoader workers ignore SIGTERM (a preemption signal must not kill them before the save), so
    multiprocessing's own exit hook, which terminates and then joins them, could wait forever when a run
    ends on an error with a worker still alive. Registered after that hook, this runs first."""
    import contextlib  # noqa: PLC0415
    import multiprocessing  # noqa: PLC0415

    with contextlib.suppress(Exception):
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the DataLoader's handler would report the kill
        for child in multiprocessing.active_children():  # this process's children: its loader workers
            with contextlib.suppress(Exception):
                child.kill()
                child.join(5)


def run_worker(cfg: Config) -> int:
    """Train as the rank the environment says this process is."""
    import faulthandler  # noqa: PLC0415

    from train import loop  # noqa: PLC0415
    from train.config import DataError  # noqa: PLC0415
    from train.distributed import identity, is_main  # noqa: PLC0415
    from train.watchdog import watchdog  # noqa: PLC0415

    faulthandler.enable(sys.__stderr__)  # a crash in C (segfault, abort) still prints every thread's stack
    import multiprocessing.util  # noqa: F401, PLC0415 - its exit hook must be registered before ours

    atexit.register(_kill_loader_workers)
    rank = identity().global_rank
    try:
        code = loop.main(cfg)
    except DataError as e:  # one rank met it; that rank says so
        print(f"error: [rank {rank}] {_last_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ConfigError as e:  # every rank raised it; one says so
        if is_main():
            print(f"error: {_last_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as e:
        if not _lost_peer(e):
            raise
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        first = re.sub(r"\[[^\]]*\.(cc|cpp):\d+\]\s*", "", first).split(". This is typically")[0]
        print(f"error: [rank {rank}] lost contact with the other workers during {watchdog.phase} "
              f"({first.strip()[:200]}): another worker died, hung or was stopped (its output says which), or "
              f"cannot be reached; run the same command to resume from the newest checkpoint. This rank's stack "
              f"at the failure:", file=sys.stderr)
        traceback.print_exception(e, file=sys.stderr)
        faulthandler.dump_traceback(sys.__stderr__, all_threads=True)
        return EXIT_FAILED
    if code == EXIT_STOPPED and "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun reports any non-zero worker as a failure (exit 1, never 75) and would restart it under
        # --max-restarts: a stop is a clean end for it. train.launch and the Slurm template read
        # status.json ("stopped") and exit 75.
        return 0
    return code


def _spawned(local_rank: int, cfg: Config, nprocs: int) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nprocs),
                      LOCAL_WORLD_SIZE=str(nprocs), TRAINBOX_LAUNCHER="spawn")
    try:
        code = run_worker(cfg)
    except Exception:  # noqa: BLE001 - torch.multiprocessing would keep the traceback to itself
        traceback.print_exc()
        code = 1
    sys.exit(code)


def spawn(cfg: Config) -> int:
    """Start cfg.spawn local workers and wait for all of them; signals are passed on to them."""
    import torch.multiprocessing as mp  # noqa: PLC0415

    from train.distributed import free_port  # noqa: PLC0415

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if not cfg.run_dir:
        cfg.run_dir = time.strftime("runs/%Y%m%d-%H%M%S")
    context = mp.start_processes(_spawned, args=(cfg, cfg.spawn), nprocs=cfg.spawn, join=False,
                                 start_method="spawn")

    def forward(signum, _frame):
        for process in context.processes:
            if process.is_alive() and signum != signal.SIGINT:  # Ctrl-C already reaches the whole group
                os.kill(process.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
        signal.signal(sig, forward)
    # Wait for all; if one fails, stop the rest now rather than after the collective timeout.
    waiting = {p.sentinel: p for p in context.processes}
    while waiting:
        for sentinel in multiprocessing.connection.wait(list(waiting)):
            process = waiting.pop(sentinel)
            process.join()
            if process.exitcode not in (0, EXIT_STOPPED):
                for other in waiting.values():
                    other.kill()  # not SIGTERM: that asks for a checkpoint, which needs the dead rank
    # A crash outranks a clean stop (75); a worker killed by signal N reports 128 + N, as a shell does.
    codes = [code if code >= 0 else 128 - code for code in (p.exitcode for p in context.processes)]
    crashed = [code for code in codes if code not in (0, EXIT_STOPPED)]
    return crashed[0] if crashed else max(codes)


def main(argv: list[str]) -> int:
    """python -m train"""
    try:
        cfg = parse_config(argv)
        preflight(cfg)
    except ConfigError as e:
        return _fail(str(e))
    return spawn(cfg) if cfg.spawn else run_worker(cfg)


def visible_gpus() -> int:
    import torch  # noqa: PLC0415

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def workers_for(gpus: str, visible: int) -> tuple[int, bool]:
    """(local workers, force CPU) for GPUS=... ('' means all visible GPUs, or one CPU worker)."""
    if gpus.strip() == "":
        return max(1, visible), visible == 0
    if not gpus.strip().isdigit():
        raise ConfigError(f"GPUS={gpus!r} is not a number: use GPUS=0 (CPU), GPUS=1, GPUS=4, ...")
    n = int(gpus)
    if n == 0:
        return 1, True
    if visible and n > visible:
        raise ConfigError(f"GPUS={n} but {visible} GPU(s) visible: set GPUS<={visible} or CUDA_VISIBLE_DEVICES")
    return n, visible == 0


def launch_main(argv: list[str]) -> int:
    """python -m train.launch --gpus N -- TRAINER ARGS: the `make train` path."""
    parser = argparse.ArgumentParser(prog="python -m train.launch")
    parser.add_argument("--gpus", default=os.environ.get("GPUS", ""),
                        help="workers: GPU count, 0 for CPU; empty: all GPUs or 1 CPU (default: $GPUS)")
    parser.add_argument("--max-restarts", type=int, default=int(os.environ.get("MAX_RESTARTS") or 3),
                        help="torchrun --max-restarts: a crashed worker restarts all of them from the newest "
                             "checkpoint (default: $MAX_RESTARTS or 3)")
    parser.add_argument("trainer_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    args = [a for a in ns.trainer_args if a != "--"] if ns.trainer_args[:1] == ["--"] else ns.trainer_args
    try:
        nprocs, cpu_only = workers_for(ns.gpus, visible_gpus())
        if cpu_only and "--device" not in args:
            args += ["--device", "cpu"]
        cfg = parse_config(args)
        if cfg.spawn:
            raise ConfigError("--spawn is for python -m train; with make use GPUS=N")
        preflight(cfg, nprocs)
    except ConfigError as e:
        return _fail(str(e))
    if not cfg.run_dir:
        args += ["--run-dir", time.strftime("runs/%Y%m%d-%H%M%S")]
    where = "CPU (gloo)" if cpu_only else "GPU (nccl)"
    if nprocs == 1:
        print(f"trainbox: 1 worker on {where}", file=sys.stderr, flush=True)
        return main(args)
    print(f"trainbox: {nprocs} workers on {where} via torchrun", file=sys.stderr, flush=True)
    return run_torchrun(nprocs, ns.max_restarts, args, Path(parse_config(args).run_dir))


def run_torchrun(nprocs: int, max_restarts: int, trainer_args: list[str], run_dir: Path) -> int:
    """torchrun --standalone in this process; a run its workers stopped on a signal exits EXIT_STOPPED."""
    from torch.distributed import run as torchrun  # noqa: PLC0415
    from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: PLC0415
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: PLC0415

    # A store of its own for every attempt (torchrun's shared one keeps an attempt's keys into the next,
    # pytorch/pytorch#135712). The workers no longer need it (they namespace every key by attempt, see
    # train/distributed.py), but nothing is gained by sharing it either.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    options = torchrun.get_args_parser().parse_args([
        "--standalone", f"--nproc-per-node={nprocs}", f"--max-restarts={max_restarts}",
        # SIGUSR2 is the preemption signal (Slurm --signal); torchrun passes on only these by default.
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2",
        "--shutdown-timeout=100",  # time for the workers to agree on a step and save before SIGKILL
        "-m", "train", *trainer_args])
    def stopped() -> bool:
        try:
            return json.loads((run_dir / "status.json").read_text()).get("state") == "stopped"
        except (OSError, ValueError):
            return False

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
    return 0


if __name__ == "__main__":
    sys.exit(launch_main(sys.argv[1:]))
