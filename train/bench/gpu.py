"""The GPU rows (where CUDA is visible): ResNet-50 through the trainer against the bare loop, and one knob
changed at a time."""

from __future__ import annotations

from pathlib import Path

import torch

from train.bench import GPU_KNOBS
from train.bench.arms import bare_arm, drain, median, row, trainer_arm
from train.bench.photos import make_photos
from train.cli import parse_config
from train.loading import build_train_loader, default_num_workers, sampling


# ---------------------------------------------------------------- GPU rows



def gpu_base(size: dict) -> list:
    """The GPU rows' run: ResNet-50, 224 px, synthetic images on the device, bf16, channels_last, one GPU."""
    return ["--spawn", 1, "--dataset", "synthetic", "--model", "resnet50", "--image-size", 224,
            "--batch-size", size["gpu_batch"], "--train-samples", 1024, "--val-samples", 128,
            "--max-steps", size["gpu_steps"], "--log-every", size["window"], "--eval-every", 0,
            "--save-every", 10**6, "--grad-clip", 0, "--precision", "bf16", "--channels-last"]


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

    cfg = parse_config(["--dataset", "imagefolder", "--batch-size", str(batch)])
    loader = build_train_loader(_HostImages(batch, batches + 1, size), sampling(cfg), cfg.data, 0, 1, pin_memory=pin)
    return drain(*loader, batches, device)


def on_files(base: list, data: Path) -> list:
    """The run of `base` on the ImageFolder `data`: a folder's size is its files', so the synthetic set's flags and
    their values go (the trainer refuses a flag that has no effect)."""
    synthetic_only = {"--dataset", "--train-samples", "--val-samples"}
    kept = [a for i, a in enumerate(base) if a not in synthetic_only and (i == 0 or base[i - 1] not in synthetic_only)]
    return [*kept, "--dataset", "imagefolder", "--data-dir", data]


def gpu_rows(out: Path, size: dict, rounds: int, only: list[str] = GPU_KNOBS) -> list[dict]:
    """ResNet-50, 224 px, synthetic data on the device, bf16 + channels_last, 1 GPU (DDP of 1)."""
    base = gpu_base(size)
    knobs = {"fp32 instead of bf16": ("fp32", ["--precision", "fp32"]),
             "without channels_last": ("no-channels-last", None),
             "torch.compile": ("compile", ["--compile"]),
             "bucket_cap_mb 100": ("bucket-cap-mb", ["--bucket-cap-mb", 100]),
             "static_graph": ("static-graph", ["--static-graph"]),
             "--model-ema (every step)": ("ema", ["--model-ema", "--model-ema-steps", 1]),
             "--mixup-alpha 0.2 --cutmix-alpha 1.0": ("mixup", ["--mixup-alpha", 0.2, "--cutmix-alpha", 1.0])}
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


def jpeg_rows(out: Path, size: dict, rounds: int) -> list[dict]:
    """The same ResNet-50 run on ImageNet-sized JPEG files (the trainer's default loader workers), decoded by
    the workers (--decode cpu) or on the GPU (--decode gpu), against synthetic images held on the device."""
    base = gpu_base(size)
    data = out / "photos-gpu"
    make_photos(data / "train", size["gpu_photos"], classes=100, seed=1)
    make_photos(data / "val", 100, classes=100, seed=2)
    files = on_files(base, data)
    ratios: dict[str, list[float]] = {"cpu": [], "gpu": []}
    waits: dict[str, list[float]] = {"cpu": [], "gpu": []}
    util: dict[str, list[float]] = {"cpu": [], "gpu": []}
    for r in range(rounds):
        synthetic = trainer_arm(out / "runs" / f"gpu-synthetic-{r}", base, size["warmup"])
        for decode in ("cpu", "gpu"):
            arm = trainer_arm(out / "runs" / f"gpu-jpeg-{decode}-{r}", [*files, "--decode", decode], size["warmup"])
            ratios[decode].append(median(synthetic["step_times"]) / median(arm["step_times"]))
            waits[decode].append(median(arm["data_wait"]))
            util[decode] += arm["gpu_util"]
    workers = default_num_workers(parse_config(["--dataset", "imagefolder"]).data)
    best = max(median(ratios["cpu"]), median(ratios["gpu"]))
    return [row(f"GPU images/s on JPEG files, --decode {decode} ({workers} loader workers) / synthetic on the device",
                ratios[decode], f"{size['gpu_photos']} photos of 500 x 375; data wait {median(waits[decode]):.2f} of "
                f"the step, NVML busy {median(util[decode]) if util[decode] else float('nan'):.0f}%",
                ">= 0.90 (better)", best >= 0.90) for decode in ("cpu", "gpu")]


