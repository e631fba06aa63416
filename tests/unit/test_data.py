"""The built-in dataset, sharding across ranks, resumable positions and the file datasets."""

import pytest
import torch

from tests.helpers import DEBUG
from train.cli import parse_config
from train.data import make_shapes
from train.loading import SeededSample, ShardSampler, build_val_loader


def test_shapes_is_a_pure_function_of_the_seed():
    a, la = make_shapes(200, 16, seed=1)
    b, lb = make_shapes(200, 16, seed=1)
    c, lc = make_shapes(200, 16, seed=2)
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert not torch.equal(a, c)
    assert a.dtype == torch.uint8 and a.shape == (200, 3, 16, 16)


def test_shapes_has_ten_balanced_classes_that_differ_in_content():
    images, labels = make_shapes(5000, 32, seed=0)
    counts = torch.bincount(labels, minlength=10)
    assert counts.min() > 400 and counts.max() < 600
    # Class-mean images are distinct: the labels are carried by the pictures, not noise.
    means = torch.stack([images[labels == c].float().mean(0) for c in range(10)])
    assert torch.cdist(means.flatten(1), means.flatten(1)).add(torch.eye(10) * 1e9).min() > 1.0


def test_sampler_shards_are_disjoint_and_cover_the_epoch():
    shards = [list(ShardSampler(103, r, 4, seed=0, with_seeds=False)) for r in range(4)]
    assert len({len(s) for s in shards}) == 1  # same length on every rank (cut to a multiple of 4)
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)) == 100


def test_sampler_reshuffles_every_epoch_and_repeats_per_seed():
    s = ShardSampler(100, 0, 2, seed=0, with_seeds=False)
    s.set_epoch(0)
    e0 = list(s)
    s.set_epoch(1)
    e1 = list(s)
    assert e0 != e1
    s.set_epoch(0)
    assert list(s) == e0


def test_sampler_start_resumes_mid_epoch_exactly():
    s = ShardSampler(100, 1, 2, seed=3, with_seeds=True)
    s.set_epoch(4)
    full = list(s)
    s.set_epoch(4, start=17)
    assert list(s) == full[17:]
    assert len(s) == len(full) - 17


def test_per_sample_augmentation_seed_is_independent_of_who_loads_it():
    class Noise(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return torch.rand(3)

    data = SeededSample(Noise())
    assert torch.equal(data[(4, 99)], data[(4, 99)])
    assert not torch.equal(data[(4, 99)], data[(4, 100)])
    # the draws are the seed's own on the CPU generator, and loading in the trainer leaves the trainer's alone
    torch.manual_seed(7)
    state = torch.get_rng_state()
    assert torch.equal(data[(4, 99)], torch.rand(3, generator=torch.Generator().manual_seed(99)))
    assert torch.equal(torch.get_rng_state(), state)
    # and in a loader worker, the same draws
    loader = torch.utils.data.DataLoader(data, batch_size=None, sampler=[(4, 99), (2, 100)], num_workers=1)
    assert all(torch.equal(got, torch.rand(3, generator=torch.Generator().manual_seed(seed)))
               for got, seed in zip(loader, (99, 100), strict=True))


def test_validation_counts_every_sample_once_across_ranks():
    cfg = parse_config(DEBUG)
    from train.data import ShapesDataset

    val = ShapesDataset(101, 16, seed=0)
    seen = []
    for rank in range(4):
        for x, _ in build_val_loader(val, cfg.data, cfg.optimisation.batch_size, rank, 4, pin_memory=False):
            seen += x.flatten(1).sum(1).tolist()
    every = [val[i][0].flatten().sum().item() for i in range(101)]
    assert len(set(every)) == 101  # each sample has its own sum, so the sums identify the samples
    assert sorted(seen) == sorted(every)






@pytest.mark.parametrize("n, world, reps", [(1000, 4, 3), (600, 3, 4), (512, 2, 3)])
def test_the_repeated_augmentation_sampler_takes_the_references_indices(n, world, reps):
    """torchvision's reference RASampler: the permutation of seed + epoch, each index `reps` times in a row,
    padded from the start to a multiple of the world size, rank r taking every world-th from r, cut to the
    set's multiple of 256 shared by the ranks. Every rank, two epochs, and a resume mid-epoch."""
    import math

    for epoch in (0, 5):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(7 + epoch)).tolist()
        repeated = [i for i in perm for _ in range(reps)]
        total = math.ceil(n * reps / world) * world
        repeated += repeated[:total - len(repeated)]
        keep = n // 256 * 256 // world
        seeds = set()
        for r in range(world):
            sampler = ShardSampler(n, r, world, seed=7, with_seeds=True, reps=reps)
            sampler.set_epoch(epoch)
            taken = list(sampler)
            assert [i for i, _ in taken] == repeated[r:total:world][:keep] and len(sampler) == keep
            seeds |= {s for _, s in taken}
            sampler.set_epoch(epoch, start=11)
            assert list(sampler) == taken[11:] and len(sampler) == keep - 11
        assert len(seeds) == world * keep  # the repetitions of an image are augmented apart


def test_repeated_augmentation_on_one_worker_samples_plainly_as_the_reference():
    """The reference uses RASampler only when distributed, RandomSampler otherwise: on one worker --ra-reps
    leaves the order a plain shuffle of the whole set (no copies in a batch, no cut to 256), and the line that
    describes the sampler says so."""
    from train.loading import describe_sampler

    plain = ShardSampler(1000, 0, 1, seed=7, with_seeds=True)
    repeated = ShardSampler(1000, 0, 1, seed=7, with_seeds=True, reps=4)
    for epoch in (0, 3):
        plain.set_epoch(epoch)
        repeated.set_epoch(epoch)
        taken = [i for i, _ in repeated]
        assert list(repeated) == list(plain) and len(repeated) == 1000 and sorted(taken) == list(range(1000))
    assert "--ra-reps 4 on one worker samples plainly at random" in describe_sampler(4, 1)
    two = ShardSampler(1000, 0, 2, seed=7, with_seeds=True, reps=4)  # two workers: the copies come back
    first = [i for i, _ in two][:8]
    assert first[0] == first[1] and "RASampler" in describe_sampler(4, 2)
