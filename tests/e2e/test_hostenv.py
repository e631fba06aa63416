"""train/hostenv.py run as `make env` and `make doctor` run it: the host's python3, one line on bad input."""

import os
import subprocess
import sys

import train.hostenv as hostenv
from tests.helpers import REPO


def test_a_missing_nas_data_folder_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-E", "-S", "-m", "train.hostenv", "--file", str(tmp_path / ".env"),
                           "--data-dir", str(tmp_path / "not-mounted")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: DATA_DIR={tmp_path / 'not-mounted'} does not exist: "
                                   f"mount the NAS there or pass an existing folder")
    assert not (tmp_path / ".env").exists()


def test_host_driver_check_as_make_doctor_runs_it():
    host = subprocess.run([sys.executable, "-E", "-S", "-m", "train.hostenv", "--check-driver", "13.0"], cwd=REPO,
                          capture_output=True, text=True)
    driver = hostenv.host_driver()
    if driver is None:
        assert host.returncode == 0 and "no NVIDIA driver on this host: CPU only" in host.stdout
    else:
        assert host.returncode == (1 if hostenv.driver_problem(driver, "13.0") else 0) and driver in host.stdout


def test_the_container_user_as_make_build_asks_for_it():
    proc = subprocess.run([sys.executable, "-E", "-S", "-m", "train.hostenv", "--ids"], cwd=REPO, capture_output=True,
                          text=True)
    expected = ["1000", "1000"] if os.getuid() == 0 else [str(os.getuid()), str(os.getgid())]
    assert proc.returncode == 0 and proc.stdout.split() == expected  # the image's own user is never root
