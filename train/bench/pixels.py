"""The segmentation row: --task segmentation's step against the tutorial loop on the same torchvision model."""

from __future__ import annotations

from pathlib import Path

from train.bench.arms import interleaved, median, row


def segmentation_bare(size: dict) -> dict:
    """The segmentation row's bare loop: the tutorial's on LRASPP and the shapes' masks, 2 ranks x 1 thread."""
    return {"world": 2, "threads": 1, "samples": size["samples"], "image_size": 32, "batch": size["batch"],
            "steps": size["steps"], "window": size["window"], "task": "segmentation"}


def segmentation_rows(out: Path, size: dict, rounds: int) -> list[dict]:
    """--task segmentation's step against the tutorial loop on the same model (torchvision's LRASPP), the shapes'
    masks, batch and threads, 2 ranks x 1 thread, interleaved."""
    w = size["window"]
    trainer = ["--task", "segmentation", "--max-steps", size["steps"], "--log-every", w, "--eval-every", 0,
               "--save-every", 10**6, "--grad-clip", 0, "--train-samples", size["samples"], "--val-samples", 64,
               "--batch-size", size["batch"], "--spawn", 2, "--threads", 1]
    ratios, steps = interleaved(out, "segmentation", trainer, segmentation_bare(size), rounds, size["warmup"])
    b = size["batch"]
    return [row("segmentation step: bare loop step / trainbox step (lraspp_mobilenet_v3_large, 2 ranks x 1 thread)",
                ratios, f"bare {1000 * median(steps['bare']):.1f} ms, trainbox {1000 * median(steps['trainbox']):.1f} "
                f"ms per step of 2x{b} shapes masks at 32 px", ">= 0.97", median(ratios) >= 0.97)]
