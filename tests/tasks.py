"""Task factories for tests, loaded through --task tests.tasks:NAME like a user's own (docs/tasks.md)."""

import torch
from torch import nn
from torch.utils.data import TensorDataset

from train.tasks.task import Task


class _MaskedRegression(Task):
    """A count that varies from batch to batch: each target holds 8 numbers of which only some count (the rest are
    NaN, ignored, as a segmentation's ignored pixels are). Its network is in float64 (tests.models._InDouble's
    reasons): runs that sum in another order agree far below any tolerance a wrong count would break."""

    metric, higher_is_better = "mse", False
    variable_count = True

    def datasets(self, run_dir=None, train=True):
        def made(n, seed):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(n, 16, generator=g)
            target = x[:, :8] * 2 - x[:, 8:] + 0.1 * torch.randn(n, 8, generator=g)
            kept = torch.rand(n, 8, generator=g) < torch.rand(n, 1, generator=g)  # 0 to 8 of each row's numbers
            return TensorDataset(x, torch.where(kept, target, torch.nan))
        return (made(512, self.cfg.run.seed) if train else None), made(128, self.cfg.run.seed + 1)

    def network(self, spec):
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8)).double()

    def head(self, model):
        return "2"

    def inputs(self, batch, device):
        x, target = batch
        return x.to(device).double(), target.to(device).double()

    def loss(self, output, target):
        kept = ~target.isnan()
        return ((output - target.nan_to_num()) ** 2 * kept).sum(), kept.sum()

    def count(self, target):
        return (~target.isnan()).sum()

    def example(self, batch_size, device):
        return torch.zeros(batch_size, 16, dtype=torch.float64, device=device), \
            torch.zeros(batch_size, 8, dtype=torch.float64, device=device)

    def metric_state(self, device, detail=False):
        return torch.zeros(3, dtype=torch.float64, device=device)

    def update(self, state, output, target):
        total, count = self.loss(output, target)
        state += torch.stack([total, count.double(), torch.tensor(len(target), dtype=torch.float64)])

    def scores(self, state, detail=False):
        total, count, samples = state.tolist()
        return {"loss": total / count, "mse": total / count, "samples": int(samples)}


def masked(cfg):
    return _MaskedRegression(cfg)


def not_a_task(cfg):
    """A factory that returns something else than a Task."""
    return nn.Linear(1, 1)
