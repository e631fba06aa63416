"""MLflow tracking against a real MLflow server (tests/conftest.py `mlflow_server`): one MLflow run per run
directory through kills, restarts, stops and resumes, each step once; a server that dies never costs
the training anything, and what it missed is sent when it is back."""

from __future__ import annotations

import json
import os
import signal
import subprocess

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from tests.helpers import (LONG, PY, assert_bit_identical, env_for_tests, metrics, python_cmd, reached_step, run,
                           status, wait_for, worker_pid)
from train.tracking import RECORD


def _tracked(server, tmp_path) -> dict:
    return env_for_tests(MLFLOW_TRACKING_URI=server.uri, MLFLOW_EXPERIMENT_NAME=f"test-{tmp_path.name}")


def _the_one_run(client: MlflowClient, run_dir, experiment: str):
    """The experiment holds one run, the one RUN_DIR/mlflow.json names."""
    run_id = json.loads((run_dir / RECORD).read_text())["run_id"]
    found = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert [r.info.run_id for r in found] == [run_id]
    return client.get_run(run_id)


def _assert_complete(client: MlflowClient, tracked, run_dir, tmp_path, max_steps: int = 240) -> None:
    """Each metric's steps once, train/loss at every logged step with the values of metrics.jsonl, the
    model as an artifact bit for bit, and the run finished."""
    run_id = tracked.info.run_id
    for key in tracked.data.metrics:
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert len(steps) == len(set(steps)), f"{key}: a step sent twice: {steps}"
    losses = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
    assert losses == {m["step"]: m["loss"] for m in metrics(run_dir, "train")}
    assert sorted(losses) == list(range(5, max_steps + 1, 5))
    assert [m.step for m in client.get_metric_history(run_id, "eval/accuracy")] == [max_steps]
    assert tracked.info.status == "FINISHED"
    downloaded = client.download_artifacts(run_id, "model.pt", str(tmp_path))
    assert open(downloaded, "rb").read() == (run_dir / "model.pt").read_bytes()


def test_one_mlflow_run_through_a_killed_worker_a_stop_and_a_resume(mlflow_server, reference_run, tmp_path):
    """make train GPUS=2: a worker killed (torchrun restarts both from the checkpoint of step 20 and replays
    the steps after it), then stopped by SIGTERM, then the same command again, to the end."""
    run_dir, env = tmp_path / "run", _tracked(mlflow_server, tmp_path)
    launch = [PY, "-m", "train.launch", "--gpus", "2", "--", *map(str, LONG), "--run-dir", str(run_dir)]
    proc = subprocess.Popen(launch, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(reached_step(run_dir, 25), 120, "step 25", proc)
    os.kill(worker_pid(proc, 1), signal.SIGKILL)
    wait_for(lambda: "resumed from" in (run_dir / "train.log").read_text() and reached_step(run_dir, 45)(), 180,
             "the restarted workers at step 45", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 75, err[-3000:]
    run(launch, env=env)  # the same command: resumed from the stop's checkpoint, to the end

    client = MlflowClient(mlflow_server.uri)
    tracked = _the_one_run(client, run_dir, env["MLFLOW_EXPERIMENT_NAME"])
    _assert_complete(client, tracked, run_dir, tmp_path)
    config = json.loads((run_dir / "config.json").read_text())
    assert tracked.data.params == {k: str(v) for k, v in config.items()}
    manifest = json.loads((run_dir / "manifest.json").read_text())
    tags = tracked.data.tags
    for key in ("git_commit", "git_dirty", "torch", "cuda", "nccl", "world_size", "launcher", "slurm_job_id",
                "image", "image_digest", "resumed_from_step"):
        assert tags[key] == (manifest[key] if isinstance(manifest[key], str) else json.dumps(manifest[key])), key
    assert manifest["resumed_from_step"] is not None and len(manifest["previous"]) == 2  # the third start's tags
    assert_bit_identical(run_dir, reference_run(*LONG))


def test_a_server_that_dies_costs_the_training_nothing_and_gets_the_rest_when_back(mlflow_server, reference_run,
                                                                                   tmp_path):
    run_dir, env = tmp_path / "run", _tracked(mlflow_server, tmp_path)
    slow = [*LONG, "--max-steps", 960]  # long enough to lose the server once it has the first points
    cmd = python_cmd(*slow, "--run-dir", run_dir)
    client = MlflowClient(mlflow_server.uri)

    def server_has_points() -> bool:
        try:
            run_id = json.loads((run_dir / RECORD).read_text())["run_id"]
            return len(client.get_metric_history(run_id, "train/loss")) >= 2
        except (OSError, ValueError, MlflowException):
            return False

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(server_has_points, 120, "the first metrics on the server", proc)
        mlflow_server.stop()
        _, err = proc.communicate(timeout=300)
    finally:
        mlflow_server.stop()
    assert proc.returncode == 0, err[-3000:]
    assert status(run_dir)["step"] == 960
    assert_bit_identical(run_dir, reference_run(*slow, workers=1))  # the weights of a run without tracking
    assert err.count("does not take the run's data") == 1, err[-3000:]  # one warning, not one per try
    (missed,) = [line for line in err.splitlines() if "mlflow: could not send" in line]
    assert "model.pt" in missed and "manifest.json" in missed and "(Connection refused)" in missed

    mlflow_server.start()  # back, on the same store: the same command sends what it missed
    again = run(cmd, env=env)
    assert "already finished at step 960" in again.stderr
    tracked = _the_one_run(client, run_dir, env["MLFLOW_EXPERIMENT_NAME"])
    _assert_complete(client, tracked, run_dir, tmp_path, max_steps=960)
