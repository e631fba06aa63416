"""Who am I: one function turns every launcher's environment into rank, world size and rendezvous."""

import pytest

from tests.helpers import HOSTLISTS, MALFORMED_HOSTLISTS, SUFFIXED_HOSTLISTS
from train.cluster import PlanError, expand_hostlist, parse_hostlist
from train.cluster import master_port as slurm_master_port
from train.distributed import resolve_identity
from train.errors import ConfigError


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
           "SLURM_STEP_ID": "0", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "7"}
    assert resolve_identity(env).launcher == "torchrun"


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
    with pytest.raises(PlanError, match=r"write ranges as name\[1-4,7\]$"):
        parse_hostlist(hostlist)


def test_a_hostlist_without_hosts_is_refused_and_a_step_names_it_in_one_line():
    with pytest.raises(PlanError, match="names no host"):
        expand_hostlist(" , ")
    env = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
           "SLURM_JOB_ID": "9", "SLURM_STEP_NODELIST": "n[2-1]", "SLURM_CONF": "/nonexistent"}
    with pytest.raises(ConfigError, match=r"'2-1' in \[2-1\] is not .* or set MASTER_ADDR$"):
        resolve_identity(env)
    assert resolve_identity({**env, "MASTER_ADDR": "n2"}).master_addr == "n2"


def test_bad_rank_variable_is_one_clear_error():
    with pytest.raises(ConfigError, match="RANK='x' is not an integer"):
        resolve_identity({"RANK": "x", "WORLD_SIZE": "2"})
