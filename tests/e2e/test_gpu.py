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
    run(python_cmd(*DEBUG, "--precision", "fp16", "--run-dir", run_dir))
    assert (run_dir / "model.pt").is_file()


def test_make_gpus_above_visible_is_one_line():
    visible = torch.cuda.device_count()
    proc = run(["make", "--no-print-directory", "train", "RUNTIME=local", f"GPUS={visible + 1}"], expect=2, cwd=REPO)
    expected = f"GPUS={visible + 1} but {visible} GPU(s) visible: set GPUS<={visible} or CUDA_VISIBLE_DEVICES"
    assert expected in proc.stderr
