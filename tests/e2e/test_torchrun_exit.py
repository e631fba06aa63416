"""A failed run fails a plain torchrun too, with or without --max-restarts, as the tutorials launch it (and as an
`srun torchrun` of a user's own script, a CI pipeline or a job array read its exit code): bad input, out of
memory and a full disk end it non-zero, the error's line said once, each restart refusing at once. A crash (a
killed worker) still restarts and resumes under plain torchrun: the drill's test in tests/e2e/test_restarts.py
kills 4 workers there four times."""

import json
import subprocess
import sys

import pytest
from PIL import Image

from tests.e2e.test_faults import _unshare
from tests.helpers import DEBUG, LONG, REPO, attempts, env_for_tests, run, status, torchrun_cmd


def plain_torchrun(restarts: int, *args) -> list[str]:
    cmd = torchrun_cmd(2, *args)
    return [*cmd[:4], f"--max-restarts={restarts}", *cmd[4:]] if restarts else cmd


def trainbox_errors(stderr: str) -> list[str]:
    """trainbox's own error lines; torchrun's report of its failed workers (its ChildFailedError traceback)
    is torchrun's, and no trainbox code may appear in a traceback."""
    assert f'File "{REPO / "train"}' not in stderr, stderr[-4000:]
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("restarts", [0, 3])
def test_out_of_memory_under_plain_torchrun_exits_non_zero_and_restarts_refuse_at_once(tmp_path, restarts):
    """The command of the report: torchrun --standalone --max-restarts=3 --nproc-per-node=2 -m train --preset
    debug --image-size 100000."""
    run_dir = tmp_path / "run"
    proc = run(plain_torchrun(restarts, *DEBUG, "--image-size", 100000, "--run-dir", run_dir), expect=1)
    errors = trainbox_errors(proc.stderr)
    assert len(errors) == 1 and "out of memory during start-up" in errors[0], proc.stderr[-4000:]
    recorded = status(run_dir)
    assert (recorded["state"], recorded["exit_code"]) == ("failed", 2) and recorded["launch"]
    assert "ChildFailedError" in proc.stderr and "exitcode  : 2" in proc.stderr  # torchrun's own report
    assert attempts(run_dir) == 0  # no attempt got as far as training: the restarts refused at start


@pytest.mark.parametrize("args, message", [
    (["--batch-size", "0"], "--batch-size must be > 0"),  # every worker meets it while parsing its flags
    (["--dataset", "imagefolder", "--data-dir", "/nonexistent"], "/nonexistent/train is missing"),  # checks
])
def test_bad_input_under_plain_torchrun_exits_non_zero_with_one_line(tmp_path, args, message):
    proc = run(plain_torchrun(2, *DEBUG, *args, "--run-dir", tmp_path / "run"), expect=1)
    errors = trainbox_errors(proc.stderr)
    assert len(errors) == 1 and message in errors[0], proc.stderr[-4000:]  # 2 workers x 3 attempts: said once


def test_a_dataset_the_workers_refuse_under_plain_torchrun_is_one_line_and_no_run_folder(tmp_path):
    """Refused while each worker lists the images, before the run folder is made: nothing records the failure for
    torchrun's restarts to read, and each restart meets it again; the line is said once all the same."""
    for split in ("train", "val"):
        (tmp_path / "data" / split / "a").mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "data" / split / "a" / "0.png")
    (tmp_path / "data" / "train" / "a" / "loop").symlink_to("..")
    proc = run(plain_torchrun(1, *DEBUG, "--dataset", "imagefolder", "--data-dir", tmp_path / "data", "--run-dir",
                              tmp_path / "run"), expect=1)
    errors = trainbox_errors(proc.stderr)
    assert len(errors) == 1 and f"{tmp_path}/data/train/a/loop is a link cycle" in errors[0], proc.stderr[-4000:]
    assert not (tmp_path / "run").exists()


def test_a_restart_of_a_failed_launch_refuses_before_importing_torch(tmp_path):
    """What a torchrun restart of a launch that failed on such an error runs: it exits 2 without importing torch
    (it cannot: torch is made unimportable here), while a new launch of the same command tries again."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "status.json").write_text(json.dumps({"state": "failed", "step": 3, "exit_code": 2, "launch": "L1"}))
    code = ("import sys; sys.modules['torch'] = None; from train.__main__ import main; "
            f"sys.exit(main({[*map(str, DEBUG), '--run-dir', str(run_dir)]!r}))")
    restart = env_for_tests(TORCHELASTIC_RUN_ID="L1", TORCHELASTIC_RESTART_COUNT="1", RANK="1", WORLD_SIZE="2")
    proc = subprocess.run([sys.executable, "-c", code], env=restart, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (2, "")
    for other in ({"TORCHELASTIC_RUN_ID": "L2"}, {"TORCHELASTIC_RESTART_COUNT": "0"}):  # another launch, a first try
        proc = subprocess.run([sys.executable, "-c", code], env={**restart, **other}, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode != 2 and "torch" in proc.stderr  # it went on, to the import of torch


def test_a_full_disk_under_plain_torchrun_exits_non_zero(tmp_path):
    """The run directory on a 2.5 MB tmpfs: the checkpoints of steps 20 and 40 fit, 60 does not."""
    out, mnt = tmp_path / "out", tmp_path / "mnt"
    out.mkdir()
    mnt.mkdir()
    cmd = " ".join(plain_torchrun(2, *LONG, "--run-dir", mnt / "run"))
    script = f"""
        set -u
        mount -t tmpfs -o size=2500k tmpfs {mnt} || exit 90
        {cmd} >{out}/out 2>{out}/err; echo $? >{out}/code
        cp -a {mnt}/run {out}/after
    """
    proc = subprocess.run([*_unshare(), "bash", "-c", script], env=env_for_tests(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    err = (out / "err").read_text()
    assert (out / "code").read_text().strip() == "1", err[-4000:]
    errors = trainbox_errors(err)
    assert len(errors) == 1 and "could not save the checkpoint of step 60" in errors[0], err[-4000:]
    assert (out / "after" / "train.log").read_text().count(f"run {mnt / 'run'}:") == 1  # trained once
    assert status(out / "after")["state"] == "failed"
