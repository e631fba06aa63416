"""The services on the network, seen from a second host: node n1 of the test cluster (a network namespace on
the cluster's bridge, tests/cluster/up.sh), which reaches this machine at CLUSTER_HOST, as another user's
machine on a shared node's network would; and from another local user of this machine (nobody), who reaches
its loopback. Closed by default; a team server answers only with a login, and MLFLOW_AUTH=1 asks for the
same login on loopback. The admin's password is the one in its file at every start, the jobs log in as a
user of their own, and no secret is on a command line or readable by other users."""

import base64
import json
import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import tempfile
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from tests.helpers import CLUSTER_HOST, DEBUG, PY, REPO, MlflowServer, env_for_tests, python_cmd, run, wait_for
from tests.processes import in_session
from train.cluster.identity import free_port

SEARCH = "/api/2.0/mlflow/experiments/search?max_results=1"


def _get(url: str, user: str | None, password: str | None, body: dict | None = None) -> str:
    """Python that prints what a GET of url (a POST of the JSON body) answers: the HTTP status, or the
    connection error."""
    data = None if body is None else json.dumps(body).encode()
    return f"""
import base64, urllib.error, urllib.request
request = urllib.request.Request({url!r}, data={data!r}, headers={{"Content-Type": "application/json"}})
if {user!r}:
    request.add_header("Authorization", "Basic " + base64.b64encode(b"{user}:{password}").decode())
try:
    print(urllib.request.urlopen(request, timeout=10).status)
except urllib.error.HTTPError as e:
    print(e.code)
except OSError as e:
    print(type(getattr(e, "reason", e)).__name__)
"""


def from_n1(url: str, user: str | None = None, password: str | None = None, body: dict | None = None) -> str:
    """What a GET of url (a POST of body) answers on node n1: the HTTP status, or the connection error."""
    return run(["nsenter", "--net=/var/run/netns/slnode1", PY, "-c", _get(url, user, password, body)],
               timeout=60).stdout.strip()


def as_another_user(url: str, user: str | None = None, password: str | None = None, body: dict | None = None) -> str:
    """What a GET of url (a POST of body) answers to another local user of this machine (nobody, with the
    system's python3)."""
    return run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c",
                _get(url, user, password, body)], timeout=60).stdout.strip()


def _as_admin(server, run_id: str):
    """The MLflow run, read with the server's admin credentials (MLflow's client takes them from the environment)."""
    from mlflow import MlflowClient

    os.environ.update(server.credentials)
    try:
        return MlflowClient(server.uri).get_run(run_id)
    finally:
        for key in server.credentials:
            os.environ.pop(key)


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
        assert as_another_user(f"http://127.0.0.1:{port}/data/runs") == "200"  # every local user, though
    finally:
        os.killpg(board.pid, signal.SIGTERM)
        board.wait(30)


def test_a_team_server_needs_a_login_and_tracks_a_run_from_another_host(cluster, team_mlflow_server, tmp_path):
    server, url = team_mlflow_server, f"http://{CLUSTER_HOST}:{team_mlflow_server.port}"
    password = server.credentials["MLFLOW_TRACKING_PASSWORD"]
    assert from_n1(f"{url}{SEARCH}") == "401"
    assert from_n1(f"{url}{SEARCH}", "admin", _misspelt(password)) == "401"
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
    tracked = _as_admin(server, run_id)
    assert tracked.info.status == "FINISHED" and tracked.data.metrics["train/loss"] > 0
    # the trainer's own refusal of bad credentials, before anything starts
    wrong = {**env, "MLFLOW_TRACKING_PASSWORD": password + "x"}
    proc = run(python_cmd(*DEBUG, "--run-dir", tmp_path / "refused"), env=wrong, expect=2)
    assert proc.stderr.strip().startswith(f"error: the MLflow server at {url} refused the credentials"), proc.stderr
    assert not (tmp_path / "refused").exists()


def _misspelt(password: str) -> str:
    """The password with its last character changed (never to itself: a password may end in "x")."""
    return password[:-1] + ("y" if password.endswith("x") else "x")


def _login(user: str, password: str) -> dict:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_every_local_user_of_this_machine_reaches_a_loopback_server(mlflow_server, tmp_path):
    # 127.0.0.1 keeps other hosts out, not the other users of this machine: they use it as its owner does
    assert as_another_user(f"{mlflow_server.uri}{SEARCH}") == "200"
    assert as_another_user(f"{mlflow_server.uri}/api/2.0/mlflow/experiments/create",
                           body={"name": f"someone-elses-{tmp_path.name}"}) == "200"


