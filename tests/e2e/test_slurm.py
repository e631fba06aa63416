"""slurm/*.sh on a real 2-node Slurm cluster (tests/cluster/up.sh: slurmd n1, n2 in network namespaces;
the `cluster` fixture in tests/conftest.py).

Without Slurm and root these tests skip, unless TRAINBOX_REQUIRE_SLURM=1 (CI) makes that a failure.
The decisions of train/cluster/jobs.py are unit-tested in tests/unit/test_cluster.py, its hostlist parser in
tests/unit/test_identity.py against the table that the first test here holds to this cluster's scontrol.
"""

import json
import re
import subprocess
import time
from datetime import datetime

import pytest

import train.cluster.hostlist as hostlist_module
from tests.helpers import (CLUSTER_HOST, DEBUG, HOSTLISTS, MALFORMED_HOSTLISTS, RECIPE, REPO, SLURM_LONG,
                           SUFFIXED_HOSTLISTS, assert_bit_identical, assert_mlflow_run_complete, metrics, reached_step,
                           run, the_one_mlflow_run, tracked_env, wait_for)
from tests.sources import draw_imagefolder


def sbatch(cluster, script, *args, sbatch_args=(), env=None, expect=0):
    proc = run(["sbatch", "--parsable", *sbatch_args, str(REPO / "slurm" / script), *map(str, args)],
               env={**cluster, **(env or {})}, expect=expect, cwd=REPO)
    return proc.stdout.strip().split(";")[0] if proc.returncode == 0 else proc


