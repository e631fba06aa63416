"""A run given in --epochs, as a user runs it: its steps on 1 and 2 workers, a finished run, a resume."""

import json

from tests.helpers import DEBUG, python_cmd, run, snapshot, status


def test_epochs_set_the_steps_for_the_layout_and_a_resume_keeps_it(tmp_path):
    """The debug preset's 512 images, batch 16: 32 steps an epoch on one worker, 16 on two."""
    one, two = tmp_path / "one", tmp_path / "two"
    first = run(python_cmd(*DEBUG, "--epochs", 2, "--warmup-epochs", 0.5, "--run-dir", one))
    assert "--epochs 2: 64 steps (32 per epoch: 512 images / (1 workers x batch 16 x accumulation 1)), warm-up " \
           "16 steps" in first.stderr
    saved = json.loads((one / "plan.json").read_text())  # what the run derived from its config, and trained from
    assert (saved["epochs"], saved["max_steps"], saved["warmup_steps"]) == (2, 64, 16)
    assert json.loads((one / "config.json").read_text())["epochs"] == 2  # the config as given
    assert (status(one)["state"], status(one)["step"], status(one)["epochs"]) == ("done", 64, 2)
    again = run(python_cmd(*DEBUG, "--epochs", 2, "--warmup-epochs", 0.5, "--run-dir", one))
    assert "already finished at step 64" in again.stderr and "pass a larger --epochs" in again.stderr
    run(python_cmd(*DEBUG, "--epochs", 2, "--spawn", 2, "--stop-at", 10, "--run-dir", two), expect=75)
    saved = json.loads((two / "plan.json").read_text())
    assert (saved["max_steps"], saved["warmup_steps"]) == (32, 5)  # the preset's warm-up, in steps, as given
    # Resuming on another layout would change the steps, the schedule and the position: refused, nothing changed
    before = snapshot(two)
    refused = run(python_cmd(*DEBUG, "--epochs", 2, "--run-dir", two), expect=2)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is a run of --epochs 2 with 2 workers x batch 16 x accumulation 1; with 1 x 16 x 1"\
        in errors[0] and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert {k: v for k, v in snapshot(two).items() if k not in ("train.log", "status.json")} == \
        {k: v for k, v in before.items() if k not in ("train.log", "status.json")}
    resumed = run(python_cmd(*DEBUG, "--epochs", 2, "--spawn", 2, "--run-dir", two))
    assert "resumed from" in resumed.stderr and status(two)["step"] == 32