def test_the_admin_password_is_the_one_in_its_file_at_every_start(mlflow_server, tmp_path):
    """MLFLOW_AUTH=1 on loopback: the login for another local user too. Then the file changes and the server
    starts again: the new password logs in, the old one no longer does."""
    server = MlflowServer(tmp_path, free_port(), login=True)
    server.start()
    try:
        old = server.credentials["MLFLOW_TRACKING_PASSWORD"]
        assert as_another_user(f"{server.uri}{SEARCH}") == "401"
        assert as_another_user(f"{server.uri}{SEARCH}", "admin", _misspelt(old)) == "401"
        assert as_another_user(f"{server.uri}{SEARCH}", "admin", old) == "200"
        server.stop()
        new = base64.urlsafe_b64encode(os.urandom(18)).decode()
        server.set_password(new)
        server.start()
        assert answers_here(f"{server.uri}{SEARCH}", _login("admin", old)) == 401
        assert answers_here(f"{server.uri}{SEARCH}", _login("admin", new)) == 200
        log = (tmp_path / "server.log").read_text()
        assert log.count("admin's password is now the one in MLFLOW_ADMIN_PASSWORD_FILE") == 1
    finally:
        server.stop()


def test_no_secret_on_a_command_line_and_the_store_is_the_servers_user_alone(tmp_path):
    """The backend store URI (a database's password, for PostgreSQL or MySQL) and the admin's password are
    in no command line of the server's processes (what `ps` shows every local user); what it writes (the
    runs' store, artifacts, the users' password hashes) only its user can read."""
    from mlflow import MlflowClient

    marker = f"store-{uuid.uuid4().hex}"
    (tmp_path / marker).mkdir()
    db = tmp_path / marker / "mlflow.db"
    server = MlflowServer(tmp_path, free_port(), login=True, env={"MLFLOW_BACKEND_STORE_URI": f"sqlite:///{db}"})
    server.start()
    try:
        os.environ.update(server.credentials)
        try:
            client = MlflowClient(server.uri)
            experiment = client.create_experiment(f"private-{tmp_path.name}")
            tracked = client.create_run(experiment)
            (tmp_path / "note.txt").write_text("an artifact\n")
            client.log_artifact(tracked.info.run_id, str(tmp_path / "note.txt"))
            client.set_terminated(tracked.info.run_id)
        finally:
            for key in server.credentials:
                os.environ.pop(key)
        command_lines = []
        for pid in in_session(server.proc.pid):
            try:
                command_lines.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode())
            except OSError:
                continue
        assert any("mlflow" in line and "server" in line for line in command_lines), command_lines
        assert any("uvicorn" in line for line in command_lines), command_lines
        assert not [line for line in command_lines if "huey" in line], command_lines  # no job runner beside it
        password = server.credentials["MLFLOW_TRACKING_PASSWORD"]
        assert not [line for line in command_lines if marker in line or password in line], command_lines
    finally:
        server.stop()
    with sqlite3.connect(db) as store:  # the server used the store its environment named
        assert (f"private-{tmp_path.name}",) in store.execute("SELECT name FROM experiments").fetchall()
    written = [db, tmp_path / "mlflow", *(tmp_path / "mlflow").rglob("*")]
    assert tmp_path / "mlflow" / "basic_auth.db" in written and any(p.name == "note.txt" for p in written)
    for path in written:
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, f"{path} is readable by others"


