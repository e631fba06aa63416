"""The task seam end to end: a task of the user's in one file (docs/tasks.md's, run as printed), and what the trainer
guarantees any task (the step's mean over a count that varies, the metric's direction picking best.pt, the records)."""

import json
import re

import torch

from tests.helpers import PY, REPO, env_for_tests, load_model, metrics, python_cmd, run, status


def _printed_task(folder, name="sines"):
    """A task module of docs/tasks.md, as the page prints it (the first, or the one before "Saved as mytasks/NAME.py"),
    saved where the page says; its command's trainer flags, as printed."""
    text = (REPO / "docs" / "tasks.md").read_text()
    code = re.findall(r"```python\n(.*?)```\n\nSaved as `mytasks/(\w+)\.py`", text, re.S)
    code = dict((module, source) for source, module in code)[name]
    assert len(code.splitlines()) < 100  # a task in one file, short
    (folder / "mytasks").mkdir(exist_ok=True)
    (folder / "mytasks" / f"{name}.py").write_text(code)
    command = re.search(rf"PYTHONPATH=\. (python -m train --task mytasks\.{name}:.*)", text).group(1)
    return command.split()[3:]


def test_the_task_of_docs_tasks_md_trains_evaluates_and_exports_as_printed(tmp_path):
    flags = _printed_task(tmp_path)
    assert flags[:2] == ["--task", "mytasks.sines:build"] and "--spawn" in flags
    env = env_for_tests(PYTHONPATH=f"{tmp_path}:{REPO}")
    run_dir = tmp_path / "run"
    run(python_cmd(*flags, "--run-dir", run_dir), env=env)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["task"] == {"name": "mytasks.sines:build", "loss": "Sines.loss, summed over the items",
                            "metric": "rmse", "better": "lower"}
    evals = metrics(run_dir, "eval")
    assert [e["step"] for e in evals] == [100, 200, 300] and evals[-1]["rmse"] < evals[0]["rmse"] / 2  # it learns
    best = min(evals, key=lambda e: e["rmse"])  # the lowest: the metric's direction, not "accuracy"
    assert status(run_dir)["best"]["step"] == best["step"] and status(run_dir)["best"]["val_rmse"] == best["rmse"]
    checkpoint = torch.load(run_dir / "checkpoints" / "step_00000300.pt", weights_only=True)
    assert checkpoint["task"] == {"name": "mytasks.sines:build", "state": {}}  # a checkpoint records its task
    # A run folder is data, never code: without --task its factory is not imported; with it, the report and export.
    refused = run([PY, "-m", "train.evaluate", str(run_dir), "--checkpoint", "best"], expect=2, env=env)
    assert refused.stderr.startswith("error: ") and "pass --task mytasks.sines:build" in refused.stderr
    scored = run([PY, "-m", "train.evaluate", str(run_dir), "--checkpoint", "best", "--task", "mytasks.sines:build",
                  "--spawn", "2"], env=env)  # the run's layout: its evaluation's figures, bit for bit
    report = json.loads((run_dir / "eval-best.json").read_text())
    assert report["rmse"] == best["rmse"] and report["samples"] == 512 and "rmse" in scored.stdout
    run([PY, "-m", "train.export", str(run_dir), "--task", "mytasks.sines:build"], env=env)
    described = json.loads((run_dir / "model.pt2.json").read_text())
    assert described["task"] == "mytasks.sines:build" and described["input_shape"] == ["N", 32]
    program = torch.export.load(run_dir / "model.pt2").module()
    model = load_model(run_dir)
    x = torch.randn(5, 32)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                              torch.nn.Linear(64, 3))
    net.load_state_dict(model)
    assert torch.equal(program(x), net(x))  # the exported program is the trained network
    # A resume under another task, and a flag of the image pipeline, are one line each.
    other = run(python_cmd("--max-steps", "310", "--run-dir", run_dir), expect=2)
    assert "--task mytasks.sines:build -> classification" in other.stderr and other.stderr.count("\n") == 1
    mixup = run(python_cmd(*flags, "--mixup-alpha", "0.2", "--run-dir", tmp_path / "r2"), expect=2, env=env)
    assert "--mixup-alpha 0.2 has no effect with --task mytasks.sines:build" in mixup.stderr
    assert not (tmp_path / "r2").exists()
    # The task's module now raises as it loads: export says where in the user's code, once, and writes nothing.
    module = tmp_path / "mytasks" / "sines.py"
    module.write_text(module.read_text() + "raise KeyError('width')\n")
    broken = run([PY, "-m", "train.export", str(run_dir), "--task", "mytasks.sines:build", "--out",
                  str(tmp_path / "broken.pt2")], expect=2, env=env)
    where = f"{module.resolve()}:{len(module.read_text().splitlines())}, in <module>"
    assert broken.stderr.count("Traceback (most recent call last):") == 1 and broken.stderr.endswith(
        f"error: KeyError: 'width' (raised in your code, {where}: its traceback above): fix it there, then run the "
        f"same command\n"), broken.stderr
    assert not list(tmp_path.glob("broken.pt2*"))


