"""Which samples each rank trains on, in which order, and with which augmentation seed.

Training batches come from ShardSampler: every epoch one permutation drawn from (seed, epoch), shared by all
ranks, rank r taking every world_size-th index (or, with --ra-reps on 2 or more workers, torchvision's
repeated-augmentation sampler). Each index travels with its own augmentation seed (SeededSample), so a run
resumed mid-epoch, or with another number of loader workers, sees the same images.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset, Sampler

from train.base.errors import ConfigError


class SeededSample(Dataset):
    """Wraps a dataset whose transforms draw random numbers: each item is (index, seed) and the
    transform's randomness comes from that seed alone, not from which worker happens to load it."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item):
        index, seed = item
        # The CPU generator alone, which the transforms draw from: torch.manual_seed would also queue a seed for
        # every accelerator torch was built for, each with a copy of the Python stack, where none is initialised
        # (a loader worker, a CPU machine): about 1.5 ms a sample.
        if torch.utils.data.get_worker_info() is not None:
            torch.default_generator.manual_seed(seed)
            return self.dataset[index]
        with torch.random.fork_rng(devices=[]):  # loading in the trainer itself: leave its RNG alone
            torch.default_generator.manual_seed(seed)
            return self.dataset[index]


def samples_per_rank(length: int, world: int, reps: int = 0) -> int:
    """The samples each rank takes in one epoch: an equal share of the set cut to a multiple of the world
    size, or with --ra-reps on more than one worker the repeated-augmentation sampler's (torchvision's
    reference: the set cut to a multiple of 256, then shared by the ranks)."""
    return length // 256 * 256 // world if reps and world > 1 else length // world


@dataclass(frozen=True)
class Sampling:
    """What a training sampler is made of, beside its rank and dataset (the run's sampler spec): the seed of its order
    and augmentation, --ra-reps, and the step's shape its epoch is cut to."""

    seed: int
    reps: int  # --ra-reps (0: none)
    batch_size: int  # per rank and micro-batch
    grad_accum: int  # micro-batches per optimizer step


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
    The epoch is cut to whole optimizer steps, so every rank yields the same number of indices.
    reps > 0 on more than one worker: torchvision's repeated-augmentation sampler (RASampler) instead (one worker
    samples plainly, as the reference outside distributed runs): the epoch's permutation (seeded
    with seed + epoch, as the reference's) with each index repeated `reps` times in a row, padded from its
    start to a multiple of the world size, rank r taking every world-th entry from r, cut to
    samples_per_rank. Each entry has a seed of its own, so the repetitions of an image are augmented apart.

    layout: the (workers, --grad-accum) the run's order was laid out for, at its first start; a resume on another
    number of workers keeps it (train/config/resume.py). Each optimizer step is then made of the same micro-batches as
    in the laid-out run, dealt to this run's ranks (see origin): the same samples in the same micro-batches, with the
    same seeds."""

    def __init__(self, length: int, rank: int, world_size: int, seed: int, with_seeds: bool, reps: int = 0,
                 batch_size: int = 1, grad_accum: int = 1, layout: tuple[int, int] | None = None):
        self.layout = layout or (world_size, grad_accum)
        if length < self.layout[0]:
            raise ConfigError(f"dataset has {length} samples but there are {self.layout[0]} workers: use more data")
        self.length, self.rank, self.world_size, self.seed = length, rank, world_size, seed
        self.batch_size, self.grad_accum = batch_size, grad_accum
        self.with_seeds = with_seeds
        self.reps = reps if self.layout[0] > 1 else 0  # laid out for one worker: plain (the reference)
        self.epoch = 0
        self.start = 0  # indices of this rank to skip in the current epoch (resume)
        self.positions = self._positions()

    def _positions(self) -> torch.Tensor:
        """This rank's places in the epoch's order, micro-batch by micro-batch of each whole optimizer step: the
        micro-batch (rank r0, micro m0) of the laid-out run takes places r0 + W0 * (k + i) for its b images
        i, k counting the micro-batches of b before it on its rank."""
        world0, accum0 = self.layout
        per_rank = samples_per_rank(self.length, world0, self.reps)
        steps = per_rank // self.batch_size // accum0
        r0, m0 = origin(self.rank, torch.arange(self.grad_accum), self.world_size, self.layout)
        s = torch.arange(steps).view(-1, 1, 1)
        i = torch.arange(self.batch_size).view(1, 1, -1)
        places = r0.view(1, -1, 1) + world0 * ((s * accum0 + m0.view(1, -1, 1)) * self.batch_size + i)
        return places.flatten()

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return len(self.positions) - self.start

    def __iter__(self):
        places = self.positions[self.start:]
        if self.reps:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=g).repeat_interleave(self.reps)
            mine = order[places].tolist()  # every place lies within the first samples_per_rank x workers entries
            seeds_by = places.tolist()  # a seed per entry of the epoch, not per image
        else:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            mine = torch.randperm(self.length, generator=g)[places].tolist()
            seeds_by = mine  # one seed per (run seed, epoch, sample): the same wherever and whenever it is loaded
        if not self.with_seeds:
            return iter(mine)
        base = (self.seed * 1_000_003 + self.epoch) * 10_000_019
        return iter([(i, (base + k) % (2**63 - 1)) for i, k in zip(mine, seeds_by, strict=True)])


def origin(rank: int, micro, world_size: int, layout: tuple[int, int]):
    """The micro-batch of the laid-out run (its rank r0, its micro-batch m0) that this run's rank `rank` trains as
    its micro-batch `micro` of a step: slot micro x world + rank of this run is slot m0 x W0 + r0 of that one. On the
    layout itself, (rank, micro)."""
    slot = micro * world_size + rank
    return slot % layout[0], slot // layout[0]
