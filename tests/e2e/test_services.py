"""The services on the network, seen from a second host: node n1 of the test cluster (a network namespace on
the cluster's bridge, tests/cluster/up.sh), which reaches this machine at CLUSTER_HOST, as another user's
machine on a shared node's network would. Closed by default; a team server answers only with a login."""

import base64
import json
import os
import signal
import subprocess
import urllib.error
import urllib.request

from tests.helpers import CLUSTER_HOST, DEBUG, PY, REPO, env_for_tests, python_cmd, run, wait_for
from train.distributed import free_port

SEARCH = "/api/2.0/mlflow/experiments/search?max_results=1"


def from_n1(url: str, user: str | None = None, password: str | None = None) -> str:
    """What a GET of url answers on node n1: the HTTP status, or the connection error."""
    code = f"""
import base64, urllib.error, urllib.request
request = urllib.request.Request({url!r})
if {user!r}:
    request.add_header("Authorization", "Basic " + base64.b64encode(b"{user}:{password}").decode())
try:
    print(urllib.request.urlopen(request, timeout=10).status)
except urllib.error.HTTPError as e:
    print(e.code)
except OSError as e:
    print(type(getattr(e, "reason", e)).__name__)
"""
    return run(["nsenter", "--net=/var/run/netns/slnode1", PY, "-c", code], timeout=60).stdout.strip()


def answers_here(url: str, headers: dict | None = None) -> int | None:
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5).status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def test_the_default_mlflow_server_and_tensorboard_cannot_be_reached_from_another_host(cluster, mlflow_server):
    assert answers_here(f"{mlflow_server.uri}{SEARCH}") == 200  # this machine: open, no login
    assert from_n1(f"http://{CLUSTER_HOST}:{mlflow_server.port}{SEARCH}") == "ConnectionRefusedError"
    port = free_port()
    board = subprocess.Popen(["make", "--no-print-directory", "tensorboard", "RUNTIME=local",
                              f"TENSORBOARD_PORT={port}"], cwd=REPO, env=env_for_tests(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: answers_here(f"http://127.0.0.1:{port}/data/runs") == 200, 120, "TensorBoard", board)
        assert from_n1(f"http://{CLUSTER_HOST}:{port}/data/runs") == "ConnectionRefusedError"
    finally:
        os.killpg(board.pid, signal.SIGTERM)
        board.wait(30)


def test_a_team_server_needs_a_login_and_tracks_a_run_from_another_host(cluster, team_mlflow_server, tmp_path):
    from mlflow import MlflowClient

    server, url = team_mlflow_server, f"http://{CLUSTER_HOST}:{team_mlflow_server.port}"
    password = server.credentials["MLFLOW_TRACKING_PASSWORD"]
    assert from_n1(f"{url}{SEARCH}") == "401"
    assert from_n1(f"{url}{SEARCH}", "admin", password[:-1] + "x") == "401"
    assert from_n1(f"{url}{SEARCH}", "admin", password) == "200"
    # a 2-worker run on n1 with the right credentials tracks as before
    run_dir = tmp_path / "run"
    env = env_for_tests(MLFLOW_TRACKING_URI=url, MLFLOW_EXPERIMENT_NAME=f"test-{tmp_path.name}", **server.credentials)
    run(["nsenter", "--net=/var/run/netns/slnode1", *python_cmd(*DEBUG, "--spawn", 2, "--run-dir", run_dir)],
        env=env, timeout=300)
    run_id = json.loads((run_dir / "mlflow.json").read_text())["run_id"]
    token = base64.b64encode(f"admin:{password}".encode()).decode()
    assert answers_here(f"{server.uri}/api/2.0/mlflow/runs/get?run_id={run_id}",
                        {"Authorization": f"Basic {token}"}) == 200
    os.environ.update(server.credentials)
    try:
        tracked = MlflowClient(server.uri).get_run(run_id)
    finally:
        for key in server.credentials:
            os.environ.pop(key)
    assert tracked.info.status == "FINISHED" and tracked.data.metrics["train/loss"] > 0
    # the trainer's own refusal of bad credentials, before anything starts
    wrong = {**env, "MLFLOW_TRACKING_PASSWORD": password + "x"}
    proc = run(python_cmd(*DEBUG, "--run-dir", tmp_path / "refused"), env=wrong, expect=2)
    assert proc.stderr.strip().startswith(f"error: the MLflow server at {url} refused the credentials"), proc.stderr
    assert not (tmp_path / "refused").exists()
