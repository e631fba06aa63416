"""Restarts under a plain `torchrun --max-restarts`, as the tutorials launch it: no start-up waits
without bound, and the chaos drill (python -m tests.chaos) ends every trial bit-identical. (Each
attempt's keys in the rendezvous store under a name of its own: tests/unit/test_session.py; a finished
run stays finished: tests/e2e/test_run_outputs.py.)"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import (DEBUG, PY, assert_bit_identical, assert_same_final_figures, env_for_tests, metrics,
                           python_cmd, run)


# ---------------------------------------------------------------- bounded start-up

def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_from_the_environment_says_so_before_it_waits_and_names_its_variables_when_no_peer_comes(tmp_path,
                                                                                                      rank):
    """RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT left in a shell by another job, and a plain `python -m train`
    (no torchrun, srun or --spawn): rank 0 of 2 whose peer never comes, rank 1 of 2 whose rank 0 is not there.
    It trains as one of several (Kubeflow's PyTorchJob starts its ranks so), but says so in one line before it
    waits, and ends within its bound on a line that names the variables, not a dead worker."""
    port = _closed_port()
    variables = f"RANK={rank} WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={port}"
    env = env_for_tests(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    started = time.monotonic()
    proc = subprocess.Popen(python_cmd(*DEBUG, "--timeout-s", 2, "--run-dir", tmp_path / "run"), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        said = next((line for line in proc.stderr if line.startswith("trainbox: ")), "")
        waiting = proc.poll() is None  # the line came before the wait ended
        said_at = time.monotonic()
        rest = proc.stderr.read()
        proc.wait(60)
    finally:
        proc.kill()
    ended_at = time.monotonic()
    assert said.rstrip() == (
        f"trainbox: rank {rank} of 2 from the environment ({variables}; set by neither torchrun nor --spawn): waiting "
        f"up to 2 s (--timeout-s) {'for rank 1' if rank == 0 else 'to reach rank 0'} at 127.0.0.1:{port}; "
        f"to train alone, unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT"), said + rest
    assert waiting and ended_at - said_at >= 1.5, "the line came after the wait, not before it"
    assert proc.returncode == 1, rest[-3000:]
    assert ended_at - started < 2 + 2 + 20, f"gave up after {ended_at - started:.0f} s with --timeout-s 2"
    errors = [line for line in rest.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, rest[-3000:]
    # torch's own timeout ends it, or (a client's connect overruns it) the watchdog a little later: either line says
    # why it waited
    missing = "rank 1 did not join at" if rank == 0 else "rank 0 could not be reached at"
    assert errors[0].startswith((f"error: [rank {rank}] {missing} 127.0.0.1:{port} within 2 s (",
                                 f"error: [rank {rank}] no progress for 4 s during process-group set-up (rendezvous "
                                 f"at 127.0.0.1:{port}): ")), errors[0]
    assert (f"this process is rank {rank} of 2 because {variables} are set in its environment (by neither torchrun "
            f"nor --spawn); if they are left over from another job, unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT and "
            f"run the same command to train alone, else start the other ranks with the same MASTER_ADDR and "
            f"MASTER_PORT") in errors[0]
    assert "died" not in rest and "lost contact" not in rest, rest[-3000:]


# ---------------------------------------------------------------- the drill, short

def test_the_chaos_drill_under_plain_torchrun_ends_every_trial_bit_identical(tmp_path, reference_run):
    """Four kills of a random one of 4 workers on the default path (no --deterministic), with a published
    recipe's knobs on (EMA, Mixup/CutMix, random erasing, label smoothing: --recipe), under `torchrun
    --standalone --max-restarts=3`, without TORCH_DISABLE_SHARE_RDZV_TCP_STORE: mid-run, in a save, in an
    evaluation, at shutdown. Every
    kill must land at the moment it aimed at, and every trial's end is compared here with a reference run
    of this test's own (not with the drill's verdict, which is the code under test)."""
    from tests import chaos

    env = env_for_tests()
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    out = tmp_path / "chaos"
    reference = reference_run(*chaos.ARGS, *chaos.RECIPE, workers=4)  # the drill's verdict too compares with it
    proc = run([PY, "-m", "tests.chaos", "--trials", "4", "--launchers", "torchrun", "--faults", "kill",
                "--workers", "4", "--recipe", "--seed", "3", "--out", str(out), "--reference", str(reference)],
               env=env, expect=None, timeout=900)
    assert proc.returncode == 0 and "torchrun: ok=4/4" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-3000:]
    trials = json.loads((out / "results.json").read_text())
    assert [t["moment"].split(" (")[0] for t in trials] == [
        trials[0]["moment"].split(" (")[0], "during a checkpoint save", "during an evaluation", "during shutdown"]
    assert trials[0]["moment"].startswith("mid-run after step")
    # Mid-run and at shutdown the kill always lands at its moment; a save or an evaluation of this small model
    # can end between the drill's look and its kill (a kill surely inside each: tests/e2e/test_faults.py).
    assert all(trials[i]["landed"] for i in (0, 3)), [(t["moment"], t["landed"]) for t in trials]
    logs = ["".join(open(p).read() for p in t["logs"]) for t in trials]
    # What each kill left behind, seen by the restarted workers: a kill in a save left its half-written file
    # (removed at the restart); after a kill mid-run they resumed from a checkpoint; after the kill at
    # shutdown they found the run done.
    # (rank 0 writes the checkpoints: a kill of rank 1 lets it finish the file before torchrun stops it)
    if trials[1]["landed"] and trials[1]["target"] == "kill -9 rank 0":
        assert "of unfinished checkpoint files" in logs[1], logs[1][-3000:]
    assert all("resumed from" in logs[i] for i in (0, 1, 2)), [log[-2000:] for log in logs]
    assert "already finished at step 24" in logs[3], logs[3][-3000:]
    assert {t["workers"] for t in trials} == {4}
    for i, trial in enumerate(trials):
        (run_dir,) = Path(trial["folder"]).glob("runs/*")  # plain torchrun named the run directory itself
        # one restart: its attempt trained on; after the kill at shutdown it found the run done and ended
        log = (run_dir / "train.log").read_text()  # the attempts' "run runs/NAME: 4 worker(s) ..." lines
        assert log.count(f" run runs/{run_dir.name}: ") == (1 if i == 3 else 2), (i, log[-3000:])
        assert_bit_identical(run_dir, reference)
        assert_same_final_figures(run_dir, reference)
        assert (run_dir / "model_ema.pt").read_bytes() == (reference / "model_ema.pt").read_bytes()
        logged = [m["step"] for m in metrics(run_dir, "train")]
        assert logged == list(range(1, chaos.MAX_STEPS + 1)), logged  # each step logged once
