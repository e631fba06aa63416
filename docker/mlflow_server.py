"""The MLflow tracking server of trainbox's runs, its store on the NAS beside them: `make mlflow` (local) and
the compose service `mlflow` (docker/mlflow.Dockerfile) both start it with this script.

  python docker/mlflow_server.py RUNS_DIR            (the MLflow environment's python: .venv-mlflow, the image)

Closed by default: it listens on 127.0.0.1 only (compose publishes its port on the host's 127.0.0.1), with
no login; reach it from a laptop through an SSH tunnel. Every local user of the machine reaches a loopback
port too: MLFLOW_AUTH=1 asks them for a login as well. A team server is opened on purpose:

  MLFLOW_EXPOSE=1               listen on MLFLOW_BIND (default 0.0.0.0, every interface) with MLflow's
                                basic-auth app on: every request needs a user and password
  MLFLOW_AUTH=1                 the same login on 127.0.0.1 (a shared machine, a TLS proxy in front)
  MLFLOW_ADMIN_PASSWORD_FILE    a file (yours only: chmod 600) holding the admin's password, 12+ characters,
                                never a default one; read here and handed to MLflow in its environment
                                (MLFLOW_AUTH_ADMIN_PASSWORD), so it is in no command line, image or .env.
                                It is the admin's password at every start: a changed file changes it
  MLFLOW_ADMIN_USERNAME         the admin's name (admin)

Basic auth over plain HTTP sends the password in clear: put TLS in front (a reverse proxy, README).
Other knobs: MLFLOW_PORT (5000); MLFLOW_BACKEND_STORE_URI (default: SQLite in RUNS_DIR/mlflow; a team
server on many nodes wants PostgreSQL or MySQL: the URI, and the database password in it, reach MLflow in
its environment, never its command line); MLFLOW_SERVER_ALLOWED_HOSTS (the Host headers it
answers, MLflow's guard against DNS rebinding; the default adds the compose service's name and this
machine's). Artifacts go to RUNS_DIR/mlflow/artifacts, uploaded through the server; with auth on, the
users and their permissions are in RUNS_DIR/mlflow/basic_auth.db. What the server writes there is its
user's alone (umask 077, the folder 700).

  python3 docker/mlflow_server.py --add-user NAME    (`make mlflow-user`: a user for training jobs, not an admin)

The checks and --add-user are standard library only (the host's python3); MLflow's own user store is
imported only to set the admin's password, just before the server starts.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import secrets
import socket
import stat
import sys
import urllib.error
import urllib.parse
import urllib.request
import warnings
from pathlib import Path

# Passwords that a scan tries first; MLflow's own check only asks for 12 characters.
COMMON = {"password1234", "passwordpassword", "123456789012", "administrator", "adminadminadmin",
          "mlflowmlflow", "changemechangeme", "qwertyuiopas", "trainboxtrainbox", "letmeinletmein"}
NEW_PASSWORD = "python3 -c 'import secrets; print(secrets.token_urlsafe(18))'"


class ServerError(ValueError):
    """A setting the server refuses: one line, the cause and the fix."""


def check_password(password: str, username: str,
                   what: str = "the admin password in MLFLOW_ADMIN_PASSWORD_FILE") -> None:
    if len(password) < 12:
        raise ServerError(f"{what} has {len(password)} characters: use 12 or more (e.g. {NEW_PASSWORD})")
    lowered = password.lower()
    if lowered in COMMON or len(set(password)) < 6 or username.lower() in lowered or "password" in lowered:
        raise ServerError(f"{what} is too easy to guess (a common word, the user name or few distinct "
                          f"characters): use a random one, e.g. {NEW_PASSWORD}")


def read_secret(name: str, key: str, fix: str) -> str:
    """The first line of the file `name` (the setting `key`): readable, the owner's alone, not empty."""
    path = Path(name).expanduser()
    try:
        mode = path.stat().st_mode
        password = path.read_text().strip()
    except OSError as e:
        raise ServerError(f"{key}={name} cannot be read ({e.strerror}): {fix}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO) and not name.startswith("/run/secrets/"):
        raise ServerError(f"{key}={name} can be read by others (mode {stat.S_IMODE(mode):o}): chmod 600 {name}")
    if not password:
        raise ServerError(f"{key}={name} is empty: {fix}")
    return password


def read_password(env, why: str = "MLFLOW_EXPOSE=1 opens the server to the network only with a login") -> str:
    """The admin password from MLFLOW_ADMIN_PASSWORD_FILE, checked: present, private, strong enough."""
    name = env.get("MLFLOW_ADMIN_PASSWORD_FILE", "")
    fix = (f"put a random password in a file only you can read (umask 077; {NEW_PASSWORD} > ~/.mlflow-admin) "
           f"and set MLFLOW_ADMIN_PASSWORD_FILE=~/.mlflow-admin")
    if not name:
        raise ServerError(f"{why}, and no admin password was given: {fix}")
    password = read_secret(name, "MLFLOW_ADMIN_PASSWORD_FILE", fix)
    check_password(password, env.get("MLFLOW_ADMIN_USERNAME") or "admin")
    return password


def _switch(env, key: str, meaning: str) -> bool:
    value = env.get(key, "").strip()
    if value not in ("", "0", "1"):
        raise ServerError(f"{key}={value!r}: use 1 ({meaning}) or leave it unset")
    return value == "1"


def exposed(env) -> bool:
    value = env.get("MLFLOW_EXPOSE", "").strip()
    if value not in ("", "0", "1"):
        raise ServerError(f"MLFLOW_EXPOSE={value!r}: use 1 (a team server with a login) or leave it unset (this "
                          f"machine only)")
    return value == "1"


def login_on_loopback(env) -> bool:
    """MLFLOW_AUTH=1: the login of a team server on 127.0.0.1 too, where every local user reaches the port."""
    on = _switch(env, "MLFLOW_AUTH", "a login for every request, from this machine too")
    if env.get("MLFLOW_AUTH", "").strip() == "0" and exposed(env):
        raise ServerError("MLFLOW_AUTH=0 with MLFLOW_EXPOSE=1: a server on the network always asks for a login: "
                          "unset MLFLOW_AUTH")
    return on


def listen_address(env, in_container: bool) -> str:
    """Where the server listens. In the compose container always on every interface of the container's own
    network (the trainer reaches mlflow:5000; the host publishes the port on 127.0.0.1 unless exposed)."""
    if in_container:
        return "0.0.0.0"
    if not exposed(env):
        return "127.0.0.1"
    return env.get("MLFLOW_BIND") or "0.0.0.0"


def command(runs: Path, env, in_container: bool) -> tuple[list[str], dict[str, str], str]:
    """The mlflow server command line, its environment (no secret on the command line) and where it
    answers, checked."""
    bind = listen_address(env, in_container)
    publish = env.get("MLFLOW_BIND") or "127.0.0.1" if in_container else bind
    open_to_network = exposed(env) or not _loopback(publish)
    login = login_on_loopback(env) or open_to_network
    port = env.get("MLFLOW_PORT") or "5000"
    where = f"{publish}:{port}" + ("" if open_to_network else ", this machine only")
    where += ", login required (basic auth)" if login else ""
    child = dict(env)
    # `mlflow server` reads both from its environment (click's envvar): a PostgreSQL or MySQL URI carries the
    # database's password, and a command line is readable by every local user (ps).
    child["MLFLOW_BACKEND_STORE_URI"] = env.get("MLFLOW_BACKEND_STORE_URI") or f"sqlite:///{runs}/mlflow/mlflow.db"
    child["MLFLOW_ARTIFACTS_DESTINATION"] = f"{runs}/mlflow/artifacts"
    # MLflow's job runner (four huey worker processes beside the server, about 1 GB) serves its GenAI features
    # (prompt optimisation, trace roll-ups); tracking training runs never uses it. MLFLOW_SERVER_ENABLE_JOB_EXECUTION
    # =true turns it back on.
    child.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    args = ["mlflow", "server", "--host", bind, "--port", "5000" if in_container else port, "--workers", "1"]
    if open_to_network and not exposed(env):
        raise ServerError(f"MLFLOW_BIND={publish} opens the server to the network: set MLFLOW_EXPOSE=1 (a login "
                          f"for every request) with MLFLOW_ADMIN_PASSWORD_FILE, or leave MLFLOW_BIND unset")
    if login:
        password = read_password(env, "MLFLOW_EXPOSE=1 opens the server to the network only with a login"
                                 if open_to_network else "MLFLOW_AUTH=1 asks for a login")
        config = runs / "mlflow" / "basic_auth.ini"  # written by main(): no secret in it
        child.update(MLFLOW_AUTH_CONFIG_PATH=str(config), MLFLOW_AUTH_ADMIN_PASSWORD=password,
                     MLFLOW_FLASK_SERVER_SECRET_KEY=secrets.token_hex(32))
        args += ["--app-name", "basic-auth"]
    host = socket.gethostname()
    private = "10.*,192.168.*,172.1[6-9].*,172.2[0-9].*,172.3[01].*,fc00:*,fd00:*"
    if not child.get("MLFLOW_SERVER_ALLOWED_HOSTS"):  # unset, or empty (compose passes it on either way)
        child["MLFLOW_SERVER_ALLOWED_HOSTS"] = ",".join(
            f"{name},{name}:*" for name in ("localhost", "127.0.0.1", "mlflow", host)) + "," + private
    return args, child, where


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def keep_private(folder: Path) -> None:
    """RUNS_DIR/mlflow, the runs, artifacts and users' password hashes in it: the server's user's alone, so
    that nobody else on the NAS reads them. New files by the umask (the server inherits it), a store from an
    earlier start by its modes, made so here."""
    os.umask(0o077)
    try:
        (folder / "artifacts").mkdir(parents=True, exist_ok=True)
        for path in (folder, *(folder / name for name in ("mlflow.db", "basic_auth.db", "basic_auth.ini"))):
            if path.exists():
                path.chmod(stat.S_IMODE(path.stat().st_mode) & ~0o077)
    except PermissionError as e:
        raise ServerError(f"{e.filename} cannot be written by uid {os.getuid()}, the server's user: `make mlflow` "
                          f"hands {folder} to the container's user, or run `chown -R {os.getuid()}:{os.getgid()} "
                          f"{folder}`") from None


def set_admin_password(database_uri: str, username: str, password: str) -> bool:
    """Make `password` the admin's in MLflow's user store, with MLflow's own store, before the server starts:
    MLflow reads MLFLOW_AUTH_ADMIN_PASSWORD only when it creates the admin, so without this a changed password
    file would leave the old password in use. True when the admin's password changed.

    MLflow's documented way to change a password (its REST API, AuthServiceClient) logs in with the current one,
    which a changed file no longer gives: this is the one place that uses MLflow's user store itself
    (mlflow.server.auth.sqlalchemy_store, not in MLflow's documented API; checked with mlflow 3.17.2, docker/mlflow.in).
    tests/e2e/test_services.py's test_the_admin_password_is_the_one_in_its_file_at_every_start fails on an MLflow that
    changes it."""
    try:
        with warnings.catch_warnings():  # a deprecation in a dependency of MLflow's, not the user's to fix
            warnings.simplefilter("ignore")
            from mlflow.server.auth.sqlalchemy_store import SqlAlchemyStore  # noqa: PLC0415 - only where MLflow is
        store = SqlAlchemyStore()
        store.init_db(database_uri)
        if not store.has_user(username, use_primary=True):
            return False  # the server creates the admin with this password
        if store.authenticate_user(username, password, use_primary=True):
            return False
        store.update_user(username, password=password)
        return True
    except Exception as e:  # noqa: BLE001 - any failure of the store is one line, before the server starts
        raise ServerError(f"the admin's password could not be set in {database_uri} ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}): check that file, or move it away to start "
                          f"with the admin alone") from None


def _api(uri: str, method: str, path: str, login: tuple[str, str], body: dict | None = None) -> tuple[int, dict]:
    """One request to MLflow's REST API as `login`: the HTTP status and the JSON answer ({} if none)."""
    token = base64.b64encode(":".join(login).encode()).decode()
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(uri + path, method=method, data=data,
                                     headers={"Authorization": f"Basic {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            status, text = answer.status, answer.read()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read()
    except OSError as e:
        raise ServerError(f"no MLflow server answers at {uri} ({getattr(e, 'reason', e)}): start it with a login on "
                          f"this machine (make mlflow MLFLOW_AUTH=1 or MLFLOW_EXPOSE=1, with "
                          f"MLFLOW_ADMIN_PASSWORD_FILE), or set MLFLOW_PORT to its port") from None
    try:
        return status, json.loads(text or b"{}")
    except ValueError:
        return status, {}


def user_password(path: Path, username: str) -> str:
    """The jobs' user's password: the one in `path`, or a new random one written there (the owner's alone)."""
    if path.exists():
        password = read_secret(str(path), "MLFLOW_USER_PASSWORD_FILE", "delete it: a new password is written there")
        check_password(password, username, f"the password in MLFLOW_USER_PASSWORD_FILE={path}")
        return password
    password = secrets.token_urlsafe(18)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise ServerError(f"MLFLOW_USER_PASSWORD_FILE={path} cannot be written ({e.strerror}): name a file in a "
                          f"folder of yours") from None
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    return password


def add_user(env, username: str) -> str:
    """`make mlflow-user`: the user NAME for training jobs, not an admin, on the server of this machine (through
    MLflow's REST API, as the admin): created, or its password set to the one in its file; allowed to log runs
    in the experiment the trainer uses (MLFLOW_EXPERIMENT_NAME, trainbox) when it exists already (one it
    creates itself is its own). What to pass to the jobs, on success."""
    admin = env.get("MLFLOW_ADMIN_USERNAME") or "admin"
    if not username or username == admin:
        raise ServerError(f"MLFLOW_USER={username!r}: name the jobs' user, not the admin (e.g. MLFLOW_USER=trainer)")
    login = (admin, read_password(env, "make mlflow-user logs in as the admin"))
    bind = env.get("MLFLOW_BIND") or "127.0.0.1"
    uri = f"http://{'127.0.0.1' if bind in ('0.0.0.0', '::') else bind}:{env.get('MLFLOW_PORT') or '5000'}"
    file = Path(env.get("MLFLOW_USER_PASSWORD_FILE") or f"~/.mlflow-{username}").expanduser()

    status, found = _api(uri, "GET", "/api/2.0/mlflow/users/get?" + urllib.parse.urlencode({"username": username}),
                         login)
    if status == 401:
        raise ServerError(f"the MLflow server at {uri} refused the admin's login: MLFLOW_ADMIN_PASSWORD_FILE must be "
                          f"the server's (after changing the file, `make mlflow` again starts it with the new one)")
    if status == 404 and found.get("error_code") != "RESOURCE_DOES_NOT_EXIST":
        raise ServerError(f"the MLflow server at {uri} asks for no login, so it has no users: start it with "
                          f"MLFLOW_AUTH=1 (this machine) or MLFLOW_EXPOSE=1 (the network)")
    if status == 200 and found["user"].get("is_admin"):
        raise ServerError(f"{username} is an admin of the MLflow server at {uri}: name another user for the jobs")
    password = user_password(file, username)
    if status == 200:
        status, answer = _api(uri, "PATCH", "/api/2.0/mlflow/users/update-password", login,
                              {"username": username, "password": password})
    else:
        status, answer = _api(uri, "POST", "/api/2.0/mlflow/users/create", login,
                              {"username": username, "password": password})
    if status != 200:
        raise ServerError(f"the MLflow server at {uri} did not take the user {username} (HTTP {status}: "
                          f"{answer.get('message', '')}): see its log")
    experiment = env.get("MLFLOW_EXPERIMENT_NAME") or "trainbox"
    status, found = _api(uri, "GET", "/api/2.0/mlflow/experiments/get-by-name?"
                         + urllib.parse.urlencode({"experiment_name": experiment}), login)
    allowed = f"it creates experiment {experiment!r} as its own"
    if status == 200:
        status, answer = _api(uri, "POST", "/api/3.0/mlflow/users/permissions/grant", login,
                              {"username": username, "resource_type": "experiment",
                               "resource_id": found["experiment"]["experiment_id"], "permission": "EDIT"})
        if status != 200 and answer.get("error_code") != "RESOURCE_ALREADY_EXISTS":
            raise ServerError(f"the MLflow server at {uri} did not let {username} log to experiment {experiment!r} "
                              f"(HTTP {status}: {answer.get('message', '')}): see its log")
        allowed = f"it may log runs in experiment {experiment!r}"
    return (f"MLflow user {username} (not an admin) at {uri}: its password is in {file}; {allowed}.\n"
            f"Jobs log in with: MLFLOW_TRACKING_USERNAME={username} MLFLOW_TRACKING_PASSWORD=\"$(cat {file})\"")


def main(argv: list[str]) -> int:
    """RUNS_DIR: start the server there. --check: only check the settings (make mlflow, on the host, before
    the container starts), the compose way (MLFLOW_BIND is then the address the port is published on).
    --add-user NAME: make mlflow-user."""
    if argv[:1] == ["--add-user"] and len(argv) == 2:
        try:
            print(add_user(os.environ, argv[1]))
        except ServerError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    check = argv[:1] == ["--check"]
    if len(argv) != 1 + check:
        print("usage: python docker/mlflow_server.py [--check] RUNS_DIR | --add-user NAME", file=sys.stderr)
        return 2
    runs = Path(argv[-1]).resolve()
    in_container = check or os.environ.get("TRAINBOX_MLFLOW_IN_CONTAINER") == "1"
    users = f"sqlite:///{runs}/mlflow/basic_auth.db"
    try:
        args, env, where = command(runs, os.environ, in_container)
        if check:
            return 0
        keep_private(runs / "mlflow")
        if "MLFLOW_AUTH_CONFIG_PATH" in env:
            admin = env.get("MLFLOW_ADMIN_USERNAME") or "admin"
            Path(env["MLFLOW_AUTH_CONFIG_PATH"]).write_text(
                f"[mlflow]\ndefault_permission = READ\ndatabase_uri = {users}\nadmin_username = {admin}\n"
                "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
            if set_admin_password(users, admin, env["MLFLOW_AUTH_ADMIN_PASSWORD"]):
                print(f"mlflow server: {admin}'s password is now the one in MLFLOW_ADMIN_PASSWORD_FILE (the file "
                      f"changed); the old one no longer logs in", file=sys.stderr, flush=True)
    except (ServerError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"mlflow server: {where}", file=sys.stderr, flush=True)
    os.execvpe(args[0], args, env)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
