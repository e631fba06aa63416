"""Fault injection, for real: killed and stopped workers, signals at random moments, a save killed
halfway, damaged checkpoints, a full disk, a hung rank. Each run must end without losing work and,
where it resumes, bit-identical to a run that was never interrupted."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch

from tests.helpers import (DEBUG, LONG, PY, assert_bit_identical, assert_same_final_figures, attempts, children,
                           end_hung, env_for_tests, metrics, python_cmd, reached_step, run, status, wait_for,
                           worker_pid)
from tests.processes import cmdline, parent_of
from train.files import checkpoint_io as ckpt

FAULT = LONG


def launch_cmd(workers: int, run_dir: Path, *extra, restarts: int | None = None, args=FAULT) -> list[str]:
    """What `make train GPUS=N ARGS=...` runs (torchrun, with its default restarts unless given)."""
    flags = [] if restarts is None else ["--max-restarts", str(restarts)]
    return [PY, "-m", "train.launch", "--gpus", str(workers), *flags, "--", *map(str, args), *map(str, extra),
            "--run-dir", str(run_dir)]


_started: list[subprocess.Popen] = []


def start(cmd, **kwargs) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, env=kwargs.pop("env", None) or env_for_tests(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)
    _started.append(proc)
    return proc


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """communicate(), but a run that does not end in time fails the test with its output, not a hang."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = end_hung(proc)
        raise AssertionError(f"still running after {timeout}s\n{out[-3000:]}\n{err[-12000:]}") from None


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            _kill_tree(proc)


def _kill_tree(proc: subprocess.Popen) -> tuple[str, str]:
    for pid in [d for c in children(proc.pid) for d in [c, *children(c)]]:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    proc.kill()
    return proc.communicate()


def assert_logged_once(run_dir: Path) -> None:
    steps = [m["step"] for m in metrics(run_dir, "train")]
    assert steps == sorted(set(steps)), "a step was logged twice after the resume"


@pytest.fixture
def reference(reference_run) -> Path:
    """FAULT with 2 workers, never interrupted: what every faulted 2-worker run must end equal to."""
    return reference_run(*FAULT)


@pytest.fixture(scope="module")
def stopped_at_60(tmp_path_factory) -> Path:
    """FAULT on one process, stopped at step 60 (exit 75) with its checkpoints of steps 20, 40 and 60: each test
    that starts from it works on a copy of its own."""
    run_dir = tmp_path_factory.mktemp("stopped") / "run"
    run(python_cmd(*FAULT, "--stop-at", 60, "--run-dir", run_dir), expect=75)
    return run_dir


def manual_ranks(world: int, run_dir: Path, *extra) -> list[subprocess.Popen]:
    """Each rank a plain process with RANK/WORLD_SIZE set, as any external launcher starts them, and no
    launcher watching over them: what the trainer alone does when a peer fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = env_for_tests(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                            LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(start(python_cmd(*FAULT, *extra, "--run-dir", run_dir), env=env))
    return procs


# ---------------------------------------------------------------- a worker dies

def test_a_killed_worker_is_restarted_each_time_and_the_run_ends_bit_identical(reference, tmp_path):
    """Three kills -9 of a random worker in one run, each at a random step of its own part of the run, under the
    default --max-restarts (3, as `make train GPUS=2`): every restart resumes from a checkpoint, and the end is the
    uninterrupted run's. Each restart's workers are forked from the server the first ones came from, which imported
    torch and the trainer once (train/launch.py): no restart imports them again."""
    rng = random.Random(11)
    run_dir = tmp_path / "run"
    proc = start(launch_cmd(2, run_dir))
    servers = set()
    for first in (25, 95, 165):  # each kill's moment past where the last one's restart resumed
        victim, at_step = rng.randrange(2), rng.randrange(first, first + 50)
        wait_for(reached_step(run_dir, at_step), 120, f"step {at_step}", proc)
        alive = status(run_dir)  # written at every log line: a monitor tells a live run at step N from a dead one
        assert alive["state"] == "running" and alive["step"] >= at_step - 5, alive
        assert abs(time.time() - datetime.strptime(alive["updated"], "%Y-%m-%dT%H:%M:%S%z").timestamp()) < 60, alive
        time.sleep(rng.uniform(0, 0.2))
        pid = worker_pid(proc, victim)
        servers.add((parent_of(pid), cmdline(parent_of(pid))))
        os.kill(pid, signal.SIGKILL)
    out, err = finish(proc, 300)
    assert proc.returncode == 0, err[-4000:]
    [(_, server)] = servers
    assert "multiprocessing.forkserver" in server and "['torch', 'torch._dynamo'," in server, server
    assert "resumed from" in err, "the restarted workers did not resume from a checkpoint"
    assert attempts(run_dir) == 4  # a restart per kill, seen in train.log (torchrun logs its own at INFO only)
    assert status(run_dir)["state"] == "done"
    assert_logged_once(run_dir)
    assert_bit_identical(run_dir, reference)
    assert_same_final_figures(run_dir, reference)


def test_with_three_workers_deterministic_mode_survives_a_kill_bit_identically(reference_run, tmp_path):
    """--deterministic, rank 2 of 3 killed -9 past step 50 of 120: torchrun restarts the workers, they resume from a
    checkpoint, and the end is the uninterrupted run's bit for bit."""
    args = [*FAULT, "--max-steps", 120, "--deterministic"]
    straight = reference_run(*args, workers=3)
    run_dir = tmp_path / "run"
    proc = start(launch_cmd(3, run_dir, args=args))
    wait_for(reached_step(run_dir, 50), 180, "step 50", proc)
    os.kill(worker_pid(proc, 2), signal.SIGKILL)
    out, err = finish(proc, 300)
    assert proc.returncode == 0, err[-4000:]
    assert "resumed from" in err
    assert_bit_identical(run_dir, straight)


