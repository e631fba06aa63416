"""What a run leaves in its directory: config, manifest, status, metrics.jsonl, TensorBoard, model.pt."""

import json
import os
import platform
import shutil
import subprocess

import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import DEBUG, PEAKED, REPO, assert_bit_identical, metrics, python_cmd, run, status, torchrun_cmd
from train.cli import parse_config
from train.components.models import build_model
from train.report.hardware import mkl_reproducible


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("outputs") / "run"
    proc = run(torchrun_cmd(2, *DEBUG, "--run-dir", run_dir, "--seed", 5))
    return run_dir, proc


def test_layout(torchrun_run):
    run_dir, _ = torchrun_run
    names = {p.name for p in run_dir.iterdir()}
    assert {"config.json", "manifest.json", "status.json", "metrics.jsonl", "train.log", "model.pt",
            "checkpoints", "tensorboard"} <= names


def test_saved_config_is_the_resolved_one_and_runs_the_run_again(torchrun_run, tmp_path):
    """config.json is the settings as resolved, and given to --config it trains the same run again: here through
    another launcher (--spawn 2 against torchrun's 2 workers), into another folder, bit for bit."""
    run_dir, _ = torchrun_run
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved == parse_config([*DEBUG, "--run-dir", str(run_dir), "--seed", "5"]).to_dict()
    run(python_cmd("--config", run_dir / "config.json", "--run-dir", tmp_path / "again", "--spawn", 2))
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == {
        **saved, "run_dir": str(tmp_path / "again"), "spawn": 2}
    assert_bit_identical(run_dir, tmp_path / "again")


def test_manifest_records_what_made_the_run(torchrun_run):
    run_dir, _ = torchrun_run
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["launcher"] == "torchrun"
    assert manifest["world_size"] == 2 and len(manifest["hostnames"]) == 2
    assert manifest["seed"] == 5
    assert manifest["torch"] == torch.__version__
    assert len(manifest["git_commit"]) == 40 and isinstance(manifest["git_dirty"], bool)
    assert manifest["git_commit"] == subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                                    text=True).stdout.strip()
    assert manifest["python"] == platform.python_version() and manifest["cuda"] == torch.version.cuda
    assert manifest["cudnn"] == (torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
    assert (manifest["backend"], manifest["device"], manifest["local_world_size"]) == ("gloo", "cpu", 2)
    assert manifest["threads"] >= 1 and manifest["deterministic"] is False and manifest["resumed_from_step"] is None
    assert manifest["onednn_deterministic"] is True  # and MKL's mode took (None: this torch has no MKL to read)
    assert manifest["mkl_reproducible"] is (None if mkl_reproducible() is None else True)
    # What the environment says (make exports TRAINBOX_IMAGE; the container sets both), and outside a Slurm job
    # and a GPU host these say so, rather than something made up
    assert (manifest["image"], manifest["image_digest"]) == (os.environ.get("TRAINBOX_IMAGE"),
                                                              os.environ.get("TRAINBOX_IMAGE_DIGEST"))
    assert manifest["slurm_job_id"] is None
    if not torch.cuda.is_available():
        assert (manifest["nccl"], manifest["gpus"]) == (None, [])
        assert manifest["driver"] is None or isinstance(manifest["driver"], str)  # a driver without a GPU


def test_metrics_jsonl_has_train_and_eval_lines(torchrun_run):
    run_dir, _ = torchrun_run
    train = metrics(run_dir, "train")
    assert [m["step"] for m in train] == [10, 20, 30, 40]
    for m in train:
        assert m["loss"] > 0 and m["samples_per_s"] > 0 and 0 <= m["data_wait_frac"] < 1 and m["lr"] > 0
    evals = metrics(run_dir, "eval")
    assert [m["step"] for m in evals] == [20, 40]
    assert all(m["samples"] == 256 for m in evals)  # the whole validation set, each sample once
    assert status(run_dir)["val_accuracy"] == evals[-1]["accuracy"]


def test_tensorboard_files_hold_the_logged_scalars(torchrun_run):
    run_dir, _ = torchrun_run
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/samples_per_s", "train/data_wait_frac", "eval/accuracy"} <= tags
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    logged = [(m["step"], m["loss"]) for m in metrics(run_dir, "train")]
    assert [s for s, _ in loss] == [s for s, _ in logged]
    assert [v for _, v in loss] == pytest.approx([v for _, v in logged], rel=1e-6)


def test_model_pt_is_the_unwrapped_state_dict(torchrun_run):
    run_dir, _ = torchrun_run
    state = torch.load(run_dir / "model.pt", weights_only=True)
    assert not any(k.startswith("module.") for k in state)
    model = build_model(parse_config(DEBUG).model, 10)
    model.load_state_dict(state)  # loads into a plain model, strictly


def test_only_rank_zero_prints_progress(torchrun_run):
    _, proc = torchrun_run
    assert proc.stderr.count("done: ") == 1
    assert "[rank 1]" not in proc.stderr


def test_rerunning_a_finished_run_changes_nothing(tmp_path):
    """Nor does a torchrun restart after a worker was lost at shutdown: the run's figures stand."""
    run_dir = tmp_path / "run"
    cmd = python_cmd(*DEBUG, "--spawn", 2, "--max-steps", 10, "--run-dir", run_dir)
    run(cmd)
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file()}
    again = run(cmd)
    assert "already finished at step 10" in again.stderr
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file()} == before
    longer = run(python_cmd(*DEBUG, "--spawn", 2, "--max-steps", 14, "--run-dir", run_dir))  # trains on
    assert "resumed from" in longer.stderr and "step 10 of 14" in longer.stderr and status(run_dir)["step"] == 14


