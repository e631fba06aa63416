"""Who am I: one function turns every launcher's environment into rank, world size and rendezvous."""

import pytest

from tests.helpers import HOSTLISTS, MALFORMED_HOSTLISTS, SUFFIXED_HOSTLISTS
from train.base.errors import ConfigError
from train.cluster.hostlist import JobError, expand_hostlist, parse_hostlist
from train.cluster.identity import check_rendezvous_variables, from_environment, resolve_identity
from train.cluster.jobs import master_port as slurm_master_port
from train.run.preflight import check_port


def test_single_process():
    ident = resolve_identity({})
    assert (ident.global_rank, ident.local_rank, ident.world_size, ident.launcher) == (0, 0, 1, "single")
    assert not ident.distributed


def test_torchrun_environment():
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "head", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "x"}
    ident = resolve_identity(env)
    assert (ident.global_rank, ident.local_rank, ident.world_size, ident.local_world_size) == (5, 1, 8, 4)
    assert (ident.launcher, ident.master_addr, ident.master_port) == ("torchrun", "head", 29400)


def test_torchrun_wins_over_the_surrounding_slurm_step():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
           "SLURM_STEP_ID": "0", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "7", "TORCHELASTIC_RUN_ID": "x"}
    assert resolve_identity(env).launcher == "torchrun"


def test_rank_and_world_size_set_by_something_else_are_the_env_launcher():
    """Kubeflow's PyTorchJob, a script of one's own, or a shell they were left in: no TORCHELASTIC_RUN_ID (torchrun
    sets it for every worker), no TRAINBOX_LAUNCHER (--spawn's)."""
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "23456"}
    ident = resolve_identity(env)
    assert (ident.launcher, ident.global_rank, ident.world_size, ident.master_addr, ident.master_port) == \
        ("env", 0, 2, "10.0.0.7", 23456)
    assert ident.distributed
    assert resolve_identity({**env, "TRAINBOX_LAUNCHER": "spawn"}).launcher == "spawn"


def test_a_rank_from_the_environment_says_which_variables_made_it_and_how_to_train_alone():
    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "head", "MASTER_PORT": "23456",
           "PATH": "/bin"}
    ident = resolve_identity(env)
    assert from_environment(ident, 30, env) == (
        "rank 2 of 4 from the environment (RANK=2 WORLD_SIZE=4 LOCAL_RANK=0 MASTER_ADDR=head MASTER_PORT=23456; set by "
        "neither torchrun nor --spawn): waiting up to 30 s (--timeout-s) to reach rank 0 at head:23456; to train "
        "alone, unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT")
    main = resolve_identity({**env, "RANK": "0"})
    assert "waiting up to 30 s (--timeout-s) for ranks 1-3 at head:23456" in from_environment(main, 30, env)
    alone = resolve_identity({**env, "RANK": "0", "WORLD_SIZE": "1"})
    assert "): a process group of one at head:23456; to train alone" in from_environment(alone, 30, env)


def test_a_rank_from_the_environment_without_a_rendezvous_address_is_refused_in_one_line():
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "23456"}
    with pytest.raises(ConfigError) as e:
        check_rendezvous_variables(env)
    assert str(e.value) == (
        "RANK=0 WORLD_SIZE=2 MASTER_PORT=23456 are set in the environment (by neither torchrun nor --spawn) but "
        "MASTER_ADDR is not: set MASTER_ADDR to rank 0's host, or unset RANK WORLD_SIZE MASTER_PORT to train alone")
    with pytest.raises(ConfigError, match="but MASTER_ADDR and MASTER_PORT are not: set MASTER_ADDR to rank 0's host "
                                          "and MASTER_PORT to a free port there, or unset RANK WORLD_SIZE to train"):
        check_rendezvous_variables({"RANK": "0", "WORLD_SIZE": "2"})
    check_rendezvous_variables({**env, "MASTER_ADDR": "head"})


def test_spawn_with_rank_variables_in_the_environment_is_refused_naming_them(monkeypatch):
    from train.run.preflight import preflight
    from train.cli import parse_config

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    for key in ("TORCHELASTIC_RUN_ID", "TRAINBOX_LAUNCHER", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ConfigError) as e:
        preflight(parse_config(["--preset", "debug", "--spawn", "2"]))
    assert str(e.value) == ("--spawn with RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=1 set in the "
                            "environment would start workers twice: drop --spawn, or unset RANK WORLD_SIZE MASTER_ADDR "
                            "MASTER_PORT and let --spawn number its workers")


