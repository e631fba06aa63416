"""docker/hostenv.py (`make env`): the .env that compose reads, and the driver table."""

import os

import pytest

from tests.helpers import host_tool

hostenv = host_tool("docker/hostenv.py")


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
    uid, gid, _ = hostenv.container_ids()
    assert values["HOST_UID"] == str(uid) and values["HOST_GID"] == str(gid)
    assert uid != 0  # the container never runs as root, even for a root host user
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
    if os.getuid() == 0:  # made by root: handed to the container user
        uid, gid, _ = hostenv.container_ids()
        assert ((tmp_path / "runs").stat().st_uid, (tmp_path / "runs").stat().st_gid) == (uid, gid)
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
