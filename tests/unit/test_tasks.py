"""The task seam in one process: the task a run names, what a checkpoint keeps of it, and what classification's
state and scores are made of (each figure equal to the one computed directly)."""

import re

import pytest
import torch
import torch.nn.functional as F

from train.base.errors import ConfigError
from train.cli import parse_config
from train.tasks.classification import Classification
from train.tasks.factory import build_task
from train.tasks.task import Task

CPU = torch.device("cpu")


@pytest.mark.parametrize("name, line", [
    ("detection", "--task 'detection' is not one of classification, segmentation, lm nor package.module:factory"),
    ("no_such_module:build", "--task no_such_module:build: cannot import no_such_module"),
    ("tests.tasks:nothing", "--task tests.tasks:nothing: tests.tasks has no attribute 'nothing'"),
    ("tests.tasks:not_a_task", "--task tests.tasks:not_a_task returned a Linear, not a train.tasks.task.Task"),
])
def test_a_task_that_cannot_be_built_is_one_line(name, line):
    with pytest.raises(ConfigError) as refused:
        build_task(parse_config(["--task", name]))
    assert line in str(refused.value) and "\n" not in str(refused.value)


def test_a_task_of_the_users_keeps_the_name_it_was_given():
    task = build_task(parse_config(["--task", "tests.tasks:masked"]))
    assert isinstance(task, Task) and task.name == "tests.tasks:masked" and task.variable_count


def test_classifications_state_sums_to_the_scores_computed_directly():
    """The state is sums (loss, correct, images, correct in the top 5, the confusion matrix): split in two and added,
    as two ranks' shares are all-reduced, it gives the figures of the whole set, each equal to the direct one."""
    task = Classification(parse_config(["--label-smoothing", "0.1"]))
    task.describe({"classes": [str(i) for i in range(7)]})
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(50, 7, generator=g), torch.randint(0, 7, (50,), generator=g)
    parts = [task.metric_state(CPU, detail=True) for _ in range(2)]
    task.update(parts[0], logits[:23], labels[:23])
    task.update(parts[1], logits[23:], labels[23:])
    scores = task.scores(parts[0] + parts[1], detail=True)
    assert scores["samples"] == 50 and scores["accuracy"] == (logits.argmax(1) == labels).sum().item() / 50
    assert scores["top5"] == (logits.topk(5, 1).indices == labels[:, None]).any(1).sum().item() / 50
    direct = F.cross_entropy(logits.double(), labels, label_smoothing=0.1).item()
    assert scores["loss"] == pytest.approx(direct, rel=50 * 2**-23)  # float32 terms in another order
    confusion = torch.zeros(7, 7, dtype=torch.long)
    confusion.index_put_((labels, logits.argmax(1)), torch.ones_like(labels), accumulate=True)
    assert scores["confusion"] == confusion.tolist()
    total, count = task.loss(logits, labels)  # the training loss: a sum and a count
    assert count == 50 and (total / count).item() == pytest.approx(direct, rel=50 * 2**-23)


def test_a_checkpoint_keeps_the_tasks_state_and_refuses_another_task(tmp_path):
    from tests.unit.test_checkpointer import _checkpointer, _position

    class Counting(Classification):
        """A task that keeps state of its own between steps."""

        def __init__(self, cfg):
            super().__init__(cfg)
            self.seen = 0

        def state_dict(self):
            return {"seen": self.seen}

        def load_state_dict(self, state):
            self.seen = state["seen"]

    saving = _checkpointer(tmp_path, 0)
    saving.task = Counting(saving.task.cfg)
    saving.task.seen = 41
    saving.save(_position(3), "a test")
    state = torch.load(tmp_path / "checkpoints" / "step_00000003.pt", weights_only=False)
    assert state["task"] == {"name": "classification", "state": {"seen": 41}}
    restoring = _checkpointer(tmp_path, 0)
    restoring.task = Counting(restoring.task.cfg)
    restoring.load_state_dict(state, tmp_path / "checkpoints" / "step_00000003.pt")
    assert restoring.task.seen == 41
    other = _checkpointer(tmp_path, 0)
    other.task.name = "segmentation"
    with pytest.raises(ConfigError, match="is a checkpoint of --task classification: resume it with --task "
                                          "classification, or start a new --run-dir"):
        other.load_state_dict(state, tmp_path / "checkpoints" / "step_00000003.pt")


def test_a_tasks_own_settings_are_typed_by_its_dataclass_and_each_mistake_is_one_line(tmp_path):
    """--task-settings as KEY=VALUE (each value read as JSON where it parses) or a config file's [task_settings]
    table: the same canonical JSON, typed by the task's Settings; an unknown key, a value of another type, or settings
    for a task that has none are one line each."""
    from dataclasses import dataclass

    from tests.tasks import _MaskedRegression
    from train.tasks.factory import typed_settings

    @dataclass
    class Settings:
        depth: int = 2
        rate: float = 0.5
        name: str = "walk"

    task = _MaskedRegression(parse_config([]))
    task.name, task.Settings = "mytasks.x:build", Settings
    flagged = parse_config(["--task-settings", "depth=3,rate=1,name=run"]).run.task_settings
    (tmp_path / "c.toml").write_text('[task_settings]\ndepth = 3\nrate = 1\nname = "run"\n')
    assert parse_config(["--config", str(tmp_path / "c.toml")]).run.task_settings == flagged
    assert typed_settings(task, flagged) == Settings(3, 1.0, "run")
    assert typed_settings(task, "") == Settings()
    for given, line in (('{"depth": 2, "width": 4}', "has no setting 'width': give one of depth, rate, name"),
                        ('{"depth": "deep"}', "depth of --task mytasks.x:build is a int, got 'deep': pass a int"),
                        ('{"depth": true}', "depth of --task mytasks.x:build is a int, got True")):
        with pytest.raises(ConfigError, match=re.escape(line)):
            typed_settings(task, given)
    with pytest.raises(ConfigError, match="--task classification has no settings of its own"):
        build_task(parse_config(["--task-settings", "depth=3"]))
    with pytest.raises(ConfigError, match="'depth' is not KEY=VALUE"):
        parse_config(["--task-settings", "depth"])
