"""The CPU rows: trainer overhead and scaling, DDP and communication, checkpoints (the input pipeline's:
train/bench/pipeline.py)."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from train.bench.arms import _init, arm_dir, bare_arm, free_port, median, row, trainer_arm
from train.cluster.distributed import destroy_and_leave_together
from train.cluster.forkserver import start_fork_server
from train.components.models import SmallCNN
from train.files import checkpoint_io as ckpt


# ---------------------------------------------------------------- CPU rows

# The trainer arm of 1 rank x 2 threads (its run: arm_dir(out, ONE_RANK, r)); --quick's built-in input headroom
# reads its step (train/bench/pipeline.py)
ONE_RANK = "trainer-1x2"


def shapes_bare(size: dict) -> dict:
    """The trainer rows' bare loop: 2 ranks x 1 thread, the trainer arms' model, data, batch and steps."""
    return {"world": 2, "threads": 1, "samples": size["samples"], "image_size": 32, "width": size["width"],
            "batch": size["batch"], "steps": size["steps"], "window": size["window"]}


def _trainer_arms(out: Path, size: dict, rounds: int) -> dict[str, list[dict]]:
    """One run of each arm per round, interleaved: {arm: its runs' results}."""
    w = size["window"]
    common = ["--max-steps", size["steps"], "--log-every", w, "--eval-every", 0, "--save-every", 10**6,
              "--grad-clip", 0, "--train-samples", size["samples"], "--val-samples", 256, "--width", size["width"],
              "--batch-size", size["batch"]]  # no clipping: the bare loop has none
    bare = shapes_bare(size)
    two = ["--spawn", 2, "--threads", 1]
    arms = {"trainer 2x1": two, "bare 2x1": None, "trainer 1x1": ["--threads", 1], "trainer 1x2": ["--threads", 2],
            "deterministic 2x1": [*two, "--deterministic"], "ema 2x1": [*two, "--model-ema", "--model-ema-steps", 1],
            "mix 2x1": [*two, "--mixup-alpha", 0.2, "--cutmix-alpha", 1.0]}
    results: dict[str, list[dict]] = {name: [] for name in arms}
    for r in range(rounds):
        for name, extra in arms.items():
            tag = name.replace(" ", "-")
            if extra is None:
                results[name].append(bare_arm(out / f"{tag}-{r}.json", bare, size["warmup"]))
            else:
                results[name].append(trainer_arm(arm_dir(out, tag, r), [*common, *extra], size["warmup"]))
    return results


def trainer_rows(out: Path, size: dict, rounds: int) -> tuple[list[dict], list[dict], list[dict], dict]:
    """Every row that compares whole trainer runs (_trainer_arms), the 2 ranks x 1 thread trainer shared by
    the rows that compare against it: the loop's rows (trainer vs bare loop, weak scaling, threads, data
    wait, time to first step), what exact resume costs (--deterministic's step, the one-time settling pass)
    and a recipe's per-step costs (EMA, MixUp/CutMix). Returns (loop rows, exactness rows, recipe rows,
    the scaling chart's bars)."""
    results = _trainer_arms(out, size, rounds)
    step = {name: [median(res["step_times"]) for res in runs] for name, runs in results.items()}
    ms = {name: 1000 * median(v) for name, v in step.items()}

    def per_round(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(step[a], step[b], strict=True)]

    b = size["batch"]
    overhead = per_round("bare 2x1", "trainer 2x1")
    scaling = [2 * one / two for one, two in zip(step["trainer 1x1"], step["trainer 2x1"], strict=True)]
    waits = [median(res["data_wait"]) for res in results["trainer 1x2"]]
    ttfs = [tb["first_step_s"] / bare["first_step_s"]
            for tb, bare in zip(results["trainer 2x1"], results["bare 2x1"], strict=True)]
    settle = [res["settle_s"] / s for res, s in zip(results["trainer 2x1"], step["trainer 2x1"], strict=True)]
    loop = [
        row("trainer overhead: bare loop step / trainbox step (2 ranks x 1 thread)", overhead,
            f"bare {ms['bare 2x1']:.1f} ms, trainbox {ms['trainer 2x1']:.1f} ms per step of 2x{b}",
            ">= 0.97", median(overhead) >= 0.97),
        row("weak scaling: samples/s 2 ranks x 1 thread / 1 rank x 1 thread", scaling,
            f"1x1 {b / median(step['trainer 1x1']):.0f}/s, 2x1 {2 * b / median(step['trainer 2x1']):.0f}/s; "
            f"efficiency {median(scaling) / 2:.0%} (ideal ratio 2.0)"),
        row("threads: samples/s 1 rank x 2 threads / 1 rank x 1 thread", per_round("trainer 1x1", "trainer 1x2"),
            f"1x2 {b / median(step['trainer 1x2']):.0f}/s"),
        row("data wait fraction per step, built-in dataset (1 rank x 2 threads)", waits,
            "time in next(batch) / step time, trainer's own metric", "< 0.05", median(waits) < 0.05),
        row("time to first step: trainbox / bare loop (2 ranks, from launch)", ttfs,
            f"trainbox {median([r['first_step_s'] for r in results['trainer 2x1']]):.1f} s, bare "
            f"{median([r['first_step_s'] for r in results['bare 2x1']]):.1f} s"),
    ]
    exactness = [
        row("--deterministic: default step / deterministic step (2 ranks x 1 thread; both resume bit-exactly)",
            per_round("trainer 2x1", "deterministic 2x1"),
            f"default {ms['trainer 2x1']:.1f} ms, --deterministic {ms['deterministic 2x1']:.1f} ms per step; "
            f"< 1: the cost of deterministic kernels and the rank-ordered gradient gather"),
        row("settling DDP's buckets: the one-time pass per attempt / one default step (2 ranks x 1 thread)", settle,
            f"{1000 * median([res['settle_s'] for res in results['trainer 2x1']]):.1f} ms once per start, resume "
            f"or restart; the steps after it are the default step above"),
    ]
    recipe = [
        row("--model-ema (every step): plain step / step with the EMA update (2 ranks x 1 thread)",
            per_round("trainer 2x1", "ema 2x1"),
            f"plain {ms['trainer 2x1']:.1f} ms, with EMA {ms['ema 2x1']:.1f} ms per step"),
        row("--mixup-alpha/--cutmix-alpha: plain step / step with MixUp or CutMix (2 ranks x 1 thread)",
            per_round("trainer 2x1", "mix 2x1"),
            f"plain {ms['trainer 2x1']:.1f} ms, with MixUp/CutMix {ms['mix 2x1']:.1f} ms per step"),
    ]
    chart = {"1 rank x 1 thread": b / median(step["trainer 1x1"]),
             "1 rank x 2 threads": b / median(step["trainer 1x2"]),
             "2 ranks x 1 thread": 2 * b / median(step["trainer 2x1"]),
             "bare 2 ranks x 1 thread": 2 * b / median(step["bare 2x1"])}
    return loop, exactness, recipe, chart


def _comm_worker(rank: int, spec: dict) -> None:
    """DDP wrapper cost (1 rank) or exposed communication (2 ranks), blocks interleaved in-process."""
    _init(rank, spec["world"], spec["port"], spec["threads"])
    times = _comm_blocks(spec)  # returns with every DDP reducer gone, before its group is destroyed
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(times))
    destroy_and_leave_together()


