"""train/cluster/jobs.py: what the batch script does before the step (job) and after it (after), decided in Python."""

import json

import pytest

import train.cluster.jobs as cluster
from tests.helpers import PY, REPO
from train.files.rundir import write_status


def _job_env(tmp_path, **extra):
    (tmp_path / "runs").mkdir(exist_ok=True)
    return {"SLURM_JOB_ID": "777", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_SUBMIT_DIR": str(REPO),
            "RUNS_DIR": str(tmp_path / "runs"), "PYTHON": PY, **extra}


def test_slurm_job_local_runtime(tmp_path):
    out = cluster.slurm_job(_job_env(tmp_path, SLURM_GPUS_ON_NODE="4"))
    assert (out["NNODES"], out["NPROC_PER_NODE"], out["MASTER_ADDR"]) == ("2", "4", "gpu07")
    assert out["MASTER_PORT"] == str(20000 + 777) and out["LAUNCH"] == [PY]
    assert out["RUN_DIR"] == out["RUN_DIR_ARG"] == str(tmp_path / "runs" / "slurm-777")
    assert cluster.slurm_job(_job_env(tmp_path, NPROC_PER_NODE="3", MASTER_PORT="31000"))["MASTER_PORT"] == "31000"
    assert cluster.slurm_job(_job_env(tmp_path))["NPROC_PER_NODE"] == "1"  # no GPUs, no NPROC_PER_NODE


def test_slurm_job_local_runtime_gives_the_trainer_data_dir(tmp_path):
    """DATA_DIR is the trainer's --data-dir in the local runtime (a container mounts it where the trainer's default
    --data-dir is), never a folder checked and then left unread; beside a --data-dir of the arguments, one line."""
    (tmp_path / "pets").mkdir()
    env = _job_env(tmp_path, DATA_DIR=str(tmp_path / "pets"))
    args = ["--dataset", "imagefolder", "--run-dir", str(tmp_path / "runs" / "pets")]
    assert cluster.slurm_job(env, args)["TRAINER_ARGS"] == ["--data-dir", str(tmp_path / "pets"), *args[:2]]
    assert cluster.slurm_job(_job_env(tmp_path), args)["TRAINER_ARGS"] == args[:2]  # no DATA_DIR: the default
    for given in (["--data-dir", "/nas/other"], ["--data-dir=/nas/other"]):
        with pytest.raises(cluster.JobError) as e:
            cluster.slurm_job(env, [*args, *given])
        assert str(e.value) == (f"DATA_DIR={tmp_path / 'pets'} and --data-dir among the arguments both name the "
                                f"data: give one")


def test_slurm_job_creates_the_default_runs_folder_beside_the_checkout(tmp_path):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    env = {k: v for k, v in _job_env(tmp_path, TRAINBOX_DIR=str(checkout)).items() if k != "RUNS_DIR"}
    out = cluster.slurm_job(env)
    assert (checkout / "runs").is_dir() and out["RUN_DIR"] == str(checkout / "runs" / "slurm-777")
    assert cluster.slurm_job(env)["RUN_DIR"] == out["RUN_DIR"]  # a second job finds it there


@pytest.mark.parametrize("extra, cpus", [({}, "1"), ({"SLURM_JOB_CPUS_PER_NODE": "64(x2)"}, "64"),
                                         ({"SLURM_JOB_CPUS_PER_NODE": "64(x2),32"}, "32"),
                                         ({"SLURM_JOB_CPUS_PER_NODE": "64(x2)", "SLURM_CPUS_PER_TASK": "8"}, "8")])
def test_slurm_job_gives_the_task_the_cpus_of_the_node(tmp_path, extra, cpus):
    assert cluster.slurm_job(_job_env(tmp_path, **extra))["CPUS_PER_TASK"] == cpus