def test_a_torchvision_model_with_sgd_and_channels_last_trains(tmp_path):
    run_dir = tmp_path / "run"
    run(python_cmd(*DEBUG, "--model", "resnet18", "--optimizer", "sgd", "--channels-last", "--max-steps", 6,
                   "--log-every", 2, "--warmup-steps", 2, "--run-dir", run_dir))
    state = torch.load(run_dir / "model.pt", weights_only=True)
    assert "layer4.1.bn2.running_mean" in state and state["fc.weight"].shape[0] == 10  # resnet18, 10 classes
    train = metrics(run_dir, "train")
    assert [m["step"] for m in train] == [2, 4, 6] and all(m["loss"] == m["loss"] for m in train)  # not NaN
    optimizer = torch.load(run_dir / "checkpoints" / "step_00000006.pt", weights_only=True)["optimizer"]
    assert set(optimizer["param_groups"][0]) >= {"momentum", "nesterov", "dampening"}  # what was built: SGD
    assert "exp_avg" not in str(optimizer["state"])  # no AdamW moments


def _image_folder(root, classes=("cat", "dog", "eel"), per_class=12, size=20):
    g = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for c, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                pixels = (torch.rand(size, size, 3, generator=g) * 60 + c * 80).to(torch.uint8).numpy()
                Image.fromarray(pixels).save(folder / f"{i}.png")


def _pool_of_links(folder, pool, data):
    """data/{train,val}/<class>/N.png as links into one flat pool of the folder's images (pool/<split>-<class>-N.png),
    and val/eel a link to a folder of the pool: the layout of a NAS whose dataset folders are made of one pool."""
    pool.mkdir()
    for image in sorted(folder.rglob("*.png")):
        split, name = image.parent.parent.name, image.parent.name
        if (split, name) == ("val", "eel"):
            shutil.copytree(image.parent, pool / "eels", dirs_exist_ok=True)
            continue
        shutil.copy(image, pool / f"{split}-{name}-{image.name}")
        link = data / split / name / image.name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(pool / f"{split}-{name}-{image.name}", link.parent))
    (data / "val" / "eel").symlink_to(pool / "eels")


def test_an_imagefolder_of_links_into_one_pool_trains_with_loader_workers(tmp_path):
    _image_folder(tmp_path / "folder")
    _pool_of_links(tmp_path / "folder", tmp_path / "pool", tmp_path / "data")
    run_dir = tmp_path / "run"
    run(python_cmd(*DEBUG, "--dataset", "imagefolder", "--data-dir", tmp_path / "data", "--batch-size", 4,
                   "--num-workers", 2, "--max-steps", 12, "--run-dir", run_dir))
    evals = metrics(run_dir, "eval")
    assert evals[-1]["samples"] == 36  # 3 classes x 12 val images, each counted once
    assert json.loads((run_dir / "plan.json").read_text())["train_samples"] == 36
    assert (run_dir / "model.pt").is_file()


def test_best_pt_holds_the_best_evaluation_and_the_figures_include_top5(tmp_path):
    """best.pt: the evaluation with the highest top-1 (the earlier of a tie), its model bit for bit the one
    evaluated (the checkpoint of the same step), named in status.json; top-5 beside top-1 (10 classes). The run
    peaks before its end, so the best evaluation is not the last."""
    run_dir = tmp_path / "run"
    run(python_cmd(*PEAKED, "--eval-every", 5, "--save-every", 5, "--keep-checkpoints", 20, "--run-dir", run_dir))
    evals = metrics(run_dir, "eval")
    assert [m["step"] for m in evals] == list(range(5, 41, 5)) and all(m["top5"] >= m["accuracy"] for m in evals)
    top = max(m["accuracy"] for m in evals)
    expected = next(m for m in evals if m["accuracy"] == top)  # the first of the best
    assert expected["step"] < evals[-1]["step"] and top > evals[-1]["accuracy"] + 0.05
    best = torch.load(run_dir / "best.pt", weights_only=True)
    assert (best["step"], best["val_accuracy"], best["val_top5"]) == (expected["step"], top, expected["top5"])
    saved = torch.load(run_dir / "checkpoints" / f"step_{expected['step']:08d}.pt", weights_only=True)["model"]
    assert saved.keys() == best["model"].keys() and all(torch.equal(saved[k], best["model"][k]) for k in saved)
    assert status(run_dir)["best"] == {"path": "best.pt", **{k: v for k, v in best.items() if k not in
                                                              ("model", "config")}}
