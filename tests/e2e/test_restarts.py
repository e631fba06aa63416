"""Restarts under a plain `torchrun --max-restarts`, as the tutorials launch it: no start-up waits
without bound, and the chaos drill (python -m tests.chaos) ends every trial bit-identical. (Each
attempt's keys in the rendezvous store under a name of its own: tests/unit/test_session.py; a finished
run stays finished: tests/e2e/test_run_outputs.py.)"""

from __future__ import annotations

import json
import socket
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
def test_a_start_up_that_cannot_reach_its_peers_ends_within_its_bound_naming_the_phase(tmp_path, rank):
    """Rank 1 of 2 whose rendezvous host never comes up; rank 0 of 2 whose peer never arrives."""
    port = _closed_port()
    env = env_for_tests(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    started = time.monotonic()
    proc = run(python_cmd(*DEBUG, "--timeout-s", 3, "--run-dir", tmp_path / "run"), env=env, expect=1, timeout=120)
    took = time.monotonic() - started
    assert took < 3 + 3 + 20, f"gave up after {took:.0f} s with --timeout-s 3"  # the limit, its margin, start-up
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"[rank {rank}]" in errors[0] and f"process-group set-up (rendezvous at 127.0.0.1:{port})" in errors[0]
    assert 'File "' in proc.stderr  # the stack at the failure


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
