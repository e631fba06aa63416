"""`make env` (train.hostenv): the .env that compose reads."""

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from train import hostenv


def test_writes_ids_paths_and_compose_files_and_keeps_other_keys(tmp_path, monkeypatch):
    monkeypatch.delenv("HOST_UID", raising=False)
    monkeypatch.delenv("HOST_GID", raising=False)
    env_file = tmp_path / ".env"
    env_file.write_text("# mine\nWANDB_PROJECT=demo\nDATA_DIR=/old\n")
    data = tmp_path / "datasets"
    data.mkdir()
    runs = tmp_path / "nas" / "runs"  # missing: created
    assert hostenv.main(["--file", str(env_file), "--data-dir", str(data), "--runs-dir", str(runs),
                         "--image", "trainbox:x"]) == 0
    values = hostenv.read_env(env_file)
    uid, gid, _ = hostenv.container_ids()
    assert values["HOST_UID"] == str(uid) and values["HOST_GID"] == str(gid)
    assert uid != 0  # the container never runs as root, even for a root host user
    assert values["DATA_DIR"] == str(data) and values["RUNS_DIR"] == str(runs) and runs.is_dir()
    if os.getuid() == 0:
        assert (runs.stat().st_uid, runs.stat().st_gid) == (uid, gid)  # handed to the container user
    assert values["WANDB_PROJECT"] == "demo" and values["TRAINBOX_IMAGE"] == "trainbox:x"
    expected = hostenv.GPU_COMPOSE if hostenv.host_has_gpus() else hostenv.CPU_COMPOSE
    assert values["COMPOSE_FILE"] == expected


def test_a_missing_nas_data_folder_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "train.hostenv", "--file", str(tmp_path / ".env"),
                           "--data-dir", str(tmp_path / "not-mounted")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: DATA_DIR={tmp_path / 'not-mounted'} does not exist: "
                                   f"mount the NAS there or pass an existing folder")
    assert not (tmp_path / ".env").exists()


@pytest.mark.parametrize("driver, cuda, too_old", [
    ("535.183.01", "13.0", True), ("550.54", "12.8", False), ("580.159.04", "13.0", False),
    ("520.61", "12.6", True), ("470.1", "11.8", False),
])
def test_driver_against_the_image_cuda(driver, cuda, too_old):
    problem = hostenv.driver_problem(driver, cuda)
    assert (problem is not None) == too_old
    if too_old:
        assert problem.startswith(f"driver {driver} is too old for CUDA {cuda}") and "TORCH_FLAVOUR=cu128" in problem


def test_host_driver_check_as_make_doctor_runs_it():
    host = subprocess.run([sys.executable, "-m", "train.hostenv", "--check-driver", "13.0"], cwd=REPO,
                          capture_output=True, text=True)
    driver = hostenv.host_driver()
    if driver is None:
        assert host.returncode == 0 and "no NVIDIA driver on this host: CPU only" in host.stdout
    else:
        assert host.returncode == (1 if hostenv.driver_problem(driver, "13.0") else 0) and driver in host.stdout
