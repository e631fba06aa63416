"""Who am I: one function turns every launcher's environment into rank, world size and rendezvous."""

import pytest

from train.cluster import expand_hostlist
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


@pytest.mark.parametrize("hostlist, hosts", [
    ("n1", ["n1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("gpu[01-03,7]", ["gpu01", "gpu02", "gpu03", "gpu7"]),
    ("a[1-2],b5,c[09-10]", ["a1", "a2", "b5", "c09", "c10"]),
    ("rack1-n[3-4]-ib", ["rack1-n3-ib", "rack1-n4-ib"]),
])
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


def test_bad_rank_variable_is_one_clear_error():
    with pytest.raises(ConfigError, match="RANK='x' is not an integer"):
        resolve_identity({"RANK": "x", "WORLD_SIZE": "2"})
