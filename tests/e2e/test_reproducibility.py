"""Same seed, same result: across a stop and resume, at any world size, and across sharding (across launchers:
test_launchers.py)."""

import json
import shutil
import time

import pytest
import torch

from tests.helpers import (DEBUG, PY, assert_bit_identical, assert_same_final_figures, load_model, metrics, python_cmd,
                           run, status)

# A norm-free user model in float64, a loss logged every step: the runs that must equal one worker's larger batch.
GROUPNORM = [*DEBUG, "--model", "tests.models:tiny_groupnorm_cnn_in_double", "--log-every", 1, "--max-steps", 30]


@pytest.fixture
def reference_2ranks(reference_run):
    """The debug preset, 2 workers via --spawn, uninterrupted: the run other runs must equal."""
    return reference_run(*DEBUG)


def test_spawned_workers_are_forked_from_one_server_that_imported_torch(tmp_path):
    """--spawn N: torch (and torch._dynamo, which torch's optimizer loads) is imported once, by the fork server its
    checks and workers come from, whatever N; never by the launcher, never by a worker, never by a worker's
    DataLoader workers, forked from it as under torchrun (train/cluster/forkserver.py, train/cluster/spawn.py)."""
    from PIL import Image

    for split in ("train", "val"):
        for c in ("a", "b"):
            (tmp_path / "data" / split / c).mkdir(parents=True)
            for i in range(12):
                colour = (20 * i, 200 if c == "a" else 0, 90)
                Image.new("RGB", (20, 20), colour).save(tmp_path / "data" / split / c / f"{i}.png")
    images = ["--dataset", "imagefolder", "--data-dir", tmp_path / "data", "--image-size", 16, "--num-workers", 1]
    proc = run([PY, "-X", "importtime", *python_cmd(*DEBUG, *images, "--batch-size", 4, "--max-steps", 2, "--spawn", 3,
                                                    "--run-dir", tmp_path / "run")[1:]])
    imported = [line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert imported.count("torch") == 1 and imported.count("torch._dynamo") == 1, proc.stderr[-3000:]
    assert status(tmp_path / "run")["state"] == "done"


def test_what_the_fork_server_imports_makes_no_cuda_call():
    """CUDA initialised in the fork server would be unusable in every worker forked from it (torch: "Cannot
    re-initialize CUDA in forked subprocess"): importing its modules (python -m train's and make evaluate's) must
    not call into CUDA, not even to count the GPUs. Every torch.cuda function goes through a torch._C._cuda_* one: each
    is wrapped here."""
    probe = """if True:
        import sys, torch
        from train import evaluate
        from train.__main__ import PRELOAD
        from train.cluster.forkserver import TORCH
        PRELOAD = [*TORCH, *PRELOAD, *evaluate.PRELOAD]  # make train's --spawn, and make evaluate's
        calls = []
        for name in [n for n in dir(torch._C) if n.startswith("_cuda_") and callable(getattr(torch._C, n))]:
            def wrapped(*args, _f=getattr(torch._C, name), _name=name, **kwargs):
                calls.append(_name)
                return _f(*args, **kwargs)
            setattr(torch._C, name, wrapped)
        for module in PRELOAD:
            __import__(module)
        assert len(calls) == 0 and all(m in sys.modules for m in PRELOAD), calls
        if torch.backends.cuda.is_built():  # the control: a call is seen
            torch.cuda.is_available()
            assert calls, "no torch._C._cuda_* call was seen"
        print("no CUDA call")
    """
    assert run([PY, "-c", probe]).stdout == "no CUDA call\n"


def test_stop_and_resume_equals_one_uninterrupted_run(reference_2ranks, tmp_path):
    """Stopped mid-epoch 0 (step 13), resumed and stopped again mid-epoch 1 (step 21, after step 20's evaluation),
    then resumed to the end: each stop leaves a stopped run and no model.pt, each resume starts from the stop's
    checkpoint, and the run equals the uninterrupted one bit for bit."""
    # The debug preset has 16 steps per epoch with 2 workers: both stops fall inside an epoch.
    run_dir = tmp_path / "resumed"
    for stop_at, resumed_from in ((13, None), (21, 13)):
        proc = run(python_cmd(*DEBUG, "--spawn", 2, "--run-dir", run_dir, "--stop-at", stop_at), expect=75)
        if resumed_from:
            assert f"resumed from {run_dir}/checkpoints/step_{resumed_from:08d}.pt" in proc.stderr
        stopped = status(run_dir)
        best = stopped.pop("best", None)  # the evaluation of step 20, if the run got there
        assert stopped.pop("updated").startswith(time.strftime("%Y-%m-%dT"))  # when it was written
        assert stopped == {"state": "stopped", "step": stop_at, "max_steps": 40, "exit_code": 75}
        assert (best and best["step"]) == (20 if stop_at > 20 else None)
        assert not (run_dir / "model.pt").exists()
    resumed = run(python_cmd(*DEBUG, "--spawn", 2, "--run-dir", run_dir))
    assert f"resumed from {run_dir}/checkpoints/step_00000021.pt" in resumed.stderr
    assert status(run_dir)["state"] == "done"
    assert_bit_identical(run_dir, reference_2ranks)


def test_an_evaluation_right_after_a_resume_equals_the_uninterrupted_one(reference_2ranks, tmp_path):
    """Stopped (or killed) just before an evaluation, the resumed run evaluates before any training step:
    every rank must use the statistics the checkpoint holds, as the uninterrupted run does. Stopped before step
    20's evaluation, resumed and stopped again before the final one (step 40), then resumed: both evaluations
    right after a resume equal the uninterrupted run's."""
    run_dir = tmp_path / "resumed"
    for stop_at in (20, 40):
        run(python_cmd(*DEBUG, "--spawn", 2, "--run-dir", run_dir, "--stop-at", stop_at), expect=75)
    run(python_cmd(*DEBUG, "--spawn", 2, "--run-dir", run_dir))
    assert_bit_identical(run_dir, reference_2ranks)
    assert_same_final_figures(run_dir, reference_2ranks)
    evals = [(m["step"], m["loss"], m["accuracy"]) for m in metrics(run_dir, "eval")]
    assert evals == [(m["step"], m["loss"], m["accuracy"]) for m in metrics(reference_2ranks, "eval")]


@pytest.mark.parametrize("workers, flags, stops", [
    # Two stops: a resumed attempt stopped and resumed again. 8: an epoch boundary (512 images / (4 x 16)).
    (3, [], [7, 25]), (4, [], [8, 13]),
    (8, [], [19]),  # the last quarter of epoch 4 (4 steps per epoch: 512 / (8 x 16))
    # Accumulation and a static graph together (a layout that settles a pass later, and no_sync between syncs).
    (3, ["--grad-accum", "2", "--static-graph"], [5, 11]), (3, ["--compile"], [13]), (3, ["--deterministic"], [25]),
], ids=["3-workers", "4-workers", "8-workers", "3-grad-accum-static-graph", "3-compile", "3-deterministic"])
def test_a_stopped_and_resumed_run_is_bit_identical_at_any_world_size(reference_run, tmp_path, workers, flags, stops):
    """DDP lays its gradient buckets out anew after its first backward, and with more than 2 ranks the
    all-reduce's sums depend on the layout: every attempt settles it first (exact.settle_buckets)."""
    straight = reference_run(*DEBUG, *flags, workers=workers)
    resumed = tmp_path / "resumed"
    for stop in stops:
        run(python_cmd(*DEBUG, *flags, "--spawn", workers, "--run-dir", resumed, "--stop-at", stop), expect=75)
    run(python_cmd(*DEBUG, *flags, "--spawn", workers, "--run-dir", resumed))
    assert_bit_identical(straight, resumed)
    assert_same_final_figures(straight, resumed)


def _same_to_rounding(run_dir, reference, step: int) -> None:
    """Every tensor of step `step`'s checkpoint, BatchNorm's running statistics too, within float64's rounding of the
    reference's (1e-9 on any CPU: two samples swapped moved them by 3e-3 and more), its counts equal; the final
    evaluation's figures equal (the counts) or to rounding (the loss, summed in float32 in another order)."""
    weights, reference_weights = (
        dict(torch.load(d / "checkpoints" / f"step_{step:08d}.pt", weights_only=True)["model"])
        for d in (run_dir, reference))
    statistics = [name for name in reference_weights if "running_" in name]
    assert statistics and all(reference_weights[name].dtype == torch.float64 for name in reference_weights
                              if reference_weights[name].is_floating_point())
    for name, value in reference_weights.items():
        if value.is_floating_point():
            assert (weights[name] - value).abs().max() <= 1e-9, name
        else:  # num_batches_tracked: once a step, by slot 0's micro-batch
            assert torch.equal(weights[name], value), name
    final, reference_final = (metrics(d, "eval")[-1] for d in (run_dir, reference))
    for key, value in reference_final.items():
        if key == "loss" or key.endswith("_loss"):
            assert final[key] == pytest.approx(value, rel=1e-6), key
        elif key != "time":
            assert final[key] == value, key


def test_a_run_resumed_on_half_its_workers_trains_the_same_steps(reference_run, tmp_path):
    """4 workers stopped mid-epoch, resumed on 2: accumulation 2 keeps the global batch, and every step trains the
    laid-out run's micro-batches (the same samples, the same seeds) at the same learning rate. Only the sums' order
    differs: in float64 (tests.models.small_cnn_in_double) that leaves the weights within rounding (1.4e-16 measured,
    bound 1e-9 on any CPU), where two samples swapped between steps after the resume moved every tensor by 3e-3 or
    more. BatchNorm's running statistics follow laid-out slot 0's micro-batch of each step, whichever worker trains
    it: resumed on 2 workers and on 1 they equal the uninterrupted run's to rounding, and so does the final evaluation
    (before that rule: running means 0.25 apart, top-1 14.45 % against 14.06 %). 3 workers cannot share 4
    micro-batches and are refused at once. And 4 workers sharding the network (--parallel fsdp) train what DDP's
    4 train, to rounding."""
    double = [*DEBUG, "--model", "tests.models:small_cnn_in_double"]
    straight = reference_run(*double, workers=4)
    resumed = tmp_path / "resumed"
    run(python_cmd(*double, "--spawn", 4, "--run-dir", resumed, "--stop-at", 13), expect=75)
    shutil.copytree(resumed, tmp_path / "alone")
    refused = run(python_cmd(*double, "--spawn", 3, "--run-dir", resumed), expect=2)
    assert refused.stderr.count("\n") == 1 and "which 3 workers cannot share evenly: resume on 1, 2, 4 workers" in \
        refused.stderr, refused.stderr
    two = run(python_cmd(*double, "--spawn", 2, "--run-dir", resumed))
    assert "on 2 workers: accumulation 2 keeps the global batch of 64" in two.stderr
    plan, reference_plan = (json.loads((d / "plan.json").read_text()) for d in (resumed, straight))
    assert plan["lr"] == reference_plan["lr"] and plan["layout"] == reference_plan["layout"]
    assert plan["resumes"] == [{"step": 13, "changed": {"grad_accum": [1, 2], "spawn": [4, 2], "world_size": [4, 2]}}]
    assert plan["running_statistics"] == reference_plan["running_statistics"] and \
        plan["running_statistics"].startswith("each step's micro-batch of laid-out slot 0")
    logged, reference_logged = ({m["step"]: m for m in metrics(d, "train")} for d in (resumed, straight))
    after = [step for step in logged if step > 20]  # windows wholly after the resume (a log line every 10 steps)
    assert after == [30, 40]
    for step in [10, *after]:
        assert logged[step]["lr"] == reference_logged[step]["lr"]
        assert logged[step]["loss"] == pytest.approx(reference_logged[step]["loss"], rel=1e-6)  # logged as float32
    _same_to_rounding(resumed, straight, 40)
    run(python_cmd(*double, "--run-dir", tmp_path / "alone"))  # one worker: accumulation 4
    _same_to_rounding(tmp_path / "alone", straight, 40)
    # The same 4 workers sharding the network stage by stage (--parallel fsdp: its features' three stages, each with
    # BatchNorm, then the root): the same weights, statistics and evaluation as DDP's, to rounding.
    run(python_cmd(*double, "--spawn", 4, "--parallel", "fsdp", "--run-dir", tmp_path / "sharded"))
    planned = json.loads((tmp_path / "sharded" / "plan.json").read_text())["parallel"]
    assert (planned["kind"], planned["blocks"]) == ("fsdp", [f"net.features.{i}" for i in range(3)])
    _same_to_rounding(tmp_path / "sharded", straight, 40)


def test_a_segmentation_run_resumed_on_twice_its_workers_keeps_its_running_statistics(reference_run, tmp_path):
    """The other way and the other task: a segmentation network with BatchNorm in float64, --grad-accum 2 asked for at
    2 workers, stopped and resumed on 4 (accumulation 1): weights, running statistics and the final evaluation equal
    the uninterrupted run's to rounding."""
    flags = ["--task", "segmentation", "--model", "tests.models:tiny_segmenter_with_batchnorm_in_double",
             "--image-size", 16, "--batch-size", 4, "--grad-accum", 2, "--max-steps", 12, "--eval-every", 12,
             "--save-every", 4, "--train-samples", 256, "--val-samples", 40, "--lr", 0.05]
    straight = reference_run(*flags, workers=2)
    resumed = tmp_path / "resumed"
    run(python_cmd(*flags, "--spawn", 2, "--run-dir", resumed, "--stop-at", 5), expect=75)
    run(python_cmd(*[f for f in flags if f not in ("--grad-accum", 2)], "--spawn", 4, "--run-dir", resumed))
    assert json.loads((resumed / "plan.json").read_text())["resumes"][0]["changed"]["world_size"] == [2, 4]
    _same_to_rounding(resumed, straight, 12)


def test_deterministic_reduction_does_not_depend_on_the_bucket_size(tmp_path):
    """--deterministic sums every gradient in rank order: the bucket size changes nothing. The control,
    without it: DDP's all-reduce of 3 ranks over 5 buckets of 1 MB or one of 25 MB gives other bits."""
    def model(*flags, cap):
        run_dir = tmp_path / f"{len(flags)}-{cap}"
        run(python_cmd(*DEBUG, "--width", 64, "--max-steps", 6, "--spawn", 3, "--bucket-cap-mb", cap, *flags,
                       "--run-dir", run_dir))
        return load_model(run_dir)

    def equal(a, b):
        return all(torch.equal(a[k], b[k]) for k in a)

    assert equal(model("--deterministic", cap=1), model("--deterministic", cap=25))
    assert not equal(model(cap=1), model(cap=25))


def test_two_workers_match_one_worker_with_twice_the_batch(reference_run, tmp_path):
    # BatchNorm statistics depend on the per-worker batch, so this uses a norm-free user model (which also exercises
    # --model package.module:factory), in float64: the two runs sum in another order, which float64's rounding keeps
    # far below the tolerance on any CPU; each step's loss is logged as float32 (1e-6: a few of its ulps at 2.3).
    two = tmp_path / "two"
    run(python_cmd(*GROUPNORM, "--spawn", 2, "--batch-size", 16, "--run-dir", two))
    a, b = metrics(two, "train"), metrics(reference_run(*GROUPNORM, "--batch-size", 32, workers=1), "train")
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, 31))
    for x, y in zip(a, b, strict=True):
        assert abs(x["loss"] - y["loss"]) < 1e-6, (x["step"], x["loss"], y["loss"])
    assert a[-1]["loss"] < a[0]["loss"] - 0.1  # and it did learn


def test_gradient_accumulation_matches_the_large_batch(reference_run, tmp_path):
    # 2 workers x 2 micro-batches of 8 (the first under DDP's no_sync) == 1 worker x 32 (the run the test above
    # compares with), in float64 as above.
    accum = tmp_path / "accum"
    run(python_cmd(*GROUPNORM, "--spawn", 2, "--batch-size", 8, "--grad-accum", 2, "--run-dir", accum))
    a, b = metrics(accum, "train"), metrics(reference_run(*GROUPNORM, "--batch-size", 32, workers=1), "train")
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, 31))
    for x, y in zip(a, b, strict=True):
        assert abs(x["loss"] - y["loss"]) < 1e-6, (x["step"], x["loss"], y["loss"])
