"""The task a run names: --task classification (the default), segmentation, or package.module:factory, a function that
takes the Config and returns a Task (docs/tasks.md). As with --model, a run folder is data, never code: a resume, make
evaluate and make export import a factory only when the command names it again."""

from __future__ import annotations

import inspect
import json
import typing

from train.base.errors import ConfigError
from train.components.models import user_factory
from train.config.settings import Config
from train.tasks.classification import Classification
from train.tasks.lm import LanguageModel
from train.tasks.segmentation import Segmentation
from train.tasks.task import Task

TASKS = {"classification": Classification, "segmentation": Segmentation, "lm": LanguageModel}


def build_task(cfg: Config) -> Task:
    """The run's task, built once."""
    name = cfg.run.task
    if name in TASKS:
        task = TASKS[name](cfg)
        task.settings = typed_settings(task, cfg.run.task_settings)
        return task
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
    task.settings = typed_settings(task, cfg.run.task_settings)
    return task


def typed_settings(task: Task, text: str):
    """--task-settings (canonical JSON: train/cli.py) as the task's own Settings dataclass, each value of its field's
    type (an int is taken for a float); a task without one has none to give. Each mistake is one line."""
    values, kind = json.loads(text) if text else {}, task.Settings
    if kind is None:
        if values:
            raise ConfigError(f"--task-settings {text}: --task {task.name} has no settings of its own (no Settings "
                              f"dataclass): drop it")
        return None
    types = typing.get_type_hints(kind)
    for key, value in values.items():
        if key not in types:
            raise ConfigError(f"--task-settings: --task {task.name} has no setting {key!r}: give one of "
                              f"{', '.join(types)}")
        want = types[key]
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            values[key] = float(value)
        elif want in (int, float, str, bool) and (not isinstance(value, want) or
                                                  want is int and isinstance(value, bool)):
            raise ConfigError(f"--task-settings: {key} of --task {task.name} is a {want.__name__}, got {value!r}: "
                              f"pass a {want.__name__}")
    try:
        return kind(**values)
    except TypeError as e:  # a field without a default that the command did not give
        raise ConfigError(f"--task-settings: --task {task.name}'s settings cannot be made ({e}): give every setting "
                          f"that has no default") from None
    except ValueError as e:  # the dataclass's own check of a value (its __post_init__): its message is the line
        raise ConfigError(f"--task-settings: --task {task.name}: {e}") from None
