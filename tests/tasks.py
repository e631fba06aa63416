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


class _Regression(_MaskedRegression):
    """tests.tasks:masked with every number counted: a count from the target's shape, as most tasks have."""

    variable_count = False

    def datasets(self, run_dir=None, train=True):
        return tuple(None if d is None else TensorDataset(d.tensors[0], d.tensors[1].nan_to_num())
                     for d in super().datasets(run_dir, train))

    def count(self, target):
        return target.numel()


class Broken(_Regression):
    """A task that breaks one clause of docs/tasks.md's table, named by `breaks` (tests/unit/test_contract.py)."""

    breaks = ""

    def datasets(self, run_dir=None, train=True):
        train_set, val_set = super().datasets(run_dir, train)
        if self.breaks == "empty validation":
            val_set = TensorDataset(val_set.tensors[0][:0], val_set.tensors[1][:0])
        if self.breaks == "items of one part":
            train_set = TensorDataset(train_set.tensors[0])
        if self.breaks == "dict items":
            train_set = [{"x": x, "y": y} for x, y in train_set]
        if self.breaks == "iterable":
            train_set = _Stream(train_set)
        return train_set, val_set

    def network(self, spec):
        return "a network" if self.breaks == "network" else super().network(spec)

    def head(self, model):
        return "nothing" if self.breaks == "head" else super().head(model)

    def loss(self, output, target):
        total, count = super().loss(output, target)
        if self.breaks == "raises":
            _raises()
        if self.breaks == "mean":
            return total / count
        return (float(total.detach()), count) if self.breaks == "float" else (total, count)

    def count(self, target):
        return 0 if self.breaks == "count 0" else super().count(target)

    def example(self, batch_size, device):
        x, target = super().example(batch_size, device)
        return (x[:, :15], target) if self.breaks == "example" else (x, target)

    def metric_state(self, device, detail=False):
        return [0.0, 0.0, 0.0] if self.breaks == "state" else super().metric_state(device, detail)

    def scores(self, state, detail=False):
        scores = super().scores(state, detail)
        if self.breaks == "metric missing":
            scores.pop("mse")
        if self.breaks == "no loss":
            scores.pop("loss")
        if self.breaks == "metric string":
            scores["mse"] = f"{scores['mse']:.3f}"
        if self.breaks == "metric nan":
            scores["mse"] = float("nan")
        return scores

    def state_dict(self):
        return {"draw": lambda: 0} if self.breaks == "state unsaved" else {}


class _Stream(torch.utils.data.IterableDataset):
    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)


def _raises():
    raise ValueError("a mistake in the task's own loss")


def raises_at_step(cfg):
    """A task whose loss raises in the user's own code (a ValueError of theirs)."""
    task = Broken(cfg)
    task.breaks = "raises"
    return task


def wrong_example(cfg):
    task = Broken(cfg)
    task.breaks = "example"
    return task


def raising_factory(cfg):
    raise RuntimeError("the factory's own mistake")


def takes_nothing():
    return Broken(None)
