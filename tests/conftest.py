"""Fixtures. Helpers are in tests/helpers.py; every test under tests/e2e/ (real processes) is marked slow.

make test runs the suite in several pytest-xdist workers at once (the Makefile's TEST_WORKERS): while one waits on
an engine (a Docker build, the Slurm cluster, a package download) another computes. So what costs minutes is made
once per `make test` for every worker (`shared`): a reference run, the default run, a tool's environment; the engines
that exist once per machine (the Docker image and the test cluster) are used by one worker alone (ENGINES), and each
end-to-end module runs whole on one worker, with its module fixtures (`pytest_xdist_make_scheduler`)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import MlflowServer, make, python_cmd, run, torchrun_cmd
from train.cluster.identity import free_port

# The modules that use the machine's one Docker engine image or its one test cluster (network namespaces and
# bridge of fixed names): one worker runs them all, first.
ENGINES = ("test_docker", "test_slurm", "test_services", "test_skypilot")
# Then the modules that take longest (measured), so that none is left to run alone at the end; the rest as collected.
# test_make first: it makes the default run (600 steps), which the engines' compose test waits for.
LONGEST = ("test_make", "test_faults", "test_reproducibility", "test_published_recipes", "test_evaluate", "test_bench",
           "test_export", "test_restarts", "test_sources", "test_tracking")


@pytest.fixture(scope="session")
def shared(tmp_path_factory, worker_id):
    """shared(name) -> (folder, lock): a folder every worker of this test run sees, and a context that holds its
    lock (one holder at a time across the workers). Whoever takes the lock first makes what the folder is for."""
    root = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    root = root / "shared"
    root.mkdir(exist_ok=True)

    def get(name: str):
        folder = root / name
        folder.mkdir(exist_ok=True)

        @contextlib.contextmanager
        def lock():
            with open(folder / ".lock", "w") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(handle, fcntl.LOCK_UN)

        return folder, lock()

    return get


def made_once(shared, name: str, make_it) -> Path:
    """shared(name)'s folder, made by make_it(folder) by the first worker that asks; the rest wait and reuse it."""
    folder, lock = shared(name)
    with lock:
        if not (folder / ".made").exists():
            make_it(folder)
            (folder / ".made").touch()
    return folder


@pytest.fixture(scope="session")
def reference_run(shared):
    """reference_run(*ARGS, workers=2, torchrun=False): the run directory of an uninterrupted run of the
    trainer with ARGS (--spawn of that many workers, or a local torchrun of them), trained once per
    test run and shared by every test (and every worker) that needs it: what interrupted, resumed or relaunched
    runs must equal. Read it; never train in it."""

    def get(*args, workers: int = 2, torchrun: bool = False) -> Path:
        key = repr((tuple(map(str, args)), workers, torchrun))
        name = "reference-" + hashlib.sha256(key.encode()).hexdigest()[:16]

        def train(folder: Path) -> None:
            run_dir = folder / "run"
            shutil.rmtree(run_dir, ignore_errors=True)  # a worker that died while training it
            if torchrun:
                run(torchrun_cmd(workers, *args, "--run-dir", run_dir), timeout=900)
            else:
                spawn = ["--spawn", workers] if workers > 1 else []
                run(python_cmd(*args, *spawn, "--run-dir", run_dir), timeout=900)

        return made_once(shared, name, train) / "run"

    return get


@pytest.fixture(scope="session")
def default_run(shared) -> Path:
    """The quickstart's run: `make train` with no flags but a run directory, in the local environment,
    trained once per test run. The tests of what it learns and of the container's default share it."""
    def train(folder: Path) -> None:
        shutil.rmtree(folder / "run", ignore_errors=True)
        make("train", "RUNTIME=local", f"ARGS=--run-dir {folder / 'run'}", timeout=900)

    return made_once(shared, "default-run", train) / "run"


@pytest.fixture(scope="session")
def tool_setup(shared):
    """tool_setup(target): `make TARGET` (mlflow-setup, sky-setup, onnx-setup: a tool's environment from its lock),
    once per test run, never by two workers at once."""
    def setup(target: str, *args: str) -> None:
        made_once(shared, f"make-{target}", lambda _: make(target, *args, timeout=900))

    return setup


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory, tool_setup):
    """A real MLflow tracking server for the session (`make mlflow-setup` installs it from its lock)."""
    tool_setup("mlflow-setup")
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"), free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def team_mlflow_server(tmp_path_factory, tool_setup):
    """A team server (MLFLOW_EXPOSE=1): every interface, a login for every request; `.credentials` to pass."""
    tool_setup("mlflow-setup")
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


def work_unit(nodeid: str) -> str:
    """What one worker runs whole: the engines' modules together, an end-to-end module, a unit-test file."""
    path = nodeid.split("::", 1)[0]
    return "engines" if Path(path).stem in ENGINES else path


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduling by scope, with work_unit as the scope and the collection's order kept."""
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False  # the order below, not by the count of tests
    return ByWorkUnit(config, log)


def _order(item) -> tuple[int, int]:
    module = item.path.stem
    if module in ENGINES:
        return 0, 0
    return (1, LONGEST.index(module)) if module in LONGEST else (2, 0)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "e2e" in item.path.parts:  # real processes, seconds each
            item.add_marker(pytest.mark.slow)
    items.sort(key=_order)  # stable: within a module, the order of its file
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