def test_without_restarts_the_survivor_fails_fast_with_a_clear_message(tmp_path):
    """Within seconds (docs/resilience.md): the dead peer's closed connection, not the collective timeout
    (600 s here)."""
    procs = manual_ranks(2, tmp_path / "run", "--timeout-s", 600)
    wait_for(reached_step(tmp_path / "run", 30), 120, "step 30", procs[0])
    procs[1].kill()
    started = time.monotonic()
    out, err = finish(procs[0], 120)
    waited = time.monotonic() - started
    procs[1].communicate()
    assert procs[0].returncode == 1
    assert waited < 20, f"rank 0 took {waited:.0f}s to notice its dead peer"
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "[rank 0] lost contact with the other workers" in errors[0], err[-3000:]
    assert "run the same command to resume" in errors[0]
    assert 'File "' in err and "train/run/trainer.py" in err  # where it was when the peer died


def test_without_restarts_torchrun_ends_the_job(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(launch_cmd(2, run_dir, restarts=0))
    wait_for(reached_step(run_dir, 30), 120, "step 30", proc)
    os.kill(worker_pid(proc, 1), signal.SIGKILL)
    out, err = finish(proc, 180)
    assert proc.returncode == 1
    assert "trainbox: torchrun failed" in err
    assert ckpt.newest_valid(run_dir) is not None  # what was saved is still there to resume from


# ---------------------------------------------------------------- preemption signals

def test_a_signal_at_a_random_moment_stops_every_rank_at_one_step(reference, tmp_path):
    """Four stops of one run, each at a random moment of its own part of the run, by a stop signal to the launcher
    or to one rank: every time, every rank stops at one step with a complete checkpoint and torchrun (restarts on)
    does not restart them; the same command resumes, and the end is the uninterrupted run's."""
    rng = random.Random(21)
    run_dir = tmp_path / "run"
    stops = [("launcher", signal.SIGUSR2), ("rank 0", signal.SIGTERM), ("rank 1", signal.SIGUSR2),
             ("launcher", signal.SIGTERM)]
    for i, (target, sig) in enumerate(stops):
        proc = start(launch_cmd(2, run_dir))  # restarts on: a stop must still end the run, not restart it
        first = 10 + 55 * i  # past the step the last stop saved at
        wait_for(reached_step(run_dir, rng.randrange(first, first + 40)), 120, "the signal's moment", proc)
        time.sleep(rng.uniform(0, 0.3))
        os.kill(proc.pid if target == "launcher" else worker_pid(proc, int(target[-1])), sig)
        out, err = finish(proc, 180)
        assert proc.returncode == 75, (target, sig, err[-4000:])
        stopped = status(run_dir)
        assert stopped["state"] == "stopped", (target, sig, stopped)
        newest = ckpt.newest_valid(run_dir)
        assert newest is not None and newest.name == f"step_{stopped['step']:08d}.pt"  # complete and verified
        assert attempts(run_dir) == i + 1  # torchrun did not restart the stopped workers
    run(launch_cmd(2, run_dir))  # the same command resumes
    assert status(run_dir)["state"] == "done"
    assert_logged_once(run_dir)
    assert_bit_identical(run_dir, reference)


def _imagefolder(root: Path) -> None:
    from PIL import Image

    rng = random.Random(0)
    for split, count in (("train", 48), ("val", 16)):
        for c, colour in enumerate([(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30)]):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                jitter = tuple(max(0, min(255, v + rng.randint(-40, 40))) for v in colour)
                Image.new("RGB", (20, 20), jitter).save(folder / f"{i}.png")


def test_a_signal_to_the_whole_process_group_spares_the_loader_workers(reference_run, tmp_path):
    """Ctrl-C in a terminal or a scheduler signalling every process: the DataLoader workers get it too,
    and must not die before the trainer has saved."""
    data = tmp_path / "data"
    _imagefolder(data)
    # --timeout-s 60: a rank stuck anywhere is ended by the watchdog (with every thread's stack) long before
    # the test's own timeout.
    args = [*DEBUG, "--dataset", "imagefolder", "--data-dir", data, "--image-size", 16, "--num-workers", 2,
            "--max-steps", 60, "--log-every", 2, "--save-every", 1000, "--eval-every", 0, "--timeout-s", 60]
    straight = reference_run(*args)
    run_dir = tmp_path / "run"
    cmd = [PY, "-m", "train.launch", "--gpus", "2", "--", *map(str, args), "--run-dir", str(run_dir)]
    proc = start(cmd, start_new_session=True)
    wait_for(reached_step(run_dir, 20), 180, "step 20", proc)
    loaders = [pid for w in (worker_pid(proc, 0), worker_pid(proc, 1)) for pid in children(w)]
    assert len(loaders) >= 4, "expected 2 loader workers per rank"
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = finish(proc, 180)
    assert proc.returncode == 75, err[-4000:]
    assert "DataLoader worker" not in err
    assert ckpt.newest_valid(run_dir).name == f"step_{status(run_dir)['step']:08d}.pt"
    run(cmd)
    assert_bit_identical(run_dir, straight)


# ---------------------------------------------------------------- checkpoints under attack

def test_killed_while_writing_a_checkpoint_the_previous_one_is_used(tmp_path):
    run_dir = tmp_path / "run"
    cmd = python_cmd(*DEBUG, "--model", "tests.models:wide_mlp", "--max-steps", 12, "--save-every", 5,
                     "--log-every", 1, "--eval-every", 0, "--run-dir", run_dir)
    proc = start(cmd)
    folder = run_dir / "checkpoints"
    wait_for(lambda: (folder / "step_00000005.pt.crc32").exists(), 180, "the first checkpoint", proc)

    def writing() -> bool:
        return any(p.stat().st_size > 0 for p in folder.glob(".step_00000010.pt.tmp.*"))
    wait_for(writing, 180, "the second checkpoint's write", proc)
    proc.kill()
    proc.communicate()
    assert list(folder.glob(".step_00000010.pt.tmp.*")), "the kill did not land inside the write"
    assert ckpt.newest_valid(run_dir).name == "step_00000005.pt"
    resumed = run(cmd)
    assert "removed" in resumed.stderr and "unfinished checkpoint files" in resumed.stderr
    assert "resumed from" in resumed.stderr and "step_00000005.pt" in resumed.stderr
    assert status(run_dir)["state"] == "done" and not list(folder.glob(".*tmp*"))


def test_a_worker_killed_during_an_evaluation_restarts_and_ends_bit_identical(reference_run, tmp_path):
    """Killed surely inside the evaluation of step 20 (the test model pauses there, once, on the rank that
    reached it first: that rank is the one killed, its peer waits for it in the evaluation): torchrun restarts
    the workers, they resume from the checkpoint and evaluate again; the end equals an uninterrupted run."""
    args = [*DEBUG, "--model", "tests.models:pauses_in_its_first_evaluation", "--log-every", 1, "--save-every", 10]
    marker = tmp_path / "evaluating"
    run_dir = tmp_path / "run"
    proc = start([PY, "-m", "train.launch", "--gpus", "2", "--", *map(str, args), "--run-dir", str(run_dir)],
                 env=env_for_tests(TRAINBOX_TEST_MARKER=str(marker)))
    wait_for(lambda: marker.exists() and marker.read_text() != "", 120, "the evaluation of step 20", proc)
    assert [m["step"] for m in metrics(run_dir, "eval")] == []  # inside it: its record not written yet
    os.kill(worker_pid(proc, int(marker.read_text())), signal.SIGKILL)  # the rank pausing there; its peer waits
    out, err = finish(proc, 300)
    assert proc.returncode == 0, err[-4000:]
    assert attempts(run_dir) == 2 and "step_00000010.pt (step 10 of 40)" in err  # the checkpoint before it
    assert [m["step"] for m in metrics(run_dir, "eval")] == [20, 40]  # the killed one done again, once
    reference = reference_run(*args)
    assert_bit_identical(run_dir, reference)
    assert_same_final_figures(run_dir, reference)
    # best.pt through the restart: the uninterrupted run's, step, figures and weights
    best, theirs = (torch.load(d / "best.pt", weights_only=True) for d in (run_dir, reference))
    assert {k: v for k, v in best.items() if k not in ("model", "config")} == \
        {k: v for k, v in theirs.items() if k not in ("model", "config")}
    assert all(torch.equal(best["model"][k], theirs["model"][k]) for k in theirs["model"])
    assert status(run_dir)["best"] == status(reference)["best"]


def _damage(checkpoint: Path, how: str) -> None:
    data = bytearray(checkpoint.read_bytes())
    if how == "flip":
        for i in range(1000, len(data), 7919):
            data[i] ^= 0xFF
        checkpoint.write_bytes(bytes(data))
    else:
        checkpoint.write_bytes(bytes(data[: len(data) // 2]))


def test_a_damaged_newest_checkpoint_is_reported_and_the_previous_used(reference_run, stopped_at_60, tmp_path):
    """A stopped run's newest checkpoint (step 60) with bits flipped; resumed, stopped again at step 100, its newest
    (step 100) cut in half: each time one warning line names it and why (its CRC32, its size), the one before it is
    used (step 40, then 80), and the end is bit-identical to a run never interrupted."""
    run_dir = tmp_path / "run"
    shutil.copytree(stopped_at_60, run_dir)
    for damage, newest, stop in (("flip", 60, ["--stop-at", 100]), ("truncate", 100, [])):
        _damage(run_dir / "checkpoints" / f"step_{newest:08d}.pt", damage)
        resumed = run(python_cmd(*FAULT, *stop, "--run-dir", run_dir), expect=75 if stop else 0)
        warnings = [line for line in resumed.stderr.splitlines() if "skipping checkpoint" in line]
        assert len(warnings) == 1 and f"step_{newest:08d}.pt: " in warnings[0], resumed.stderr[-3000:]
        assert ("checksum mismatch" if damage == "flip" else "file truncated") in warnings[0]
        assert f"resumed from {run_dir / 'checkpoints' / f'step_{newest - 20:08d}.pt'}" in resumed.stderr
    assert_bit_identical(run_dir, reference_run(*FAULT, workers=1))


def _unshare() -> list[str]:
    """A private mount namespace (the tmpfs vanishes with it); as a normal user via a user namespace."""
    if not shutil.which("unshare"):
        pytest.fail("unshare (util-linux) is needed to mount a small tmpfs")
    return ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--map-root-user", "--mount"]


def test_disk_full_while_saving_fails_cleanly_and_restarts_fail_fast(reference, tmp_path):
    """The run directory on a 2.5 MB tmpfs: the checkpoints of steps 20 and 40 (0.9 MB each) fit, 60 does not.
    A restart cannot free space: torchrun's restarts (2 left) refuse at once and none trains, and the same
    command run again before space is freed fails at start-up, in seconds, instead of training up to the save
    again."""
    out = tmp_path / "out"
    out.mkdir()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cmd = " ".join(launch_cmd(2, mnt / "run", restarts=2))
    script = f"""
        set -u
        mount -t tmpfs -o size=2500k tmpfs {mnt} || exit 90
        {cmd} >{out}/out1 2>{out}/err1; echo $? >{out}/code1
        cp -a {mnt}/run {out}/after_failure
        {cmd} >{out}/out_again 2>{out}/err_again; echo $? >{out}/code_again
        mount -o remount,size=64m {mnt}     # space freed
        {cmd} >{out}/out2 2>{out}/err2; echo $? >{out}/code2
        cp -a {mnt}/run {out}/after_resume
    """
    proc = subprocess.run([*_unshare(), "bash", "-c", script], env=env_for_tests(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    err1 = (out / "err1").read_text()
    assert (out / "code1").read_text().strip() == "2", err1[-4000:]
    failed = [line for line in err1.splitlines() if "could not save the checkpoint" in line]
    assert len(failed) == 1, err1[-4000:]  # one save failed; the restarts did not train up to it again
    assert "No space left on device" in failed[0] and "kept step_00000040.pt" in failed[0]
    assert "trainbox: the workers stopped on the error above (exit 2)" in err1
    again = (out / "err_again").read_text()
    assert (out / "code_again").read_text().strip() == "2", again[-4000:]
    assert "MiB free but needs" in again and "resumed from" not in again  # at start-up
    after = out / "after_failure"
    assert (after / "train.log").read_text().count(f"run {mnt / 'run'}:") == 1  # no restart trained again
    assert ckpt.newest_valid(after).name == "step_00000040.pt"
    assert not list((after / "checkpoints").glob(".*")), "a partial file was left behind"
    assert status(after)["state"] == "failed"
    assert (out / "code2").read_text().strip() == "0", (out / "err2").read_text()[-4000:]
    assert "step_00000040.pt" in (out / "err2").read_text()
    assert_bit_identical(out / "after_resume", reference)


def test_disk_full_between_checkpoints_is_one_line_and_keeps_every_checkpoint(reference_run, tmp_path):
    """The disk fills while the run trains between its checkpoints of steps 100 and 200 (the run is paused, the
    tmpfs filled, the run let go on): its next write (status.json, metrics.jsonl) ends it on one line naming the disk
    and the fix, exit 2, status.json "failed" with that line (written in place: no temporary file fits), the
    checkpoint of step 100 whole. The same command before space is freed refuses at start-up, saying what it needs;
    once freed it resumes, bit-identical to a run never interrupted."""
    out = tmp_path / "out"
    out.mkdir()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cmd = " ".join(map(str, python_cmd(*FAULT, "--save-every", 100, "--run-dir", mnt / "run")))
    script = f"""
        set -u
        mount -t tmpfs -o size=8m tmpfs {mnt} || exit 90
        {cmd} >{out}/out1 2>{out}/err1 &
        pid=$! step=0
        until [ "$step" -ge 105 ] || ! kill -0 $pid 2>/dev/null; do
          step=$(grep -o '^{{"step": [0-9]*' {mnt}/run/metrics.jsonl 2>/dev/null | tail -n 1 | tr -dc 0-9)
          step=${{step:-0}}
          sleep 0.02
        done
        kill -STOP $pid; cat /dev/zero >{mnt}/filler 2>/dev/null; kill -CONT $pid
        wait $pid; echo $? >{out}/code1
        cp -a {mnt}/run {out}/after_failure
        {cmd} >{out}/out_again 2>{out}/err_again; echo $? >{out}/code_again
        rm {mnt}/filler     # space freed
        {cmd} >{out}/out2 2>{out}/err2; echo $? >{out}/code2
        cp -a {mnt}/run {out}/after_resume
    """
    proc = subprocess.run([*_unshare(), "bash", "-c", script], env=env_for_tests(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    err1 = (out / "err1").read_text()
    line = (f"error: run directory {mnt / 'run'}: its disk is full (0.0 MiB free on {mnt}): free space on {mnt}, or "
            f"pass a --run-dir on another disk; then run the same command (a run resumes from its newest checkpoint)")
    assert (out / "code1").read_text().strip() == "2" and err1.splitlines()[-1] == line, err1[-4000:]
    assert "Traceback" not in err1 and "Logging error" not in err1, err1[-4000:]
    after = out / "after_failure"
    recorded = status(after)
    assert (recorded["state"], recorded["exit_code"], recorded["error"]) == ("failed", 2, line[len("error: "):])
    assert 100 < recorded["step"] < 200 and ckpt.newest_valid(after).name == "step_00000100.pt"
    again = (out / "err_again").read_text()
    assert (out / "code_again").read_text().strip() == "2" and "resumed from" not in again, again[-4000:]
    assert again.splitlines()[-1].startswith(f"error: {mnt / 'run'} has 0.0 MiB free but needs 1.9 MiB to train on "
                                             f"(a checkpoint of 0.9 MiB, and 1 MiB for the run's other files): free "
                                             f"space on that disk"), again
    assert (out / "code2").read_text().strip() == "0", (out / "err2").read_text()[-4000:]
    assert "resumed from" in (out / "err2").read_text() and "step_00000100.pt" in (out / "err2").read_text()
    assert_bit_identical(out / "after_resume", reference_run(*FAULT, workers=1))


# ---------------------------------------------------------------- hangs

def test_a_stopped_rank_makes_the_others_fail_within_the_timeout_with_stacks(tmp_path):
    procs = manual_ranks(2, tmp_path / "run", "--timeout-s", 5)
    try:
        wait_for(reached_step(tmp_path / "run", 30), 120, "step 30", procs[0])
        os.kill(procs[1].pid, signal.SIGSTOP)  # alive, connected, silent
        started = time.monotonic()
        out, err = finish(procs[0], 120)
        waited = time.monotonic() - started
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode == 1, err[-5000:]
    assert 4.5 <= waited < 35, f"rank 0 gave up after {waited:.0f}s with --timeout-s 5"
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "lost contact with the other workers" in errors[0] and \
        ("Timed out" in errors[0] or "timeout" in errors[0]), \
        err[-5000:]
    assert "train/run/trainer.py" in err and ("Thread 0x" in err or "Current thread" in err), err[-5000:]  # the stacks


def test_a_rank_stuck_outside_collectives_dumps_its_stack_and_exits(tmp_path):
    started = time.monotonic()
    proc = run(python_cmd(*DEBUG, "--model", "tests.models:hangs_after_30_steps", "--timeout-s", 3,
                          "--log-every", 5, "--run-dir", tmp_path / "run"), expect=1, timeout=120)
    assert time.monotonic() - started < 60
    assert "Timeout (0:00:06)!" in proc.stderr
    assert "tests/models.py" in proc.stderr and "in forward" in proc.stderr  # where it hung
    assert status(tmp_path / "run")["state"] == "running"  # neither "done" nor "stopped": not resumable as such


@pytest.mark.parametrize("model, phase", [
    ("never_freed", "the end of the run (freeing the trainer)"),
    ("leaves_a_thread", "the process's exit (joining its threads, its exit handlers)"),
])
def test_what_a_rank_does_after_its_run_ended_is_bounded_too(tmp_path, model, phase):
    """After `done` the ranks have left the group; what each still does (its objects freed, its threads joined, its
    exit handlers) stays under the watchdog: named, its stacks printed, exit 1, within --timeout-s's limit."""
    started = time.monotonic()
    proc = run(python_cmd(*DEBUG, "--max-steps", 4, "--eval-every", 0, "--model", f"tests.models:{model}",
                          "--timeout-s", 2, "--spawn", 2, "--run-dir", tmp_path / "run"), expect=1, timeout=120)
    assert time.monotonic() - started < 60
    assert status(tmp_path / "run")["state"] == "done"
    assert f"no progress for 4 s during {phase}" in proc.stderr, proc.stderr[-3000:]
    assert "Thread 0x" in proc.stderr or "Current thread" in proc.stderr  # the stacks


# ---------------------------------------------------------------- resuming with something changed

def test_resume_with_another_model_is_refused_and_nothing_changes(stopped_at_60, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(stopped_at_60, run_dir)
    before = {p: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()}
    proc = run(python_cmd(*FAULT, "--width", 32, "--run-dir", run_dir), expect=2)
    assert proc.stderr.strip().splitlines() == [
        f"error: {run_dir} is a run of other settings, which its checkpoint fixes (--width 16 -> 32): resume it with "
        f"the settings it was started with, or start a new run from its weights with a new --run-dir --weights "
        f"{run_dir}/checkpoints/step_00000060.pt"]
    assert {p: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()} == before
    assert torch.load(ckpt.newest_valid(run_dir), weights_only=True)["step"] == 60
