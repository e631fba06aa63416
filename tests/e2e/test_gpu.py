"""GPU behaviour: runs only where CUDA is visible (skipped on CPU-only machines and in CI)."""

import json

import pytest
import torch

from tests.helpers import DEBUG, REPO, metrics, python_cmd, run, torchrun_cmd

pytestmark = pytest.mark.gpu


def test_single_gpu_bf16_channels_last(tmp_path):
    run_dir = tmp_path / "run"
    run(python_cmd(*DEBUG, "--device", "cuda", "--precision", "bf16", "--channels-last", "--run-dir", run_dir))
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["device"] == "cuda:0" and manifest["gpus"] and manifest["driver"]
    log = (run_dir / "train.log").read_text()
    assert "precision bfloat16" in log  # the autocast dtype the trainer chose
    assert log.count("note: on CUDA, a resumed or restarted run equals an uninterrupted one bit for bit only "
                     "with --deterministic") == 1  # said once, at the start
    convs = [t for t in torch.load(run_dir / "model.pt", weights_only=True).values() if t.dim() == 4]
    assert convs and all(t.is_contiguous(memory_format=torch.channels_last) for t in convs)  # saved as trained
    train = metrics(run_dir, "train")
    assert "gpu0_util" in train[-1] and train[-1]["gpu0_mem_mib"] > 0
    assert metrics(run_dir, "eval")[-1]["samples"] == 256


def test_torchrun_uses_nccl_on_gpus(tmp_path):
    run_dir = tmp_path / "run"
    run(torchrun_cmd(torch.cuda.device_count(), *DEBUG, "--run-dir", run_dir))
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["backend"] == "nccl" and manifest["world_size"] == torch.cuda.device_count()


def test_fp16_with_grad_scaler_resumes(tmp_path):
    run_dir = tmp_path / "run"
    run(python_cmd(*DEBUG, "--precision", "fp16", "--run-dir", run_dir, "--stop-at", 15), expect=75)
    proc = run(python_cmd(*DEBUG, "--precision", "fp16", "--run-dir", run_dir))
    assert "step_00000015.pt (step 15 of" in proc.stderr + proc.stdout  # resumed from the stop's checkpoint
    assert json.loads((run_dir / "status.json").read_text())["state"] == "done" and (run_dir / "model.pt").is_file()


def test_torchrun_with_more_workers_than_gpus_is_one_line_and_the_workers_exit_2(tmp_path):
    visible = torch.cuda.device_count()
    proc = run(torchrun_cmd(visible + 1, *DEBUG, "--run-dir", tmp_path / "run"), expect=1)  # torchrun's own code
    assert f"error: {visible + 1} workers on this node but {visible} GPU(s) visible" in proc.stderr
    assert "exitcode  : 2" in proc.stderr  # the workers' code, in torchrun's failure report


def test_make_gpus_above_visible_is_one_line():
    visible = torch.cuda.device_count()
    proc = run(["make", "--no-print-directory", "train", "RUNTIME=local", f"GPUS={visible + 1}"], expect=2, cwd=REPO)
    expected = f"GPUS={visible + 1} but {visible} GPU(s) visible: set GPUS<={visible} or CUDA_VISIBLE_DEVICES"
    assert expected in proc.stderr


def test_gpu_decode_trains_and_matches_the_cpu_decode_within_a_level(tmp_path):
    """nvJPEG and libjpeg-turbo round differently (IDCT, chroma upsampling): on average the two batches
    are within a level (mean difference < 2 of 255); the crops and flips are the same draws, and another
    draw (the next epoch's batch) differs by far more, so the check can see a wrong crop or flip."""
    from train.bench.photos import make_photos

    for split, count in (("train", 64), ("val", 16)):
        make_photos(tmp_path / "data" / split, count, classes=4, seed=len(split))
    common = ["--dataset", "imagefolder", "--data-dir", str(tmp_path / "data"), "--image-size", "128",
              "--batch-size", "8", "--num-workers", "2"]
    loaded, loader, sampler = first_batches(common)
    assert loaded["gpu"].device.type == "cuda" and loaded["gpu"].shape == loaded["cpu"].shape
    difference = (loaded["gpu"].float() - loaded["cpu"].float()).abs()
    assert difference.mean() < 2, difference.mean()
    sampler.set_epoch(1)  # the control: the next epoch's batch (other samples, crops and flips)
    other = next(iter(loader))[0].to("cuda")
    assert (other.float() - loaded["gpu"].float()).abs().mean() > 10 * max(difference.mean(), 0.1)
    run_dir = tmp_path / "run"
    run(python_cmd(*common, "--decode", "gpu", "--max-steps", 20, "--model", "resnet18", "--run-dir", run_dir))
    assert metrics(run_dir, "eval")[-1]["samples"] == 16


