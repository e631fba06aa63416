"""MLflow tracking against a real MLflow server (tests/conftest.py `mlflow_server`): one MLflow run per run
directory through kills, restarts, stops and resumes, each step once; a server that dies never costs
the training anything, and what it missed is sent when it is back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from tests.helpers import (DEBUG, LONG, PY, MlflowServer, assert_bit_identical, assert_mlflow_run_complete, metrics,
                           python_cmd, reached_step, run, status, the_one_mlflow_run, tracked_env, wait_for, worker_pid)
from train.cluster.identity import free_port
from train.report.mlflow_tracking import KEY_TAG, RECORD


def test_one_mlflow_run_through_a_killed_worker_a_stop_and_a_resume_at_another_name(mlflow_server, reference_run,
                                                                                     tmp_path):
    """make train GPUS=2: a worker killed (torchrun restarts both from the checkpoint of step 20 and replays
    the steps after it), then stopped by SIGTERM, then the same command again, to the end, with the same server
    reached by another name (localhost on the host, `mlflow` inside compose): one MLflow run. Started again against
    a different server, which does not have that run: a run of its own there, with everything."""
    run_dir, env = tmp_path / "run", tracked_env(mlflow_server.uri, tmp_path)
    launch = [PY, "-m", "train.launch", "--gpus", "2", "--", *map(str, LONG), "--mlflow-checkpoints",
              "--run-dir", str(run_dir)]
    proc = subprocess.Popen(launch, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(reached_step(run_dir, 25), 120, "step 25", proc)
    os.kill(worker_pid(proc, 1), signal.SIGKILL)
    wait_for(lambda: "resumed from" in (run_dir / "train.log").read_text() and reached_step(run_dir, 45)(), 180,
             "the restarted workers at step 45", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 75, err[-3000:]
    first = json.loads((run_dir / RECORD).read_text())["run_id"]
    other_name = f"http://localhost:{mlflow_server.port}/"
    resumed = run(launch, env={**env, "MLFLOW_TRACKING_URI": other_name})  # resumed from the stop's checkpoint
    assert f"mlflow: continuing run {first} at {other_name}" in resumed.stderr, resumed.stderr[-3000:]

    client = MlflowClient(mlflow_server.uri)
    tracked = the_one_mlflow_run(client, run_dir, env["MLFLOW_EXPERIMENT_NAME"])
    assert tracked.info.run_id == first
    assert_mlflow_run_complete(client, tracked, run_dir, tmp_path)
    config = json.loads((run_dir / "config.json").read_text())
    assert tracked.data.params == {k: str(v) for k, v in config.items()}
    manifest = json.loads((run_dir / "manifest.json").read_text())
    tags = tracked.data.tags
    for key in ("git_commit", "git_dirty", "torch", "cuda", "nccl", "world_size", "launcher", "slurm_job_id",
                "image", "image_digest", "resumed_from_step"):
        assert tags[key] == (manifest[key] if isinstance(manifest[key], str) else json.dumps(manifest[key])), key
    assert manifest["resumed_from_step"] is not None and len(manifest["previous"]) == 2  # the third start's tags
    sent = {f.path for f in client.list_artifacts(tracked.info.run_id, "checkpoints")}  # --mlflow-checkpoints
    kept = {f"checkpoints/{p.name}" for p in (run_dir / "checkpoints").iterdir()}
    assert kept < sent and {f"checkpoints/step_{s:08d}.pt" for s in range(20, 240, 20)} <= sent
    assert_bit_identical(run_dir, reference_run(*LONG))  # tracking changes nothing in the training
    _another_server_gets_a_run_of_its_own(run_dir, env, first, other_name, tmp_path)
    experiment = client.get_experiment_by_name(env["MLFLOW_EXPERIMENT_NAME"]).experiment_id
    assert [r.info.run_id for r in client.search_runs([experiment])] == [first]  # the first server: still one


def _another_server_gets_a_run_of_its_own(run_dir, env: dict, first: str, tracked_at: str, tmp_path) -> None:
    """The finished run started again against a server that does not have its MLflow run: a run of its own there,
    with every metric and model.pt."""
    other = MlflowServer(tmp_path / "other", free_port())
    (tmp_path / "other").mkdir()
    other.start()
    try:
        again = run(python_cmd(*LONG, "--run-dir", run_dir), env={**env, "MLFLOW_TRACKING_URI": other.uri})
        assert f"run {first} is not on the server at {other.uri} (it was tracked at {tracked_at})" in again.stderr
        other_client = MlflowClient(other.uri)
        tracked = the_one_mlflow_run(other_client, run_dir, env["MLFLOW_EXPERIMENT_NAME"])
        assert tracked.info.run_id != first
        (tmp_path / "download").mkdir()
        assert_mlflow_run_complete(other_client, tracked, run_dir, tmp_path / "download")
    finally:
        other.stop()


SLOW = [*LONG, "--max-steps", 960]  # long enough to lose the server once it has the first points


def _asked_every(seconds: float, question):
    """question(), put to the server at most every `seconds` (False in between): each one is a query the server
    answers beside the run's own requests."""
    asked = [-seconds]

    def ask() -> bool:
        if time.monotonic() - asked[0] < seconds:
            return False
        asked[0] = time.monotonic()
        return question()

    return ask


