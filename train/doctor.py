"""`make doctor`: one report to paste into a bug report. Each failed check names its fix.

  python -m train.doctor [--workers N] [--data-dir D] [--runs-dir R]

Checks: torch and its CUDA build vs the driver, GPUs visible and their mapping, cores and /dev/shm for
the GPUs' loader workers, a free rendezvous port, the data and runs folders (readable / writable as this
user), and a short all-reduce across N local workers with its bandwidth, then one step of --parallel fsdp's sharding
on those workers (its all-gather and reduce-scatter). Exit code 1 if any check failed.
"""

from __future__ import annotations

import argparse
import os
import platform
import queue as queue_module
import shutil
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from train.base.errors import ConfigError, OneLineParser, fail
from train.cluster.cuda_driver import MIN_DRIVER, driver_problem
from train.cluster.distributed import destroy_and_leave_together, join_group
from train.cluster.identity import free_port
from train.cluster.identity import usable_cores
from train.cluster.sharding import Sharded
from train.report.hardware import nvml_read
from train.run import preflight




ALLREDUCE_TIMEOUT_S = 120  # the all-reduce check gives up after this

results: list[tuple[str, str, str]] = []  # (status, check, detail)


def report(status: str, check: str, detail: str) -> None:
    results.append((status, check, detail))
    print(f"[{status:4}] {check:<14} {detail}", flush=True)


def driver_version() -> str | None:
    return nvml_read("nvmlSystemGetDriverVersion")


def check_software() -> None:
    report("ok", "system", f"{platform.node()} {platform.system()} {platform.machine()}, "
           f"python {platform.python_version()}, uid {os.getuid()} gid {os.getgid()}")
    report("ok", "torch", f"{torch.__version__} (CUDA build {torch.version.cuda or 'none'}, "
           f"cuDNN {torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else 'none'})")
    image = os.environ.get("TRAINBOX_IMAGE")
    if image:
        report("ok", "image", f"{image} {os.environ.get('TRAINBOX_IMAGE_DIGEST', '')}".strip())


def check_gpus() -> int:
    driver = driver_version()
    cuda_build = torch.version.cuda
    if driver is None:
        visible = "CUDA_VISIBLE_DEVICES=" + os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        report("info", "gpu", f"no NVIDIA driver reachable: CPU only (gloo) ({visible})")
        return 0
    need = MIN_DRIVER.get(int(cuda_build.split(".")[0])) if cuda_build else None
    problem = driver_problem(driver, cuda_build) if cuda_build else None
    if problem:
        report("FAIL", "driver", problem)
    else:
        report("ok", "driver", f"{driver} (CUDA {cuda_build} needs >= {need})")
    if not torch.cuda.is_available():
        report("FAIL", "gpu", "a driver is present but CUDA is not usable here: in a container, run with the "
               "NVIDIA Container Toolkit (compose: docker/compose.gpu.yml)")
        return 0
    count = torch.cuda.device_count()
    mapping = ", ".join(f"cuda:{i}={torch.cuda.get_device_name(i)}" for i in range(count))
    report("ok", "gpus", f"{count} visible: {mapping} (CUDA_VISIBLE_DEVICES="
           f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}, NVIDIA_VISIBLE_DEVICES="
           f"{os.environ.get('NVIDIA_VISIBLE_DEVICES', '<unset>')})")
    return count


# What image files need per GPU: one loader worker decodes and augments about 670 ImageNet-sized JPEGs/s
# (make bench, train pipeline) and ResNet-50 on one H100 takes about 3,900 images/s, so about 6 cores; the
# workers' prefetched batches (4 per worker, 224 px uint8) want about 2 GiB of /dev/shm per GPU.
CORES_PER_GPU = 6
SHM_PER_GPU = 2 * 2**30


def check_shm(gpus: int) -> None:
    if not os.path.isdir("/dev/shm"):
        report("info", "shm", "/dev/shm not present")
        return
    size = shutil.disk_usage("/dev/shm").total
    need = max(1, gpus) * SHM_PER_GPU if gpus else 2**30
    detail = f"/dev/shm is {size / 2**30:.2f} GiB"
    if size < need:
        serve = f"{gpus} GPU(s)' loader workers" if gpus else "the loader workers of a CPU run"
        report("FAIL", "shm", f"{detail}, {need / 2**30:.0f} GiB wanted for {serve}: "
               f"docker run --shm-size={max(8, need // 2**30)}g (compose: SHM_SIZE), or --num-workers 0")
    else:
        report("ok", "shm", detail)


