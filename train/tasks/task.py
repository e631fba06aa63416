"""The seam between the trainer and what it trains for: a Task owns everything task-specific, the trainer the rest.

The trainer (train/run/) owns the sampler, the RNG, the precision, accumulation, the checkpoints and the resume; it
knows no class, no loss and no metric. A task, built once per run (build_task), owns:

  datasets(run_dir, train)     the training and validation sets, as (input, target) items; what they hold
  description / describe(d)    what the data is (its classes, say): classes.json, the plan, make evaluate and export
  network(spec) / model(spec)  the network, adapted to the data; as a run trains it, frozen where --freeze says
  head(model)                  which of its modules is the head (--freeze backbone trains it alone)
  blocks(model)                its blocks: --parallel fsdp shards them one by one, --activation-checkpointing
                               recomputes them (default: none, the whole model as one)
  start_from(state, model)     --weights fitted to the model (a head of another class count starts anew)
  collate(items)               a loader's batch of items (None: torch's default_collate): ragged sequences padded
  inputs(batch, device)        a loader's batch on the device, ready for the model: (input, target)
  forward(model, x, target)    the model's output (default model(x)): a dict input, several tensors, targets too
  loss(output, target)         (sum, count) over the batch's items, never a mean: the trainer divides by the count
                               summed over the micro-batches of a step and over the ranks, so accumulation and any
                               world size train on the large batch's mean
  count(target)                that count before the forward pass (variable_count: it depends on the target)
  metric, higher_is_better     the score that picks best.pt, and which way is better
  metric_state / update        evaluation as sum-reducible state (counts, a confusion matrix): every rank adds its
  scores(state)                share, the trainer all-reduces it by SUM once, scores() computes the figures once
  example(batch_size, device)  a batch of a training step's shape, for the pass that settles DDP's buckets
  augment()                    the batch augmentation on the device, or None
  facts()                      what the task is, for the run's plan (plan.json's task, --dry-run): name, loss, metric
  state_dict / load_state_dict what the task keeps between steps, saved in every checkpoint (most keep nothing)

Built in: classification (train/tasks/classification.py). A task of your own: --task package.module:factory, a
function that takes the Config and returns a Task (train/tasks/factory.py, docs/tasks.md).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from train.base.errors import ConfigError
from train.components.models import freeze, frozen_names
from train.components.weights import fitted
from train.config.settings import Config, Model
from train.loading import on_device
from train.tasks.contract import check_network

class Task:
    """The base of every task: the defaults below hold for most; a task overrides what it owns."""

    name = "task"
    metric = "loss"  # the score that picks best.pt (a key of scores())
    higher_is_better = False
    # False: every micro-batch counts alike, a number count() reads off its target's shape (its images, its numbers);
    # True: the count depends on the target's values (ignored pixels, say), summed over the step before its backward
    variable_count = False
    classes_from = "its class folders, or its label names"  # where a dataset's classes come from (make evaluate's line)
    Settings = None  # a dataclass of the task's own settings (--task-settings, [task_settings]); None: none
    settings = None  # this run's, an instance of it (build_task)

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.description: dict = {}

    # ---------------------------------------------------------------- data and model

    def check(self, run_dir=None, train: bool = True) -> None:
        """The data's checks that need no process group, before any worker starts (one line each); train False: the
        validation split's alone (make evaluate)."""

    def datasets(self, run_dir=None, train: bool = True) -> tuple:
        """(train set or None when train is False, validation set); sets self.description."""
        raise NotImplementedError

    def describe(self, description: dict) -> None:
        """What a finished run's data was (its classes.json): for make evaluate and export, which build no train set."""
        self.description = dict(description)

    @property
    def classes(self) -> list[str]:
        return list(self.description.get("classes", []))

    def network(self, spec: Model) -> nn.Module:
        """The network --model names, adapted to the data, every parameter trainable: what make evaluate and make
        export load the weights into."""
        raise NotImplementedError

    def model(self, spec: Model) -> nn.Module:
        """The network a run trains: frozen where --freeze says (the head: head()), before any optimizer has state."""
        model = check_network(self, self.network(spec))
        freeze(model, frozen_names(spec, model, lambda: self.head(model)))
        return model

    def start_from(self, state: dict, model: nn.Module, sized: bool = True) -> dict:
        """--weights' state_dict, fitted to the model: what its load_state_dict takes (sized False: the checks before
        the data is read, on a model with a head of a stand-in size). Here every tensor must fit; a task whose head
        has the data's size names its tensors to fitted(), which starts them anew where the class count differs."""
        return fitted(self.cfg.model, state, model, [], sized, network=f"the network of --task {self.name}")

    def head(self, model: nn.Module) -> str:
        """The name of the model's head module (--freeze backbone trains it alone)."""
        raise ConfigError(f"--task {self.name} names no head of its model: --freeze backbone cannot apply; give "
                          f"parameter prefixes to --freeze")

    def blocks(self, model: nn.Module) -> list[str]:
        """The qualified names of the model's blocks that --parallel fsdp shards one by one (each gathered whole for
        its own forward and backward alone) and --activation-checkpointing recomputes in the backward; [] (the
        default): the model sharded as one, gathered whole for a pass, and nothing to recompute."""
        return []

    # ---------------------------------------------------------------- a step

    def inputs(self, batch, device: torch.device) -> tuple:
        """A loader's batch on the device: (input, target), each a tensor, or a dict, list or tuple of them (every
        tensor moved there)."""
        x, y = batch
        return on_device(x, device), on_device(y, device)

    collate = None  # collate(items) -> a loader's batch of the task's items; None: torch's default_collate

    def forward(self, model: nn.Module, inputs, target):
        """The model's output for a batch: model(inputs). A task whose model takes a dict (ids and a mask) or several
        tensors, or its targets in training (as torchvision's detection models do), says how here."""
        return model(inputs)

    def loss(self, output, target) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum, count) of the batch's loss."""
        raise NotImplementedError

    def count(self, target) -> torch.Tensor | int:
        """How many items the loss of `target` sums over: a number from its shape, or with variable_count a tensor of
        its values."""
        return len(target)

    def example(self, batch_size: int, device: torch.device) -> tuple:
        """A batch of a training step's shape (zeros), for the pass that settles DDP's buckets."""
        raise NotImplementedError

    def throughput(self, samples_per_s: float) -> tuple[float, str]:
        """What the log line's speed counts, from the samples a second: (samples/s, "samples"), or a sequence task's
        tokens."""
        return samples_per_s, "samples"

    def sizes(self, where: str) -> list[tuple[str, object]]:
        """The settings that make a sample large where memory ran out (`where`: "training step N", "evaluation at step
        N", ...), as (the flag, its value now): what the out-of-memory line advises beside a smaller --batch-size.
        None known by default."""
        return []

    def augment(self):
        """The batch augmentation on the device, called as augment(x, target, seed) -> (x, target); None: none."""
        return None

    # ---------------------------------------------------------------- evaluation

    def metric_state(self, device: torch.device, detail: bool = False) -> torch.Tensor:
        """Zeros of the evaluation's state: float64, summed across ranks (detail: what a report needs too)."""
        return torch.zeros(2, dtype=torch.float64, device=device)

    def update(self, state: torch.Tensor, output, target) -> None:
        """Add the batch to the state, in place."""
        total, count = self.loss(output, target)
        state[0] += total.double()
        state[1] += count

    def scores(self, state: torch.Tensor, detail: bool = False) -> dict:
        """The figures of the whole validation set, from the all-reduced state: loss, the metric, samples, ..."""
        loss, count = state.tolist()
        if not count:
            raise ConfigError(f"--task {self.name}: the evaluation counted nothing: give the validation set items")
        return {"loss": loss / count, "samples": int(count)}

    def pictures(self, model: nn.Module, val_set, device: torch.device) -> list:
        """What make evaluate's report shows of the data beside the figures (segmentation: a few images with their true
        and predicted masks); rank 0 makes them. The default: none."""
        return []

    def report(self, record: dict, result: dict, pictures: list | None = None) -> tuple:
        """make evaluate's report of `result` (the scores with detail): what the record (eval-<checkpoint>.json) holds
        beyond the scores, added to `record`; a matplotlib figure (its PNG); the summary's lines, the first the
        figures. The default: the scores as a table."""
        from train.report import figure as figures  # noqa: PLC0415 - matplotlib: the evaluation command's alone

        figure = figures.plt.figure(figsize=(6, 2))
        rows = [[k, f"{v:.6g}"] for k, v in record.items() if isinstance(v, (int, float))]
        figure.add_subplot().axis("off")
        figure.axes[0].table(cellText=rows, loc="center")
        return figure, [self.summary(result)]

    # ---------------------------------------------------------------- records

    def exportable(self, model: nn.Module) -> nn.Module:
        """The module make export captures: the network itself (a network whose output is a dict wraps it)."""
        return model

    def export_io(self) -> tuple:
        """make export's (an input of batch 2 on the CPU, {"input": name, "output": name}, what a caller must know of
        the input: its shape, its preprocessing), for the exported program and its JSON beside it."""
        example = self.example(2, torch.device("cpu"))[0]
        return example, {"input": "inputs", "output": "outputs"}, {"input_shape": ["N", *example.shape[1:]]}

    def dynamic_dims(self) -> dict:
        """make export's dimensions of the example input that may vary: {dim: (name, largest or None)}; the batch."""
        return {0: ("batch", None)}

    def source(self, train_set, val_set) -> dict:
        """What the run reads, for the plan: the kind of source and the order of its samples."""
        return {"kind": f"--task {self.name}'s own datasets", "order": "their index order, as the sampler deals it"}

    def input_steps(self, train_set, val_set) -> dict:
        """What the run does to an input before the model, for the plan (a task of images: their normalisation, the
        side a training step sees, the transforms)."""
        return {"normalize": None, "train_size": None, "train_transform": "none", "eval_transform": "none"}

    def summary(self, scores: dict) -> str:
        """The figures of an evaluation in the log line (before "over N samples")."""
        return ", ".join(f"{k} {v:.4f}" for k, v in scores.items() if isinstance(v, float))

    def facts(self) -> dict:
        """What the task is, for the run's plan (its "task"): its name, its loss, the metric that picks best.pt, which
        way is better, its own settings."""
        return {"name": self.name, "loss": f"{type(self).__name__}.loss, summed over the items",
                "metric": self.metric, "better": "higher" if self.higher_is_better else "lower",
                **({"settings": dataclasses.asdict(self.settings)} if self.settings is not None else {})}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ConfigError(f"the checkpoint holds state of --task {self.name} that it does not keep: resume it with "
                              f"the task that saved it")

