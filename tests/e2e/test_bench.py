"""`make bench` end to end at tiny sizes: every CPU row is measured and reported (table, JSON, PNG).
Its numbers are not checked against targets here: timing on shared machines belongs to the bench."""

import json
import math
import time

import pytest
import torch
from PIL import Image

from tests.helpers import make


CPU_ROWS = ("trainer overhead", "weak scaling", "threads", "data wait fraction per step, built-in",
            "time to first step", "DDP wrapper", "gradient_as_bucket_view",
            "fused AdamW", "communication: step without sync", "--deterministic: default step",
            "settling DDP's buckets", "--model-ema (every step)", "segmentation step", "language model step",
            "sharded step: a bare FSDP2 loop's step", "model state per worker: --parallel fsdp / ddp",
            "--mixup-alpha/--cutmix-alpha", "static_graph", "exposed communication",
            "input headroom, built-in", "input headroom, CIFAR-sized", "data wait fraction per step, CIFAR-sized",
            "persistent workers", "checkpoint save", "checkpoint load",
            "train pipeline, one loader worker", "eval pipeline, one loader worker",
            "packed shards: time to the first batch", "packed shards: samples/s over an epoch",
            "label file: images/s on one core", "WebDataset tars of another tool: images/s on one core",
            "Hugging Face dataset: images/s on one core",
            "label-file check",
            "camera-sized photos, train pipeline on one core: shards packed with MAX_SIDE=512 / loose originals",
            "make pack MAX_SIDE=512 of camera-sized photos: images/s with")


def test_make_bench_measures_and_reports_every_cpu_row(tmp_path):
    """--quick --rounds 1: every row once, at tiny sizes (a second round, interleaved, adds time and no row)."""
    out = tmp_path / "bench"
    proc = make("bench", f"BENCH_ARGS=--quick --rounds 1 --out {out}", timeout=900)
    report = json.loads((out / "bench.json").read_text())
    names = [r["row"] for r in report["rows"]]
    for prefix in CPU_ROWS:
        assert any(n.startswith(prefix) for n in names), f"row {prefix!r} missing"
    for r in report["rows"]:
        assert r["rounds"] >= 1 and r["low"] <= r["ratio"] <= r["high"] and math.isfinite(r["ratio"]) and \
            r["ratio"] >= 0, r
        assert r["row"] in proc.stdout  # the printed table carries every row
        if r["target"] and r["row"].startswith(CPU_ROWS):  # the verdict: the measured median against the target
            op, bound = r["target"].split()  # the CPU rows' targets: ">= x" or "< x"
            assert op in (">=", "<"), r
            assert r["meets_target"] == (r["ratio"] >= float(bound) if op == ">=" else r["ratio"] < float(bound)), r
            assert f"{r['row']}{' ok' if r['meets_target'] else ' MISSED'}\n" in proc.stdout, r
    settle = next(r for r in report["rows"] if r["row"].startswith("settling DDP's buckets"))
    assert settle["low"] > 0, settle  # 2 ranks: the attempt made its settling pass, and it was timed
    targets = {r["row"].split(":")[0]: r["target"] for r in report["rows"] if r["target"]}
    assert targets["trainer overhead"] == ">= 0.97" and targets["checkpoint save"] == ">= 0.7"
    assert targets["train pipeline, one loader worker"] == ">= 1.8"
    photos = sorted((out / "photos").rglob("*.jpg"))
    assert len(photos) == 24
    with Image.open(photos[0]) as photo:  # ImageNet-sized JPEGs, cut from real photographs
        assert photo.format == "JPEG" and sorted(photo.size) == [375, 500]
    camera = sorted((out / "camera").rglob("*.jpg"))
    assert len(camera) == 6  # 4 to train on, 2 to validate
    with Image.open(camera[0]) as photo:  # a camera's size, and packed to 512 px for the row that compares them
        assert photo.format == "JPEG" and 3000 <= max(photo.size) <= 4000
    assert json.loads((out / "camera-512-1" / "index.json").read_text())["max_side"] == 512
    with Image.open(out / "scaling.png") as chart:
        assert chart.format == "PNG" and chart.size[0] > 300
    assert set(report["scaling_samples_per_s"]) >= {"1 rank x 1 thread", "2 ranks x 1 thread"}


def test_bench_refuses_a_single_round(tmp_path):
    """A single round reports no spread: refused but for --quick, which only checks that every row runs."""
    proc = make("bench", f"BENCH_ARGS=--rounds 1 --out {tmp_path}", expect=2)
    assert "error: --rounds must be at least 2" in proc.stderr and "(--quick alone takes --rounds 1" in proc.stderr


def test_bench_refuses_unknown_gpu_knobs(tmp_path):
    proc = make("bench", f"BENCH_ARGS=--gpu-knobs fp32,warp-drive --out {tmp_path}", expect=2)
    assert "error: unknown --gpu-knobs warp-drive: pick from fp32," in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_gpu_only_without_a_gpu_is_one_line(tmp_path):
    proc = make("bench", f"BENCH_ARGS=--gpu-only --out {tmp_path}", expect=2)
    assert "error: --gpu-only needs a CUDA GPU and none is visible" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_bench_arm_run_twice_in_one_folder_measures_the_second_run(tmp_path):
    """A reused --out must not resume the first run and hand back its metrics."""
    from train.bench.arms import trainer_arm

    args = ["--preset", "debug", "--max-steps", 4, "--log-every", 1, "--eval-every", 0]
    for _ in range(2):
        started = time.monotonic()
        result = trainer_arm(tmp_path / "arm", args, warmup=0)
        # The first step of this run, not of the one before: after its launch and within the call.
        assert 0 < result["first_step_s"] <= time.monotonic() - started, result
        assert len(result["step_times"]) == 4, result


def test_the_pinned_memory_row_counts_every_batch_it_delivers():
    """The GPU row's loader arm, run on the CPU: the trainer's loader and copy deliver every batch asked for."""
    from train.bench.gpu import host_to_device

    images, seconds = host_to_device(False, batch=8, batches=3, size=32, device=torch.device("cpu"))
    assert images == 24 and seconds > 0