def _server_has_points(client: MlflowClient, run_dir) -> bool:
    try:
        run_id = json.loads((run_dir / RECORD).read_text()).get("run_id")  # noted once the run exists
        return run_id is not None and len(client.get_metric_history(run_id, "train/loss")) >= 2
    except (OSError, ValueError, MlflowException):
        return False


def _server_steps(client: MlflowClient, run_dir) -> set[int]:
    """The steps of the run's train/loss on the server (none while it cannot say)."""
    try:
        run_id = json.loads((run_dir / RECORD).read_text())["run_id"]
        return {m.step for m in client.get_metric_history(run_id, "train/loss")}
    except (OSError, ValueError, KeyError, MlflowException):
        return set()


def test_a_server_that_hangs_then_dies_costs_the_training_nothing_and_gets_the_rest_when_back(mlflow_server,
                                                                                             reference_run, tmp_path):
    """One run, two outages. The server hangs (stopped where it stands: it takes connections and never answers) for
    100 steps, then answers again and gets what it missed while the run trains on; later it dies, the run trains to
    its end, and the same command sends the rest once the server is back. Each outage is one warning, not one per
    try, and the weights are those of a run without tracking."""
    run_dir, env = tmp_path / "run", tracked_env(mlflow_server.uri, tmp_path)
    cmd = python_cmd(*SLOW, "--run-dir", run_dir)
    client = MlflowClient(mlflow_server.uri)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(_asked_every(0.5, lambda: _server_has_points(client, run_dir)), 120, "the first metrics on the server",
                 proc)
        mlflow_server.freeze(True)
        try:
            at = max(m["step"] for m in metrics(run_dir, "train"))
            wait_for(lambda: max(m["step"] for m in metrics(run_dir, "train")) >= at + 100, 120,
                     "100 steps trained while the server hangs", proc)
        finally:
            mlflow_server.freeze(False)
        logged = {m["step"] for m in metrics(run_dir, "train")}  # every step logged up to the end of the hang
        wait_for(_asked_every(0.5, lambda: logged <= _server_steps(client, run_dir)), 120,
                 "the hang's points on the server", proc)
        assert proc.poll() is None, "the run ended before the server died: make SLOW longer"
        mlflow_server.stop()
        _, err = proc.communicate(timeout=300)
    finally:
        mlflow_server.stop()
    assert proc.returncode == 0, err[-3000:]
    assert status(run_dir)["step"] == 960
    assert_bit_identical(run_dir, reference_run(*SLOW, workers=1))  # the weights of a run without tracking
    outages = 1 + err.count("answers again: sent what was kept")  # the hang's, if a call timed out in it
    assert err.count("does not take the run's data") == outages, err[-3000:]  # one warning each, not one per try
    (missed,) = [line for line in err.splitlines() if "mlflow: could not send" in line]
    assert "model.pt" in missed and "manifest.json" in missed and "(Connection refused)" in missed

    mlflow_server.start()  # back, on the same store: the same command sends what it missed
    again = run(cmd, env=env)
    assert "already finished at step 960" in again.stderr
    tracked = the_one_mlflow_run(client, run_dir, env["MLFLOW_EXPERIMENT_NAME"])
    assert_mlflow_run_complete(client, tracked, run_dir, tmp_path, max_steps=960)


def test_a_run_made_by_an_attempt_that_died_before_noting_its_id_is_continued_and_tracked_anew_once_deleted(
        mlflow_server, tmp_path):
    """An attempt killed between creating the MLflow run and writing its id to mlflow.json (a Slurm step
    cancelled right after a stop, say): the next attempt finds that run by the key mlflow.json held first. That
    MLflow run then deleted on the server (or the server's store made anew): the same command tracks the run
    directory in a new MLflow run, and sends model.pt again although mlflow.json says it was sent before."""
    run_dir, env = tmp_path / "run", tracked_env(mlflow_server.uri, tmp_path)
    client = MlflowClient(mlflow_server.uri)
    orphan = client.create_run(client.create_experiment(env["MLFLOW_EXPERIMENT_NAME"]), tags={KEY_TAG: "k-1"})
    run_dir.mkdir()
    (run_dir / RECORD).write_text(json.dumps({"tracking_uri": mlflow_server.uri, "key": "k-1"}))
    cmd = python_cmd(*DEBUG, "--max-steps", 10, "--run-dir", run_dir)
    run(cmd, env=env)
    tracked = the_one_mlflow_run(client, run_dir, env["MLFLOW_EXPERIMENT_NAME"])
    assert tracked.info.run_id == orphan.info.run_id and tracked.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(orphan.info.run_id, "train/loss")] == [10]
    assert "model.pt" in json.loads((run_dir / RECORD).read_text())["artifacts"]  # noted as sent

    client.delete_run(orphan.info.run_id)
    again = run(cmd, env=env)
    assert f"run {orphan.info.run_id} is gone from the server" in again.stderr
    tracked = the_one_mlflow_run(client, run_dir, env["MLFLOW_EXPERIMENT_NAME"])
    assert tracked.info.run_id != orphan.info.run_id and tracked.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(tracked.info.run_id, "train/loss")] == [10]
    downloaded = client.download_artifacts(tracked.info.run_id, "model.pt", str(tmp_path))
    assert open(downloaded, "rb").read() == (run_dir / "model.pt").read_bytes()
