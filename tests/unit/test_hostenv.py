"""train/hostenv.py (`make env`): the .env that compose reads, and the driver table."""

import os
import stat

import pytest

import train.hostenv as hostenv


def test_writes_ids_paths_and_compose_files_and_keeps_other_keys(tmp_path, monkeypatch):
    monkeypatch.delenv("HOST_UID", raising=False)
    monkeypatch.delenv("HOST_GID", raising=False)
    env_file = tmp_path / ".env"
    env_file.write_text("# mine\nWANDB_PROJECT=demo\nDATA_DIR=/old\n")
    data = tmp_path / "datasets"
    data.mkdir()
    runs = tmp_path / "nas" / "runs"
    runs.mkdir(parents=True)
    assert hostenv.main(["--file", str(env_file), "--data-dir", str(data), "--runs-dir", str(runs),
                         "--image", "trainbox:x"]) == 0
    values = hostenv.read_env(env_file)
    # the host user's own, root's too: files written in the container and outside belong to the same user
    assert values["HOST_UID"] == str(os.getuid()) and values["HOST_GID"] == str(os.getgid())
    assert values["DATA_DIR"] == str(data) and values["RUNS_DIR"] == str(runs)
    assert values["WANDB_PROJECT"] == "demo" and values["TRAINBOX_IMAGE"] == "trainbox:x"
    expected = hostenv.GPU_COMPOSE if hostenv.host_has_gpus() else hostenv.CPU_COMPOSE
    assert values["COMPOSE_FILE"] == expected


