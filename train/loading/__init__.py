"""What the trainer needs of any data, below the tasks and their data: which samples each rank trains on, in which
order and with which seeds (samplers), and the loaders that bring them (loaders), whatever the items are."""

from train.loading.loaders import (build_train_loader, build_val_loader, default_num_workers, in_memory, on_device,
                                  sampling)
from train.loading.samplers import Sampling, SeededSample, ShardSampler, describe_sampler, origin, samples_per_rank

__all__ = ["Sampling", "SeededSample", "ShardSampler", "build_train_loader", "build_val_loader", "default_num_workers",
           "describe_sampler", "in_memory", "on_device", "origin", "samples_per_rank", "sampling"]