def test_slurm_job_container_runtimes_mount_the_nas(tmp_path):
    (tmp_path / "data").mkdir()
    image = tmp_path / "trainbox.sqsh"
    image.write_text("x")
    env = _job_env(tmp_path, DATA_DIR=str(tmp_path / "data"), IMAGE=str(image))
    pyxis = cluster.slurm_job({**env, "RUNTIME": "pyxis"})
    assert pyxis["LAUNCH"][0] == f"--container-image={image}"
    assert f"{tmp_path / 'runs'}:/opt/trainbox/runs:rw" in pyxis["LAUNCH"][1]
    assert f"{tmp_path / 'data'}:/opt/trainbox/data:ro" in pyxis["LAUNCH"][1]
    assert pyxis["RUN_DIR_ARG"] == "runs/slurm-777"
    assert pyxis["TRAINER_ARGS"] == []  # the trainer's default --data-dir, data, is the mount
    apptainer = cluster.slurm_job({**env, "RUNTIME": "apptainer"})
    assert apptainer["LAUNCH"][:3] == ["apptainer", "exec", "--nv"] and str(image) in apptainer["LAUNCH"]


@pytest.mark.parametrize("extra, message", [
    ({"RUNTIME": "docker"}, "RUNTIME='docker': use one of local, pyxis, apptainer"),
    ({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE='0'"),
    ({"RUNS_DIR": "/nonexistent/runs"}, "RUNS_DIR=/nonexistent/runs does not exist"),
    ({"DATA_DIR": "/nonexistent/data"}, "DATA_DIR=/nonexistent/data does not exist"),
    ({"RUNTIME": "pyxis"}, "RUNTIME=pyxis needs IMAGE="),
    ({"RUNTIME": "apptainer", "IMAGE": "/nonexistent/t.sif"}, "RUNTIME=apptainer needs IMAGE="),
    ({"PYTHON": "/nonexistent/python"}, "/nonexistent/python not found: run `make setup`"),
    ({"MAX_RESTARTS": "abc"}, "MAX_RESTARTS='abc' is not a number: use 0, 1, 3, ..."),
    ({"MAX_REQUEUES": "x"}, "MAX_REQUEUES='x' is not a number: use 0, 1, 3, ..."),
    ({"SLURM_JOB_NODELIST": "gpu[3-1]"}, "hostlist 'gpu[3-1]': '3-1' in [3-1] is not a number or a range"),
    ({"MASTER_PORT": "abc"}, "MASTER_PORT='abc' is not a port number (1-65535): unset it"),
])
def test_slurm_job_refuses_bad_input(tmp_path, extra, message):
    with pytest.raises(cluster.JobError) as e:
        cluster.slurm_job({**_job_env(tmp_path), **extra})
    assert message in str(e.value)


@pytest.mark.parametrize("state, restarts, preempted, decision", [
    ("done", "0", False, ("done", 0)), ("done", "0", True, ("done", 0)),
    ("stopped", "0", True, ("requeue", 0)),  # a preemption notice: the checkpoint is made, the job comes back
    ("stopped", "0", False, ("stopped", 75)),  # a cancel or the user's own signal: stopped, not requeued
    ("stopped", "10", True, ("failed", 0)),  # MAX_REQUEUES used up
    ("running", "0", True, ("failed", 0)), ("failed", "0", False, ("failed", 0)), (None, "0", True, ("failed", 0)),
])
def test_after_the_step(tmp_path, state, restarts, preempted, decision):
    if state:
        (tmp_path / "status.json").write_text(json.dumps({"state": state, "step": 5}))
    env = {"SLURM_RESTART_COUNT": restarts, "MAX_REQUEUES": "10"}
    assert cluster.after(tmp_path, env, preempted=preempted) == decision


def test_after_an_error_a_restart_cannot_mend_the_job_exits_with_its_code(tmp_path):
    """Out of memory: the workers exit 0 (so that torchrun does not restart them) and status.json holds 2."""
    (tmp_path / "status.json").write_text(json.dumps({"state": "failed", "step": 5, "exit_code": 2,
                                                      "slurm_restart_count": 1}))
    assert cluster.after(tmp_path, {"SLURM_RESTART_COUNT": "1"}, preempted=False) == ("failed", 2)
    assert cluster.after(tmp_path, {"SLURM_RESTART_COUNT": "1"}, preempted=True) == ("failed", 2)  # not requeued
    # an earlier attempt's record
    assert cluster.after(tmp_path, {"SLURM_RESTART_COUNT": "2"}, preempted=False) == ("failed", 0)


def test_a_run_dir_among_the_trainer_arguments_is_the_run_folder(tmp_path):
    env = {k: v for k, v in _job_env(tmp_path).items() if k != "RUNS_DIR"}
    nas = tmp_path / "nas" / "runs"
    nas.mkdir(parents=True)
    args = ["--preset", "debug", "--run-dir", str(nas / "exp1"), "--max-steps", "6"]
    out = cluster.slurm_job(env, args)
    assert out["RUN_DIR"] == out["RUN_DIR_ARG"] == str(nas / "exp1")
    assert out["TRAINER_ARGS"] == ["--preset", "debug", "--max-steps", "6"]
    assert cluster.slurm_job(env, [f"--run-dir={nas / 'exp2'}"])["RUN_DIR"] == str(nas / "exp2")
    assert cluster.slurm_job({**env, "RUN_NAME": "exp1", "RUNS_DIR": str(nas)}, args)["RUN_DIR"] == str(nas / "exp1")
    # relative to the checkout, as the trainer would take it there
    assert cluster.slurm_job({**env, "TRAINBOX_DIR": str(tmp_path / "nas")}, ["--run-dir", "runs/exp3"])["RUN_DIR"] == \
        str(nas / "exp3")
    config = tmp_path / "exp.json"
    config.write_text(json.dumps({"run_dir": str(nas / "exp4")}))
    assert cluster.slurm_job(env, ["--config", str(config)])["RUN_DIR"] == str(nas / "exp4")
    assert cluster.slurm_job(env, ["--config", str(config), "--run-dir", str(nas / "exp5")])["RUN_DIR"] == str(nas / "exp5")
    (tmp_path / "i.sqsh").write_text("x")
    pyxis = cluster.slurm_job({**env, "RUNTIME": "pyxis", "IMAGE": str(tmp_path / "i.sqsh")}, args)
    assert pyxis["RUN_DIR"] == str(nas / "exp1") and pyxis["RUN_DIR_ARG"] == "runs/exp1"  # its parent mounted
    assert f"{nas}:/opt/trainbox/runs:rw" in pyxis["LAUNCH"][1]
    sky = cluster.sky_job({**_sky_env(tmp_path, 0), "RUNS_DIR": str(nas), "RUN_NAME": "exp1",
                          "ARGS": f"--preset debug --run-dir {nas / 'exp1'}"})
    assert sky["RUN_DIR"] == str(nas / "exp1") and sky["TRAINER_ARGS"] == ["--preset", "debug"]


@pytest.mark.parametrize("extra, args, message", [
    ({"RUN_NAME": "other"}, ["--run-dir", "{nas}/exp1"], "name two different run folders: give one of them"),
    ({"RUNS_DIR": "{tmp}/runs"}, ["--run-dir", "{nas}/exp1"], "name two different run folders"),
    ({}, ["--run-dir", "{tmp}/not-mounted/exp1"], "RUNS_DIR={tmp}/not-mounted does not exist"),
    ({}, ["--run-dir", "/"], "name the run's own folder"),
])
def test_a_run_dir_that_contradicts_the_job_or_is_missing_is_refused(tmp_path, extra, args, message):
    env = {k: v for k, v in _job_env(tmp_path).items() if k != "RUNS_DIR"}
    (tmp_path / "nas").mkdir()
    fill = {"nas": tmp_path / "nas", "tmp": tmp_path}
    with pytest.raises(cluster.JobError) as e:
        cluster.slurm_job({**env, **{k: v.format(**fill) for k, v in extra.items()}}, [a.format(**fill) for a in args])
    assert message.format(**fill) in str(e.value)


def test_make_train_and_the_slurm_template_take_their_torchrun_flags_from_here(tmp_path):
    from train import launch

    assert launch.torchrun_flags is cluster.torchrun_flags and launch.TORCHRUN_ENV is cluster.TORCHRUN_ENV
    assert cluster.torchrun_flags("") == cluster.torchrun_flags(None) == cluster.torchrun_flags(3)
    assert "--max-restarts=3" in cluster.torchrun_flags("") and "--max-restarts=0" in cluster.torchrun_flags("0")
    planned = cluster.slurm_job(_job_env(tmp_path, MAX_RESTARTS="5"))
    assert planned["TORCHRUN"] == ["-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                                   "--rdzv-backend=c10d", "--rdzv-endpoint=gpu07:20777", "--rdzv-id=777",
                                   *cluster.torchrun_flags("5")]


def test_a_stale_stopped_status_is_not_requeued_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    # Attempt 0 stopped and was requeued; attempt 1 failed to launch before training wrote a status.
    write_status(tmp_path, "stopped", 30)  # what attempt 0 wrote, under Slurm
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["slurm_restart_count"] == 0 and status["slurm_job_id"] == "42"
    assert cluster.after(tmp_path, {"SLURM_RESTART_COUNT": "0", "MAX_REQUEUES": "10"}, preempted=True)[0] == "requeue"
    assert cluster.after(tmp_path, {"SLURM_RESTART_COUNT": "1", "MAX_REQUEUES": "10"}, preempted=True)[0] == "failed"


def _sky_env(tmp_path, rank: int, **extra):
    (tmp_path / "runs").mkdir(exist_ok=True)
    return {"SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2\n", "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NUM_GPUS_PER_NODE": "8", "RUN_NAME": "resnet50-a", "RUNS_DIR": str(tmp_path / "runs"),
            "PYTHON": PY, **extra}


def test_sky_job_one_torchrun_per_node_with_the_store_on_the_first(tmp_path):
    head, other = cluster.sky_job(_sky_env(tmp_path, 0)), cluster.sky_job(_sky_env(tmp_path, 1))
    assert (head["NNODES"], head["NPROC_PER_NODE"], head["MASTER_ADDR"]) == ("2", "8", "10.0.0.1")
    assert head["RUN_DIR"] == other["RUN_DIR"] == str(tmp_path / "runs" / "resnet50-a")  # a relaunch resumes it
    assert head["LAUNCH"] == [PY]
    common = ["-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d",
              "--rdzv-endpoint=10.0.0.1:29400", "--rdzv-id=resnet50-a"]
    assert head["TORCHRUN"] == [*common, "--rdzv-conf=is_host=true", *cluster.torchrun_flags(None)]
    assert other["TORCHRUN"] == [*common, "--rdzv-conf=is_host=false", *cluster.torchrun_flags(None)]
    cpu = cluster.sky_job(_sky_env(tmp_path, 0, SKYPILOT_NUM_GPUS_PER_NODE="0", NPROC_PER_NODE="2"))
    assert cpu["NPROC_PER_NODE"] == "2"


@pytest.mark.parametrize("extra, message", [
    ({"SKYPILOT_NODE_IPS": ""}, "not inside a SkyPilot task"),
    ({"RUN_NAME": ""}, "RUN_NAME='': name the run"),
    ({"RUN_NAME": "a b"}, "RUN_NAME='a b': name the run"),
    ({"RUNS_DIR": "/nonexistent/runs"}, "RUNS_DIR=/nonexistent/runs does not exist on node 0"),
    ({"PYTHON": "/nonexistent/python"}, "/nonexistent/python not found: run `make setup`"),
    ({"NPROC_PER_NODE": "x"}, "NPROC_PER_NODE='x'"),
    ({"MAX_RESTARTS": "-1"}, "MAX_RESTARTS='-1' is not a number"),
    ({"MASTER_PORT": "65536"}, "MASTER_PORT='65536' is not a port number (1-65535): unset it"),
])
def test_sky_job_refuses_bad_input(tmp_path, extra, message):
    with pytest.raises(cluster.JobError) as e:
        cluster.sky_job({**_sky_env(tmp_path, 0), **extra})
    assert message in str(e.value)


def test_make_trains_torchrun_in_process_with_the_arguments_torchrun_itself_parses():
    """train/launch.py runs torch.distributed.run in its own process: torch's own parser reads what it is given."""
    from torch.distributed import run as torchrun

    from train import launch

    options = torchrun.get_args_parser().parse_args(launch.torchrun_argv(2, "5", ["--preset", "debug"]))
    assert (options.standalone, options.nproc_per_node, options.max_restarts, options.module) == (True, "2", 5, True)
    assert options.signals_to_handle == "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2" and options.shutdown_timeout == 100
    assert (options.training_script, options.training_script_args) == ("train", ["--preset", "debug"])
    assert callable(torchrun.run)