def test_a_named_folder_must_exist_and_only_the_defaults_are_made(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    env_file = tmp_path / ".env"
    missing = tmp_path / "nas" / "runs"  # the NAS not mounted: nothing may be made there
    assert hostenv.main(["--file", str(env_file), "--runs-dir", str(missing)]) == 2
    assert capsys.readouterr().err.startswith(f"error: RUNS_DIR={missing} does not exist: mount the NAS there")
    assert not (tmp_path / "nas").exists() and not env_file.exists()
    assert hostenv.main(["--file", str(env_file)]) == 0  # the defaults, ./data and ./runs, are made
    values = hostenv.read_env(env_file)
    assert values["RUNS_DIR"] == str(tmp_path / "runs") and (tmp_path / "runs").is_dir()
    owner = (tmp_path / "runs").stat()
    assert (owner.st_uid, owner.st_gid) == (os.getuid(), os.getgid())
    assert values["DATA_DIR"] == str(tmp_path / "data") and (tmp_path / "data").is_dir()
    (tmp_path / "runs").rmdir()  # the default, deleted: a later `make env` makes it again
    assert hostenv.main(["--file", str(env_file)]) == 0 and (tmp_path / "runs").is_dir()
    env_file.write_text(f"DATA_DIR={tmp_path / 'gone'}\n")  # named in .env, since unmounted
    assert hostenv.main(["--file", str(env_file)]) == 2
    assert f"DATA_DIR={tmp_path / 'gone'} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "gone").exists()


def test_points_compose_runs_at_an_mlflow_server_and_keeps_it(tmp_path):
    env_file = tmp_path / ".env"
    assert hostenv.main(["--file", str(env_file), "--mlflow-uri", "http://mlflow:5000"]) == 0
    assert hostenv.read_env(env_file)["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert hostenv.main(["--file", str(env_file)]) == 0  # a later `make env` without it keeps it
    assert hostenv.read_env(env_file)["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert hostenv.main(["--file", str(env_file), "--mlflow-uri", ""]) == 0  # empty: tracking off
    assert hostenv.read_env(env_file)["MLFLOW_TRACKING_URI"] == ""


@pytest.mark.parametrize("driver, cuda, too_old", [
    ("535.183.01", "13.0", True), ("550.54", "12.8", False), ("580.159.04", "13.0", False),
    ("520.61", "12.6", True), ("470.1", "11.8", False),
])
def test_driver_against_the_image_cuda(driver, cuda, too_old):
    problem = hostenv.driver_problem(driver, cuda)
    assert (problem is not None) == too_old
    if too_old:
        assert problem.startswith(f"driver {driver} is too old for CUDA {cuda}") and "TORCH_FLAVOUR=cu128" in problem


@pytest.mark.skipif(os.getuid() != 0, reason="chown needs root")
def test_root_hands_the_default_folders_to_a_container_user_it_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOST_UID", "1234")
    monkeypatch.setenv("HOST_GID", "1235")
    assert hostenv.main(["--file", str(tmp_path / ".env")]) == 0
    for name in ("runs", "data"):
        assert ((tmp_path / name).stat().st_uid, (tmp_path / name).stat().st_gid) == (1234, 1235)


@pytest.mark.skipif(os.getuid() != 0, reason="chown needs root")
def test_a_folder_the_container_user_cannot_write_is_named_before_the_container_starts(tmp_path, capsys):
    runs = tmp_path / "runs"
    (runs / "exp1" / "checkpoints").mkdir(parents=True)
    runs.chmod(0o755)
    env_file = tmp_path / ".env"
    env_file.write_text(f"HOST_UID=1234\nHOST_GID=1234\nRUNS_DIR={runs}\n")
    assert hostenv.main(["--check-writable", "--file", str(env_file), "--", "--preset", "debug"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {runs} belongs to uid 0 (gid 0) and the container runs as uid 1234 (gid 1234, "
                   f"HOST_UID/HOST_GID in {env_file}), which cannot write it: run `make env` (the container then "
                   f"runs as you, uid 0) or `chown -R 1234:1234 {runs}`")
    os.chown(runs, 1234, 1234)
    assert hostenv.main(["--check-writable", "--file", str(env_file)]) == 0
    # the run a --run-dir names, and what is in it (a resume appends to train.log), root's from a local run
    assert hostenv.main(["--check-writable", "--file", str(env_file), "--", "--run-dir", "runs/exp1"]) == 2
    assert f"error: {runs / 'exp1'} belongs to uid 0" in capsys.readouterr().err
    os.chown(runs / "exp1", 1234, 1234)
    (runs / "exp1" / "train.log").write_text("")
    (runs / "exp1" / "train.log").chmod(0o644)
    assert hostenv.main(["--check-writable", "--file", str(env_file), "--", "--run-dir=runs/exp1"]) == 2
    assert f"error: {runs / 'exp1' / 'checkpoints'} belongs to uid 0" in capsys.readouterr().err
    for path in (runs / "exp1" / "checkpoints", runs / "exp1" / "train.log"):
        os.chown(path, 1234, 1234)
    assert hostenv.main(["--check-writable", "--file", str(env_file), "--", "--run-dir", "runs/exp1"]) == 0
    (runs / "exp1" / "checkpoints").chmod(0o577)  # the owner's own write bit off
    assert hostenv.main(["--check-writable", "--file", str(env_file), "--", "--run-dir", "runs/exp1"]) == 2
    capsys.readouterr()
    env_file.write_text(f"HOST_UID=0\nHOST_GID=0\nRUNS_DIR={runs}\n")  # root in the container writes anywhere
    assert hostenv.main(["--check-writable", "--file", str(env_file), "--", "--run-dir", "runs/exp1"]) == 0


@pytest.mark.parametrize("built, head, dirty, expected", [
    ("a" * 40, "a" * 40, False, None),
    ("a" * 40, "b" * 40, False, "warning: trainbox:local was built from aaaaaaaaaaaa, this checkout is bbbbbbbbbbbb: "
                                "run 'make build' to train this code"),
    ("a" * 40, "a" * 40, True, "warning: trainbox:local was built from aaaaaaaaaaaa, this checkout is aaaaaaaaaaaa "
                               "with changes: run 'make build' to train this code"),
    ("", "b" * 40, False, "warning: trainbox:local was built from an unknown commit, this checkout is bbbbbbbbbbbb: "
                          "run 'make build' to train this code"),
    ("a" * 40, "", True, None),  # no git: nothing to compare
])
def test_make_image_warns_when_the_image_holds_other_code(built, head, dirty, expected):
    assert hostenv.stale_image("trainbox:local", built, head, dirty) == expected


def test_the_services_user_is_the_host_users_but_never_root(tmp_path, monkeypatch):
    for key in ("HOST_UID", "HOST_GID", "SERVICE_UID", "SERVICE_GID"):
        monkeypatch.delenv(key, raising=False)
    env_file = tmp_path / ".env"
    monkeypatch.chdir(tmp_path)
    assert hostenv.main(["--file", str(env_file)]) == 0
    values = hostenv.read_env(env_file)
    expected = ("1000", "1000") if os.getuid() == 0 else (str(os.getuid()), str(os.getgid()))
    assert (values["SERVICE_UID"], values["SERVICE_GID"]) == expected
    assert hostenv.service_ids(0, 0) == (1000, 1000) and hostenv.service_ids(1234, 1235) == (1234, 1235)
    monkeypatch.setenv("HOST_UID", "1234")  # a container user named for make env: the services' too
    monkeypatch.setenv("HOST_GID", "1235")
    if os.getuid() != 0:
        return  # handing the folders to uid 1234 needs root
    assert hostenv.main(["--file", str(env_file)]) == 0
    assert (hostenv.read_env(env_file)["SERVICE_UID"], hostenv.read_env(env_file)["SERVICE_GID"]) == ("1234", "1235")


def test_a_service_needs_its_user_in_env_and_never_root(tmp_path, capsys):
    env_file = tmp_path / ".env"
    env_file.write_text(f"HOST_UID=0\nHOST_GID=0\nRUNS_DIR={tmp_path}\n")  # an older .env
    assert hostenv.main(["--service", "tensorboard", "--file", str(env_file)]) == 2
    assert capsys.readouterr().err == (f"error: {env_file} names no SERVICE_UID/SERVICE_GID, the user tensorboard "
                                       f"runs as (never root): run `make env`\n")
    env_file.write_text(f"SERVICE_UID=0\nSERVICE_GID=0\nRUNS_DIR={tmp_path}\n")
    assert hostenv.main(["--service", "mlflow", "--file", str(env_file)]) == 2
    assert capsys.readouterr().err.startswith(f"error: SERVICE_UID=0 in {env_file} runs mlflow as root: run `make env`")
    env_file.write_text(f"SERVICE_UID={os.getuid() or 1000}\nSERVICE_GID={os.getgid() or 1000}\nRUNS_DIR={tmp_path}\n")
    assert hostenv.main(["--service", "tensorboard", "--file", str(env_file)]) == 0
    assert not (tmp_path / "mlflow").exists()


@pytest.mark.skipif(os.getuid() != 0, reason="chown needs root")
def test_root_hands_the_mlflow_store_to_the_services_user(tmp_path, capsys, monkeypatch):
    runs = tmp_path / "runs"
    runs.mkdir()
    env_file = tmp_path / ".env"
    env_file.write_text(f"HOST_UID=0\nHOST_GID=0\nSERVICE_UID=1000\nSERVICE_GID=1000\nRUNS_DIR={runs}\n")
    assert hostenv.main(["--service", "mlflow", "--file", str(env_file)]) == 0
    store = runs / "mlflow"
    assert (store.stat().st_uid, store.stat().st_gid, stat.S_IMODE(store.stat().st_mode)) == (1000, 1000, 0o700)
    # a store an older root container wrote: handed over whole
    os.chown(store, 0, 0)
    (store / "artifacts" / "1").mkdir(parents=True)
    (store / "mlflow.db").write_text("")
    assert hostenv.main(["--service", "mlflow", "--file", str(env_file)]) == 0
    for path in (store, store / "artifacts", store / "artifacts" / "1", store / "mlflow.db"):
        assert (path.stat().st_uid, path.stat().st_gid) == (1000, 1000), path
    # the admin's password file is mounted into the container: its user must be able to read it
    password = tmp_path / "mlflow-admin"
    password.write_text("q7Jx-2mLp_9Vz4Rk\n")
    password.chmod(0o600)
    monkeypatch.setenv("MLFLOW_ADMIN_PASSWORD_FILE", str(password))
    assert hostenv.main(["--service", "mlflow", "--file", str(env_file)]) == 2
    assert capsys.readouterr().err == (
        f"error: MLFLOW_ADMIN_PASSWORD_FILE={password} belongs to uid 0 and the MLflow container runs as uid 1000 "
        f"(SERVICE_UID in {env_file}), which cannot read it: run `chown 1000:1000 {password}`, or name the container's "
        f"user: SERVICE_UID=... SERVICE_GID=... make env\n")
    os.chown(password, 1000, 1000)
    assert hostenv.main(["--service", "mlflow", "--file", str(env_file)]) == 0


def test_a_base_image_that_cannot_be_fetched_is_one_line_with_the_choices(capsys):
    assert hostenv.main(["--fetch-base", "registry.invalid/nothing:1", "--for", "trainbox:local",
                         "--docker", "/nonexistent/docker"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: the base image registry.invalid/nothing:1 of trainbox:local cannot be fetched "
                   "(/nonexistent/docker: No such file or directory): run without the image (RUNTIME=local), build on "
                   "a base your site mirrors (BASE_IMAGE=...), or `docker load` an image trainbox:local built "
                   "elsewhere (`docker save trainbox:local` there)\n")
