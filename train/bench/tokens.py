"""The language model's row: --task lm's step against nanoGPT's loop on the same GPT, windows, batch and threads."""

from __future__ import annotations

from pathlib import Path

from train.bench.arms import interleaved, median, row
from train.components.gpt import SIZES


def lm_rows(out: Path, size: dict, rounds: int) -> list[dict]:
    """--task lm's step (gpt-tiny on --dataset copy, tokens/s in its log) against nanoGPT's training loop on the
    same model and the same windows held in memory, 2 ranks x 1 thread, interleaved."""
    w, model = size["window"], "gpt-tiny"
    context = SIZES[model].context
    trainer = ["--task", "lm", "--model", model, "--max-steps", size["steps"], "--log-every", w, "--eval-every", 0,
               "--save-every", 10**6, "--grad-clip", 0, "--train-samples", size["lm_samples"], "--val-samples", 16,
               "--batch-size", size["lm_batch"], "--spawn", 2, "--threads", 1]
    bare = {"world": 2, "threads": 1, "samples": size["lm_samples"], "context": context, "model": model,
            "batch": size["lm_batch"], "steps": size["steps"], "window": w, "task": "lm"}
    ratios, steps = interleaved(out, "lm", trainer, bare, rounds, size["warmup"])
    b = size["lm_batch"]
    return [row(f"language model step: nanoGPT's loop step / trainbox step ({model}, 2 ranks x 1 thread)", ratios,
                f"nanoGPT loop {1000 * median(steps['bare']):.1f} ms, trainbox {1000 * median(steps['trainbox']):.1f} "
                f"ms per step of 2x{b} windows of {context} tokens", ">= 0.97", median(ratios) >= 0.97)]
