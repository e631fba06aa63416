"""slurm/skypilot.yaml: parsed by SkyPilot's own library (`make sky-setup`), and its setup and run commands
executed as SkyPilot executes them on each node of a 2-node task, with SkyPilot's variables set as it sets
them. The nodes are the network namespaces of the test cluster (tests/conftest.py `cluster`); the
task's mounted storage is a folder both see, as a bucket mounted on every node would be."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess

import pytest

from tests.helpers import (CLUSTER_NODES, REPO, SLURM_LONG, assert_bit_identical, descendants, env_for_tests, make,
                           metrics, reached_step, run, wait_for)

SKY_PYTHON = REPO / ".venv-sky" / "bin" / "python"
TASK = REPO / "slurm" / "skypilot.yaml"
PARSE = """
import json, sys, sky, yaml
config = yaml.safe_load(open(sys.argv[1]))
task = sky.Task.from_yaml_config(config, env_overrides=[tuple(a.split("=", 1)) for a in sys.argv[2:]])
(resources,) = task.resources
print(json.dumps({"num_nodes": task.num_nodes, "setup": task.setup, "run": task.run, "envs": task.envs,
                  "workdir": task.workdir, "accelerators": resources.accelerators,
                  "job_recovery": resources.job_recovery,
                  "mounts": {path: [s.name, s.mode.value] for path, s in task.storage_mounts.items()}}))
"""


def parse_task(*overrides: str) -> subprocess.CompletedProcess:
    return run([str(SKY_PYTHON), "-c", PARSE, str(TASK), *overrides], expect=None, timeout=120)


@pytest.fixture(scope="module")
def task():
    make("sky-setup", timeout=900)
    parsed = parse_task("RUN_NAME=placeholder", "RUNS_BUCKET=trainbox-test-runs")
    assert parsed.returncode == 0, parsed.stderr[-3000:]
    return json.loads(parsed.stdout)


def test_skypilot_parses_the_task_and_insists_on_a_run_name(task):
    assert task["num_nodes"] == 2 and task["accelerators"] == {"H100": 8} and task["workdir"] == "."
    assert task["mounts"] == {"/runs": ["trainbox-test-runs", "MOUNT_CACHED"]}
    assert task["envs"]["RUNS_DIR"] == "/runs" and task["job_recovery"]["max_restarts_on_errors"] == 3
    unnamed = parse_task("RUNS_BUCKET=trainbox-test-runs")
    assert unnamed.returncode != 0 and "Environment variable 'RUN_NAME' is None" in unnamed.stderr


class SkyNode:
    """One node of the task: SkyPilot runs `setup`, then `run`, in the workdir under bash, with the task's
    envs and its own variables; here in the network namespace (and hostname) of a test node."""

    def __init__(self, task: dict, rank: int, envs: dict, log):
        self.name = list(CLUSTER_NODES)[rank]
        env = {**env_for_tests(), **task["envs"], **envs,
               "SKYPILOT_NODE_IPS": "".join(ip + "\n" for ip in CLUSTER_NODES.values()),
               "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_NODES": str(task["num_nodes"]),
               "SKYPILOT_NUM_GPUS_PER_NODE": "0", "SKYPILOT_TASK_ID": f"sky-test_{envs['RUN_NAME']}_{rank}"}
        script = f"hostname {self.name}; set -e; {task['setup']}\nset +e\n{task['run']}"
        self.proc = subprocess.Popen(["nsenter", f"--net=/run/netns/slnode{rank + 1}", "unshare", "--uts", "bash",
                                      "-c", script], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def kill(self) -> None:
        """Every process of this node's task, at once, as when its VM is preempted."""
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


def launch(task: dict, envs: dict, log_path) -> list[SkyNode]:
    log = open(log_path, "a")
    return [SkyNode(task, rank, envs, log) for rank in range(task["num_nodes"])]


def test_two_nodes_killed_and_relaunched_resume_and_equal_a_local_4_worker_run(cluster, task, tmp_path,
                                                                               reference_run):
    runs = tmp_path / "bucket"
    runs.mkdir()
    envs = {"RUN_NAME": "sky-test", "RUNS_DIR": str(runs), "NPROC_PER_NODE": "2",
            "ARGS": " ".join(map(str, SLURM_LONG))}
    log = tmp_path / "task.log"
    run_dir = runs / "sky-test"
    nodes = launch(task, envs, log)
    try:
        wait_for(reached_step(run_dir, 30), 300, "step 30 of the task", nodes[0].proc)
        nodes[1].kill()  # the second node is preempted; SkyPilot then ends the task on the others
        nodes[0].kill()
        killed_at = max(m["step"] for m in metrics(run_dir, "train"))
        assert killed_at < 160, log.read_text()[-3000:]
        relaunched = launch(task, envs, log)  # a managed job's recovery: the same task on new nodes
        codes = [node.proc.wait(timeout=600) for node in relaunched]
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                node.kill()
    text = log.read_text()
    assert codes == [0, 0], text[-4000:]
    assert "trainbox: node 0 of 2, 2 worker(s), rendezvous 10.231.77.11:29400" in text
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["world_size"] == 4 and sorted(set(manifest["hostnames"])) == ["n1", "n2"]
    assert 20 <= manifest["resumed_from_step"] <= killed_at  # from the newest checkpoint in the bucket
    logged = [m["step"] for m in metrics(run_dir, "train")]
    assert logged == sorted(set(logged)) and logged[-1] == 160
    assert_bit_identical(run_dir, reference_run(*SLURM_LONG, workers=4, torchrun=True))
