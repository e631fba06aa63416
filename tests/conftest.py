"""Fixtures. Helpers are in tests/helpers.py; every test under tests/e2e/ (real processes) is marked slow."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import MlflowServer, make, python_cmd, run, torchrun_cmd
from train.distributed import free_port


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """reference_run(*ARGS, workers=2, torchrun=False): the run directory of an uninterrupted run of the
    trainer with ARGS (--spawn of that many workers, or a local torchrun of them), trained once per
    session and shared by every test that needs it: what interrupted, resumed or relaunched runs must
    equal. Read it; never train in it."""
    made: dict[tuple, Path] = {}

    def get(*args, workers: int = 2, torchrun: bool = False) -> Path:
        key = (tuple(map(str, args)), workers, torchrun)
        if key not in made:
            run_dir = tmp_path_factory.mktemp("reference") / "run"
            if torchrun:
                run(torchrun_cmd(workers, *args, "--run-dir", run_dir), timeout=900)
            else:
                spawn = ["--spawn", workers] if workers > 1 else []
                run(python_cmd(*args, *spawn, "--run-dir", run_dir), timeout=900)
            made[key] = run_dir
        return made[key]

    return get


@pytest.fixture(scope="session")
def default_run(tmp_path_factory) -> Path:
    """The quickstart's run: `make train` with no flags but a run directory, in the local environment,
    trained once per session. The tests of what it learns and of the container's default share it."""
    run_dir = tmp_path_factory.mktemp("default") / "run"
    make("train", "RUNTIME=local", f"ARGS=--run-dir {run_dir}", timeout=900)
    return run_dir


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server for the session (`make mlflow-setup` installs it from its lock)."""
    make("mlflow-setup", timeout=900)
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"), free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def team_mlflow_server(tmp_path_factory):
    """A team server (MLFLOW_EXPOSE=1): every interface, a login for every request; `.credentials` to pass."""
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
    for item in items:
        if "e2e" in item.path.parts:  # real processes, seconds each
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
