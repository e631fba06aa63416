"""What the trainer asks of a task (docs/tasks.md's table), checked where it is met: an answer that breaks it is one
line (ConfigError) naming the method, what it returned and what the table asks, never a traceback deep in the trainer.

  check_task(task, ...)        before the run folder is made: the datasets' kind and items, the network, the example
                               against a real batch, the loss's form on the meta device (no memory, no time)
  check_batch_of_one(task)     a model whose BatchNorm cannot train at a per-worker batch of 1, before any worker
  loss_of(task, result)        every micro-batch: (sum, count), the sum a scalar tensor, the count a number
  fixed_count(task, target)    count() of a task whose count is a number: at least 1
  checked_state / checked_scores   every evaluation: a float tensor of state; scores with loss, the metric (a number)
                               and samples
"""

from __future__ import annotations

import io
import math
import numbers

import torch
from torch import nn
from torch.utils.data import IterableDataset, default_collate

from train.base.errors import ConfigError
from train.loading import on_device

TABLE = "docs/tasks.md's table of a task's methods"


def _what(value) -> str:
    """A returned value as a line names it: its type, and a tensor's shape and dtype."""
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).replace('torch.', '')} tensor of shape {list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, dict):
        return f"a dict of {sorted(map(str, value))[:5]}"
    return f"a {type(value).__name__}"


def _refuse(task, method: str, got: str, asked: str) -> ConfigError:
    return ConfigError(f"--task {task.name}: {method} {got}, and {asked} ({TABLE}): return that")


# ---------------------------------------------------------------- before the run


def check_datasets(task, train_set, val_set) -> None:
    """Map-style datasets (a length, items by index: the sampler deals indices), a validation set with items, and
    (input, target) pairs."""
    for name, dataset in (("training", train_set), ("validation", val_set)):
        if dataset is None:
            continue
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__") or \
                not hasattr(dataset, "__getitem__"):
            raise _refuse(task, f"datasets() gave a {name} set that is {_what(dataset)}",
                          "without a length and items by index",
                          "a set is a map-style torch.utils.data.Dataset (__len__ and __getitem__: the trainer's "
                          "sampler deals its indices, so a resume replays the same items), not an IterableDataset")
        if len(dataset) == 0:
            raise ConfigError(f"--task {task.name}: datasets() gave an empty {name} set: give it items (an evaluation "
                              f"of nothing has no figures)")
    item = train_set[0] if train_set is not None else val_set[0]
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise _refuse(task, "datasets()' items are", _what(item),
                      "an item is an (input, target) pair, which inputs(batch, device) takes apart")


def check_network(task, model) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise _refuse(task, "network(spec) returned", _what(model), "it returns a torch.nn.Module")
    return model


def check_task(task, spec, train_set, val_set, batch_size: int) -> None:
    """The task's answers before anything is written: its datasets, its network (built on the meta device), its
    example against a real batch of the data, and the form of its loss on that batch (on the meta device: where the
    network cannot run there, the first step checks it)."""
    check_datasets(task, train_set, val_set)
    try:  # a network that cannot be built on the meta device (an .item() in its init, say) is checked when built
        with torch.device("meta"):
            model = task.network(spec)
    except Exception:  # noqa: BLE001 - only what builds on the meta device is checked here
        model = None
    if model is not None:
        check_network(task, model)
    source = train_set if train_set is not None else val_set
    batch = (task.collate or default_collate)([source[i] for i in range(min(batch_size, len(source)))])
    x, target = task.inputs(batch, torch.device("cpu"))
    example = task.example(batch_size, torch.device("cpu"))
    if not isinstance(example, (tuple, list)) or len(example) != 2:
        raise _refuse(task, f"example({batch_size}, device) returned", _what(example),
                      "it returns (input, target) of a training step's shape")
    for part, made, real in (("input", example[0], x), ("target", example[1], target)):
        # a batch of a training step's shape: the data's, or (sequences of varying length) its longest
        if isinstance(made, torch.Tensor) and isinstance(real, torch.Tensor) and \
                (made.dim() != real.dim() or made.dtype != real.dtype or
                 any(m < r for m, r in zip(made.shape[1:], real.shape[1:], strict=False))):
            raise ConfigError(f"--task {task.name}: example({batch_size}, device) gives an {part} that is "
                              f"{_what(made)}, and the data's batches (through inputs()) are {_what(real)}: make "
                              f"example() a batch of a training step's shape and dtype (zeros will do; sequences at "
                              f"their longest)")
    if model is None:
        return
    try:  # the form of the loss, without memory or time; a network that cannot run on meta is checked at step 1
        meta = torch.device("meta")
        with torch.no_grad():
            result = task.loss(task.forward(model.train(), _to(x, meta), _to(target, meta)), _to(target, meta))
    except Exception:  # noqa: BLE001 - only what runs on the meta device is checked here
        return
    loss_of(task, result)