def _comm_blocks(spec: dict) -> dict[str, list[float]]:
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
    # The ranks fork from a server that imported torch and this module once (the rows time blocks, not the start)
    start_fork_server(["train.bench.cpu"])
    for world, threads in ((1, 2), (2, 1)):
        spec = {"world": world, "threads": threads, "batch": size["batch"], "width": size["width"],
                "blocks": size["blocks"], "per_block": size["per_block"], "port": free_port(),
                "out": str(out / f"comm-{world}.json")}
        mp.start_processes(_comm_worker, args=(spec,), nprocs=world, start_method="forkserver")
        results[world] = json.loads(Path(spec["out"]).read_text())
    one, two = results[1], results[2]
    wrapper = [p / d for p, d in zip(one["plain"], one["ddp"], strict=True)]
    view = [c / d for c, d in zip(one["ddp_copy"], one["ddp"], strict=True)]
    fused = [lp / d for lp, d in zip(one["loop"], one["ddp"], strict=True)]
    fused_alone = [lp / f for lp, f in zip(one["opt_loop"], one["opt_fused"], strict=True)]
    compute = [n / s for n, s in zip(two["no_sync"], two["ddp"], strict=True)]
    static = [d / g for d, g in zip(two["ddp"], two["static"], strict=True)]
    exposed = [max(0.0, s - n) / a for s, n, a in zip(two["ddp"], two["no_sync"], two["allreduce"], strict=True)]

    def ms(v):
        return 1000 * median(v)

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


def checkpoint_rows(out: Path, size: dict, rounds: int) -> list[dict]:
    """The trainer's save (stream + CRC32 + fsync + sidecar + rename + prune) vs writing the same bytes raw."""

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
