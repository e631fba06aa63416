"""Graceful stop: a signal on any rank stops every rank at the same step, saved and resumable."""

import os
import signal
import subprocess
import time
from pathlib import Path

from tests.helpers import (DEBUG, LONG, PY, assert_bit_identical, assert_same_final_figures, env_for_tests, metrics,
                           python_cmd, reached_step, run, status, wait_for, worker_pid)
from tests.processes import alive, descendants, in_session
from train.files import checkpoint_io as ckpt


def _stopped(run_dir: Path, said: str, stops: int, first: int) -> Path:
    """The stopped run: every rank at one step (`first` or later), a verified checkpoint of it, status.json
    "stopped" with exit code 75, the stop logged once (train.log's `stops`th), no model.pt. Returns the checkpoint."""
    stopped = status(run_dir)
    assert (stopped["state"], stopped.get("exit_code")) == ("stopped", 75), said[-3000:]
    step = stopped["step"]
    assert first <= step < 240
    newest = ckpt.newest_valid(run_dir)  # the stop's own checkpoint, whole: its size and CRC32 verified
    assert newest is not None and newest.name == f"step_{step:08d}.pt"
    log = (run_dir / "train.log").read_text()
    assert log.count("and exiting with code 75") == stops and f"saving at step {step} and exiting with code 75" in log
    assert not (run_dir / "model.pt").exists()
    return newest


def _resumed_to_the_end(resumed, run_dir: Path, newest: Path, straight: Path) -> None:
    """Resumed to the end from the stop's checkpoint (not an earlier one): equal to `straight`."""
    assert f"resumed from {newest}" in resumed.stderr, resumed.stderr[-3000:]
    assert status(run_dir)["state"] == "done"
    logged = [m["step"] for m in metrics(run_dir, "train")]
    assert logged == sorted(set(logged))  # nothing logged twice
    assert_bit_identical(run_dir, straight)
    assert_same_final_figures(run_dir, straight)  # every rank evaluated with the weights' own statistics


def _stop(proc: subprocess.Popen, target: str, sig: int) -> None:
    """Send sig to the launcher, or to the torchrun worker of that rank ("rank N"); a launcher killed -9 leaves
    the run's processes behind it: each must end within seconds."""
    if target.startswith("rank"):
        os.kill(worker_pid(proc, int(target[-1])), sig)
    elif sig != signal.SIGKILL:
        proc.send_signal(sig)
    else:
        run_processes = descendants(proc.pid)  # torchrun's workers are in sessions of their own
        proc.kill()
        proc.wait()
        wait_for(lambda: not [p for p in [*run_processes, *in_session(proc.pid)] if alive(p)], 15,
                 "every process of the run to end")
    proc.wait(timeout=120)


def test_a_killed_launcher_leaves_no_process_behind_and_the_run_resumes_bit_identical(reference_run, tmp_path):
    """One run of 2 workers stopped four times, each stop resumed by the next launch. First by a stop signal:
    SIGTERM to one worker under make train's launcher (torchrun; rank 0 learns of it from rank 1), then SIGUSR2 to
    the --spawn parent. Then by SIGKILL to the launcher (the out-of-memory killer, kill -9), make train's (torchrun in
    its process) and then --spawn's: nothing is left to forward a signal or wait for the workers, which see it end
    and stop as on SIGTERM, and every process of the run is gone within seconds (--spawn's fork server too). Every
    time every rank stops at one step with a verified checkpoint of it, which the next launch (of either launcher)
    resumes from; the end is bit-identical to an uninterrupted run."""
    run_dir = tmp_path / "run"
    launchers = {"torchrun": [PY, "-m", "train.launch", "--gpus", "2", "--", *map(str, LONG), "--run-dir",
                              str(run_dir)],
                 "--spawn": python_cmd(*LONG, "--spawn", 2, "--run-dir", run_dir)}
    stops = [("torchrun", "rank 1", signal.SIGTERM), ("--spawn", "launcher", signal.SIGUSR2),
             ("torchrun", "launcher", signal.SIGKILL), ("--spawn", "launcher", signal.SIGKILL)]
    step, newest = 0, None
    for i, (name, target, sig) in enumerate(stops):
        with open(tmp_path / f"{i}.err", "w+") as err:
            proc = subprocess.Popen(launchers[name], env=env_for_tests(), stdout=subprocess.DEVNULL, stderr=err,
                                    text=True, start_new_session=True)
            wait_for(reached_step(run_dir, step + 20), 120, f"step {step + 20}", proc)
            _stop(proc, target, sig)
            err.seek(0)
            said = err.read()
        assert sig == signal.SIGKILL or proc.returncode == 75, (name, target, said[-3000:])
        assert newest is None or f"resumed from {newest}" in said, said[-3000:]
        newest = _stopped(run_dir, said, i + 1, step + 20)
        step = status(run_dir)["step"]
        if sig == signal.SIGTERM:
            assert "a stop signal on another rank" in said  # rank 0 learned it from rank 1
        elif sig == signal.SIGUSR2:
            assert f"SIGUSR2: saving at step {step}" in said
        else:  # each worker sees the launcher end; rank 0 says so, and saves as on SIGTERM or, where rank 1 saw it
            # first, as on a stop from another rank: at the same agreed step either way
            assert "ended: its workers stop as on SIGTERM" in said and any(
                f"{why}: saving at step {step} and exiting with code 75" in said
                for why in ("SIGTERM", "a stop signal on another rank")), said[-3000:]
    _resumed_to_the_end(run(launchers["--spawn"]), run_dir, newest, reference_run(*LONG))


