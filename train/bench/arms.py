"""The arms every row compares: the trainer itself (python -m train, timed by its own metrics) and the
bare loop of the PyTorch DDP tutorial on the same model, data, batch, threads and world size."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from train.cluster.distributed import destroy_and_leave_together, join_group
from train.cluster.identity import free_port
from train.components.gpt import SIZES as GPT_SIZES
from train.components.gpt import Gpt
from train.components.models import SmallCNN
from train.data import make_shape_masks, make_shapes, prepare_inputs
from train.files.rundir import read_metrics
from train.tasks.text import IGNORE, VOCAB, TextWindows

PY = sys.executable
REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- the bare loop (the reference arm)

def _init(rank: int, world: int, port: int, threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    join_group("gloo", rank, world)


def _bare_worker(rank: int, specs: list[dict]) -> None:
    """The tutorial's DDP loop of each spec in turn, in one process group (one spec but under --quick:
    bare_arms_at_once); rank 0 writes each one's per-window step times to its "out"."""
    _init(rank, specs[0]["world"], specs[0]["port"], specs[0]["threads"])
    for spec in specs:
        result = _bare_loop(rank, spec)  # its model and optimizer go as it returns: each DDP reducer goes while
        if rank == 0:  # every peer is still in the group (Trainer.release)
            Path(spec["out"]).write_text(json.dumps(result))
    destroy_and_leave_together()


def _bare_loop(rank: int, spec: dict) -> dict:
    """The tutorial's DDP loop on the trainer's model and in-memory data: its per-window step times and its first
    step's time from the launch."""
    world, started = spec["world"], spec["launched"]
    torch.manual_seed(0)
    if spec.get("task") == "segmentation":  # the tutorial loop on torchvision's LRASPP and the shapes' masks
        images, labels = make_shape_masks(spec["samples"], spec["image_size"], seed=1)
        labels = labels.long()
        model = DDP(torchvision.models.get_model("lraspp_mobilenet_v3_large", weights=None, weights_backbone=None,
                                                 num_classes=11))
        cross_entropy = nn.CrossEntropyLoss(ignore_index=255)

        def loss_fn(output, target):
            return cross_entropy(output["out"], target)
    elif spec.get("task") == "lm":  # nanoGPT's loop on the built-in GPT and the corpus's windows, held in memory
        images, labels = text_windows(Path(spec["corpus"]), spec["context"])
        model = Gpt(GPT_SIZES[spec["model"]], VOCAB)
        model = fsdp2(model, world) if spec.get("parallel") == "fsdp" else DDP(model)

        def loss_fn(logits, targets):  # nanoGPT's: the mean over the labelled tokens
            return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    else:
        images, labels = make_shapes(spec["samples"], spec["image_size"], seed=1)
        model = DDP(SmallCNN(10, spec["width"]))
        loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05, fused=True)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))[rank::world]
    per_step = len(order) // spec["batch"]
    times, first, window = [], None, time.perf_counter()
    for step in range(spec["steps"]):
        idx = order[(step % per_step) * spec["batch"]:(step % per_step + 1) * spec["batch"]]
        x, y = images[idx], labels[idx]
        if x.dtype == torch.uint8:
            x = x.float().div_(255).sub_(0.5).div_(0.25)
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        if first is None:
            first = time.time() - started
        if (step + 1) % spec["window"] == 0:
            times.append((time.perf_counter() - window) / spec["window"])
            window = time.perf_counter()
    return {"step_times": times, "first_step_s": first}


def fsdp2(model: Gpt, world: int) -> Gpt:
    """FSDP2 as its tutorial applies it: fully_shard on each transformer block, then on the root, over a CPU mesh of
    every rank (gloo), its defaults otherwise."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _bare_gpu(spec: dict) -> None:
    """The same loop on one GPU: ResNet-50, synthetic data already on the device, bf16, channels_last."""
    started = spec["launched"]
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    join_group("nccl", 0, 1, device_id=device)
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
    del model, optimizer  # the reducer goes while the group is still there (Trainer.release)
    destroy_and_leave_together()  # a rank exiting while a peer's gloo group lives can abort that peer


def text_windows(corpus: Path, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The training windows --task lm --dataset text cuts from the corpus's train/ (byte tokens), stacked: ids and
    targets, as nanoGPT's loop reads its token file."""
    windows = TextWindows(corpus, "train", context)
    ids, targets = zip(*(windows[i] for i in range(len(windows))), strict=True)
    return torch.stack(ids), torch.stack(targets)


def bare_main(spec_json: str) -> None:
    """--bare: one spec (bare_arm), or a list of them run in turn by the same ranks (bare_arms_at_once)."""
    spec = json.loads(spec_json)
    if isinstance(spec, dict) and spec.get("gpu"):
        _bare_gpu(spec)
    else:
        specs = spec if isinstance(spec, list) else [spec]
        mp.start_processes(_bare_worker, args=(specs,), nprocs=specs[0]["world"], start_method="spawn")


