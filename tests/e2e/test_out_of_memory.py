"""Out of memory, as a user meets it: a size typo, a batch too large at the first step, mid-run on one rank,
at an evaluation. The real allocator refuses (the CPU's here; a test model asks it for terabytes where a
too-large batch of images would), and the run ends in one line and exit code 2 on every rank: where it
happened, the memory the device has, the flags that fix it; checkpoints kept; under torchrun no attempt trains
again."""

import json

from tests.helpers import DEBUG, REPO, make, python_cmd, run, status, torchrun_cmd

FIX = "use a smaller --batch-size (now 16; a larger --grad-accum, now 1, keeps the global batch) or a smaller " \
      "--image-size (now {size}), then run the same command"


def _one_line(stderr: str, torchrun: bool = False) -> str:
    """The one error line; no traceback (a plain torchrun's report of its failed workers is its own: no frame of
    trainbox's in it)."""
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    clean = f'File "{REPO / "train"}' not in stderr and "ChildFailedError" in stderr if torchrun else \
        "Traceback" not in stderr
    assert len(errors) == 1 and clean, stderr[-4000:]
    return errors[0]


def test_an_image_size_typo_is_one_line_not_a_traceback(tmp_path):
    run_dir = tmp_path / "run"
    proc = run(python_cmd(*DEBUG, "--image-size", 100000, "--run-dir", run_dir), expect=2)
    line = _one_line(proc.stderr)
    assert line.startswith("error: [rank 0] out of memory during start-up (the data and the model) on the CPU "
                           "(tried to allocate 19073.5 GiB, this machine has "), line
    assert line.endswith(FIX.format(size=100000)), line
    recorded = status(run_dir)
    assert (recorded["state"], recorded["exit_code"]) == ("failed", 2) and recorded["error"] in line


def test_a_step_that_does_not_fit_ends_make_train_with_2_and_no_torchrun_restart(tmp_path):
    """make train GPUS=2 runs torchrun with --max-restarts=3: an out-of-memory step must not be retried."""
    run_dir = tmp_path / "run"
    proc = make("train", "RUNTIME=local", "GPUS=2", "MAX_RESTARTS=3",
                f"ARGS={' '.join(DEBUG)} --model tests.models:out_of_memory_at_step_3 --save-every 2 "
                f"--run-dir {run_dir}", expect=None)
    assert proc.returncode == 2, proc.stderr[-4000:]
    line = _one_line(proc.stderr)
    assert "out of memory during training step 3 on the CPU (tried to allocate 768.0 GiB" in line, line
    # the checkpoint of step 2 fixes the batch and sizes of a resume: the line says so, not "the same command"
    assert line.endswith(f"the run's checkpoint fixes its --batch-size, --image-size and --precision: run the same "
                         f"command on a device with more memory, or start a new --run-dir from its weights (--weights "
                         f"{run_dir}/checkpoints/step_00000002.pt) with a smaller --batch-size (now 16; a larger "
                         f"--grad-accum keeps the global batch) or a smaller --image-size (now 16)"), line
    assert "trainbox: the workers stopped on the error above (exit 2)" in proc.stderr
    log = (run_dir / "train.log").read_text()
    assert log.count(f"run {run_dir}:") == 1, log  # one attempt: torchrun restarted nothing
    assert [p.name for p in (run_dir / "checkpoints").glob("step_*.pt")] == ["step_00000002.pt"]  # kept
    assert status(run_dir)["state"] == "failed" and status(run_dir)["exit_code"] == 2


def test_one_rank_out_of_memory_mid_run_ends_every_rank_at_once(tmp_path):
    """Rank 1 alone (a larger batch of variable-size images): rank 0, waiting for it in the all-reduce,
    learns why and ends with the same code at once instead of a lost-peer report or the collective timeout."""
    # A bare torchrun with restarts left restarts on any non-zero exit: its restarts refuse at once, and it
    # exits 1 (torchrun's code for failed workers); status.json holds the run's own (make train, compose, Slurm
    # and SkyPilot exit with it).
    for launch, expect in (("spawn", 2), ("torchrun", 1)):
        run_dir = tmp_path / launch
        args = [*DEBUG, "--model", "tests.models:out_of_memory_on_rank_1_at_step_3", "--run-dir", run_dir]
        cmd = python_cmd(*args, "--spawn", 2) if launch == "spawn" else \
            [*torchrun_cmd(2, *args)[:4], "--max-restarts=2", *torchrun_cmd(2, *args)[4:]]
        proc = run(cmd, expect=expect, timeout=120)
        line = _one_line(proc.stderr, torchrun=launch == "torchrun")
        assert line.startswith("error: [rank 1] out of memory during training step 3 on the CPU"), line
        assert "lost contact" not in proc.stderr
        recorded = status(run_dir)
        assert (recorded["state"], recorded["step"], recorded["exit_code"]) == ("failed", 2, 2)
        assert (run_dir / "train.log").read_text().count(f"run {run_dir}:") == 1  # no restart


def test_out_of_memory_at_an_evaluation_names_it(tmp_path):
    run_dir = tmp_path / "run"
    proc = run(python_cmd(*DEBUG, "--model", "tests.models:out_of_memory_in_evaluation", "--eval-every", 10,
                          "--run-dir", run_dir), expect=2)
    line = _one_line(proc.stderr)
    assert line.startswith("error: [rank 0] out of memory during evaluation at step 10 on the CPU"), line
    assert json.loads((run_dir / "status.json").read_text())["step"] == 10