def overwritten(decode, rounds: int = 20, files: int = 8) -> int:
    """How many of the training stream's queued reads saw their input overwritten by a decode: each round frees 16
    image-sized blocks on the stream while a long kernel holds the reductions that read them, decodes a batch of
    512 px JPEGs with decode(data, device), then counts the reductions that no longer see all ones."""
    from torchvision.io import encode_jpeg

    g = torch.Generator().manual_seed(0)
    jpegs = [encode_jpeg(torch.randint(0, 256, (3, 512, 512), dtype=torch.uint8, generator=g)) for _ in range(files)]
    device, wrong = torch.device("cuda"), 0
    for _ in range(rounds):
        held = [torch.ones(3, 512, 512, dtype=torch.uint8, device=device) for _ in range(16)]
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # the stream busy for about 0.1 s: the sums below wait behind it
        sums = [t.sum(dtype=torch.int64) for t in held]
        del held  # freed on the stream while their sums are still queued: the allocator may hand them out again
        decode(jpegs, device)
        torch.cuda.synchronize()
        wrong += sum(int(s) != 3 * 512 * 512 for s in sums)
    return wrong


def test_gpu_decode_never_writes_into_memory_the_step_still_reads():
    """--decode gpu decodes on a stream of its own (train/data/decode.py's device_decode): torchvision's decode_jpeg
    on the training stream writes into blocks that kernels queued there still read (pytorch/vision#9606), which made
    make bench's --decode gpu arm diverge on an H200. Decoded through decode_batch, no queued read is disturbed."""
    from train.data.decode import decode_batch

    def batch(jpegs, device):
        decode_batch(jpegs, [f"{i}.jpg" for i in range(len(jpegs))], list(range(len(jpegs))), lambda x: x, device)

    assert overwritten(batch) == 0


def test_a_recipe_with_gpu_decode_augments_as_the_cpu_path_and_resumes_exactly(tmp_path):
    """--decode gpu with TrivialAugmentWide and the repeated-augmentation sampler: the same draws as the CPU
    path per sample (the batches within a level, as the plain decode), and a recipe run (random erasing,
    Mixup/CutMix, EMA on the device) stopped and resumed under --deterministic equals the uninterrupted one."""
    from train.bench.photos import make_photos

    for split, count in (("train", 256), ("val", 16)):
        make_photos(tmp_path / "data" / split, count, classes=4, seed=len(split))
    common = ["--dataset", "imagefolder", "--data-dir", str(tmp_path / "data"), "--image-size", "128",
              "--batch-size", "8", "--num-workers", "2", "--auto-augment", "ta_wide", "--ra-reps", "2"]
    loaded, _, _ = first_batches(common)
    assert (loaded["gpu"].float() - loaded["cpu"].float()).abs().mean() < 2
    args = [*common, "--decode", "gpu", "--deterministic", "--max-steps", 24, "--save-every", 8, "--eval-every", 0,
            "--model-ema", "--model-ema-steps", 2, "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0",
            "--random-erase", "0.25", "--label-smoothing", "0.1"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(python_cmd(*args, "--run-dir", straight))
    run(python_cmd(*args, "--run-dir", resumed, "--stop-at", 13), expect=75)
    run(python_cmd(*args, "--run-dir", resumed))
    for name in ("model.pt", "model_ema.pt"):
        assert (straight / name).read_bytes() == (resumed / name).read_bytes(), name


def first_batches(common: list[str]) -> tuple[dict, object, object]:
    """The first training batch of epoch 0 on the CPU path and on --decode gpu, on the GPU; and the GPU
    path's loader and sampler, for a control draw."""
    from train.cli import parse_config
    from train.data import build_datasets
    from train.loading import build_train_loader, sampling

    loaded = {}
    for decode in ("cpu", "gpu"):
        cfg = parse_config([*common, "--decode", decode])
        train_set, _, _ = build_datasets(cfg)
        loader, sampler = build_train_loader(train_set, sampling(cfg), cfg.data, 0, 1, False, torch.device("cuda"))
        sampler.set_epoch(0)
        loaded[decode] = next(iter(loader))[0].to("cuda")
    return loaded, loader, sampler
