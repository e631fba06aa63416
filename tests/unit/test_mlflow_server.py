"""docker/mlflow_server.py: closed by default; open to the network only with a login and a real password."""

import os
import stat

import pytest

from tests.helpers import host_tool

server = host_tool("docker/mlflow_server.py")
STRONG = "q7Jx-2mLp_9Vz4Rk"


def _password_file(tmp_path, text=STRONG, mode=0o600):
    path = tmp_path / "admin-password"
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


def test_closed_by_default_local_and_in_compose(tmp_path):
    args, env, where = server.command(tmp_path, {}, in_container=False)
    assert args[args.index("--host") + 1] == "127.0.0.1" and "--app-name" not in args
    assert where == "127.0.0.1:5000, this machine only"
    # In compose the server listens on the container's own network (the trainer reaches mlflow:5000) and the
    # host publishes the port on its loopback (MLFLOW_BIND's default): no login needed there either.
    args, env, where = server.command(tmp_path, {"MLFLOW_PORT": "5123"}, in_container=True)
    assert args[args.index("--host") + 1] == "0.0.0.0" and args[args.index("--port") + 1] == "5000"
    assert "--app-name" not in args and where == "127.0.0.1:5123, this machine only"
    assert "MLFLOW_AUTH_ADMIN_PASSWORD" not in env
    # the Host names it answers: the compose service's too, also when compose passes the variable on empty
    for given in ({}, {"MLFLOW_SERVER_ALLOWED_HOSTS": ""}):
        assert "mlflow,mlflow:*" in server.command(tmp_path, given, in_container=True)[1]["MLFLOW_SERVER_ALLOWED_HOSTS"]
    assert server.command(tmp_path, {"MLFLOW_SERVER_ALLOWED_HOSTS": "team.example.org"},
                          in_container=True)[1]["MLFLOW_SERVER_ALLOWED_HOSTS"] == "team.example.org"


def test_exposed_means_basic_auth_with_the_password_out_of_the_command_line(tmp_path):
    password = _password_file(tmp_path)
    given = {"MLFLOW_EXPOSE": "1", "MLFLOW_ADMIN_PASSWORD_FILE": str(password)}
    args, env, where = server.command(tmp_path, given, in_container=False)
    assert args[args.index("--host") + 1] == "0.0.0.0" and args[-2:] == ["--app-name", "basic-auth"]
    assert env["MLFLOW_AUTH_ADMIN_PASSWORD"] == STRONG and STRONG not in " ".join(args)
    assert env["MLFLOW_AUTH_CONFIG_PATH"] == str(tmp_path / "mlflow" / "basic_auth.ini")
    assert len(env["MLFLOW_FLASK_SERVER_SECRET_KEY"]) == 64 and where == "0.0.0.0:5000, login required (basic auth)"
    one = server.command(tmp_path, {**given, "MLFLOW_BIND": "10.1.2.3"}, in_container=False)[0]
    assert one[one.index("--host") + 1] == "10.1.2.3"  # one interface of the host
    # compose: published on MLFLOW_BIND, the password file mounted as a secret
    _, env, where = server.command(tmp_path, {**given, "MLFLOW_BIND": "0.0.0.0"}, in_container=True)
    assert where == "0.0.0.0:5000, login required (basic auth)" and env["MLFLOW_AUTH_ADMIN_PASSWORD"] == STRONG