def check_cores(gpus: int) -> None:
    """Loader workers per training process (the trainer's default: every core of its share but one)."""
    cores = usable_cores()
    per_process = cores // max(1, gpus)
    detail = f"{cores} usable, {per_process} per training process: {max(1, per_process - 1)} loader worker(s) each"
    if gpus and per_process < CORES_PER_GPU:
        report("warn", "cores", f"{detail}; image files need about {CORES_PER_GPU} per GPU to keep it busy: "
               f"use fewer GPUs per job or a machine with more cores per GPU (make bench: images/s per core)")
    else:
        report("ok", "cores", detail)


def check_port() -> None:
    port = os.environ.get("MASTER_PORT", "29500")
    try:
        preflight.check_port(port, fix="set MASTER_PORT to a free port")
    except ConfigError as e:
        report("FAIL", "port", str(e))
        return
    report("ok", "port", f"rendezvous port {port} is free")


def check_folder(name: str, path: str, write: bool) -> None:
    if not os.path.isdir(path):
        report("FAIL", name, f"{path} does not exist: mount the NAS there or set it in .env (make env)")
        return
    if write:
        probe = os.path.join(path, f".doctor-{os.getpid()}")
        try:
            with open(probe, "w") as f:
                f.write("ok")
            os.unlink(probe)
        except OSError as e:
            report("FAIL", name, f"{path} is not writable as uid {os.getuid()} ({e.strerror}): chown it to "
                   f"that user, or set HOST_UID/HOST_GID (make env)")
            return
    elif not os.access(path, os.R_OK | os.X_OK):
        report("FAIL", name, f"{path} is not readable as uid {os.getuid()}: fix its permissions")
        return
    report("ok", name, f"{path} is {'writable' if write else 'readable'} as uid {os.getuid()}")


def _allreduce_worker(rank: int, world: int, port: int, use_cuda: bool, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    join_group("nccl" if use_cuda else "gloo", rank, world, timeout=timedelta(seconds=ALLREDUCE_TIMEOUT_S))
    tensor = torch.ones(16 * 2**20 // 4, device=device)  # 16 MiB of float32
    for _ in range(2):
        dist.all_reduce(tensor)
    if use_cuda:
        torch.cuda.synchronize()
    start, repeats = time.perf_counter(), 5
    for _ in range(repeats):
        dist.all_reduce(tensor)
    if use_cuda:
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / repeats
    ok = bool(torch.allclose(tensor[:1].cpu(), torch.tensor([float(world) ** (repeats + 2)])))
    sharded = _sharded_step(rank, world, device)
    wrong = torch.tensor([0 if sharded is None else 1], device=device)
    dist.all_reduce(wrong)
    if rank == 0:
        # Bus bandwidth as nccl-tests reports it: a ring all-reduce moves 2(n-1)/n of the data.
        queue.put((elapsed, tensor.numel() * 4 * 2 * (world - 1) / world / elapsed / 1e9, ok,
                   (sharded or "it differed on another worker", int(wrong.item())) if wrong.item() else None))
    dist.barrier()
    destroy_and_leave_together()


def _sharded_step(rank: int, world: int, device: torch.device) -> str | None:
    """One step of --parallel fsdp's sharding (train/cluster/sharding.py, as a run shards) of two layers of ones: the
    forward gathers the workers' shards (all-gather), the backward sums the gradients into shards (reduce-scatter).
    None where both give the whole model's figures (exact in float32), else what differed."""
    width = 64
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(2))).to(device)
    for layer in model:
        torch.nn.init.ones_(layer.weight)
    try:
        Sharded(world, device).shard(model, ["0"])
        output = model(torch.full((1, width), float(rank + 1), device=device))
        if not torch.equal(output, torch.full_like(output, width * width * (rank + 1))):
            return f"the forward gave {output[0, 0].item():g}, not {width * width * (rank + 1)} (all-gather)"
        output.sum().backward()
    except Exception as e:  # noqa: BLE001 - report, do not crash the report
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    summed = width * world * (world + 1) // 2  # each worker's gradient is width * (rank + 1) everywhere
    for layer in model:
        grad = layer.weight.grad.to_local()
        if not torch.equal(grad, torch.full_like(grad, summed)):
            return f"a gradient shard held {grad.flatten()[0].item():g}, not the workers' sum {summed} (reduce-scatter)"
    return None