def _to(value, device: torch.device):
    return on_device(value, device)


def check_state_saves(task) -> None:
    """What the task keeps between steps goes into every checkpoint: it must be what torch.save writes."""
    state = task.state_dict()
    try:
        torch.save(state, io.BytesIO())
    except Exception as e:  # noqa: BLE001 - pickle raises many kinds
        raise ConfigError(f"--task {task.name}: state_dict() returned {_what(state)} that a checkpoint cannot hold "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): return tensors, numbers, "
                          f"strings and lists or dicts of them") from None


def check_batch_of_one(task, spec, batch_size: int, world: int = 1) -> None:
    """A network with BatchNorm over a single value per channel (after a global pooling, say) cannot train at a
    per-worker batch of 1: refused before any worker, on the meta device (the model as a run trains it: frozen where
    --freeze says). Under --sync-bn on several workers their values are normalised together: not refused there."""
    if batch_size != 1 or spec.sync_bn and world > 1:
        return
    meta = torch.device("meta")
    try:
        with torch.device("meta"):
            model = task.model(spec)
        x, target = task.example(1, meta)
        task.forward(model.train(), x, target)
    except ValueError as e:
        if "Expected more than 1 value per channel" not in str(e):
            return
        raise ConfigError(f"--batch-size 1: --model {spec.model} has BatchNorm over a single value per channel at a "
                          f"per-worker batch of 1 ({str(e).split(',')[0]}), which cannot train: pass --batch-size 2 or "
                          f"more (fewer workers keep the global batch), or a model without it") from None
    except Exception:  # noqa: BLE001 - what cannot run on the meta device is met by the first step
        return


# ---------------------------------------------------------------- during the run


def loss_of(task, result) -> tuple:
    """loss(output, target)'s (sum, count), checked: the sum a scalar tensor, the count a number or a scalar tensor."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise _refuse(task, "loss(output, target) returned", _what(result),
                      "it returns (sum, count): the batch's loss summed over its items, and their count, never a mean")
    total, count = result
    if not isinstance(total, torch.Tensor) or total.dim() != 0 or not total.is_floating_point():
        raise _refuse(task, "loss(output, target)'s sum is", _what(total),
                      "the sum is a scalar floating-point tensor that backward() runs from")
    if isinstance(count, bool) or not (isinstance(count, numbers.Number) or
                                       isinstance(count, torch.Tensor) and count.dim() == 0):
        raise _refuse(task, "loss(output, target)'s count is", _what(count), "the count is a number or a scalar tensor")
    return total, count


def fixed_count(task, target) -> int | float:
    """count(target) of a task whose count is a number (variable_count False): at least 1."""
    count = task.count(target)
    value = count.item() if isinstance(count, torch.Tensor) else count
    if isinstance(value, bool) or not isinstance(value, numbers.Number) or value < 1:
        raise ConfigError(f"--task {task.name}: count(target) returned {value!r} for a batch of {len(target)}, and a "
                          f"task whose items count alike counts at least 1 per batch ({TABLE}): return the items the "
                          f"loss sums over, or set variable_count = True where a batch may count none")
    return value


def checked_state(task, state) -> torch.Tensor:
    if not isinstance(state, torch.Tensor) or not state.is_floating_point():
        raise _refuse(task, "metric_state(device) returned", _what(state),
                      "it returns a floating-point tensor of zeros (float64) that update() adds to and the ranks sum")
    return state


def checked_scores(task, scores) -> dict:
    """scores(state): a dict with the loss, the task's metric and the samples; the loss and the metric numbers (a
    number that is not finite is a diverged evaluation: the trainer's health check)."""
    if not isinstance(scores, dict):
        raise _refuse(task, "scores(state) returned", _what(scores), "it returns a dict of figures")
    for key in dict.fromkeys(("loss", task.metric, "samples")):
        if key not in scores:
            raise ConfigError(f"--task {task.name}: scores(state) gives {sorted(map(str, scores))}, without "
                              f"{key!r}{' (the task metric, which picks best.pt)' if key == task.metric else ''} "
                              f"({TABLE}): return it, or name another metric")
        value = scores[key]
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ConfigError(f"--task {task.name}: scores(state)[{key!r}] is {_what(value)} ({value!r:.40}), not a "
                              f"number ({TABLE}): return a float (a tensor's .item())")
    if scores["samples"] == 0 or not math.isfinite(scores["samples"]):
        raise ConfigError(f"--task {task.name}: the evaluation counted {scores['samples']} samples: give the "
                          f"validation set items")
    return scores
