"""make bench: trainbox measured against plain PyTorch, side by side, on this machine.

  python -m train.bench                       every CPU row (and the GPU rows where CUDA is visible)
  python -m train.bench --out runs/bench-x    where bench.json, bench.txt and scaling.png go
  python -m train.bench --quick               tiny sizes, for the test suite (numbers mean little)

Every figure is a ratio of two arms measured in this one run: the arms alternate (A B A B ...), the
first windows of each run are dropped as warm-up, and each row reports the median ratio and its spread
(lowest and highest of the per-round ratios). No figure is compared with a stored absolute time.

The "bare" arm is the canonical loop of the PyTorch DDP tutorial, written out below: zero_grad,
forward, loss, backward, step, on the same model, data, batch, threads and world size as the trainer,
with fused AdamW kernels as the trainer uses (one parameter group and no schedule, as in the tutorial).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from train.distributed import destroy_and_leave_together

PY = sys.executable
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- the bare loop (the reference arm)

def _init(rank: int, world: int, port: int, threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _bare_worker(rank: int, spec: dict) -> None:
    """The tutorial's DDP loop on the trainer's model and in-memory data; per-window step times."""
    from train.data import make_shapes  # noqa: PLC0415
    from train.models import SmallCNN  # noqa: PLC0415

    world, started = spec["world"], spec["launched"]
    _init(rank, world, spec["port"], spec["threads"])
    torch.manual_seed(0)
    images, labels = make_shapes(spec["samples"], spec["image_size"], seed=1)
    model = DDP(SmallCNN(10, spec["width"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05, fused=True)
    loss_fn = nn.CrossEntropyLoss()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))[rank::world]
    per_step = len(order) // spec["batch"]
    times, first, window = [], None, time.perf_counter()
    for step in range(spec["steps"]):
        idx = order[(step % per_step) * spec["batch"]:(step % per_step + 1) * spec["batch"]]
        x, y = images[idx].float().div_(255).sub_(0.5).div_(0.25), labels[idx]
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        if first is None:
            first = time.time() - started
        if (step + 1) % spec["window"] == 0:
            times.append((time.perf_counter() - window) / spec["window"])
            window = time.perf_counter()
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps({"step_times": times, "first_step_s": first}))
    destroy_and_leave_together()


def _bare_gpu(spec: dict) -> None:
    """The same loop on one GPU: ResNet-50, synthetic data already on the device, bf16, channels_last."""
    import torchvision  # noqa: PLC0415

    started = spec["launched"]
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    g = torch.Generator(device=device).manual_seed(0)
    size, batch = spec["image_size"], spec["batch"]
    images = torch.randint(0, 256, (spec["samples"], 3, size, size), dtype=torch.uint8, device=device, generator=g)
    labels = torch.randint(0, 1000, (spec["samples"],), device=device, generator=g)
    model = torchvision.models.resnet50().to(device, memory_format=torch.channels_last)
    model = DDP(model, device_ids=[0], gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05, fused=spec.get("fused", True))
    loss_fn = nn.CrossEntropyLoss()
    times, first, window = [], None, time.perf_counter()
    for step in range(spec["steps"]):
        idx = torch.randint(0, spec["samples"], (batch,), device=device, generator=g)
        x = images[idx].float().div_(255).sub_(0.5).div_(0.25).contiguous(memory_format=torch.channels_last)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x), labels[idx])
        loss.backward()
        optimizer.step()
        if first is None:
            torch.cuda.synchronize()
            first = time.time() - started
        if (step + 1) % spec["window"] == 0:
            torch.cuda.synchronize()
            times.append((time.perf_counter() - window) / spec["window"])
            window = time.perf_counter()
    Path(spec["out"]).write_text(json.dumps({"step_times": times, "first_step_s": first}))
    dist.destroy_process_group()


def bare_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    if spec.get("gpu"):
        _bare_gpu(spec)
    else:
        mp.start_processes(_bare_worker, args=(spec,), nprocs=spec["world"], start_method="spawn")


# ---------------------------------------------------------------- running arms

def _free_port() -> int:
    from train.distributed import free_port  # noqa: PLC0415

    return free_port()


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _run(cmd: list[str], what: str) -> None:
    started = time.monotonic()
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"bench: {what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    print(f"bench: {time.monotonic() - started:5.1f} s  {what}", file=sys.stderr, flush=True)


def trainer_arm(run_dir: Path, args: list, warmup: int) -> dict:
    """Run the trainer in an empty run dir; its own metrics give per-window step time, data wait and GPU use."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a reused --out would resume the old run and read its metrics
    launched = time.time()
    _run([PY, "-m", "train", *map(str, args), "--run-dir", str(run_dir)], f"trainer {' '.join(map(str, args))}")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if m["kind"] == "train"][warmup:]
    first = next(m for m in lines if m["kind"] == "first_step")
    return {"step_times": [m["step_time_s"] for m in train], "data_wait": [m["data_wait_frac"] for m in train],
            "gpu_util": [m["gpu0_util"] for m in train if "gpu0_util" in m],
            "first_step_s": first["time"] - launched}


