"""One short run through each launcher, as a user types it: a plain process, --spawn, `make train`'s launcher
(torchrun in its process), a plain torchrun and srun-style tasks (each rank a process with Slurm's variables).
`make check` runs these beside the unit tests: the edit-test loop, in a few minutes."""

import json
import subprocess

import pytest

from tests.helpers import DEBUG, PY, assert_bit_identical, env_for_tests, python_cmd, run, status, torchrun_cmd
from train.cluster.identity import free_port

pytestmark = pytest.mark.check

SHORT = [*DEBUG, "--max-steps", 8, "--save-every", 4, "--eval-every", 4, "--log-every", 2]


def srun_style(run_dir, workers: int = 2) -> None:
    """What `srun python -m train` starts: one task per rank with the variables srun gives each task of a step
    (no torchrun); they find each other through the step's first node."""
    port = free_port()
    procs = []
    for rank in range(workers):
        env = env_for_tests(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS=str(workers),
                            SLURM_STEP_ID="0", SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="localhost",
                            SLURM_STEP_TASKS_PER_NODE=str(workers), MASTER_PORT=str(port))
        procs.append(subprocess.Popen(python_cmd(*SHORT, "--run-dir", run_dir), env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The same short run through every launcher, once per session."""
    root = tmp_path_factory.mktemp("launchers")
    made = {name: root / name for name in ("plain", "spawn", "launch", "torchrun", "srun")}
    run(python_cmd(*SHORT, "--run-dir", made["plain"]))
    run(python_cmd(*SHORT, "--spawn", 2, "--run-dir", made["spawn"]))
    run([PY, "-m", "train.launch", "--gpus", "2", "--", *map(str, SHORT), "--run-dir", str(made["launch"])])
    run(torchrun_cmd(2, *SHORT, "--run-dir", made["torchrun"]))
    srun_style(made["srun"])
    return made


def test_every_launcher_finishes_the_run(runs):
    for name, run_dir in runs.items():
        assert status(run_dir)["state"] == "done" and status(run_dir)["step"] == 8, name
        assert (run_dir / "model.pt").is_file(), name
    manifests = {name: json.loads((d / "manifest.json").read_text()) for name, d in runs.items()}
    assert {name: m["launcher"] for name, m in manifests.items()} == {
        "plain": "single", "spawn": "spawn", "launch": "torchrun", "torchrun": "torchrun", "srun": "slurm"}
    assert (manifests["srun"]["world_size"], manifests["srun"]["slurm_job_id"]) == (2, "4242")


def test_two_workers_train_the_same_bits_under_every_launcher(runs):
    for name in ("launch", "torchrun", "srun"):
        assert_bit_identical(runs[name], runs["spawn"])