# ---------------------------------------------------------------- running arms

def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    return env


def run_timed(cmd: list[str], what: str) -> None:
    started = time.monotonic()
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"bench: {what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    print(f"bench: {time.monotonic() - started:5.1f} s  {what}", file=sys.stderr, flush=True)


def arm_dir(out: Path, tag: str, r: int) -> Path:
    """Where the trainer arm `tag` of round r runs (a row may read another's run: --quick)."""
    return out / "runs" / f"{tag}-{r}"


def trainer_arm(run_dir: Path, args: list, warmup: int) -> dict:
    """Run the trainer in an empty run dir; its own metrics give per-window step time, data wait and GPU use."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a reused --out would resume the old run and read its metrics
    launched = time.time()
    run_timed([PY, "-m", "train", *map(str, args), "--run-dir", str(run_dir)], f"trainer {' '.join(map(str, args))}")
    return arm_result(run_dir, warmup, launched)


def arm_result(run_dir: Path, warmup: int, launched: float | None = None) -> dict:
    """A trainer run's own metrics, the first `warmup` windows dropped; the time to its first step from `launched`
    (None without it)."""
    lines = read_metrics(run_dir, strict=True)
    train = [m for m in lines if m["kind"] == "train"][warmup:]
    first = next(m for m in lines if m["kind"] == "first_step")
    return {"step_times": [m["step_time_s"] for m in train], "data_wait": [m["data_wait_frac"] for m in train],
            "gpu_util": [m["gpu0_util"] for m in train if "gpu0_util" in m],
            "first_step_s": None if launched is None else first["time"] - launched, "settle_s": first["settle_s"]}


# The bare arms bare_arms_at_once ran, by their spec, until bare_arm asks for each (once)
_READY: dict[str, dict] = {}


def bare_arms_at_once(out: Path, specs: list[dict]) -> None:
    """--quick: the bare arms of `specs` in one launch (their ranks start and import once), each spec in turn in the
    same process group; bare_arm then hands back a spec's result instead of launching it, once. The specs share
    world and threads; the first one's time to its first step is from the launch, as bare_arm's."""
    if len({(spec["world"], spec["threads"]) for spec in specs}) != 1:
        raise ValueError("bare arms launched together share their world size and threads")
    port, launched = free_port(), time.time()
    runs = [{**spec, "out": str(out / f"bare-at-once-{i}.json"), "port": port, "launched": launched}
            for i, spec in enumerate(specs)]
    run_timed([PY, "-m", "train.bench", "--bare", json.dumps(runs)], f"the bare loop ({len(runs)} arms in turn)")
    for spec, ran in zip(specs, runs, strict=True):
        _READY[json.dumps(spec, sort_keys=True)] = json.loads(Path(ran["out"]).read_text())


def bare_arm(out: Path, spec: dict, warmup: int) -> dict:
    result = _READY.pop(json.dumps(spec, sort_keys=True), None)
    if result is None:
        spec = {**spec, "out": str(out), "port": free_port(), "launched": time.time()}
        run_timed([PY, "-m", "train.bench", "--bare", json.dumps(spec)], "the bare loop")
        result = json.loads(out.read_text())
    result["step_times"] = result["step_times"][warmup:]
    return result


def interleaved(out: Path, tag: str, trainer: list, bare: dict, rounds: int, warmup: int) -> tuple[list, dict]:
    """The trainer with `trainer`'s flags and the bare loop of `bare`, a run of each per round, interleaved: (the bare
    loop's median step over the trainer's, per round; each arm's median step per round)."""
    ratios, steps = [], {"bare": [], "trainbox": []}
    for r in range(rounds):
        steps["trainbox"].append(median(trainer_arm(arm_dir(out, tag, r), trainer, warmup)["step_times"]))
        steps["bare"].append(median(bare_arm(out / f"{tag}-bare-{r}.json", bare, warmup)["step_times"]))
        ratios.append(steps["bare"][-1] / steps["trainbox"][-1])
    return ratios, steps


def median(values) -> float:
    return statistics.median(values)


def row(name: str, ratio_per_round: list[float], detail: str, target: str = "", ok: bool | None = None) -> dict:
    return {"row": name, "ratio": median(ratio_per_round), "low": min(ratio_per_round),
            "high": max(ratio_per_round), "rounds": len(ratio_per_round), "detail": detail, "target": target,
            "meets_target": ok}


def drain(loader, sampler, batches: int, device: torch.device | None = None) -> tuple[int, float]:
    """(images, seconds) for `batches` batches of a train loader after its first (the workers' start);
    with a device, each batch is copied onto it as the trainer copies it, and the time includes the copies."""
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
