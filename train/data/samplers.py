"""Which samples each rank trains on, in which order, and with which augmentation seed.

Training batches come from ShardSampler: every epoch one permutation drawn from (seed, epoch), shared by all
ranks, rank r taking every world_size-th index (or, with --ra-reps on 2 or more workers, torchvision's
repeated-augmentation sampler). Each index travels with its own augmentation seed (SeededSample), so a run
resumed mid-epoch, or with another number of loader workers, sees the same images.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, Sampler

from train.errors import ConfigError


class SeededSample(Dataset):
    """Wraps a dataset whose transforms draw random numbers: each item is (index, seed) and the
    transform's randomness comes from that seed alone, not from which worker happens to load it."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item):
        index, seed = item
        if torch.utils.data.get_worker_info() is not None:
            torch.manual_seed(seed)
            return self.dataset[index]
        with torch.random.fork_rng(devices=[]):  # loading in the trainer itself: leave its RNG alone
            torch.manual_seed(seed)
            return self.dataset[index]


def samples_per_rank(length: int, world: int, reps: int = 0) -> int:
    """The samples each rank takes in one epoch: an equal share of the set cut to a multiple of the world
    size, or with --ra-reps on more than one worker the repeated-augmentation sampler's (torchvision's
    reference: the set cut to a multiple of 256, then shared by the ranks)."""
    return length // 256 * 256 // world if reps and world > 1 else length // world


def describe_sampler(reps: int, world: int) -> str:
    """What the training sampler does with --ra-reps `reps` on `world` workers, in a line (the plan's, the log's)."""
    if reps and world > 1:
        return (f"repeated augmentation (torchvision's RASampler): each image {reps} times in a row in the epoch's "
                f"order, dealt round the {world} ranks in turn (a rank gets several copies of an image when there are "
                f"fewer ranks than copies), each copy augmented apart; the epoch cut to a multiple of 256 images")
    shared = f", rank r taking every {world}-th" if world > 1 else ""
    plain = f"one shuffled pass over the set per epoch{shared}"
    if reps:
        return (f"{plain}: --ra-reps {reps} on one worker samples plainly at random, as torchvision's reference does "
                f"outside distributed runs (the repetitions need 2 or more workers)")
    return plain


class ShardSampler(Sampler):
    """Like DistributedSampler (shared per-epoch permutation, rank r takes every world-th index),
    plus: a start position inside the epoch for resuming, and a per-sample augmentation seed.
    The epoch is cut to a multiple of world_size so every rank yields the same number of indices.
    reps > 0 on more than one worker: torchvision's repeated-augmentation sampler (RASampler) instead (one worker
    samples plainly, as the reference outside distributed runs): the epoch's permutation (seeded
    with seed + epoch, as the reference's) with each index repeated `reps` times in a row, padded from its
    start to a multiple of the world size, rank r taking every world-th entry from r, cut to
    samples_per_rank. Each entry has a seed of its own, so the repetitions of an image are augmented apart."""

    def __init__(self, length: int, rank: int, world_size: int, seed: int, with_seeds: bool, reps: int = 0):
        if length < world_size:
            raise ConfigError(f"dataset has {length} samples but there are {world_size} workers: use more data")
        self.length, self.rank, self.world_size, self.seed = length, rank, world_size, seed
        self.with_seeds, self.reps = with_seeds, reps if world_size > 1 else 0  # one worker: plain (the reference)
        self.epoch = 0
        self.start = 0  # indices of this rank to skip in the current epoch (resume)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return samples_per_rank(self.length, self.world_size, self.reps) - self.start

    def __iter__(self):
        if self.reps:
            return self._repeated()
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.length, generator=g)
        usable = self.length - self.length % self.world_size
        mine = order[self.rank:usable:self.world_size][self.start:].tolist()
        if not self.with_seeds:
            return iter(mine)
        # One seed per (run seed, epoch, sample): the same wherever and whenever the sample is loaded.
        base = (self.seed * 1_000_003 + self.epoch) * 10_000_019
        return iter([(i, (base + i) % (2**63 - 1)) for i in mine])

    def _repeated(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.length, generator=g).repeat_interleave(self.reps)
        total = -(-self.length * self.reps // self.world_size) * self.world_size
        order = torch.cat([order, order[:total - len(order)]])
        positions = torch.arange(self.rank, total, self.world_size)[:samples_per_rank(self.length, self.world_size,
                                                                                       self.reps)][self.start:]
        mine = order[positions].tolist()
        if not self.with_seeds:
            return iter(mine)
        base = (self.seed * 1_000_003 + self.epoch) * 10_000_019  # a seed per entry of the epoch, not per image
        return iter([(i, (base + p) % (2**63 - 1)) for i, p in zip(mine, positions.tolist(), strict=True)])


def relayout(step_in_epoch: int, saved: tuple[int, int, int], now: tuple[int, int, int]) -> int:
    """A position inside the epoch saved with (workers, batch, accumulation) `saved`, in steps of `now`:
    the samples seen, rounded down to a whole step of the new layout (the data order is kept)."""
    if saved == now:
        return step_in_epoch
    return step_in_epoch * saved[0] * saved[1] * saved[2] // (now[0] * now[1] * now[2])