def bare_arm(out: Path, spec: dict, warmup: int) -> dict:
    spec = {**spec, "out": str(out), "port": _free_port(), "launched": time.time()}
    _run([PY, "-m", "train.bench", "--bare", json.dumps(spec)], "the bare loop")
    result = json.loads(out.read_text())
    result["step_times"] = result["step_times"][warmup:]
    return result


def median(values) -> float:
    return statistics.median(values)


def row(name: str, ratio_per_round: list[float], detail: str, target: str = "", ok: bool | None = None) -> dict:
    return {"row": name, "ratio": median(ratio_per_round), "low": min(ratio_per_round),
            "high": max(ratio_per_round), "rounds": len(ratio_per_round), "detail": detail, "target": target,
            "meets_target": ok}


# ---------------------------------------------------------------- CPU rows

def loop_rows(out: Path, size: dict, rounds: int) -> tuple[list[dict], dict]:
    """Trainer vs bare loop (2 ranks), and the trainer at 1 rank x 1 thread, 1 x 2, 2 x 1 (weak scaling)."""
    w = size["window"]
    common = ["--max-steps", size["steps"], "--log-every", w, "--eval-every", 0, "--save-every", 10**6,
              "--grad-clip", 0, "--train-samples", size["samples"], "--val-samples", 256, "--width", size["width"],
              "--batch-size", size["batch"]]
    bare = {"world": 2, "threads": 1, "samples": size["samples"], "image_size": 32, "width": size["width"],
            "batch": size["batch"], "steps": size["steps"], "window": w}
    arms = {"trainer 2x1": ["--spawn", 2, "--threads", 1], "bare 2x1": None,
            "trainer 1x1": ["--threads", 1], "trainer 1x2": ["--threads", 2]}
    results: dict[str, list[dict]] = {name: [] for name in arms}
    for r in range(rounds):
        for name, extra in arms.items():
            tag = name.replace(" ", "-")
            if extra is None:
                results[name].append(bare_arm(out / f"{tag}-{r}.json", bare, size["warmup"]))
            else:
                results[name].append(trainer_arm(out / "runs" / f"{tag}-{r}", [*common, *extra], size["warmup"]))
    step = {name: [median(res["step_times"]) for res in runs] for name, runs in results.items()}
    b = size["batch"]
    overhead = [bare / tb for bare, tb in zip(step["bare 2x1"], step["trainer 2x1"], strict=True)]
    scaling = [2 * one / two for one, two in zip(step["trainer 1x1"], step["trainer 2x1"], strict=True)]
    threads = [one / two for one, two in zip(step["trainer 1x1"], step["trainer 1x2"], strict=True)]
    waits = [median(res["data_wait"]) for res in results["trainer 1x2"]]
    ttfs = [tb["first_step_s"] / bare["first_step_s"]
            for tb, bare in zip(results["trainer 2x1"], results["bare 2x1"], strict=True)]
    ms = {name: 1000 * median(v) for name, v in step.items()}
    rows = [
        row("trainer overhead: bare loop step / trainbox step (2 ranks x 1 thread)", overhead,
            f"bare {ms['bare 2x1']:.1f} ms, trainbox {ms['trainer 2x1']:.1f} ms per step of 2x{b}",
            ">= 0.97", median(overhead) >= 0.97),
        row("weak scaling: samples/s 2 ranks x 1 thread / 1 rank x 1 thread", scaling,
            f"1x1 {b / median(step['trainer 1x1']):.0f}/s, 2x1 {2 * b / median(step['trainer 2x1']):.0f}/s; "
            f"efficiency {median(scaling) / 2:.0%} (ideal ratio 2.0)"),
        row("threads: samples/s 1 rank x 2 threads / 1 rank x 1 thread", threads,
            f"1x2 {b / median(step['trainer 1x2']):.0f}/s"),
        row("data wait fraction per step, built-in dataset (1 rank x 2 threads)", waits,
            "time in next(batch) / step time, trainer's own metric", "< 0.05", median(waits) < 0.05),
        row("time to first step: trainbox / bare loop (2 ranks, from launch)", ttfs,
            f"trainbox {median([r['first_step_s'] for r in results['trainer 2x1']]):.1f} s, bare "
            f"{median([r['first_step_s'] for r in results['bare 2x1']]):.1f} s"),
    ]
    chart = {"1 rank x 1 thread": b / median(step["trainer 1x1"]),
             "1 rank x 2 threads": b / median(step["trainer 1x2"]),
             "2 ranks x 1 thread": 2 * b / median(step["trainer 2x1"]),
             "bare 2 ranks x 1 thread": 2 * b / median(step["bare 2x1"])}
    return rows, chart


