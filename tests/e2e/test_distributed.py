"""Who-am-I resolution for every launcher, and DDP behaviour on real gloo process groups."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from train.cluster.distributed import destroy_and_leave_together, join_group, ordered_allreduce_hook
from train.cluster.identity import free_port


# ------------------------------------------------------------ real process groups

# Every (bucket_cap_mb, hook) layout the tests below compare, computed by one group of 3 ranks: one
# DistributedDataParallel per layout, each from the same initial weights on the same data.
LAYOUTS = [(25, False), (25, True), (0.01, True), (100, True), (0.01, False), (100, False)]


def _worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    join_group("gloo", rank, world)
    results = {}
    for bucket_cap_mb, use_hook in LAYOUTS:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                    torch.nn.ReLU(), torch.nn.Linear(256, 10))
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        if use_hook:
            ddp.register_comm_hook(None, ordered_allreduce_hook)
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        # Twice: DDP's first backward runs with every gradient in one bucket, whatever bucket_cap_mb says; it
        # then rebuilds the buckets in the order the gradients became ready, at bucket_cap_mb, for the second.
        for _ in range(2):
            ddp.zero_grad(set_to_none=True)
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
        results[bucket_cap_mb, use_hook] = (grads.tolist(), [g.tolist() for g in gathered], expected.tolist())
    if rank == 0:
        queue.put(results)  # plain data: exact
    destroy_and_leave_together()  # a rank exiting while a peer's gloo group lives can abort that peer


@pytest.fixture(scope="module")
def ddp_gradients():
    """{(bucket_cap_mb, use_hook): (rank 0's gradients, every rank's, the single-process expectation)}."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    context = mp.start_processes(_worker, args=(3, free_port(), queue), nprocs=3, start_method="spawn",
                                 join=False)
    results = queue.get(timeout=120)  # a worker that died fails the test, not hangs it
    while not context.join():
        pass
    return {layout: (torch.tensor(grads), [torch.tensor(g) for g in gathered], torch.tensor(expected))
            for layout, (grads, gathered, expected) in results.items()}


@pytest.mark.parametrize("use_hook", [False, True], ids=["ddp-allreduce", "ordered-hook"])
def test_gradients_equal_across_ranks_after_a_step(ddp_gradients, use_hook):
    grads, gathered, expected = ddp_gradients[25, use_hook]
    for other in gathered:
        assert torch.equal(other, grads)  # every rank holds the same bits
    torch.testing.assert_close(grads, expected, rtol=1e-5, atol=1e-6)  # and it is the global mean gradient


def test_ordered_reduction_does_not_depend_on_bucket_layout(ddp_gradients):
    small, large = ddp_gradients[0.01, True][0], ddp_gradients[100, True][0]  # many tiny buckets; one bucket
    assert torch.equal(small, large)
    # The control: DDP's own all-reduce over the same two layouts sums in another order, and the bits differ
    # (so the equality above is the hook's doing, and this check could see it fail).
    assert not torch.equal(ddp_gradients[0.01, False][0], ddp_gradients[100, False][0])
