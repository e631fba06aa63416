"""Graceful stop: a signal on any rank stops every rank at the same step, saved and resumable."""

import os
import signal
import subprocess
import time

import pytest

from tests.conftest import (DEBUG, PY, assert_bit_identical, assert_same_final_figures, children, env_for_tests,
                            metrics, process_env, python_cmd, reached_step, run, status, wait_for)

pytestmark = pytest.mark.slow

# Long enough (a few seconds on 2 cores) that the signal lands mid-run.
LONG = [*DEBUG, "--max-steps", 240, "--width", 16, "--log-every", 5, "--save-every", 1000, "--eval-every", 0]


def _start(cmd, run_dir):
    proc = subprocess.Popen(cmd, env=env_for_tests(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(reached_step(run_dir, 20), 120, "step 20", proc)
    return proc


def _finish_and_compare(proc, run_dir, reference_cmd, tmp_path, expected_code):
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == expected_code, err[-3000:]
    stopped = status(run_dir)
    assert stopped["state"] == "stopped"
    step = stopped["step"]
    assert 20 <= step < 240
    assert (run_dir / "checkpoints" / f"step_{step:08d}.pt").is_file()
    assert not (run_dir / "model.pt").exists()
    run(reference_cmd(run_dir))  # resume to the end
    assert status(run_dir)["state"] == "done"
    logged = [m["step"] for m in metrics(run_dir, "train")]
    assert logged == sorted(set(logged))  # nothing logged twice
    straight = tmp_path / "straight"
    run(reference_cmd(straight))
    assert_bit_identical(run_dir, straight)
    assert_same_final_figures(run_dir, straight)  # every rank evaluated with the weights' own statistics
    return err


def test_sigterm_to_one_torchrun_worker_stops_all_ranks(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [PY, "-m", "train.launch", "--gpus", "2", "--", *map(str, LONG), "--run-dir", str(run_dir)]
    proc = _start(cmd, run_dir)
    workers = [pid for agent in children(proc.pid) for pid in [agent, *children(agent)]
               if process_env(pid).get("RANK") == "1"]
    assert workers, "rank 1 not found"
    os.kill(workers[0], signal.SIGTERM)
    err = _finish_and_compare(proc, run_dir, lambda d: python_cmd(*LONG, "--spawn", 2, "--run-dir", d),
                              tmp_path, expected_code=75)
    assert "a stop signal on another rank" in err  # rank 0 learned it from rank 1


def test_sigusr2_to_the_spawn_parent_stops_the_run(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(python_cmd(*LONG, "--spawn", 2, "--run-dir", run_dir), run_dir)
    proc.send_signal(signal.SIGUSR2)
    err = _finish_and_compare(proc, run_dir, lambda d: python_cmd(*LONG, "--spawn", 2, "--run-dir", d),
                              tmp_path, expected_code=75)
    assert "SIGUSR2: saving at step" in err


def test_sigterm_to_a_single_process_run(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(python_cmd(*LONG, "--run-dir", run_dir), run_dir)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _finish_and_compare(proc, run_dir, lambda d: python_cmd(*LONG, "--run-dir", d), tmp_path, expected_code=75)


def test_spawn_stops_the_other_workers_when_one_crashes(tmp_path):
    # Rank 0 would otherwise wait in a collective for the full --timeout-s (600 s).
    proc = run(python_cmd(*DEBUG, "--spawn", 2, "--model", "tests.models:crashes_on_rank_1",
                          "--run-dir", tmp_path / "run"), expect=None, timeout=120)
    assert proc.returncode not in (0, 75)
    assert "deliberate failure on rank 1" in proc.stderr
