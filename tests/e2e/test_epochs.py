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
    # Resumed on one worker: the global batch (2 x 16) kept by accumulating 2 micro-batches, so the steps, the schedule
    # and the position stay; another --batch-size would change them, and is refused before anything is written
    before = snapshot(two)
    refused = run(python_cmd(*DEBUG, "--epochs", 2, "--batch-size", 8, "--run-dir", two), expect=2)
    assert refused.stderr.count("\n") == 1 and "(--batch-size 16 -> 8)" in refused.stderr, refused.stderr[-3000:]
    assert snapshot(two) == before
    resumed = run(python_cmd(*DEBUG, "--epochs", 2, "--run-dir", two))
    assert "resuming a run laid out for 2 workers x batch 16 x accumulation 1 on 1 worker: accumulation 2 keeps " \
           "the global batch of 32" in resumed.stderr
    assert status(two)["step"] == 32 and json.loads((two / "plan.json").read_text())["resumes"] == [
        {"step": 10, "changed": {"grad_accum": [1, 2], "spawn": [2, 0], "world_size": [2, 1]}}]
