"""A run's loaders, whatever its data: the training loader with its sampler (in-memory batches cut on the device for a
dataset held whole, DataLoader workers for any other) and the validation loader (every sample once across ranks, no
padding). They know no image: a dataset says what it needs of them by what it has (the image wing's FileBytes, say):

  tensors                 held in memory whole, its items their rows (a TensorDataset, the built-in sets): moved to
                          the device once, batches cut there
  collate(items)          the DataLoader's collate function (default: torch's default_collate)
  seeded = True           its items are asked for as (index, seed) and it applies the seed itself (else SeededSample
                          seeds the global RNG around each item)
  loader_on(loader, dev)  the loader wrapped into one that yields batches on the device (no pinned memory then)
"""

from __future__ import annotations

import signal

import torch
from torch.utils.data import DataLoader

from train.cluster.identity import identity, usable_cores
from train.config.catalog import source
from train.config.settings import Config, Data
from train.loading.samplers import Sampling, SeededSample, ShardSampler


def on_device(value, device: torch.device):
    """A tensor, or a dict, list or tuple of them (nested), on the device; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {k: on_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_device(v, device) for v in value)
    return value


def in_memory(dataset) -> tuple[torch.Tensor, ...] | None:
    """The tensors of a dataset held in memory whole, its items their rows (the built-in sets; a task's TensorDataset),
    moved to the training device once and cut into batches there; None for any other dataset."""
    tensors = getattr(dataset, "tensors", None)
    return tuple(tensors) if isinstance(tensors, (tuple, list)) and tensors and \
        all(isinstance(t, torch.Tensor) and t.dim() and len(t) == len(dataset) for t in tensors) else None


def to_device(dataset, device: torch.device) -> tuple[torch.Tensor, ...]:
    """An in-memory dataset's tensors on the device (the dataset keeps them there)."""
    dataset.tensors = tuple(t.to(device) for t in dataset.tensors)
    return tuple(dataset.tensors)


class TensorLoader:
    """Batches straight from in-memory tensors: no worker processes, no per-sample collate."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], sampler: ShardSampler, batch_size: int):
        self.tensors, self.sampler, self.batch_size = tensors, sampler, batch_size

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size

    def __iter__(self):
        indices = torch.tensor(list(self.sampler), dtype=torch.long).to(self.tensors[0].device)
        for b in range(len(self)):
            idx = indices[b * self.batch_size:(b + 1) * self.batch_size]
            yield tuple(t[idx] for t in self.tensors)


def default_num_workers(data: Data) -> int:
    """--num-workers, or where it is -1 the DataLoader workers per process that the data wants: none for the
    built-in sets, made in memory, and the token windows cut from memory; for any dataset whose items a loader reads
    (files, a task's own), the cores'."""
    return 0 if data.num_workers < 0 and source(data.dataset).in_memory else read_workers(data)


def read_workers(data: Data) -> int:
    """The loader workers of a dataset whose items a loader reads: --num-workers, or where it is -1 none for a source
    whose items are slices of tokens held in memory (a worker would only copy them, on cores the training uses) and
    loader_workers() for any other (files, a task's own)."""
    if data.num_workers >= 0:
        return data.num_workers
    return 0 if source(data.dataset).sliced else loader_workers()


def loader_workers() -> int:
    """Every core of this process's share but one (the one that runs the training loop itself), no cap: reading,
    decoding and augmenting is the work that scales with cores (make bench: images/s per loader worker)."""
    return max(1, usable_cores() // max(1, identity().local_world_size) - 1)


def ignore_stop_signals(_worker_id: int) -> None:
    # A preemption signal sent to the whole process group must not kill loader workers before
    # the trainer has saved its checkpoint; the trainer shuts them down itself.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)


def sampling(cfg: Config) -> Sampling:
    """The run's sampler spec: what of its config the training sampler reads."""
    return Sampling(cfg.run.seed, cfg.augmentation.ra_reps, cfg.optimisation.batch_size, cfg.optimisation.grad_accum)


def build_train_loader(dataset, spec: Sampling, data: Data, rank: int, world_size: int, pin_memory: bool,
                       device: torch.device | None = None, persistent: bool = True,
                       layout: tuple[int, int] | None = None, collate=None):
    """The training loader of this rank and its sampler, as `spec` deals the samples and `data` (--num-workers) loads
    them. layout: the (workers, --grad-accum) the run's sample order is laid out for (a resume on other workers keeps
    it); default: this one. collate: the task's (Task.collate), which takes its items through DataLoader workers even
    where they are tensors held in memory; default: the dataset's, else torch's."""
    held = in_memory(dataset) is not None and collate is None
    sampler = ShardSampler(len(dataset), rank, world_size, spec.seed, with_seeds=not held, reps=spec.reps,
                           batch_size=spec.batch_size, grad_accum=spec.grad_accum, layout=layout)
    if held:  # in memory: batches are cut on the training device itself
        return TensorLoader(to_device(dataset, device or torch.device("cpu")), sampler, spec.batch_size), sampler
    workers = read_workers(data)  # items a loader reads
    loader_on = getattr(dataset, "loader_on", None)
    loader = DataLoader(dataset if getattr(dataset, "seeded", False) else SeededSample(dataset),
                        batch_size=spec.batch_size, sampler=sampler, drop_last=True, num_workers=workers,
                        pin_memory=pin_memory and loader_on is None, persistent_workers=persistent and workers > 0,
                        worker_init_fn=ignore_stop_signals if workers > 0 else None,
                        prefetch_factor=4 if workers > 0 else None,
                        collate_fn=collate or getattr(dataset, "collate", None),
                        generator=torch.Generator().manual_seed(spec.seed))  # iter() must not draw global RNG
    return (loader if loader_on is None else loader_on(loader, device or torch.device("cpu"))), sampler


def build_val_loader(dataset, data: Data, batch_size: int, rank: int, world_size: int, pin_memory: bool,
                     device: torch.device | None = None, collate=None):
    """This rank's validation loader: each rank takes indices rank, rank+W, ... with no padding, every sample counted
    exactly once, in batches of twice the run's `batch_size` (no gradients to hold); collate as the training
    loader's."""
    indices, size = list(range(rank, len(dataset), world_size)), 2 * batch_size
    if in_memory(dataset) is not None and collate is None:
        tensors = to_device(dataset, device or torch.device("cpu"))
        idx = torch.tensor(indices, dtype=torch.long, device=tensors[0].device)
        return [tuple(t[idx[i:i + size]] for t in tensors) for i in range(0, len(idx), size)]
    workers = read_workers(data)  # items a loader reads
    loader_on = getattr(dataset, "loader_on", None)
    loader = DataLoader(torch.utils.data.Subset(dataset, indices), batch_size=size,
                        num_workers=workers, pin_memory=pin_memory and loader_on is None,
                        worker_init_fn=ignore_stop_signals if workers > 0 else None,
                        collate_fn=collate or getattr(dataset, "collate", None))
    return loader if loader_on is None else loader_on(loader, device or torch.device("cpu"))