def test_sigterm_to_a_single_process_run(reference_run, tmp_path):
    run_dir = tmp_path / "run"
    cmd = python_cmd(*LONG, "--run-dir", run_dir)
    proc = subprocess.Popen(cmd, env=env_for_tests(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(reached_step(run_dir, 20), 120, "step 20", proc)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    newest = _stopped(run_dir, err, 1, 20)
    _resumed_to_the_end(run(cmd), run_dir, newest, reference_run(*LONG, workers=1))


def test_spawn_stops_the_other_workers_when_one_crashes(tmp_path):
    # Rank 0 would otherwise wait in a collective for the full --timeout-s (600 s).
    proc = run(python_cmd(*DEBUG, "--spawn", 2, "--model", "tests.models:crashes_on_rank_1",
                          "--run-dir", tmp_path / "run"), expect=None, timeout=120)
    assert proc.returncode not in (0, 75)
    assert "deliberate failure on rank 1" in proc.stderr


def test_a_second_ctrl_c_stops_at_once_without_saving(tmp_path):
    """Ctrl-C in the terminal (SIGINT to the process group) asks for a checkpoint; a second one while that
    checkpoint is being written (a 240 MB model, so the write takes a while) stops at once: the half-written
    file is never taken for a checkpoint, the earlier one stays the newest, status.json does not say stopped."""
    run_dir = tmp_path / "run"
    cmd = python_cmd(*DEBUG, "--model", "tests.models:wide_mlp", "--max-steps", 40, "--save-every", 5,
                     "--log-every", 1, "--eval-every", 0, "--run-dir", run_dir)
    proc = subprocess.Popen(cmd, env=env_for_tests(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    folder = run_dir / "checkpoints"
    wait_for(lambda: (folder / "step_00000005.pt.crc32").exists(), 180, "the first checkpoint", proc)
    os.killpg(proc.pid, signal.SIGINT)  # the first Ctrl-C: stop after this step, saving it
    wait_for(lambda: any(p.stat().st_size > 0 for p in folder.glob(".step_*.pt.tmp.*")), 180, "the stop's save",
             proc)
    (partial,) = folder.glob(".step_*.pt.tmp.*")
    saving = int(partial.name.split("_")[1].split(".")[0])  # the step whose checkpoint is being written
    os.killpg(proc.pid, signal.SIGINT)  # the second: now, without the checkpoint
    out, err = proc.communicate(timeout=60)
    # 128 + SIGINT, as a shell says; the first Ctrl-C had asked for the checkpoint of the step being saved
    assert proc.returncode == 130 and f"SIGINT: saving at step {saving} and exiting" in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: [rank 0] interrupted by a second Ctrl-C during the checkpoint save of step {saving}: "
                      "stopped without saving; run the same command to resume from the newest checkpoint"] and \
        "Traceback" not in err, err[-3000:]
    assert ckpt.newest_valid(run_dir).name == "step_00000005.pt" and saving > 5
    recorded = status(run_dir)  # as the last step left it: running, not a stop that never saved
    assert (recorded["state"], recorded.get("exit_code")) == ("running", None)
