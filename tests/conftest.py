"""Fixtures. Helpers are in tests/helpers.py; every test under tests/e2e/ (real processes) is marked slow.

`make test` runs the suite on pytest-xdist workers (TEST_WORKERS, 2 by default). What the machine holds once
goes to one worker: every test of MACHINE_FILES (the test cluster, the Docker engine's images, compose
projects and ports) runs there, one after another; the session's runs (the references, the quickstart's run)
are trained once, under a file lock, in the folder that all workers share."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.helpers import MlflowServer, make, python_cmd, run, torchrun_cmd
from train.distributed import free_port


# The files whose tests use the machine's one Slurm test cluster or Docker engine (MACHINE_FIXTURES), with
# every other test of theirs (their module fixtures build the image and start compose projects).
MACHINE_FILES = ("tests/e2e/test_docker.py", "tests/e2e/test_services.py", "tests/e2e/test_skypilot.py",
                 "tests/e2e/test_slurm.py")
MACHINE_FIXTURES = {"cluster", "docker"}


def pytest_xdist_make_scheduler(config, log):
    """xdist's `load` (what -n picks) with one unit for all of MACHINE_FILES' tests, sent first (the longest)."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class MachineOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "machine" if nodeid.split("::")[0] in MACHINE_FILES else nodeid

    return MachineOnOneWorker(config, log)


@contextmanager
def file_lock(path: Path):
    """Held by one test process at a time (xdist workers, or two sessions side by side)."""
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory) -> Path:
    """The session's folder that every xdist worker sees (each worker's own basetemp is a folder in it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _once(session_dir: Path, key: str, make_run) -> Path:
    """The run folder for KEY, made by make_run(run_dir) once per session whichever worker asks first."""
    folder = session_dir / "once" / hashlib.sha256(key.encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    with file_lock(folder / "lock"):
        if not (folder / "made").exists():
            shutil.rmtree(folder / "run", ignore_errors=True)
            make_run(folder / "run")
            (folder / "made").write_text(key + "\n")
    return folder / "run"


@pytest.fixture(scope="session")
def reference_run(session_dir):
    """reference_run(*ARGS, workers=2, torchrun=False): the run directory of an uninterrupted run of the
    trainer with ARGS (--spawn of that many workers, or a local torchrun of them), trained once per
    session and shared by every test that needs it: what interrupted, resumed or relaunched runs must
    equal. Read it; never train in it."""
    def get(*args, workers: int = 2, torchrun: bool = False) -> Path:
        def train(run_dir):
            if torchrun:
                run(torchrun_cmd(workers, *args, "--run-dir", run_dir), timeout=900)
            else:
                spawn = ["--spawn", workers] if workers > 1 else []
                run(python_cmd(*args, *spawn, "--run-dir", run_dir), timeout=900)
        return _once(session_dir, repr(("reference", tuple(map(str, args)), workers, torchrun)), train)

    return get


@pytest.fixture(scope="session")
def default_run(session_dir) -> Path:
    """The quickstart's run: `make train` with no flags but a run directory, in the local environment,
    trained once per session. The tests of what it learns and of the container's default share it."""
    return _once(session_dir, "default", lambda run_dir: make("train", "RUNTIME=local", f"ARGS=--run-dir {run_dir}",
                                                                timeout=900))


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server for the session (`make mlflow-setup` installs it from its lock)."""
    with file_lock(Path(os.environ.get("TMPDIR", "/tmp")) / "trainbox-tests-mlflow-setup.lock"):
        make("mlflow-setup", timeout=900)
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"), free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def team_mlflow_server(tmp_path_factory):
    """A team server (MLFLOW_EXPOSE=1): every interface, a login for every request; `.credentials` to pass."""
    with file_lock(Path(os.environ.get("TMPDIR", "/tmp")) / "trainbox-tests-mlflow-setup.lock"):
        make("mlflow-setup", timeout=900)
    server = MlflowServer(tmp_path_factory.mktemp("team-mlflow"), free_port(), exposed=True)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def cluster():
    """A real 2-node Slurm cluster (tests/cluster/up.sh): slurmd n1 and n2 in network namespaces slnode1 and
    slnode2 on a private bridge, for the session. The environment that reaches it (SLURM_CONF)."""
    if not (os.getuid() == 0 and all(shutil.which(t) for t in ("slurmctld", "slurmd", "munged", "sbatch"))):
        if os.environ.get("TRAINBOX_REQUIRE_SLURM") == "1":
            pytest.fail("TRAINBOX_REQUIRE_SLURM=1 but Slurm (slurm-wlm, munge) or root is missing")
        pytest.skip("needs root and slurm-wlm + munge (apt-get install slurm-wlm munge)")
    lab = Path(os.environ.get("TMPDIR", "/tmp")) / "trainbox-slurm-cluster"
    env = {**os.environ, "LAB": str(lab)}
    scripts = Path(__file__).parent / "cluster"
    subprocess.run(["bash", str(scripts / "down.sh")], env=env, capture_output=True)
    up = subprocess.run(["bash", str(scripts / "up.sh")], env=env, capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    yield {**env, "SLURM_CONF": str(lab / "slurm.conf")}
    subprocess.run(["bash", str(scripts / "down.sh")], env=env, capture_output=True)


def pytest_collection_modifyitems(config, items):
    strays = sorted({item.nodeid.split("::")[0] for item in items if MACHINE_FIXTURES & set(item.fixturenames)}
                    - set(MACHINE_FILES))
    if strays:
        raise pytest.UsageError(f"{', '.join(strays)} use the test cluster or the Docker engine: add them to "
                                "MACHINE_FILES in tests/conftest.py (make test's workers share one of each)")
    for item in items:
        if "e2e" in item.path.parts:  # real processes, seconds each
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