def _comm_worker(rank: int, spec: dict) -> None:
    """DDP wrapper cost (1 rank) or exposed communication (2 ranks), blocks interleaved in-process."""
    _init(rank, spec["world"], spec["port"], spec["threads"])
    times = _comm_blocks(spec)  # returns with every DDP reducer gone, before its group is destroyed
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(times))
    destroy_and_leave_together()


def _comm_blocks(spec: dict) -> dict[str, list[float]]:
    from train.models import SmallCNN  # noqa: PLC0415

    world = spec["world"]
    torch.manual_seed(0)
    x = torch.randn(spec["batch"], 3, 32, 32)
    y = torch.randint(0, 10, (spec["batch"],))
    loss_fn = nn.CrossEntropyLoss()

    def stepper(model, fused=True):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)  # fused, as the trainer's

        def step():
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
        return step

    ddp = DDP(SmallCNN(10, spec["width"]), gradient_as_bucket_view=True)  # as the trainer wraps it
    arms = {"ddp": stepper(ddp)}
    if world == 1:
        arms["plain"] = stepper(SmallCNN(10, spec["width"]))
        arms["ddp_copy"] = stepper(DDP(SmallCNN(10, spec["width"]), gradient_as_bucket_view=False))
        # torch's default AdamW on CPU: a loop over the parameters (its for-each kernels are for GPUs)
        arms["loop"] = stepper(DDP(SmallCNN(10, spec["width"]), gradient_as_bucket_view=True), fused=None)
        for fused in (True, None):  # the optimizer step alone, 20 per call, on gradients that stay put
            model = SmallCNN(10, spec["width"])
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
            arms[f"opt_{'fused' if fused else 'loop'}"] = lambda opt=opt: [opt.step() for _ in range(20)]
    else:
        sync_free = stepper(ddp)

        def no_sync():
            with ddp.no_sync():
                sync_free()
        arms["no_sync"] = no_sync
        arms["static"] = stepper(DDP(SmallCNN(10, spec["width"]), gradient_as_bucket_view=True, static_graph=True))
        flat = torch.zeros(sum(p.numel() for p in ddp.parameters()))
        arms["allreduce"] = lambda: dist.all_reduce(flat)
    times = {name: [] for name in arms}
    for block in range(spec["blocks"]):
        for name, fn in arms.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(spec["per_block"]):
                fn()
            if block >= 1:  # the first block of each arm is warm-up
                times[name].append((time.perf_counter() - start) / spec["per_block"])
    return times


