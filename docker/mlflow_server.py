"""The MLflow tracking server of trainbox's runs, its store on the NAS beside them: `make mlflow` (local) and
the compose service `mlflow` (docker/mlflow.Dockerfile) both start it with this script.

  python docker/mlflow_server.py RUNS_DIR            (the MLflow environment's python: .venv-mlflow, the image)

Closed by default: it listens on 127.0.0.1 only (compose publishes its port on the host's 127.0.0.1), with
no login; reach it from a laptop through an SSH tunnel. A team server is opened on purpose:

  MLFLOW_EXPOSE=1               listen on MLFLOW_BIND (default 0.0.0.0, every interface) with MLflow's
                                basic-auth app on: every request needs a user and password
  MLFLOW_ADMIN_PASSWORD_FILE    a file (yours only: chmod 600) holding the admin's password, 12+ characters,
                                never a default one; read here and handed to MLflow in its environment
                                (MLFLOW_AUTH_ADMIN_PASSWORD), so it is in no command line, image or .env
  MLFLOW_ADMIN_USERNAME         the admin's name (admin)

Basic auth over plain HTTP sends the password in clear: put TLS in front (a reverse proxy, README).
Other knobs: MLFLOW_PORT (5000); MLFLOW_BACKEND_STORE_URI (default: SQLite in RUNS_DIR/mlflow; a team
server on many nodes wants PostgreSQL or MySQL); MLFLOW_SERVER_ALLOWED_HOSTS (the Host headers it
answers, MLflow's guard against DNS rebinding; the default adds the compose service's name and this
machine's). Artifacts go to RUNS_DIR/mlflow/artifacts, uploaded through the server; with auth on, the
users and their permissions are in RUNS_DIR/mlflow/basic_auth.db.

Standard library only, so that its checks run (and are tested) before MLflow is imported.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import stat
import sys
from pathlib import Path

# Passwords that a scan tries first; MLflow's own check only asks for 12 characters.
COMMON = {"password1234", "passwordpassword", "123456789012", "administrator", "adminadminadmin",
          "mlflowmlflow", "changemechangeme", "qwertyuiopas", "trainboxtrainbox", "letmeinletmein"}


class ServerError(ValueError):
    """A setting the server refuses: one line, the cause and the fix."""


def check_password(password: str, username: str) -> None:
    if len(password) < 12:
        raise ServerError(f"the admin password in MLFLOW_ADMIN_PASSWORD_FILE has {len(password)} characters: use "
                          f"12 or more (e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(18))')")
    lowered = password.lower()
    if lowered in COMMON or len(set(password)) < 6 or username.lower() in lowered or "password" in lowered:
        raise ServerError("the admin password in MLFLOW_ADMIN_PASSWORD_FILE is too easy to guess (a common "
                          "word, the user name or few distinct characters): use a random one, e.g. "
                          "python3 -c 'import secrets; print(secrets.token_urlsafe(18))'")


def read_password(env) -> str:
    """The admin password from MLFLOW_ADMIN_PASSWORD_FILE, checked: present, private, strong enough."""
    name = env.get("MLFLOW_ADMIN_PASSWORD_FILE", "")
    fix = ("put a random password in a file only you can read (umask 077; python3 -c 'import secrets; "
           "print(secrets.token_urlsafe(18))' > ~/.mlflow-admin) and set MLFLOW_ADMIN_PASSWORD_FILE=~/.mlflow-admin")
    if not name:
        raise ServerError(f"MLFLOW_EXPOSE=1 opens the server to the network only with a login, and no admin "
                          f"password was given: {fix}")
    path = Path(name).expanduser()
    try:
        mode = path.stat().st_mode
        password = path.read_text().strip()
    except OSError as e:
        raise ServerError(f"MLFLOW_ADMIN_PASSWORD_FILE={name} cannot be read ({e.strerror}): {fix}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO) and not name.startswith("/run/secrets/"):
        raise ServerError(f"MLFLOW_ADMIN_PASSWORD_FILE={name} can be read by others (mode {stat.S_IMODE(mode):o}): "
                          f"chmod 600 {name}")
    if not password:
        raise ServerError(f"MLFLOW_ADMIN_PASSWORD_FILE={name} is empty: {fix}")
    check_password(password, env.get("MLFLOW_ADMIN_USERNAME") or "admin")
    return password


def exposed(env) -> bool:
    value = env.get("MLFLOW_EXPOSE", "").strip()
    if value not in ("", "0", "1"):
        raise ServerError(f"MLFLOW_EXPOSE={value!r}: use 1 (a team server with a login) or leave it unset (this "
                          f"machine only)")
    return value == "1"


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
    port = env.get("MLFLOW_PORT") or "5000"
    where = f"{publish}:{port}" + (", login required (basic auth)" if open_to_network else ", this machine only")
    child = dict(env)
    args = ["mlflow", "server", "--host", bind, "--port", "5000" if in_container else port, "--workers", "1",
            "--backend-store-uri", env.get("MLFLOW_BACKEND_STORE_URI") or f"sqlite:///{runs}/mlflow/mlflow.db",
            "--artifacts-destination", f"{runs}/mlflow/artifacts"]
    if open_to_network:
        if not exposed(env):
            raise ServerError(f"MLFLOW_BIND={publish} opens the server to the network: set MLFLOW_EXPOSE=1 (a login "
                              f"for every request) with MLFLOW_ADMIN_PASSWORD_FILE, or leave MLFLOW_BIND unset")
        password = read_password(env)
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


def main(argv: list[str]) -> int:
    """RUNS_DIR: start the server there. --check: only check the settings (make mlflow, on the host, before
    the container starts), the compose way (MLFLOW_BIND is then the address the port is published on)."""
    check = argv[:1] == ["--check"]
    if len(argv) != 1 + check:
        print("usage: python docker/mlflow_server.py [--check] RUNS_DIR", file=sys.stderr)
        return 2
    runs = Path(argv[-1]).resolve()
    in_container = check or os.environ.get("TRAINBOX_MLFLOW_IN_CONTAINER") == "1"
    try:
        if not check:
            (runs / "mlflow" / "artifacts").mkdir(parents=True, exist_ok=True)
        args, env, where = command(runs, os.environ, in_container)
    except (ServerError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if check:
        return 0
    if "MLFLOW_AUTH_CONFIG_PATH" in env:
        Path(env["MLFLOW_AUTH_CONFIG_PATH"]).write_text(
            "[mlflow]\ndefault_permission = READ\n"
            f"database_uri = sqlite:///{runs}/mlflow/basic_auth.db\n"
            f"admin_username = {env.get('MLFLOW_ADMIN_USERNAME') or 'admin'}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    print(f"mlflow server: {where}", file=sys.stderr, flush=True)
    os.execvpe(args[0], args, env)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
