"""The language model's row: --task lm's step against nanoGPT's loop on the same GPT, windows, batch and threads."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from train.bench.arms import PY, arm_dir, interleaved, median, row, run_timed
from train.components.gpt import SIZES
from train.files.rundir import read_metrics
from train.tasks.text import LETTERS, CopyChain

FILES = 16  # the corpus's train/ files; val/ holds one
MODEL = "gpt-tiny"  # the language model rows' (and --quick's model state per worker)
TAGS = {"ddp": "lm", "fsdp": "lm-fsdp"}  # the rows' trainer arms (arm_dir), by --parallel


def lm_bare(out: Path, size: dict) -> list[dict]:
    """The language model rows' bare loops, nanoGPT's (DDP) and FSDP2's, 2 ranks x 1 thread, on the corpus (made
    here, once)."""
    context = SIZES[MODEL].context
    corpus = write_corpus(out / "lm-corpus", size["lm_samples"] * context)
    bare = {"world": 2, "threads": 1, "corpus": str(corpus), "context": context, "model": MODEL,
            "batch": size["lm_batch"], "steps": size["steps"], "window": size["window"], "task": "lm"}
    return [bare, {**bare, "parallel": "fsdp"}]


def lm_rows(out: Path, size: dict, rounds: int) -> list[dict]:
    """--task lm's step (gpt-tiny on --dataset text, tokens/s in its log) against nanoGPT's training loop on the
    same model and the same windows held in memory, 2 ranks x 1 thread, interleaved. The corpus (write_corpus's text
    files) is read as a team's own: windows cut from tokens held in memory, as nanoGPT reads its token file, where
    --dataset copy would draw each window with its Markov chain in a loader worker. And the same under --parallel fsdp
    against FSDP2's own loop (fully_shard per block, then the root)."""
    w, model = size["window"], MODEL
    context = SIZES[model].context
    bare, fsdp_bare = lm_bare(out, size)
    trainer = ["--task", "lm", "--model", model, "--dataset", "text", "--data-dir", bare["corpus"],
               "--max-steps", size["steps"], "--log-every", w, "--eval-every", 0, "--save-every", 10**6,
               "--grad-clip", 0, "--batch-size", size["lm_batch"], "--spawn", 2, "--threads", 1]
    ratios, steps = interleaved(out, TAGS["ddp"], trainer, bare, rounds, size["warmup"])
    sharded, fsdp = interleaved(out, TAGS["fsdp"], [*trainer, "--parallel", "fsdp"], fsdp_bare, rounds,
                                size["warmup"])
    b = size["lm_batch"]
    ms = {name: 1000 * median(times) for name, times in (*steps.items(), *(("fsdp " + k, v) for k, v in fsdp.items()))}
    return [row(f"language model step: nanoGPT's loop step / trainbox step ({model}, 2 ranks x 1 thread)", ratios,
                f"nanoGPT loop {ms['bare']:.1f} ms, trainbox {ms['trainbox']:.1f} ms per step of 2x{b} windows of "
                f"{context} tokens (--dataset text)", ">= 0.97", median(ratios) >= 0.97),
            row(f"sharded step: a bare FSDP2 loop's step / trainbox --parallel fsdp step ({model}, 2 ranks x 1 "
                f"thread)", sharded, f"bare FSDP2 loop {ms['fsdp bare']:.1f} ms, trainbox {ms['fsdp trainbox']:.1f} ms "
                f"per step (fully_shard per block, then the root; the same windows)", ">= 0.97",
                median(sharded) >= 0.97)]


def sharding_rows(out: Path, size: dict) -> list[dict]:
    """The model's state each worker holds (its parameters, their gradients and AdamW's moments, as the trainer
    measures them at its first step: metrics.jsonl's model_state_mib), --parallel fsdp against ddp on as many workers:
    gpt-small on 2 and 4 workers, DDP on 1 too (--quick: gpt-tiny on 2, read from the language model rows' first
    runs, the same model on 2 workers under each --parallel: the state depends on neither batch nor data). A measure
    of tensors, not of time: one round."""
    model = MODEL if size["quick"] else "gpt-small"
    worlds = (2,) if size["quick"] else (1, 2, 4)
    held = {}
    for kind, world in [("ddp", w) for w in worlds] + [("fsdp", w) for w in worlds if w > 1]:
        run_dir = arm_dir(out, TAGS[kind], 0)
        if not (size["quick"] and (run_dir / "metrics.jsonl").is_file()):
            run_dir = out / f"held-{kind}-{world}"
            shutil.rmtree(run_dir, ignore_errors=True)
            args = ["--task", "lm", "--model", model, "--parallel", kind, "--max-steps", 1, "--batch-size", 1,
                    "--train-samples", 16, "--val-samples", 4, "--log-every", 1, "--num-workers", 0,
                    *(["--spawn", world] if world > 1 else []), "--run-dir", run_dir]
            run_timed([PY, "-m", "train", *map(str, args)],
                      f"trainer --parallel {kind} on {world} ({model}: its state)")
        held[kind, world] = next(m["model_state_mib"] for m in read_metrics(run_dir, strict=True)
                                 if m["kind"] == "first_step")
    shown = ", ".join(f"{kind} on {world}: {mib:.1f} MiB" for (kind, world), mib in held.items())
    return [row(f"model state per worker: --parallel fsdp / ddp ({model}, {world} workers)",
                [held["fsdp", world] / held["ddp", world]], shown, "<= 0.35" if world == 4 else "",
                held["fsdp", world] / held["ddp", world] <= 0.35 if world == 4 else None)
            for world in worlds if world > 1]


def write_corpus(folder: Path, tokens: int) -> Path:
    """A text folder of about `tokens` bytes in train/ (FILES files) and a small val/: words of the copy documents'
    letters (seed 0), each followed by "|" and itself, one a line; made once, kept."""
    if not (folder / "val" / "0.txt").is_file():
        chain, rng = CopyChain(0), random.Random(0)
        for split, count, size in (("train", FILES, tokens // FILES), ("val", 1, 4096)):
            (folder / split).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                text = bytearray()
                while len(text) < size:
                    length = rng.randint(3, 10)
                    word = bytes(LETTERS[rng.choices(range(len(LETTERS)), chain.start)[0]] for _ in range(length))
                    text += word + b"|" + word + b"\n"
                (folder / split / f"{i}.txt").write_bytes(bytes(text))
    return folder
