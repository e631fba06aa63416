"""Same seed, same result: across launchers, across a stop and resume, and across sharding."""

import json
import subprocess

import pytest
import torch

from tests.helpers import (DEBUG, assert_bit_identical, assert_same_final_figures, env_for_tests, load_model,
                           metrics, python_cmd, run, status, torchrun_cmd)


@pytest.fixture
def reference_2ranks(reference_run):
    """The debug preset, 2 workers via --spawn, uninterrupted: the run other runs must equal."""
    return reference_run(*DEBUG)


def test_torchrun_and_spawn_give_bit_identical_models(reference_2ranks, tmp_path):
    run_dir = tmp_path / "torchrun"
    run(torchrun_cmd(2, *DEBUG, "--run-dir", run_dir))
    launchers = [json.loads((d / "manifest.json").read_text())["launcher"] for d in (run_dir, reference_2ranks)]
    assert launchers == ["torchrun", "spawn"]
    assert_bit_identical(run_dir, reference_2ranks)


@pytest.mark.parametrize("stop_at", [13, 21], ids=["mid-epoch-0", "mid-epoch-1"])
def test_stop_and_resume_equals_one_uninterrupted_run(reference_2ranks, tmp_path, stop_at):
    # The debug preset has 16 steps per epoch with 2 workers: both stops fall inside an epoch.
    run_dir = tmp_path / "resumed"
    run(python_cmd(*DEBUG, "--spawn", 2, "--run-dir", run_dir, "--stop-at", stop_at), expect=75)
    stopped = status(run_dir)
    best = stopped.pop("best", None)  # the evaluation of step 20, if the run got there
    assert stopped == {"state": "stopped", "step": stop_at, "max_steps": 40, "exit_code": 75}
    assert (best and best["step"]) == (20 if stop_at > 20 else None)
    assert not (run_dir / "model.pt").exists()
    resumed = run(python_cmd(*DEBUG, "--spawn", 2, "--run-dir", run_dir))
    assert f"resumed from {run_dir}/checkpoints/step_{stop_at:08d}.pt" in resumed.stderr
    assert status(run_dir)["state"] == "done"
    assert_bit_identical(run_dir, reference_2ranks)


@pytest.mark.parametrize("stop_at", [20, 40], ids=["before-an-evaluation", "before-the-final-evaluation"])
def test_an_evaluation_right_after_a_resume_equals_the_uninterrupted_one(reference_2ranks, tmp_path, stop_at):
    """Stopped (or killed) just before an evaluation, the resumed run evaluates before any training step:
    every rank must use the statistics the checkpoint holds, as the uninterrupted run does."""
    run_dir = tmp_path / "resumed"
    run(python_cmd(*DEBUG, "--spawn", 2, "--run-dir", run_dir, "--stop-at", stop_at), expect=75)
    run(python_cmd(*DEBUG, "--spawn", 2, "--run-dir", run_dir))
    assert_bit_identical(run_dir, reference_2ranks)
    assert_same_final_figures(run_dir, reference_2ranks)
    evals = [(m["step"], m["loss"], m["accuracy"]) for m in metrics(run_dir, "eval")]
    assert evals == [(m["step"], m["loss"], m["accuracy"]) for m in metrics(reference_2ranks, "eval")]


def test_deterministic_mode_resumes_bit_identically_with_three_workers(tmp_path):
    # With 3+ ranks DDP's rebuilt buckets change the summation order after a restart; the
    # deterministic mode's ordered reduction must make two restarts invisible.
    def straight_and_resumed(*flags):
        straight, resumed = tmp_path / f"straight{len(flags)}", tmp_path / f"resumed{len(flags)}"
        run(python_cmd(*DEBUG, "--spawn", 3, *flags, "--run-dir", straight))
        run(python_cmd(*DEBUG, "--spawn", 3, *flags, "--run-dir", resumed, "--stop-at", 7), expect=75)
        run(python_cmd(*DEBUG, "--spawn", 3, *flags, "--run-dir", resumed, "--stop-at", 25), expect=75)
        run(python_cmd(*DEBUG, "--spawn", 3, *flags, "--run-dir", resumed))
        return load_model(straight), load_model(resumed)

    straight, resumed = straight_and_resumed("--deterministic")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    # The control, without --deterministic: the same stops change the bits (so the equality above is the
    # flag's doing, and this test could see it fail)
    straight, resumed = straight_and_resumed()
    assert not all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_two_workers_match_one_worker_with_twice_the_batch(tmp_path):
    # BatchNorm statistics depend on the per-worker batch, so this uses a norm-free user model
    # (which also exercises --model package.module:factory). Tolerance: 1e-4 absolute on the loss.
    common = [*DEBUG, "--model", "tests.models:tiny_groupnorm_cnn", "--log-every", 1, "--max-steps", 30]
    two, one = tmp_path / "two", tmp_path / "one"
    run(python_cmd(*common, "--spawn", 2, "--batch-size", 16, "--run-dir", two))
    run(python_cmd(*common, "--batch-size", 32, "--run-dir", one))
    a, b = metrics(two, "train"), metrics(one, "train")
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, 31))
    for x, y in zip(a, b, strict=True):
        assert abs(x["loss"] - y["loss"]) < 1e-4, (x["step"], x["loss"], y["loss"])
    assert a[-1]["loss"] < a[0]["loss"] - 0.1  # and it did learn


def test_gradient_accumulation_matches_the_large_batch(tmp_path):
    # 2 workers x 2 micro-batches of 8 (the first under DDP's no_sync) == 1 worker x 32.
    common = [*DEBUG, "--model", "tests.models:tiny_groupnorm_cnn", "--log-every", 1, "--max-steps", 20]
    accum, one = tmp_path / "accum", tmp_path / "one"
    run(python_cmd(*common, "--spawn", 2, "--batch-size", 8, "--grad-accum", 2, "--run-dir", accum))
    run(python_cmd(*common, "--batch-size", 32, "--run-dir", one))
    a, b = metrics(accum, "train"), metrics(one, "train")
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, 21))
    for x, y in zip(a, b, strict=True):
        assert abs(x["loss"] - y["loss"]) < 1e-4, (x["step"], x["loss"], y["loss"])


def test_srun_style_tasks_match_the_other_launchers(reference_2ranks, tmp_path):
    # Two plain `python -m train` processes with the variables srun gives each task of a 2-task step
    # (no torchrun): they must find each other through the first node of the step and agree bit for bit.
    from train.distributed import free_port

    port = free_port()
    run_dir = tmp_path / "srun"
    procs = []
    for rank in range(2):
        env = env_for_tests(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS="2",
                            SLURM_STEP_ID="0", SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="localhost",
                            SLURM_STEP_TASKS_PER_NODE="2", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(python_cmd(*DEBUG, "--run-dir", run_dir), env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert (manifest["launcher"], manifest["world_size"], manifest["slurm_job_id"]) == ("slurm", 2, "4242")
    assert_bit_identical(run_dir, reference_2ranks)
