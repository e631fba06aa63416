"""Every source trains the same model: one set of images as an ImageFolder, a label file, WebDataset tars written by
webdataset's own ShardWriter and a Hugging Face dataset's Parquet files written by `datasets` (tests/sources.py) gives
the same weights bit for bit under one seed; on the label file and the Parquet files a run stopped and resumed, and on
the tars a run whose worker is killed (kill -9) and restarted by torchrun, end as the uninterrupted run does. The same
samples batch by batch are tests/unit/test_sources.py's (in-process, every source and path)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess

import pytest

from tests.helpers import (DEBUG, PY, assert_bit_identical, assert_same_final_figures, end_hung, env_for_tests,
                           python_cmd, reached_step, run, status, wait_for, worker_pid)
from tests.sources import draw_imagefolder, hf_parquet_plan, write_hf, write_label_files, write_wds_shards

# 128 training images: 4 steps an epoch on 2 workers of 16; 80 steps (a few seconds: long enough for a kill to land
# mid-run), a checkpoint every 10, the loss every 2
COMMON = [*DEBUG, "--num-workers", 0, "--max-steps", 80, "--log-every", 2, "--save-every", 10]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sources")
    folder = draw_imagefolder(root / "folder", classes=4, train=128, val=32, size=20)
    write_hf({root / "hf": hf_parquet_plan(folder, root / "hf")})
    return {"hf": ["--dataset", "hf", "--data-dir", root / "hf"],
            "imagefolder": ["--dataset", "imagefolder", "--data-dir", folder],
            "shards": ["--dataset", "shards", "--data-dir", write_wds_shards(folder, root / "wds", per_shard=40)]}


@pytest.fixture
def reference(reference_run, data):
    """The ImageFolder, 2 workers (--spawn), uninterrupted."""
    return reference_run(*COMMON, *data["imagefolder"])


def same_data(run_dir, reference) -> None:
    """plan.json's counts and classes, and classes.json, as the ImageFolder's."""
    plan, theirs = (json.loads((d / "plan.json").read_text()) for d in (run_dir, reference))
    keys = ("train_samples", "val_samples", "num_classes", "classes")
    assert [plan[k] for k in keys] == [theirs[k] for k in keys] == [128, 32, 4, ["disk", "plus", "ring", "square"]]
    assert json.loads((run_dir / "classes.json").read_text()) == plan["classes"]


def test_a_label_file_stops_at_a_listed_file_that_is_gone_and_restored_trains_the_imagefolders_model(reference, data,
                                                                                                        tmp_path):
    """A listed file that is gone is not asked about before the start (a NAS would take minutes for a million): met by
    a loader worker of a rank, one line naming the file and its line, exit 2, status.json "failed". Restored, the same
    command trains on, is stopped and resumed, and ends as the ImageFolder's uninterrupted run (whose ranks decoded
    their images themselves, --num-workers 0)."""
    folder = tmp_path / "folder"
    shutil.copytree(data["imagefolder"][3], folder)
    labels = write_label_files(folder, tmp_path / "csv")
    gone = sorted((folder / "train" / "ring").iterdir())[5]
    kept = gone.read_bytes()
    gone.unlink()
    line = next(n for n, text in enumerate((labels / "train.csv").read_text().splitlines(), 1) if gone.name in text
                and "/ring/" in text)
    run_dir = tmp_path / "run"
    args = [*COMMON, "--dataset", "csv", "--data-dir", labels, "--num-workers", 1, "--spawn", 2, "--run-dir", run_dir]
    proc = run(python_cmd(*args, "--stop-at", 13), expect=2)
    errors = [text for text in proc.stderr.splitlines() if text.startswith("error:")]
    said = f"cannot read image {gone}, listed on line {line} of {labels}/train.csv (No such file or directory)"
    assert len(errors) == 1 and said in errors[0] and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    failed = status(run_dir)
    assert failed["state"] == "failed" and failed["exit_code"] == 2 and said in failed["error"], failed
    gone.write_bytes(kept)
    run(python_cmd(*args, "--stop-at", 13), expect=75)
    assert status(run_dir)["step"] == 13
    resumed = run(python_cmd(*args))
    assert f"resumed from {run_dir}/checkpoints/step_00000013.pt" in resumed.stderr
    assert status(run_dir)["state"] == "done"
    assert_bit_identical(run_dir, reference)
    assert_same_final_figures(run_dir, reference)
    same_data(run_dir, reference)
    assert json.loads((run_dir / "plan.json").read_text())["source"]["kind"] == "csv"


def test_a_hugging_face_dataset_stopped_and_resumed_trains_the_imagefolders_model(reference, data, tmp_path):
    """Parquet files: made Arrow files once by rank 0 (beside them), read by both ranks; stopped, resumed."""
    run_dir = tmp_path / "hf"
    run(python_cmd(*COMMON, *data["hf"], "--spawn", 2, "--run-dir", run_dir, "--stop-at", 13), expect=75)
    assert status(run_dir)["step"] == 13 and (data["hf"][3] / ".trainbox-index" / "hf-train.json").is_file()
    resumed = run(python_cmd(*COMMON, *data["hf"], "--spawn", 2, "--run-dir", run_dir))
    assert f"resumed from {run_dir}/checkpoints/step_00000013.pt" in resumed.stderr
    assert_bit_identical(run_dir, reference)
    assert_same_final_figures(run_dir, reference)
    same_data(run_dir, reference)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["source"]["kind"] == "hf (a Hugging Face dataset)"
    assert plan["source"]["classes_from"] == "the label names of the train split, sorted"


def test_tars_with_a_worker_killed_and_restarted_train_the_imagefolders_model(reference, data, tmp_path):
    run_dir = tmp_path / "tars"  # what `make train GPUS=2` runs: torchrun, which restarts the workers
    cmd = [PY, "-m", "train.launch", "--gpus", "2", "--", *map(str, COMMON), *map(str, data["shards"]),
           "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, env=env_for_tests(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(reached_step(run_dir, 14), 180, "step 14", proc)
        os.kill(worker_pid(proc, 1), signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    except BaseException:
        end_hung(proc)
        raise
    assert proc.returncode == 0, err[-4000:]
    assert "resumed from" in err, err[-4000:]
    assert status(run_dir)["state"] == "done"
    assert_bit_identical(run_dir, reference)
    assert_same_final_figures(run_dir, reference)
    same_data(run_dir, reference)
    kind = json.loads((run_dir / "plan.json").read_text())["source"]["kind"]
    assert kind == "shards (WebDataset tars of another tool)"