def job_info(cluster, job_id) -> dict:
    out = run(["scontrol", "show", "job", job_id], env=cluster).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_job(cluster, job_id, timeout=600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(cluster, job_id)
        if info["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return info
        time.sleep(1)
    raise AssertionError(f"job {job_id} still {job_info(cluster, job_id)['JobState']} after {timeout}s")


def nas(tmp_path):
    runs = tmp_path / "nas" / "runs"
    runs.mkdir(parents=True)
    return {"RUNS_DIR": str(runs), "PYTHON": str(REPO / ".venv" / "bin" / "python")}, runs


def test_hostlists_expand_as_this_clusters_scontrol_expands_them(cluster, tmp_path):
    """The hostlist table is scontrol's own answer here; expand_hostlist takes scontrol's answer where it
    gives one and the parser's where it cannot (text after the last bracket before Slurm 23.02.5, a
    SLURM_CONF that names no file: scontrol would retry that for 60 s)."""
    def scontrol(hostlist, env=cluster):
        out = subprocess.run(["scontrol", "show", "hostnames", hostlist], env=env, capture_output=True, text=True,
                             timeout=30)
        return None if "Invalid hostlist" in out.stderr else out.stdout.split()

    version = tuple(map(int, re.search(r"(\d+)\.(\d+)\.(\d+)", run(["scontrol", "--version"]).stdout).groups()))
    reads_suffixes = version >= (23, 2, 5)
    for hostlist, hosts in HOSTLISTS + SUFFIXED_HOSTLISTS:
        answer = hosts if (hostlist, hosts) in HOSTLISTS or reads_suffixes else None
        assert scontrol(hostlist) == answer, hostlist
        assert hostlist_module.scontrol_hostnames(hostlist, cluster) == answer
        assert hostlist_module.expand_hostlist(hostlist, cluster) == hostlist_module.parse_hostlist(hostlist) == hosts
    for hostlist in MALFORMED_HOSTLISTS:
        assert scontrol(hostlist) is None, hostlist
        with pytest.raises(hostlist_module.JobError, match="write ranges as"):
            hostlist_module.expand_hostlist(hostlist, cluster)
    no_config = {**cluster, "SLURM_CONF": str(tmp_path / "slurm.conf")}
    started = time.monotonic()
    assert hostlist_module.scontrol_hostnames("a[1-2]-ib[3-4]", no_config) is None
    assert hostlist_module.expand_hostlist("a[1-2]-ib[3-4]", no_config) == ["a1-ib3", "a1-ib4", "a2-ib3", "a2-ib4"]
    assert time.monotonic() - started < 1


def test_multinode_2x2_equals_local_torchrun_4(cluster, tmp_path, reference_run):
    """With the run's folder named by the trainer's own --run-dir (not RUN_NAME): the job's verdict reads
    that folder, so a finished run ends `finished`, exit code 0, not requeued."""
    env, runs = nas(tmp_path)
    env.pop("RUNS_DIR")
    log = tmp_path / "job.out"
    run_dir = runs / "exp1"
    job = sbatch(cluster, "multinode.sh", *DEBUG, "--deterministic", "--run-dir", run_dir,
                 sbatch_args=("--nodes=2", f"--output={log}"), env={**env, "NPROC_PER_NODE": "2"})
    info = wait_job(cluster, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log.read_text()
    assert info["Restarts"] == "0" and f"trainbox: finished: {run_dir}/model.pt" in log.read_text()
    assert not (REPO / "runs" / f"slurm-{job}").exists()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["world_size"] == 4 and sorted(set(manifest["hostnames"])) == ["n1", "n2"]
    assert manifest["slurm_job_id"] == job
    assert "2 node(s) x 2 worker(s), 2 CPU(s) per node" in log.read_text()  # --exclusive: both cores
    assert_bit_identical(run_dir, reference_run(*DEBUG, "--deterministic", workers=4, torchrun=True))


def test_preemption_checkpoints_requeues_and_resumes_bit_identically(cluster, tmp_path, reference_run,
                                                                     team_mlflow_server, monkeypatch):
    """USR2 mid-run of a recipe run (EMA, Mixup/CutMix, ...): checkpoint, requeue, resume; the weights and the
    EMA of an uninterrupted run, and one MLflow run
    (the team server on the host, with a login, reached from the nodes over the cluster's bridge) with each
    step once."""
    from mlflow import MlflowClient

    mlflow_server = team_mlflow_server
    for key, value in mlflow_server.credentials.items():  # this test's own client, as the nodes' trainers
        monkeypatch.setenv(key, value)

    env, runs = nas(tmp_path)
    log = tmp_path / "job.out"
    run_dir = runs / "preempted"  # named by the trainer's --run-dir: the requeue decision reads it there
    tracking = tracked_env(f"http://{CLUSTER_HOST}:{mlflow_server.port}", tmp_path)
    to_track = {**{k: tracking[k] for k in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME")},
                **mlflow_server.credentials}
    job = sbatch(cluster, "multinode.sh", *SLURM_LONG, *RECIPE, "--run-dir", run_dir,
                 sbatch_args=("--nodes=2", f"--output={log}"), env={**env, "NPROC_PER_NODE": "2", **to_track})
    wait_for(reached_step(run_dir, 15), 300, "step 15 of the Slurm job")
    run(["scancel", "--signal=USR2", "--batch", job], env=cluster)
    info = wait_job(cluster, job, timeout=900)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text
    assert info["Restarts"] == "1" and f"trainbox: finished: {run_dir}/model.pt" in text, text
    assert "preemption signal: checkpointing" in text and "requeueing job" in text and "resumed from" in text
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["resumed_from_step"] and 15 <= manifest["resumed_from_step"] < 160
    logged = [m["step"] for m in metrics(run_dir, "train")]
    assert logged == sorted(set(logged)) and logged[-1] == 160
    reference = reference_run(*SLURM_LONG, *RECIPE, workers=4, torchrun=True)
    assert_bit_identical(run_dir, reference)  # a recipe run: its EMA came back with it
    assert (run_dir / "model_ema.pt").read_bytes() == (reference / "model_ema.pt").read_bytes()
    client = MlflowClient(mlflow_server.uri)
    tracked = the_one_mlflow_run(client, run_dir, tracking["MLFLOW_EXPERIMENT_NAME"])
    assert_mlflow_run_complete(client, tracked, run_dir, tmp_path, max_steps=160)
    assert tracked.data.tags["slurm_job_id"] == job


def test_singlenode_two_jobs_share_a_node_without_port_clashes(cluster, tmp_path):
    """Two jobs at once on one node, each on its own port; the second trains on DATA_DIR's images (the local
    runtime gives the trainer DATA_DIR as its --data-dir)."""
    env, runs = nas(tmp_path)
    data = draw_imagefolder(tmp_path / "nas" / "pets")
    jobs = [sbatch(cluster, "singlenode.sh", *DEBUG, "--max-steps", 20, *args,
                   sbatch_args=("--nodelist=n1", "--cpus-per-task=1", f"--output={tmp_path}/%j.out"),
                   env={**env, **extra})
            for args, extra in (((), {}), (("--dataset", "imagefolder"), {"DATA_DIR": str(data)}))]
    infos = [wait_job(cluster, job) for job in jobs]
    logs = [(tmp_path / f"{job}.out").read_text() for job in jobs]
    assert [i["JobState"] for i in infos] == ["COMPLETED", "COMPLETED"], logs
    assert [i["NodeList"] for i in infos] == ["n1", "n1"]
    ports = [re.search(r"rendezvous n1:(\d+)", text).group(1) for text in logs]
    assert ports[0] != ports[1]
    # and they really ran at the same time, each with its own rendezvous on the node
    start, end = ([datetime.fromisoformat(i[key]) for i in infos] for key in ("StartTime", "EndTime"))
    assert start[0] < end[1] and start[1] < end[0], infos
    for job in jobs:
        assert (runs / f"slurm-{job}" / "model.pt").is_file()
    on_files = runs / f"slurm-{jobs[1]}"
    config = json.loads((on_files / "config.json").read_text())
    assert (config["dataset"], config["data_dir"]) == ("imagefolder", str(data))
    assert metrics(on_files, "eval")[-1]["samples"] == 12  # draw_imagefolder's validation images, read from DATA_DIR


def test_a_cancelled_job_checkpoints_and_is_not_requeued(cluster, tmp_path):
    env, runs = nas(tmp_path)
    log = tmp_path / "job.out"
    job = sbatch(cluster, "multinode.sh", *DEBUG, "--max-steps", 100000, "--log-every", 5, "--eval-every", 0,
                 sbatch_args=("--nodes=1", f"--output={log}"), env={**env, "NPROC_PER_NODE": "2"})
    run_dir = runs / f"slurm-{job}"
    wait_for(reached_step(run_dir, 10), 300, "step 10 of the Slurm job")
    run(["scancel", job], env=cluster)  # SIGTERM to the batch shell and the step, as a user's cancel
    # The batch shell's verdict is its last word: a wrong `scontrol requeue` would come before that line.
    wait_for(lambda: "not requeued" in log.read_text() or "trainbox: the run failed" in log.read_text(), 60,
             "the batch shell's verdict")
    info = wait_job(cluster, job, timeout=120)
    text = log.read_text()
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", text
    assert "trainbox: cancelled: checkpointing, no requeue" in text and "requeueing" not in text
    assert json.loads((run_dir / "status.json").read_text())["state"] == "stopped"
    assert any((run_dir / "checkpoints").glob("step_*.pt"))


def test_more_nodes_than_the_partition_has_is_refused(cluster, tmp_path):
    proc = sbatch(cluster, "multinode.sh", sbatch_args=("--nodes=3", f"--output={tmp_path}/x.out"), expect=None)
    assert proc.returncode != 0
    assert "Node count specification invalid" in proc.stderr  # EnforcePartLimits=ALL, as clusters set it


def test_missing_nas_folder_is_one_line_in_the_job_log(cluster, tmp_path):
    log = tmp_path / "job.out"
    job = sbatch(cluster, "multinode.sh", *DEBUG, sbatch_args=(f"--output={log}",),
                 env={"RUNS_DIR": str(tmp_path / "not-mounted"), "PYTHON": str(REPO / ".venv" / "bin" / "python")})
    info = wait_job(cluster, job)
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0"
    assert f"error: RUNS_DIR={tmp_path / 'not-mounted'} does not exist on" in log.read_text()


def test_an_error_a_restart_cannot_mend_fails_the_job_with_its_code(cluster, tmp_path):
    """Out of memory at start-up on 2 nodes x 1 worker (torchrun --max-restarts=3 on each): the job fails with
    the run's own exit code 2, is not requeued, and the error is said once; torchrun's restarts refused at once
    (no attempt got as far as training)."""
    env, runs = nas(tmp_path)
    log = tmp_path / "job.out"
    job = sbatch(cluster, "multinode.sh", *DEBUG, "--image-size", 100000, "--run-dir", runs / "oom",
                 sbatch_args=("--nodes=2", f"--output={log}"), env={**env, "NPROC_PER_NODE": "1"})
    info = wait_job(cluster, job)
    text = log.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "2:0", "0"), text[-4000:]
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "out of memory during start-up" in errors[0], text[-4000:]
    assert "trainbox: the run failed (exit code 2): not requeued" in text
    recorded = json.loads((runs / "oom" / "status.json").read_text())
    assert (recorded["state"], recorded["exit_code"]) == ("failed", 2) and recorded["launch"]
    assert not (runs / "oom" / "train.log").exists() or " run " not in (runs / "oom" / "train.log").read_text()