def check_allreduce(workers: int, gpus: int) -> None:
    use_cuda = gpus > 0
    if use_cuda and workers > gpus:
        report("FAIL", "all-reduce", f"{workers} workers but {gpus} GPU(s) visible: set GPUS<={gpus}")
        return
    if workers < 2:
        report("info", "all-reduce", "1 worker: nothing to reduce (GPUS=N or --workers N to test N)")
        return
    queue = mp.get_context("spawn").Queue()
    context = None
    try:
        context = mp.start_processes(_allreduce_worker, args=(workers, free_port(), use_cuda, queue),
                                     nprocs=workers, start_method="spawn", join=False)
        # A worker that dies (or a group that never forms) must fail the check, not hang the report.
        deadline = time.monotonic() + ALLREDUCE_TIMEOUT_S
        result = None
        while result is None:
            try:
                result = queue.get(timeout=1)
            except queue_module.Empty:
                context.join(timeout=0)  # raises when a worker exited with an error
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no result within {ALLREDUCE_TIMEOUT_S} s") from None
        elapsed, busbw, ok, sharded = result
        while not context.join(timeout=ALLREDUCE_TIMEOUT_S):
            pass
    except Exception as e:  # noqa: BLE001 - report, do not crash the report
        if context is not None:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        report("FAIL", "all-reduce", f"{lines[-1] if lines else type(e).__name__}: "
               "see the troubleshooting section of the README "
               "(NCCL_P2P_DISABLE, NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME)")
        return
    backend = "nccl" if use_cuda else "gloo"
    status = "ok" if ok else "FAIL"
    report(status, "all-reduce", f"{workers} workers ({backend}), 16 MiB: {elapsed * 1e3:.1f} ms, "
           f"bus bandwidth {busbw:.2f} GB/s{'' if ok else ', WRONG RESULT'}")
    if sharded is None:
        report("ok", "fsdp", f"{workers} workers ({backend}): a sharded step gathers the parameters and sums the "
               "gradients as the whole model's (--parallel fsdp)")
    else:
        problem, where = sharded
        report("FAIL", "fsdp", f"{workers} workers ({backend}), a sharded step on {where} of them: {problem}: "
               "--parallel fsdp cannot train here; train with --parallel ddp")


def main(argv: list[str]) -> int:
    parser = OneLineParser(prog="python -m train.doctor", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default=os.environ.get("GPUS", ""),
                        help="workers for the all-reduce (default: $GPUS, else all GPUs, else 2)")
    parser.add_argument("--data-dir", help="the datasets folder (default: data, as the trainer's --data-dir)")
    parser.add_argument("--runs-dir", help="the runs folder (default: runs, where runs/<timestamp> go)")
    try:
        args = parser.parse_args(argv)
    except ConfigError as e:
        return fail(e)
    print("trainbox doctor")
    check_software()
    gpus = check_gpus()
    check_cores(gpus)
    check_shm(gpus)
    check_port()
    # Without the NAS (a fresh clone, no .env) the default folders may not exist yet: that is fine.
    if args.data_dir is None and not os.path.isdir("data"):
        report("info", "data", "no data folder: only CIFAR-10 and ImageFolder runs need one "
               "(DATA_DIR=... to check one)")
    else:
        check_folder("data", args.data_dir or "data", write=False)
    if args.runs_dir is None and not os.path.isdir("runs"):
        check_folder("runs", ".", write=True)  # the first run creates runs/ here
    else:
        check_folder("runs", args.runs_dir or "runs", write=True)
    workers = int(args.workers) if str(args.workers).strip().isdigit() and int(args.workers) > 0 else (gpus or 2)
    check_allreduce(workers, gpus)
    failed = [check for status, check, _ in results if status == "FAIL"]
    print(f"{len(failed)} check(s) failed: {', '.join(failed)}" if failed else "all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
