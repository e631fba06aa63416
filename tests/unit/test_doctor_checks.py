"""make doctor's checks of what loader workers need, against this machine's real cores and /dev/shm."""

import os
import shutil
import socket

import pytest

from train import doctor
from train.cluster.identity import free_port
from train.cluster.identity import usable_cores


@pytest.fixture(autouse=True)
def _fresh_results():
    doctor.results.clear()
    yield
    doctor.results.clear()


def test_too_few_cores_per_gpu_is_a_warning_that_names_the_need():
    doctor.check_cores(usable_cores())  # one core per GPU: short of what image files need
    ((status, check, detail),) = doctor.results
    assert (status, check) == ("warn", "cores") and f"about {doctor.CORES_PER_GPU} per GPU" in detail
    doctor.results.clear()
    doctor.check_cores(0)  # on the CPU the trainer runs one process with every core
    assert doctor.results[0][0] == "ok" and f"{max(1, usable_cores() - 1)} loader worker(s)" in doctor.results[0][2]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_shm_is_measured_against_the_gpus_it_must_serve():
    size = shutil.disk_usage("/dev/shm").total
    gpus = int(size // doctor.SHM_PER_GPU) + 1  # more GPUs than this /dev/shm can serve
    doctor.check_shm(gpus)
    ((status, _, detail),) = doctor.results
    assert status == "FAIL" and f"for {gpus} GPU(s)" in detail and "--shm-size=" in detail
    if size >= doctor.SHM_PER_GPU:
        doctor.results.clear()
        doctor.check_shm(1)
        assert doctor.results[0][0] == "ok"


@pytest.mark.parametrize("value", ["busy", "not-a-port"])
def test_a_busy_or_malformed_master_port_is_a_failed_check(monkeypatch, value):
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        monkeypatch.setenv("MASTER_PORT", str(held.getsockname()[1]) if value == "busy" else value)
        doctor.check_port()
    ((status, check, detail),) = doctor.results
    assert (status, check) == ("FAIL", "port") and "set MASTER_PORT to a free port" in detail
    doctor.results.clear()
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    doctor.check_port()
    assert doctor.results[0][:2] == ("ok", "port")
