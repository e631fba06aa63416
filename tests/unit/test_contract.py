"""A task's answers held to docs/tasks.md's table (train/tasks/contract.py), in this process: each broken clause is one
line naming the method, what it returned and what the table asks, met before the run folder where the data allows, else
at the first step or evaluation, with nothing written that claims success."""

import sys

import pytest
import torch

from tests.tasks import Broken
from train.base.errors import ConfigError, UserCodeError, user_code_error
from train.base.watchdog import watchdog
from train.cli import parse_config
from train.components.models import user_factory
from train.run import build as build_module
from train.run import preflight
from train.run.build import build
from train.run.health import Diverged
from train.run.trainer import Trainer
from train.tasks.contract import check_batch_of_one
from train.tasks.factory import build_task

CPU = torch.device("cpu")


def _cfg(run_dir, *flags):
    return parse_config(["--task", "tests.tasks:masked", "--max-steps", "4", "--batch-size", "8", "--run-dir",
                         str(run_dir), *map(str, flags)])


def _broken(cfg, breaks):
    task = Broken(cfg)
    task.name, task.breaks = cfg.run.task, breaks
    return task


@pytest.mark.parametrize("breaks, line", [
    ("empty validation", "datasets() gave an empty validation set: give it items"),
    ("items of one part", "datasets()' items are a tuple of 1, and an item is an (input, target) pair"),
    ("dict items", "datasets()' items are a dict of ['x', 'y'], and an item is an (input, target) pair"),
    ("iterable", "datasets() gave a training set that is a _Stream without a length and items by index, and a set is "
                 "a map-style torch.utils.data.Dataset"),
    ("network", "network(spec) returned a str, and it returns a torch.nn.Module"),
    ("mean", "loss(output, target) returned a float64 tensor of shape [], and it returns (sum, count)"),
    ("example", "example(8, device) gives an input that is a float64 tensor of shape [8, 15], and the data's batches "
                "(through inputs()) are a float64 tensor of shape [8, 16]"),
    ("state unsaved", "state_dict() returned a dict of ['draw'] that a checkpoint cannot hold"),
])
def test_a_broken_answer_is_one_line_before_the_run_folder_is_made(tmp_path, monkeypatch, breaks, line):
    cfg = _cfg(tmp_path / "run")
    monkeypatch.setattr(build_module, "build_task", lambda cfg: _broken(cfg, breaks))
    with pytest.raises(ConfigError) as refused:
        build(cfg, tmp_path / "run", CPU, "fp32")
    assert str(refused.value).startswith("--task tests.tasks:masked: ") and line in str(refused.value)
    assert "\n" not in str(refused.value) and not (tmp_path / "run").exists()


def test_a_head_that_names_nothing_is_refused_before_any_worker(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path / "run", "--freeze", "backbone")
    monkeypatch.setattr(preflight, "build_task", lambda cfg: _broken(cfg, "head"))
    with pytest.raises(ConfigError, match=r"--freeze backbone: the head of --model cnn is 'nothing', which names no "
                                          r"module of it with parameters, so every parameter would be frozen"):
        preflight.preflight(cfg)


@pytest.mark.parametrize("breaks, line", [
    ("count 0", "count(target) returned 0 for a batch of 8, and a task whose items count alike counts at least 1 per "
                "batch"),
    ("float", "loss(output, target)'s sum is a float, and the sum is a scalar floating-point tensor"),  # not on meta
])
def test_a_broken_answer_met_at_the_first_step_is_one_line(tmp_path, monkeypatch, breaks, line):
    monkeypatch.setattr(build_module, "build_task", lambda cfg: _broken(cfg, breaks))
    parts = build(_cfg(tmp_path), tmp_path, CPU, "fp32")
    parts.metrics.close()
    trainer = Trainer(parts, stop=None)
    with pytest.raises(ConfigError) as refused:
        trainer.train_step(trainer.micro_batches(trainer.batches()))
    assert line in str(refused.value) and "\n" not in str(refused.value)