def test_make_mlflow_user_makes_the_jobs_a_user_that_is_no_admin(cluster, team_mlflow_server, tmp_path):
    """The jobs on the nodes log in as a user of their own, made by `make mlflow-user` with the admin's
    password, which stays on the server's machine; it logs runs in the experiment the admin made."""
    from mlflow import MlflowClient

    server, url = team_mlflow_server, f"http://{CLUSTER_HOST}:{team_mlflow_server.port}"
    experiment, user = f"jobs-{tmp_path.name}", f"trainer-{uuid.uuid4().hex[:8]}"
    os.environ.update(server.credentials)
    try:
        experiment_id = MlflowClient(server.uri).create_experiment(experiment)  # the admin's: others may only read it
    finally:
        for key in server.credentials:
            os.environ.pop(key)
    password_file = tmp_path / "trainer-password"
    knobs = [f"MLFLOW_USER={user}", f"MLFLOW_USER_PASSWORD_FILE={password_file}", f"MLFLOW_PORT={server.port}",
             f"MLFLOW_ADMIN_PASSWORD_FILE={server.root / 'admin-password'}"]
    make_user = ["make", "--no-print-directory", "mlflow-user", *knobs]
    made = run(make_user, env=env_for_tests(MLFLOW_EXPERIMENT_NAME=experiment))
    assert f"MLflow user {user} (not an admin)" in made.stdout, made.stdout
    assert f"may log runs in experiment '{experiment}'" in made.stdout
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
    password = password_file.read_text().strip()
    assert len(password) >= 12 and password not in made.stdout + made.stderr
    again = run(make_user, env=env_for_tests(MLFLOW_EXPERIMENT_NAME=experiment))
    assert password_file.read_text().strip() == password and f"MLflow user {user}" in again.stdout  # the same user

    run_dir = tmp_path / "run"
    job = env_for_tests(MLFLOW_TRACKING_URI=url, MLFLOW_EXPERIMENT_NAME=experiment, MLFLOW_TRACKING_USERNAME=user,
                        MLFLOW_TRACKING_PASSWORD=password)
    run(["nsenter", "--net=/var/run/netns/slnode1", *python_cmd(*DEBUG, "--max-steps", 10, "--run-dir", run_dir)],
        env=job, timeout=300)
    run_id = json.loads((run_dir / "mlflow.json").read_text())["run_id"]
    tracked = _as_admin(server, run_id)
    assert tracked.info.status == "FINISHED" and tracked.info.experiment_id == experiment_id
    # no admin: it can neither read other users nor make one
    assert from_n1(f"{url}/api/2.0/mlflow/users/get?username=admin", user, password) == "403"
    assert from_n1(f"{url}/api/2.0/mlflow/users/create", user, password,
                   {"username": f"{user}-2", "password": "Wd3-kP9s_Hx4Mq7V"}) == "403"
    # an experiment it makes itself is its own: it logs runs there
    os.environ.update(MLFLOW_TRACKING_USERNAME=user, MLFLOW_TRACKING_PASSWORD=password)
    try:
        jobs = MlflowClient(server.uri)
        jobs.set_terminated(jobs.create_run(jobs.create_experiment(f"{experiment}-own")).info.run_id)
    finally:
        for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            os.environ.pop(key)
    # the file changed: make mlflow-user sets the new password
    password_file.write_text("Jr6-tB2m_Lz8Wq4C\n")
    run(make_user, env=env_for_tests(MLFLOW_EXPERIMENT_NAME=experiment))
    assert from_n1(f"{url}{SEARCH}", user, "Jr6-tB2m_Lz8Wq4C") == "200"
    assert from_n1(f"{url}{SEARCH}", user, password) == "401"

    wrong = tmp_path / "not-the-admin-password"
    wrong.write_text("Qm4-wX8z_Tn2Lp7R\n")
    wrong.chmod(0o600)
    refused = run(["make", "--no-print-directory", "mlflow-user", *knobs[:-1], f"MLFLOW_ADMIN_PASSWORD_FILE={wrong}"],
                  expect=2)
    assert refused.stderr.startswith(f"error: the MLflow server at http://127.0.0.1:{server.port} refused the "
                                     f"admin's login"), refused.stderr
    assert len([line for line in refused.stderr.splitlines() if not line.startswith("make: ***")]) == 1


def test_a_store_the_servers_user_cannot_write_is_one_line_with_the_fix():
    """RUNS_DIR/mlflow of another user (root's, from an older root container): the server says whose and how
    to hand it over, before MLflow starts."""
    root = Path(tempfile.mkdtemp(prefix="trainbox-store-"))  # outside pytest's folders, which only root enters
    try:
        root.chmod(0o755)
        (root / "mlflow").mkdir(mode=0o755)
        proc = run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                    str(REPO / "docker" / "mlflow_server.py"), str(root)], expect=2)
        assert proc.stderr == (f"error: {root / 'mlflow' / 'artifacts'} cannot be written by uid 65534, the server's "
                               f"user: `make mlflow` hands {root / 'mlflow'} to the container's user, or run "
                               f"`chown -R 65534:65534 {root / 'mlflow'}`\n")
    finally:
        shutil.rmtree(root)
