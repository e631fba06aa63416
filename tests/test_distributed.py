"""Who-am-I resolution for every launcher, and DDP behaviour on real gloo process groups."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from train.distributed import free_port, resolve_identity
from train.slurm import expand_hostlist
from train.slurm import master_port as slurm_master_port
from train.loop import ordered_allreduce_hook


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
    with pytest.raises(RuntimeError, match="RANK='x' is not an integer"):
        resolve_identity({"RANK": "x", "WORLD_SIZE": "2"})


# ------------------------------------------------------------ real process groups

def _worker(rank, world, port, bucket_cap_mb, use_hook, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    if use_hook:
        ddp.register_comm_hook(None, ordered_allreduce_hook)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    # The gradient of the mean loss over all ranks' data, computed locally for comparison.
    local = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    local.load_state_dict(model.state_dict())
    xs, ys = [], []
    for r in range(world):
        gr = torch.Generator().manual_seed(100 + r)
        xs.append(torch.randn(32, 64, generator=gr))
        ys.append(torch.randint(0, 10, (32,), generator=gr))
    torch.nn.functional.cross_entropy(local(torch.cat(xs)), torch.cat(ys)).backward()
    expected = torch.cat([p.grad.flatten() for p in local.parameters()])
    gathered = [torch.empty_like(grads) for _ in range(world)]
    dist.all_gather(gathered, grads)
    if rank == 0:
        queue.put((grads.tolist(), [g.tolist() for g in gathered], expected.tolist()))  # plain data: exact
    dist.barrier()
    dist.destroy_process_group()


def _ddp_gradients(world, bucket_cap_mb, use_hook):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    context = mp.start_processes(_worker, args=(world, free_port(), bucket_cap_mb, use_hook, queue),
                                 nprocs=world, start_method="spawn", join=False)
    grads, gathered, expected = queue.get()
    while not context.join():
        pass
    return torch.tensor(grads), [torch.tensor(g) for g in gathered], torch.tensor(expected)


@pytest.mark.slow
@pytest.mark.parametrize("use_hook", [False, True], ids=["ddp-allreduce", "ordered-hook"])
def test_gradients_equal_across_ranks_after_a_step(use_hook):
    grads, gathered, expected = _ddp_gradients(3, 25, use_hook)
    for other in gathered:
        assert torch.equal(other, grads)  # every rank holds the same bits
    torch.testing.assert_close(grads, expected, rtol=1e-5, atol=1e-6)  # and it is the global mean gradient


@pytest.mark.slow
def test_ordered_reduction_does_not_depend_on_bucket_layout():
    small, _, _ = _ddp_gradients(3, 0.01, True)  # many tiny buckets
    large, _, _ = _ddp_gradients(3, 100, True)   # one bucket
    assert torch.equal(small, large)