def test_a_step_that_counts_nothing_trains_on(tmp_path):
    # tests.tasks:masked counts a number per target value that is not NaN: a step whose every value is NaN counts 0,
    # and its gradient is nothing (0), never a division by zero
    parts = build(_cfg(tmp_path), tmp_path, CPU, "fp32")
    parts.metrics.close()
    trainer = Trainer(parts, stop=None)
    x, target = next(trainer.batches())
    sums, counts = trainer.train_step(iter([(x, torch.full_like(target, torch.nan))]))
    assert [s.item() for s in sums] == [0.0] and [int(c) for c in counts] == [0]
    assert all(p.grad is None or not p.grad.any() for p in parts.raw_model.parameters())
    assert all(torch.isfinite(p).all() for p in parts.raw_model.parameters())


@pytest.mark.parametrize("breaks, error, line", [
    ("state", ConfigError, "metric_state(device) returned a list of 3, and it returns a floating-point tensor"),
    ("metric missing", ConfigError, "scores(state) gives ['loss', 'samples'], without 'mse' (the task metric, which "
                                    "picks best.pt)"),
    ("no loss", ConfigError, "scores(state) gives ['mse', 'samples'], without 'loss'"),
    ("metric string", ConfigError, "scores(state)['mse'] is a str ("),
    ("metric nan", Diverged, "the run diverged: the evaluation at step 0 had a mse of nan"),
])
def test_an_evaluation_that_breaks_the_table_is_refused_before_best_pt(tmp_path, monkeypatch, breaks, error, line):
    monkeypatch.setattr(build_module, "build_task", lambda cfg: _broken(cfg, breaks))
    parts = build(_cfg(tmp_path), tmp_path, CPU, "fp32")
    with pytest.raises(error) as refused:
        Trainer(parts, stop=None).evaluate()
    parts.metrics.close()
    assert line in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "best.pt").exists()
    evaluations = (tmp_path / "metrics.jsonl").read_text().splitlines()  # said as it was, where it was a number
    assert evaluations == [] if error is ConfigError else '"mse": null' in evaluations[0]


def test_an_error_raised_in_the_users_own_code_is_theirs_with_its_traceback_once(tmp_path, monkeypatch, capsys):
    """The task's loss raises a ValueError of its own: a UserCodeError whose line names the file and line in the user's
    code, whose trace is the traceback; the worker says both once, exit code 2 (a restart would meet it again)."""
    from train.run.worker import exit_code, unrecoverable

    monkeypatch.setattr(build_module, "build_task", lambda cfg: _broken(cfg, "raises"))
    cfg = _cfg(tmp_path)
    parts = build(cfg, tmp_path, CPU, "fp32")
    parts.metrics.close()
    trainer = Trainer(parts, stop=None)
    with pytest.raises(ValueError) as raised:
        trainer.train_step(trainer.micro_batches(trainer.batches()))
    found = unrecoverable(raised.value, trainer, CPU, cfg, "fp32", tmp_path)
    assert isinstance(found, UserCodeError)
    assert str(found).startswith("ValueError: a mistake in the task's own loss (raised in your code, ")
    assert "tests/tasks.py:" in str(found) and ", in _raises: its traceback above)" in str(found)
    assert found.trace.startswith("Traceback (most recent call last):") and "train/run/trainer.py" in found.trace
    assert user_code_error(raised.value, ["classification", "cnn"]) is None  # no code of the user's named: a crash
    watchdog.begin("rank 0")  # this process's run: its one error line not yet said (an earlier test's may have been)
    try:
        assert exit_code(found, 0) == 2
    finally:
        watchdog.pause()
    err = capsys.readouterr().err
    assert err.count("Traceback (most recent call last):") == 1 and err.count("\nerror: [rank 0] ValueError") == 1