@pytest.mark.parametrize("case, message", [
    ("no-file", "MLFLOW_EXPOSE=1 opens the server to the network only with a login, and no admin password was given"),
    ("missing", "cannot be read (No such file or directory)"),
    ("empty", "is empty"),
    ("readable-by-others", "can be read by others (mode 644): chmod 600"),
    ("short", "has 8 characters: use 12 or more"),
    ("common", "is too easy to guess"),
    ("few-characters", "is too easy to guess"),
    ("the-user-name", "is too easy to guess"),
    ("bind-without-expose", "MLFLOW_BIND=0.0.0.0 opens the server to the network: set MLFLOW_EXPOSE=1"),
    ("expose-not-1", "MLFLOW_EXPOSE='yes': use 1"),
])
def test_a_missing_or_weak_password_is_refused_in_one_line(tmp_path, case, message):
    env = {"MLFLOW_EXPOSE": "1"}
    if case != "no-file":
        text = {"empty": "", "short": "a1b2c3d4", "common": "password1234", "few-characters": "abababababab",
                "the-user-name": "admin-2026-xyz"}.get(case, STRONG)
        env["MLFLOW_ADMIN_PASSWORD_FILE"] = str(_password_file(tmp_path, text, 0o644 if case == "readable-by-others"
                                                               else 0o600))
        if case == "missing":
            env["MLFLOW_ADMIN_PASSWORD_FILE"] = str(tmp_path / "nowhere")
    in_container = False
    if case == "bind-without-expose":
        env, in_container = {"MLFLOW_BIND": "0.0.0.0"}, True
    if case == "expose-not-1":
        env["MLFLOW_EXPOSE"] = "yes"
    with pytest.raises(server.ServerError) as e:
        server.command(tmp_path, env, in_container)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_check_make_mlflow_runs_before_the_container_starts(tmp_path, capsys, monkeypatch):
    for key in ("MLFLOW_EXPOSE", "MLFLOW_BIND", "MLFLOW_ADMIN_PASSWORD_FILE"):
        monkeypatch.delenv(key, raising=False)
    assert server.main(["--check", str(tmp_path)]) == 0
    monkeypatch.setenv("MLFLOW_EXPOSE", "1")
    monkeypatch.setenv("MLFLOW_BIND", "0.0.0.0")
    assert server.main(["--check", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: MLFLOW_EXPOSE=1 opens the server to the network only")
    monkeypatch.setenv("MLFLOW_ADMIN_PASSWORD_FILE", str(_password_file(tmp_path)))
    assert server.main(["--check", str(tmp_path)]) == 0
    assert not (tmp_path / "mlflow").exists()  # a check writes nothing
    assert os.environ.get("MLFLOW_AUTH_ADMIN_PASSWORD") is None


def test_the_store_uri_reaches_mlflow_in_its_environment_not_its_command_line(tmp_path):
    # `mlflow server` reads both from its environment (click's envvar); a command line is readable by everyone (ps)
    uri = "postgresql://mlflow:db-secret-1234@db.example.org/mlflow"
    for given, expected in (({}, f"sqlite:///{tmp_path}/mlflow/mlflow.db"), ({"MLFLOW_BACKEND_STORE_URI": uri}, uri)):
        args, env, _ = server.command(tmp_path, given, in_container=False)
        assert env["MLFLOW_BACKEND_STORE_URI"] == expected and expected not in " ".join(args)
        assert env["MLFLOW_ARTIFACTS_DESTINATION"] == f"{tmp_path}/mlflow/artifacts"
        assert not [a for a in args if a.startswith(("--backend-store-uri", "--artifacts-destination"))]


def test_mlflow_auth_asks_for_the_login_on_loopback_too(tmp_path):
    """Every local user reaches 127.0.0.1: MLFLOW_AUTH=1 puts the team server's login there as well."""
    password = _password_file(tmp_path)
    given = {"MLFLOW_AUTH": "1", "MLFLOW_ADMIN_PASSWORD_FILE": str(password)}
    args, env, where = server.command(tmp_path, given, in_container=False)
    assert args[args.index("--host") + 1] == "127.0.0.1" and args[-2:] == ["--app-name", "basic-auth"]
    assert where == "127.0.0.1:5000, this machine only, login required (basic auth)"
    assert env["MLFLOW_AUTH_ADMIN_PASSWORD"] == STRONG and STRONG not in " ".join(args)
    args, _, where = server.command(tmp_path, given, in_container=True)  # compose: published on the host's loopback
    assert args[-2:] == ["--app-name", "basic-auth"]
    assert where == "127.0.0.1:5000, this machine only, login required (basic auth)"
    refused = [({"MLFLOW_AUTH": "1"}, "MLFLOW_AUTH=1 asks for a login, and no admin password was given: "),
               ({"MLFLOW_AUTH": "yes"}, "MLFLOW_AUTH='yes': use 1"),
               ({"MLFLOW_AUTH": "0", "MLFLOW_EXPOSE": "1"},
                "MLFLOW_AUTH=0 with MLFLOW_EXPOSE=1: a server on the network always asks for a login")]
    for given, message in refused:
        with pytest.raises(server.ServerError) as e:
            server.command(tmp_path, given, in_container=False)
        assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.fixture
def umask():
    """The test's process umask as it was, after a test that sets it (as the server does)."""
    before = os.umask(0o022)
    os.umask(before)
    yield
    os.umask(before)


def test_the_store_is_the_servers_user_alone(tmp_path, umask):
    store = tmp_path / "mlflow"
    store.mkdir(mode=0o755)
    for name in ("mlflow.db", "basic_auth.db"):  # a store from an earlier start, readable by everyone
        (store / name).write_text("")
        (store / name).chmod(0o644)
    server.keep_private(store)
    assert stat.S_IMODE(store.stat().st_mode) == 0o700 and (store / "artifacts").is_dir()
    for name in ("mlflow.db", "basic_auth.db"):
        assert stat.S_IMODE((store / name).stat().st_mode) == 0o600
    (store / "artifacts" / "new").write_text("")  # what the server writes next: its user's alone (umask 077)
    assert stat.S_IMODE((store / "artifacts" / "new").stat().st_mode) == 0o600


def test_make_mlflow_user_refuses_the_admin_and_a_missing_server_in_one_line(tmp_path):
    admin = {"MLFLOW_ADMIN_PASSWORD_FILE": str(_password_file(tmp_path)), "MLFLOW_PORT": "1"}
    with pytest.raises(server.ServerError) as e:
        server.add_user(admin, "admin")
    assert str(e.value) == "MLFLOW_USER='admin': name the jobs' user, not the admin (e.g. MLFLOW_USER=trainer)"
    with pytest.raises(server.ServerError) as e:
        server.add_user({}, "trainer")
    assert str(e.value).startswith("make mlflow-user logs in as the admin, and no admin password was given: ")
    with pytest.raises(server.ServerError) as e:
        server.add_user(admin, "trainer")
    assert str(e.value).startswith("no MLflow server answers at http://127.0.0.1:1 (")
    assert "\n" not in str(e.value) and not list(tmp_path.glob("*trainer*"))  # no password file before a server


def test_mlflows_job_runner_is_off_unless_asked_for(tmp_path):
    _, env, _ = server.command(tmp_path, {}, in_container=False)
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    _, env, _ = server.command(tmp_path, {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "true"}, in_container=False)
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "true"