def test_accumulation_and_workers_train_on_the_mean_of_a_step_whose_count_varies(tmp_path):
    """tests.tasks:masked counts only some numbers of each target, a different number per batch: 2 workers x 2
    micro-batches of 8 train on the same mean as 1 worker x 32, in float64 to rounding (5.6e-17 measured on the
    weights, 1.8e-15 on the losses), where a mean per micro-batch (each divided by its own count) is off by far more."""
    common = ["--task", "tests.tasks:masked", "--max-steps", 20, "--log-every", 1, "--eval-every", 10, "--lr", 0.01]
    split, one = tmp_path / "split", tmp_path / "one"
    run(python_cmd(*common, "--spawn", 2, "--batch-size", 8, "--grad-accum", 2, "--run-dir", split))
    run(python_cmd(*common, "--batch-size", 32, "--run-dir", one))
    a, b = metrics(split, "train"), metrics(one, "train")
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, 21))
    for x, y in zip(a, b, strict=True):
        assert abs(x["loss"] - y["loss"]) < 1e-9, (x["step"], x["loss"], y["loss"])
    weights, reference = load_model(split), load_model(one)
    assert all((weights[k] - reference[k]).abs().max() < 1e-9 for k in weights)
    assert metrics(split, "eval")[-1]["samples"] == metrics(one, "eval")[-1]["samples"] == 128  # each counted once


def test_a_tasks_mistake_at_two_workers_is_said_once_and_recorded_as_failed(tmp_path):
    """Under --spawn 2: an exception raised in the task's own loss at the first step is its traceback, once, then one
    line naming where in the user's code, exit code 2, status.json "failed" with that line; an example() of another
    shape than the data's batches is one line before the run folder (every rank meets it; one says it)."""
    raised = run(python_cmd("--task", "tests.tasks:raises_at_step", "--spawn", 2, "--max-steps", 4,
                            "--run-dir", tmp_path / "raises"), expect=2)
    assert raised.stderr.count("Traceback (most recent call last):") == 1, raised.stderr
    errors = [line for line in raised.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "ValueError: a mistake in the task's own loss (raised in your code, " in errors[0]
    assert "tests/tasks.py:" in errors[0] and raised.stderr.index("Traceback") < raised.stderr.index("error:")
    recorded = status(tmp_path / "raises")
    assert recorded["state"] == "failed" and recorded["exit_code"] == 2
    assert recorded["error"].startswith("ValueError: a mistake in the task's own loss")
    example = run(python_cmd("--task", "tests.tasks:wrong_example", "--spawn", 2, "--run-dir", tmp_path / "example"),
                  expect=2)
    assert example.stderr.count("\n") == 1 and "Traceback" not in example.stderr
    assert "example(64, device) gives an input that is a float64 tensor of shape [64, 15]" in example.stderr
    assert not (tmp_path / "example").exists()


def test_the_sequence_task_of_docs_tasks_md_owns_its_batches_inputs_and_settings_as_printed(tmp_path):
    """docs/tasks.md's tagger of variable-length walks, run as printed: its items through DataLoader workers and its
    own collate (padded batches, a dict input), its settings kept in config.json and the plan, its accuracy learnt;
    make evaluate scores it again to the run's figures; a resume with other settings is refused."""
    flags = _printed_task(tmp_path, "walks")
    assert flags[:4] == ["--task", "mytasks.walks:build", "--task-settings", "max_len=24,width=32"]
    env = env_for_tests(PYTHONPATH=f"{tmp_path}:{REPO}")
    run_dir = tmp_path / "run"
    run(python_cmd(*flags, "--run-dir", run_dir), env=env)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["task"]["settings"] == {"max_len": 24, "width": 32} and plan["val_samples"] == 200
    assert json.loads((run_dir / "config.json").read_text())["task_settings"] == '{"max_len": 24, "width": 32}'
    evals = metrics(run_dir, "eval")
    assert [e["samples"] for e in evals] == [200, 200] and evals[-1]["accuracy"] > 0.9, evals  # it learns
    scored = run([PY, "-m", "train.evaluate", str(run_dir), "--task", "mytasks.walks:build"], env=env)
    assert json.loads((run_dir / "eval-model.json").read_text())["accuracy"] == evals[-1]["accuracy"], scored.stdout
    other = run(python_cmd(*[f if f != "max_len=24,width=32" else "max_len=30,width=32" for f in flags],
                           "--max-steps", 130, "--run-dir", run_dir), expect=2, env=env)
    assert other.stderr.count("\n") == 1 and "--task-settings" in other.stderr, other.stderr