def comm_rows(out: Path, size: dict) -> list[dict]:
    results = {}
    for world, threads in ((1, 2), (2, 1)):
        spec = {"world": world, "threads": threads, "batch": size["batch"], "width": size["width"],
                "blocks": size["blocks"], "per_block": size["per_block"], "port": _free_port(),
                "out": str(out / f"comm-{world}.json")}
        mp.start_processes(_comm_worker, args=(spec,), nprocs=world, start_method="spawn")
        results[world] = json.loads(Path(spec["out"]).read_text())
    one, two = results[1], results[2]
    wrapper = [p / d for p, d in zip(one["plain"], one["ddp"], strict=True)]
    view = [c / d for c, d in zip(one["ddp_copy"], one["ddp"], strict=True)]
    fused = [lp / d for lp, d in zip(one["loop"], one["ddp"], strict=True)]
    fused_alone = [lp / f for lp, f in zip(one["opt_loop"], one["opt_fused"], strict=True)]
    compute = [n / s for n, s in zip(two["no_sync"], two["ddp"], strict=True)]
    static = [d / g for d, g in zip(two["ddp"], two["static"], strict=True)]
    exposed = [max(0.0, s - n) / a for s, n, a in zip(two["ddp"], two["no_sync"], two["allreduce"], strict=True)]
    ms = lambda v: 1000 * median(v)  # noqa: E731
    from train.models import SmallCNN  # noqa: PLC0415

    params = sum(p.numel() for p in SmallCNN(10, size["width"]).parameters())
    return [
        row("DDP wrapper: plain module step / 1-rank DDP step (CPU, 2 threads)", wrapper,
            f"plain {ms(one['plain']):.1f} ms, DDP {ms(one['ddp']):.1f} ms", ">= 0.95", median(wrapper) >= 0.95),
        row("gradient_as_bucket_view: 1-rank DDP step without it / with it (the trainer's setting)", view,
            f"without {ms(one['ddp_copy']):.1f} ms, with {ms(one['ddp']):.1f} ms; > 1: the bucket view saves time"),
        row("fused AdamW: 1-rank DDP step with torch's default AdamW (a loop over the parameters on CPU) / "
            "with fused (the trainer's)", fused, f"default {ms(one['loop']):.1f} ms, fused {ms(one['ddp']):.1f} ms"),
        row("fused AdamW: the optimizer step alone, torch's default on CPU / fused (same model, 2 threads)",
            fused_alone, f"default {ms(one['opt_loop']) / 20:.2f} ms, fused {ms(one['opt_fused']) / 20:.2f} ms per "
            f"optimizer step of {params:,} parameters"),
        row("communication: step without sync (no_sync) / step with sync (2 ranks x 1 thread)", compute,
            f"with sync {ms(two['ddp']):.1f} ms, without {ms(two['no_sync']):.1f} ms"),
        row("static_graph: 2-rank DDP step without it / with it (--static-graph, off by default)", static,
            f"without {ms(two['ddp']):.1f} ms, with {ms(two['static']):.1f} ms; > 1: static_graph saves time"),
        row("exposed communication / raw all_reduce of the same gradient bytes", exposed,
            f"all_reduce alone {ms(two['allreduce']):.1f} ms; 0 = fully overlapped with backward, "
            f"1 = none overlapped"),
    ]


def _cifar_like(root: Path, train: int, val: int) -> None:
    """A CIFAR-sized ImageFolder: 10 classes of 32x32 PNGs (the shapes, written as files)."""
    from PIL import Image  # noqa: PLC0415

    from train.data import SHAPE_CLASSES, make_shapes  # noqa: PLC0415

    if (root / ".complete").exists():
        return
    for split, n, seed in (("train", train, 1), ("val", val, 2)):
        images, labels = make_shapes(n, 32, seed)
        for c in SHAPE_CLASSES:
            (root / split / c).mkdir(parents=True, exist_ok=True)
        for i, (img, label) in enumerate(zip(images, labels, strict=True)):
            Image.fromarray(img.permute(1, 2, 0).numpy()).save(root / split / SHAPE_CLASSES[label] / f"{i}.png")
    (root / ".complete").write_text("")


def loader_alone(cfg_args: list, batches: int) -> float:
    """Samples/s of the trainer's own train loader with nothing consuming it (first batch dropped)."""
    from train.config import parse_config  # noqa: PLC0415
    from train.data import build_datasets, build_train_loader  # noqa: PLC0415

    cfg = parse_config(list(map(str, cfg_args)))
    train_set, _, _ = build_datasets(cfg)
    count, seconds = drain(*build_train_loader(cfg, train_set, 0, 1, pin_memory=False), batches)
    return count / seconds


def drain(loader, sampler, batches: int, device: torch.device | None = None) -> tuple[int, float]:
    """(images, seconds) for `batches` batches of a train loader after its first (the workers' start);
    with a device, each batch is copied onto it as the trainer copies it, and the time includes the copies."""
    from train.loop import prepare_inputs  # noqa: PLC0415

    sampler.set_epoch(0)
    it = iter(loader)
    next(it)
    start, count = time.perf_counter(), 0
    for _ in range(batches):
        x, y = next(it)
        if device is not None:
            x, y = prepare_inputs(x, device, channels_last=True), y.to(device, non_blocking=True)
        count += len(x)
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return count, time.perf_counter() - start


