"""The task a run names: --task classification (the default), segmentation, or package.module:factory, a function that
takes the Config and returns a Task (docs/tasks.md). As with --model, a run folder is data, never code: a resume, make
evaluate and make export import a factory only when the command names it again."""

from __future__ import annotations

import inspect

from train.base.errors import ConfigError
from train.components.models import user_factory
from train.config.settings import Config
from train.tasks.classification import Classification
from train.tasks.segmentation import Segmentation
from train.tasks.task import Task

TASKS = {"classification": Classification, "segmentation": Segmentation}


def build_task(cfg: Config) -> Task:
    """The run's task, built once."""
    name = cfg.run.task
    if name in TASKS:
        return TASKS[name](cfg)
    if ":" not in name:
        raise ConfigError(f"--task {name!r} is not one of {', '.join(TASKS)} nor package.module:factory: pass one "
                          f"of those")
    factory = user_factory(name, "--task", "the Config and returns a train.tasks.task.Task")
    try:
        inspect.signature(factory).bind(cfg)
    except TypeError as e:
        raise ConfigError(f"--task {name}: the factory cannot be called with the run's Config ({e}): make it a "
                          f"function of one argument, the Config, that returns a Task") from None
    except ValueError:  # a callable without a signature Python can read: called as it is
        pass
    task = factory(cfg)
    if not isinstance(task, Task):
        raise ConfigError(f"--task {name} returned a {type(task).__name__}, not a train.tasks.task.Task: make the "
                          f"factory return one (a subclass of it)")
    task.name = name
    return task