def test_evaluate_checks_the_launch_environment_and_gpus_as_the_trainer_does(monkeypatch, tmp_path, capsys):
    """python -m train.evaluate (make evaluate) with RANK and WORLD_SIZE left in the shell: the trainer's one line, not
    torch's traceback; make evaluate's GPUS= counted and checked as make train's, before the run folder is read."""
    from train import evaluate

    for key in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TRAINBOX_LAUNCHER", "LOCAL_RANK",
                "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert evaluate.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: RANK=0 WORLD_SIZE=2 are set in the environment (by neither torchrun nor --spawn) but MASTER_ADDR and "
        "MASTER_PORT are not: set MASTER_ADDR to rank 0's host and MASTER_PORT to a free port there, or unset RANK "
        "WORLD_SIZE to train alone"]
    assert evaluate.main([str(tmp_path), "--gpus", "2"]) == 2  # GPUS=2: --spawn 2 under a rank of another launch
    assert capsys.readouterr().err.startswith("error: --spawn with RANK=0 WORLD_SIZE=2 set in the environment would "
                                              "start workers twice")
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    for flags, line in [(["--gpus", "-1"], "GPUS=-1: a count of workers cannot be negative: give 0 for the CPU or a "
                                           "positive count (GPUS=1, GPUS=4, ...)"),
                        (["--gpus", "x"], "GPUS='x' is not a number: use GPUS=0 (CPU), GPUS=1, GPUS=4, ..."),
                        (["--gpus", "2", "--spawn", "2"], "--gpus 2 (make's GPUS=) and --spawn 2 both count the "
                                                          "workers: give one")]:
        assert evaluate.main([str(tmp_path), *flags]) == 2
        assert capsys.readouterr().err.splitlines() == [f"error: {line}"]
    assert evaluate.local_workers(0, "") == (0, False)  # unset: this process alone, on the run's --device
    assert evaluate.local_workers(0, "0") == (0, True)  # GPUS=0: on the CPU, as make train


def test_srun_task_environment():
    env = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0",
           "SLURM_JOB_ID": "12345", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    ident = resolve_identity(env)
    assert (ident.global_rank, ident.local_rank, ident.world_size, ident.local_world_size) == (3, 1, 4, 2)
    assert (ident.launcher, ident.master_addr, ident.master_port) == ("slurm", "gpu07", slurm_master_port("12345"))
    assert resolve_identity({**env, "MASTER_PORT": "30000"}).master_port == 30000


def test_batch_script_is_not_a_step_of_many_tasks():
    # sbatch's batch shell has SLURM_PROCID=0 and SLURM_NTASKS=N but no step: it is one process.
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert resolve_identity(env).launcher == "single"


def test_slurm_ports_differ_between_jobs():
    assert slurm_master_port("1001") != slurm_master_port("1002")
    assert 20000 <= slurm_master_port("987654321") < 40000


@pytest.mark.parametrize("hostlist, hosts", HOSTLISTS + SUFFIXED_HOSTLISTS)
def test_hostlists_parse_as_scontrol_expands_them(hostlist, hosts):
    assert parse_hostlist(hostlist) == hosts


# Slurm 22.05 reads the last three leniently ('a]', 'a1-2]', 'a1'); its newer releases refuse the first.
@pytest.mark.parametrize("hostlist", [*MALFORMED_HOSTLISTS, "a[1-2", "a1-2]", "a[1-]"])
def test_a_malformed_hostlist_is_one_line(hostlist):
    with pytest.raises(JobError, match=r"write ranges as name\[1-4,7\]$"):
        parse_hostlist(hostlist)


def test_a_hostlist_without_hosts_is_refused_and_a_step_names_it_in_one_line():
    with pytest.raises(JobError, match="names no host"):
        expand_hostlist(" , ")
    env = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
           "SLURM_JOB_ID": "9", "SLURM_STEP_NODELIST": "n[2-1]", "SLURM_CONF": "/nonexistent"}
    with pytest.raises(ConfigError, match=r"'2-1' in \[2-1\] is not .* or set MASTER_ADDR$"):
        resolve_identity(env)
    assert resolve_identity({**env, "MASTER_ADDR": "n2"}).master_addr == "n2"


def test_bad_rank_variable_is_one_clear_error():
    with pytest.raises(ConfigError, match="RANK='x' is not an integer"):
        resolve_identity({"RANK": "x", "WORLD_SIZE": "2"})


@pytest.mark.parametrize("port", ["abc", "0", "70000", "-5", " 123", ""])
def test_a_master_port_that_is_no_port_number_is_named_so_not_taken_for_a_busy_one(port):
    """--spawn's launcher checks MASTER_PORT before it listens there; a rank from the environment (or srun) reads it."""
    with pytest.raises(ConfigError) as e:
        check_port(port, fix="unset MASTER_PORT so a free one is picked")
    assert str(e.value) == f"MASTER_PORT={port!r} is not a port number (1-65535): unset MASTER_PORT so a free one " \
                           f"is picked, or set a free one"
    with pytest.raises(ConfigError, match=r"^MASTER_PORT=.* is not a port number \(1-65535\): fix the launcher"):
        resolve_identity({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "n1", "MASTER_PORT": port})