def epoch_start(cfg_args: list, persistent: bool, epochs: int) -> float:
    """Median wait from iter() to the first batch of epochs 2.. of the trainer's train loader, with
    persistent DataLoader workers (the trainer's default) or workers started anew every epoch."""
    from train.config import parse_config  # noqa: PLC0415
    from train.data import build_datasets, build_train_loader  # noqa: PLC0415

    cfg = parse_config(list(map(str, cfg_args)))
    train_set, _, _ = build_datasets(cfg)
    loader, sampler = build_train_loader(cfg, train_set, 0, 1, pin_memory=False, persistent=persistent)
    waits = []
    for epoch in range(epochs + 1):
        sampler.set_epoch(epoch)
        start = time.perf_counter()
        it = iter(loader)
        next(it)
        if epoch:
            waits.append(time.perf_counter() - start)
        for _ in it:  # the whole epoch, so no batch is still in flight when the next one starts
            pass
        del it
    del loader
    return median(waits)


def pipeline_rows(out: Path, size: dict, rounds: int) -> list[dict]:
    model = ["--width", size["width"], "--batch-size", size["batch"]]
    _cifar_like(out / "cifar-like", size["files"], 200)
    folder = ["--dataset", "imagefolder", "--data-dir", out / "cifar-like", *model]
    # The wait at an epoch's start does not grow with the epoch: a short one will do.
    _cifar_like(out / "cifar-small", max(size["files"] // 6, 4 * size["batch"]), 100)
    short = ["--dataset", "imagefolder", "--data-dir", out / "cifar-small", *model]
    builtin = ["--train-samples", size["samples"], *model]
    run = ["--max-steps", size["steps"], "--log-every", size["window"], "--eval-every", 0, "--save-every", 10**6]
    headroom = {"imagefolder": [], "shapes": []}
    waits, restart = [], []
    for r in range(rounds):
        fresh, kept = epoch_start(short, False, 2), epoch_start(short, True, 2)
        restart.append(fresh / kept)
        for name, args in (("imagefolder", folder), ("shapes", builtin)):
            alone = loader_alone(args, size["loader_batches"])
            trained = trainer_arm(out / "runs" / f"pipeline-{name}-{r}", [*args, *run], size["warmup"])
            consumed = size["batch"] / median(trained["step_times"])
            headroom[name].append(alone / consumed)
            if name == "imagefolder":
                waits.append(median(trained["data_wait"]))
    from train.config import parse_config  # noqa: PLC0415
    from train.data import default_num_workers  # noqa: PLC0415

    workers = default_num_workers(parse_config(list(map(str, folder))))
    return [
        row("input headroom, built-in: loader alone / model consumption (samples/s)", headroom["shapes"],
            "in-memory batches cut on the training device"),
        row(f"input headroom, CIFAR-sized ImageFolder ({workers} loader worker(s), default): loader / model",
            headroom["imagefolder"], "PNG decode + augmentation vs the default CNN's training speed"),
        row("data wait fraction per step, CIFAR-sized ImageFolder, defaults", waits,
            "time in next(batch) / step time", "< 0.05", median(waits) < 0.05),
        row("persistent workers: epoch-start wait with workers started anew / kept (CIFAR-sized ImageFolder)",
            restart, f"iter() to the first batch of an epoch ({size['batch']} PNGs); > 1: persistent workers save it"),
    ]


def checkpoint_rows(out: Path, size: dict, rounds: int) -> list[dict]:
    """The trainer's save (stream + CRC32 + fsync + sidecar + rename + prune) vs writing the same bytes raw."""
    import torchvision  # noqa: PLC0415

    from train import checkpoint as ckpt  # noqa: PLC0415

    model = torchvision.models.resnet18() if not size["quick"] else nn.Linear(512, 512)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3, 64, 64) if not size["quick"] else torch.randn(2, 512)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1, "config": {}}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    raw = buffer.getvalue()
    folder = out / "checkpoint-bench"
    raw_dir = ckpt.checkpoint_dir(folder)  # the very folder the checkpoints go to
    raw_dir.mkdir(parents=True, exist_ok=True)
    saves, raws, loads, reads = [], [], [], []

    def timed_save(r: int) -> float:
        start = time.perf_counter()
        ckpt.save_checkpoint(folder, r, state, keep=1)
        elapsed = time.perf_counter() - start
        ckpt.list_checkpoints(folder)  # waits for the old checkpoint's deletion, untimed (it overlaps training)
        return elapsed

    def timed_raw(r: int) -> float:
        start = time.perf_counter()
        with open(raw_dir / f"raw-{r}.bin", "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        return time.perf_counter() - start

    # Disk write-back here is bursty: many short rounds, the arms' order alternating (A B, B A, ...).
    for r in range(4 * rounds + 1):
        if r % 2:
            raw_s, save_s = timed_raw(r), timed_save(r)
        else:
            save_s, raw_s = timed_save(r), timed_raw(r)
        path = ckpt.list_checkpoints(folder)[-1]
        start = time.perf_counter()
        if ckpt.verify(path) is not None:
            raise SystemExit(f"bench: {path} does not verify: {ckpt.verify(path)}")
        ckpt.load_checkpoint(path, torch.device("cpu"))
        load_s = time.perf_counter() - start
        start = time.perf_counter()
        (raw_dir / f"raw-{r}.bin").read_bytes()
        read_s = time.perf_counter() - start
        (raw_dir / f"raw-{r}.bin").unlink()
        if r:  # round 0 warms the page cache and allocator
            saves.append(save_s), raws.append(raw_s), loads.append(load_s), reads.append(read_s)
    mb = len(raw) / 2**20
    save = [w / s for w, s in zip(raws, saves, strict=True)]
    load = [rd / ld for rd, ld in zip(reads, loads, strict=True)]
    return [
        row("checkpoint save: raw write+fsync / trainbox save (same bytes, same folder)", save,
            f"{mb:.0f} MiB: raw {mb / median(raws):.0f} MiB/s, save {mb / median(saves):.0f} MiB/s", ">= 0.7",
            median(save) >= 0.7),
        row("checkpoint load: raw read / trainbox load (size + CRC32 check, then weights_only load)", load,
            f"raw {mb / median(reads):.0f} MiB/s, load {mb / median(loads):.0f} MiB/s"),
    ]


# ---------------------------------------------------------------- GPU rows

GPU_KNOBS = ("fp32", "no-channels-last", "compile", "bucket-cap-mb", "static-graph", "foreach-adamw", "no-pin-memory")


class _HostImages(torch.utils.data.Dataset):
    """`distinct` random uint8 images held in host memory, read `repeat` times: a loader with no decode cost."""

    def __init__(self, distinct: int, repeat: int, size: int):
        self.images = torch.randint(0, 256, (distinct, 3, size, size), dtype=torch.uint8)
        self.labels = torch.randint(0, 1000, (distinct,))
        self.repeat = repeat

    def __len__(self) -> int:
        return len(self.labels) * self.repeat

    def __getitem__(self, i: int):
        return self.images[i % len(self.labels)], self.labels[i % len(self.labels)]


def host_to_device(pin: bool, batch: int, batches: int, size: int, device: torch.device) -> tuple[int, float]:
    """Images delivered onto the device by the trainer's own train loader (its default workers for an
    image dataset) and its own copy (`prepare_inputs`, non_blocking), with or without pinned memory.
    Returns (images, seconds); the first batch (worker start) is not counted."""
    from train.config import parse_config  # noqa: PLC0415
    from train.data import build_train_loader  # noqa: PLC0415

    cfg = parse_config(["--dataset", "imagefolder", "--batch-size", str(batch)])
    return drain(*build_train_loader(cfg, _HostImages(batch, batches + 1, size), 0, 1, pin_memory=pin), batches,
                 device)


def gpu_rows(out: Path, size: dict, rounds: int, only: list[str] = GPU_KNOBS) -> list[dict]:
    """ResNet-50, 224 px, synthetic data on the device, bf16 + channels_last, 1 GPU (DDP of 1)."""
    base = ["--spawn", 1, "--dataset", "synthetic", "--model", "resnet50", "--image-size", 224,
            "--batch-size", size["gpu_batch"], "--train-samples", 1024, "--val-samples", 128,
            "--max-steps", size["gpu_steps"], "--log-every", size["window"], "--eval-every", 0,
            "--save-every", 10**6, "--grad-clip", 0, "--precision", "bf16", "--channels-last"]
    knobs = {"fp32 instead of bf16": ("fp32", ["--precision", "fp32"]),
             "without channels_last": ("no-channels-last", None),
             "torch.compile": ("compile", ["--compile"]),
             "bucket_cap_mb 100": ("bucket-cap-mb", ["--bucket-cap-mb", 100]),
             "static_graph": ("static-graph", ["--static-graph"])}
    knobs = {name: extra for name, (key, extra) in knobs.items() if key in only}
    foreach, pinned = [], []
    bare = {"gpu": True, "samples": 1024, "image_size": 224, "batch": size["gpu_batch"],
            "steps": size["gpu_steps"], "window": size["window"]}
    vs_bare, util, trainer_ips, bare_ips = [], [], [], []
    knob_ratio = {name: [] for name in knobs}
    for r in range(rounds):
        tb = trainer_arm(out / "runs" / f"gpu-trainer-{r}", base, size["warmup"])
        bb = bare_arm(out / f"gpu-bare-{r}.json", bare, size["warmup"])
        vs_bare.append(median(bb["step_times"]) / median(tb["step_times"]))
        util += tb["gpu_util"]
        trainer_ips.append(size["gpu_batch"] / median(tb["step_times"]))
        bare_ips.append(size["gpu_batch"] / median(bb["step_times"]))
        for name, extra in knobs.items():
            args = [a for a in base if a != "--channels-last"] if extra is None else [*base, *extra]
            kb = trainer_arm(out / "runs" / f"gpu-{name.replace(' ', '-')}-{r}", args, size["warmup"] + 1)
            knob_ratio[name].append(median(tb["step_times"]) / median(kb["step_times"]))
        if "foreach-adamw" in only:
            fb = bare_arm(out / f"gpu-bare-foreach-{r}.json", {**bare, "fused": False}, size["warmup"])
            foreach.append(median(bb["step_times"]) / median(fb["step_times"]))
        if "no-pin-memory" in only:
            rates = {}
            for pin in (True, False) if r % 2 else (False, True):  # alternate which goes first
                if r == 0:  # warm-up: pinned host blocks and device memory are allocated once, not timed
                    host_to_device(pin, size["gpu_batch"], 2, 224, torch.device("cuda", 0))
                images, seconds = host_to_device(pin, size["gpu_batch"], size["loader_batches"], 224,
                                                 torch.device("cuda", 0))
                rates[pin] = images / seconds
            pinned.append(rates[False] / rates[True])
            torch.cuda.empty_cache()  # leave the GPU's memory to the trainer runs that follow
    name = torch.cuda.get_device_name(0)
    rows = [row(f"GPU images/s: trainbox / bare loop (ResNet-50, 224 px, bf16, channels_last, {name})", vs_bare,
                f"trainbox {median(trainer_ips):.0f} img/s, bare {median(bare_ips):.0f} img/s, batch "
                f"{size['gpu_batch']}; NVML busy {median(util) if util else float('nan'):.0f}%", ">= 0.97",
                median(vs_bare) >= 0.97)]
    rows += [row(f"GPU knob: images/s with {knob} / the row above", ratios, "one setting changed")
             for knob, ratios in knob_ratio.items()]
    if foreach:
        rows.append(row("GPU knob: bare loop images/s with the for-each AdamW / with fused AdamW (the trainer's)",
                        foreach, "the bare loop of the first row, its optimizer changed"))
    if pinned:
        rows.append(row("GPU knob: images/s onto the GPU from the trainer's loader without pinned memory / with it",
                        pinned, f"224 px uint8 held on the host, batch {size['gpu_batch']}, no model: the "
                        f"loader and the non_blocking copy alone"))
    return rows


# ---------------------------------------------------------------- report

def chart(path: Path, bars: dict[str, float]) -> None:
    """A PNG bar chart of the scaling arms (samples/s), with the ideal 2-rank line."""
    from PIL import Image, ImageDraw  # noqa: PLC0415

    width, height, left, bottom = 720, 360, 60, 300
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    top_value = max(max(bars.values()), 2 * bars["1 rank x 1 thread"]) * 1.1
    scale = (bottom - 40) / top_value
    draw.text((left, 10), "trainbox weak scaling on this machine (samples/s, CPU)", fill="black")
    draw.line([(left, bottom), (width - 20, bottom)], fill="black")
    slot = (width - left - 40) // len(bars)
    for i, (label, value) in enumerate(bars.items()):
        x0 = left + i * slot + 15
        draw.rectangle([x0, bottom - value * scale, x0 + slot - 30, bottom],
                       fill=(70, 110, 180) if "bare" not in label else (160, 160, 160))
        draw.text((x0, bottom - value * scale - 14), f"{value:.0f}", fill="black")
        draw.text((x0, bottom + 8), label, fill="black")
    ideal = bottom - 2 * bars["1 rank x 1 thread"] * scale
    draw.line([(left, ideal), (width - 20, ideal)], fill=(200, 60, 60))
    draw.text((width - 230, ideal - 14), "ideal 2 ranks = 2 x (1 rank x 1 thread)", fill=(200, 60, 60))
    image.save(path)


def table(rows: list[dict], header: str) -> str:
    lines = [header, "", f"{'ratio':>6} {'spread':>13} {'target':>7}  row", "-" * 100]
    for r in rows:
        mark = "" if r["meets_target"] is None else (" ok" if r["meets_target"] else " MISSED")
        lines.append(f"{r['ratio']:6.3f} {r['low']:6.3f}-{r['high']:<6.3f} {r['target']:>7}  {r['row']}{mark}")
        lines.append(f"{'':29}{r['detail']}")
    return "\n".join(lines)


SIZES = {
    "full": {"steps": 100, "window": 10, "warmup": 2, "samples": 4096, "width": 32, "batch": 64, "blocks": 8,
             "per_block": 5, "files": 3000, "loader_batches": 30, "gpu_batch": 256, "gpu_steps": 80, "quick": False},
    "quick": {"steps": 8, "window": 2, "warmup": 1, "samples": 512, "width": 8, "batch": 16, "blocks": 3,
              "per_block": 2, "files": 120, "loader_batches": 3, "gpu_batch": 32, "gpu_steps": 8, "quick": True},
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=time.strftime("runs/bench-%Y%m%d-%H%M%S"), help="output folder")
    parser.add_argument("--rounds", type=int, default=3, help="A B A B rounds per comparison")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that every row runs")
    parser.add_argument("--gpu-only", action="store_true", help="only the GPU rows (needs CUDA)")
    parser.add_argument("--gpu-knobs", default=",".join(GPU_KNOBS),
                        help=f"GPU knobs to measure, comma-separated from {','.join(GPU_KNOBS)} (default: all)")
    parser.add_argument("--bare", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.bare:
        bare_main(ns.bare)
        return 0
    if ns.rounds < 2:
        print("error: --rounds must be at least 2 to report a spread: pass --rounds 2 or more", file=sys.stderr)
        return 2
    if ns.gpu_only and not torch.cuda.is_available():
        print("error: --gpu-only needs a CUDA GPU and none is visible: drop --gpu-only or check nvidia-smi",
              file=sys.stderr)
        return 2
    knobs = [k for k in ns.gpu_knobs.split(",") if k]
    if unknown := sorted(set(knobs) - set(GPU_KNOBS)):
        print(f"error: unknown --gpu-knobs {','.join(unknown)}: pick from {','.join(GPU_KNOBS)}", file=sys.stderr)
        return 2
    size = SIZES["quick" if ns.quick else "full"]
    out = Path(ns.out).resolve()
    (out / "runs").mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    started = time.monotonic()
    header = (f"trainbox bench: torch {torch.__version__}, {cores} CPU cores, "
              f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}; "
              f"{ns.rounds} interleaved rounds; ratio = median, spread = lowest-highest round")
    print(f"bench: measuring into {out}{'' if ns.gpu_only else ' (7 to 8 minutes on 2 cores)'}", file=sys.stderr,
          flush=True)
    rows, bars = [], {}
    if not ns.gpu_only:
        rows, bars = loop_rows(out, size, ns.rounds)
        rows += comm_rows(out, size)
        rows += pipeline_rows(out, size, ns.rounds)
        rows += checkpoint_rows(out, size, ns.rounds)
        chart(out / "scaling.png", bars)
    if torch.cuda.is_available():
        rows += gpu_rows(out, size, ns.rounds, knobs)
    text = table(rows, header) + f"\n\n{time.monotonic() - started:.0f} s; written to {out}"
    (out / "bench.txt").write_text(text + "\n")
    (out / "bench.json").write_text(json.dumps({"header": header, "rows": rows, "scaling_samples_per_s": bars,
                                                "sizes": size, "rounds": ns.rounds}, indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