def test_a_factory_that_raises_takes_no_config_or_does_not_parse_is_named(tmp_path, monkeypatch):
    with pytest.raises(UserCodeError) as raised:
        preflight.preflight(parse_config(["--task", "tests.tasks:raising_factory"]))
    assert "RuntimeError: the factory's own mistake (raised in your code, " in str(raised.value)
    assert "in raising_factory" in str(raised.value) and raised.value.trace.count("Traceback") == 1
    with pytest.raises(ConfigError, match=r"--task tests.tasks:takes_nothing: the factory cannot be called with the "
                                          r"run's Config \(too many positional arguments\): make it a function of one"):
        build_task(parse_config(["--task", "tests.tasks:takes_nothing"]))
    (tmp_path / "typo_task.py").write_text("def build(cfg)\n    return None\n")
    (tmp_path / "needs_more.py").write_text("import no_such_package_here\n\ndef build(cfg):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"--task typo_task:build: .*typo_task.py, line 1: expected ':' "
                                          r"\(def build\(cfg\)\): fix the file"):
        user_factory("typo_task:build", "--task")
    with pytest.raises(ConfigError, match=r"--task needs_more:build: needs_more imports no_such_package_here, which is "
                                          r"not installed here: install it \(pip install no_such_package_here"):
        user_factory("needs_more:build", "--task")
    # A module that raises as it loads is not kept by the import system: its file is still where the user's code is.
    (tmp_path / "raises_on_import.py").write_text("import math\n\nLIMIT = math.inf\nraise KeyError('width')\n")
    with pytest.raises(UserCodeError) as raised:
        preflight.preflight(parse_config(["--task", "raises_on_import:build"]))
    assert str(raised.value) == (f"KeyError: 'width' (raised in your code, {tmp_path.resolve()}/raises_on_import.py:4, "
                                 f"in <module>: its traceback above): fix it there, then run the same command")
    assert raised.value.trace.count("Traceback") == 1 and "raise KeyError('width')" in raised.value.trace
    sys.modules.pop("typo_task", None)


def test_weights_that_do_not_fit_a_tasks_own_network_name_that_network(tmp_path):
    task = build_task(_cfg(tmp_path, "--weights", tmp_path / "w.pt"))
    model = task.network(task.cfg.model)
    state = {k: torch.zeros(3) for k in model.state_dict()}
    with pytest.raises(ConfigError, match=r"do not fit the network of --task tests.tasks:masked: 0.weight is \(3,\)"):
        task.start_from(state, model)


def test_batchnorm_over_a_single_value_at_a_batch_of_one_is_refused_before_any_worker():
    """DeepLabV3's pooling branch normalises one value per channel at batch 1: refused, with the fix; LRASPP (no such
    branch) trains at batch 1; at batch 2 both do."""
    for model, refused in (("deeplabv3_mobilenet_v3_large", True), ("lraspp_mobilenet_v3_large", False)):
        for batch in (1, 2):
            cfg = parse_config(["--task", "segmentation", "--model", model, "--batch-size", str(batch)])
            if refused and batch == 1:
                with pytest.raises(ConfigError, match=rf"--batch-size 1: --model {model} has BatchNorm over a single "
                                                      rf"value per channel at a per-worker batch of 1 .*: pass "
                                                      rf"--batch-size 2 or more"):
                    check_batch_of_one(build_task(cfg), cfg.model, 1)
            else:
                check_batch_of_one(build_task(cfg), cfg.model, batch)


def test_a_segmentation_network_that_gives_no_pixel_logits_is_one_line():
    task = build_task(parse_config(["--task", "segmentation"]))
    task.describe({"classes": [str(i) for i in range(5)]})
    target = torch.zeros(2, 8, 8, dtype=torch.long)
    task.loss(torch.zeros(2, 5, 8, 8), target)
    for output in (torch.zeros(2, 5), {"out": torch.zeros(2, 4, 8, 8)}, torch.zeros(2, 5, 4, 4)):
        with pytest.raises(ConfigError, match=r"--task segmentation takes N x C x H x W logits \(C = 5 classes"):
            task.loss(output, target)
