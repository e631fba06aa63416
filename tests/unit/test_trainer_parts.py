"""The Trainer's parts: the logging window, status records, a finished run, the end of a
clean run (no DDP wrapper left when the ranks leave the group), the pass that settles DDP's buckets, what its
evaluation reports."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.sources import draw_imagefolder
from train.cli import parse_config
from train.cluster.distributed import teardown, wrap, wrappers_alive
from train.files.checkpoint_io import finished
from train.files.rundir import read_metrics, status_record
from train.report.metrics import LogWindow
from train.run.build import build
from train.run.exact import settle_buckets
from train.run.trainer import Trainer

CPU = torch.device("cpu")


def test_the_logging_window_averages_over_its_steps_and_starts_anew(monkeypatch):
    now = [100.0]  # the clock the window reads, moved by hand
    monkeypatch.setattr("train.report.metrics.time.perf_counter", lambda: now[0])
    window = LogWindow(torch.device("cpu"), samples_per_step=32)
    window.add([torch.tensor(32.0), torch.tensor(16.0)], [32, 32])  # two micro-batches of 32: loss sums and counts
    window.add([torch.tensor(8.0), torch.tensor(8.0)], [32, 32])
    window.wait += 0.1
    now[0] = 100.5
    values = window.report(world=1)
    assert values["loss"] == 0.5  # the mean over every item: (32 + 16 + 8 + 8) / 128
    assert values["step_time_s"] == pytest.approx(0.25)  # 0.5 s over 2 steps
    assert values["samples_per_s"] == pytest.approx(128)  # 2 steps x 32 samples in 0.5 s
    assert values["data_wait_frac"] == pytest.approx(0.2)  # 0.1 s of the 0.5 s
    assert (window.steps, window.wait, window.loss.tolist()) == (0, 0.0, [0.0, 0.0, 0.0])
    assert values["empty_batches"] == 0
    window.add([torch.tensor(64.0)], [32])
    now[0] = 101.25
    again = window.report(world=1)  # a new window, opened at the report: 0.75 s for its one step
    assert (again["loss"], again["step_time_s"], again["samples_per_s"]) == pytest.approx((2.0, 0.75, 32 / 0.75))
    # Micro-batches that counted nothing (a crop of ignored pixels alone) add nothing, and are counted; a window of
    # nothing but them has no loss, never a division by zero.
    window.add([torch.tensor(0.0), torch.tensor(6.0)], [torch.tensor(0), torch.tensor(3)])
    now[0] = 102.0
    assert window.report(world=1)["loss"] == 2.0 and window.loss.tolist() == [0.0, 0.0, 0.0]
    window.add([torch.tensor(0.0)], [torch.tensor(0)])
    now[0] = 103.0
    empty = window.report(world=1)
    assert empty["loss"] is None and empty["empty_batches"] == 1


def test_a_status_record_says_which_attempt_of_a_slurm_job_wrote_it():
    assert status_record("running", 3, {}, max_steps=10) == {"state": "running", "step": 3, "max_steps": 10}
    stopped = status_record("stopped", 30, {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "2"}, exit_code=75)
    assert stopped == {"state": "stopped", "step": 30, "exit_code": 75, "slurm_job_id": "42", "slurm_restart_count": 2}
    with pytest.raises(ValueError, match="not one of"):
        status_record("paused", 1, {})


@pytest.mark.parametrize("status, max_steps, model, done", [
    ({"state": "done", "step": 40}, 40, True, True),
    ({"state": "done", "step": 40}, 50, True, False),  # more steps asked for: train on
    ({"state": "done", "step": 40}, 40, False, False),  # model.pt missing: evaluate and write it again
    ({"state": "stopped", "step": 40}, 40, True, False),
    ({"state": "running", "step": 40}, 40, True, False),  # lost between model.pt and the status
    ({}, 40, False, False),
])
def test_a_run_counts_as_finished_only_when_done_at_max_steps_with_its_model(status, max_steps, model, done):
    assert finished(status, max_steps, model) is done


@pytest.fixture
def rank_1_of_2(monkeypatch):
    """This process as rank 1 of 2, its session store a client of a real TCPStore that this test hosts as rank 0."""
    import datetime

    import torch.distributed as dist

    from train.cluster import distributed
    from train.cluster import identity
    from train.run import worker

    monkeypatch.setattr(identity, "_identity", identity.Identity(1, 0, 2, 1, "torchrun", "127.0.0.1", 0))
    monkeypatch.setattr(worker, "is_main", lambda: False)
    host = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", host.port, 2, False, timeout=datetime.timedelta(seconds=5))
    monkeypatch.setattr(distributed, "_session_store", dist.PrefixStore("trainbox/0/", client))
    return {"host": host}


def _end(tmp_path, message="out of memory during start-up"):
    from train.base.errors import OutOfMemory
    from train.run.worker import end_unrecoverable

    error = OutOfMemory(message)
    end_unrecoverable(error, tmp_path, None)
    return error.first


def test_the_first_rank_to_meet_an_unrecoverable_error_says_it_and_the_others_do_not(rank_1_of_2, tmp_path):
    assert _end(tmp_path) is True
    assert _end(tmp_path) is False  # a second rank meeting it (the same store): already said


def test_when_rank_0_ended_first_on_its_recorded_error_its_peers_say_nothing(rank_1_of_2, tmp_path):
    """Rank 0 hosts the store (torchrun with a fresh store per attempt, srun): where it said its line, wrote
    status.json and exited before a peer on another node met the same error, the peer stays silent."""
    from train.files.rundir import write_status

    write_status(tmp_path, "failed", -1, error="out of memory during start-up", exit_code=2)
    del rank_1_of_2["host"]  # rank 0 exited: its store is gone
    assert _end(tmp_path) is False


def test_when_rank_0_is_gone_without_recording_an_error_this_run_the_peer_says_its_own(rank_1_of_2, tmp_path):
    import os

    from train.files.rundir import write_status

    write_status(tmp_path, "failed", -1, error="an earlier run's error", exit_code=2)
    os.utime(tmp_path / "status.json", (0, 0))  # written before this process started
    del rank_1_of_2["host"]
    assert _end(tmp_path) is True
    (tmp_path / "status.json").unlink()
    assert _end(tmp_path) is True


def test_a_clean_end_refuses_to_leave_the_group_while_a_ddp_wrapper_lives():
    """A finished run frees its DDP wrapper (Trainer.release) before the ranks leave together: a real
    one-rank gloo group, in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 2)
        ddp = wrap(model, torch.device("cpu"))
        ddp(torch.randn(3, 4)).sum().backward()
        assert wrappers_alive() == 1
        with pytest.raises(RuntimeError, match="1 DistributedDataParallel wrapper.* still alive .*Trainer.release"):
            teardown(clean=True, timeout_s=30)
        assert dist.is_initialized()  # it did not leave
        del ddp  # what Trainer.release does: the wrapper goes, the model stays
        assert wrappers_alive() == 0
        teardown(clean=True, timeout_s=30)
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_evaluation_reports_the_training_criterion_and_says_which_it_is(tmp_path):
    """As torchvision's reference evaluates with its training criterion: the validation loss is the label-smoothed
    cross-entropy the run trains with, over every validation sample, and its records name it. A confident model
    (its head biased to one class) makes the smoothed loss far from the plain one."""
    cfg = parse_config(["--preset", "debug", "--label-smoothing", "0.1", "--train-samples", "64", "--val-samples", "64",
                        "--run-dir", str(tmp_path)])
    parts = build(cfg, tmp_path, CPU, "fp32")
    with torch.no_grad():
        parts.raw_model.head[-1].bias[0] = 10.0
    result = Trainer(parts, stop=None).evaluate()
    parts.metrics.close()
    parts.raw_model.eval()
    with torch.no_grad():
        batches = [parts.task.inputs(batch, CPU) for batch in parts.val_loader]
        batches = [(parts.raw_model(x), y) for x, y in batches]
    logits, labels = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    smoothed = torch.nn.CrossEntropyLoss(label_smoothing=0.1)(logits, labels).item()
    plain = F.cross_entropy(logits, labels).item()
    # One sum of 64 float32 terms against another order of the same: rounding differs by at most 64 ulp.
    assert result["loss"] == pytest.approx(smoothed, rel=64 * 2**-23) != plain
    recorded = read_metrics(tmp_path, "eval", strict=True)
    assert recorded[-1]["criterion"] == parts.plan.loss == "CrossEntropyLoss(label_smoothing=0.1)"
    assert recorded[-1]["loss"] == result["loss"]


def test_the_settling_pass_feeds_a_batch_of_a_training_steps_shape(tmp_path):
    """The imagenet recipe trains on --train-crop-size crops (16 px here), not --image-size (32, the evaluation's):
    the pass that settles DDP's buckets (a real one-rank gloo group) feeds the model what a step feeds it, so it
    asks no more memory than a step and, under --compile, compiles for the shape the run trains at."""
    data = draw_imagefolder(tmp_path / "data", train=12, val=3, size=40)
    cfg = parse_config(["--preset", "debug", "--dataset", "imagefolder", "--data-dir", str(data), "--augment",
                        "imagenet", "--image-size", "32", "--train-crop-size", "16", "--batch-size", "4",
                        "--num-workers", "0", "--run-dir", str(tmp_path / "run")])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parts = build(cfg, tmp_path / "run", CPU, "fp32")
        parts.metrics.close()
        trainer = Trainer(parts, stop=None)
        fed = []
        parts.raw_model.register_forward_pre_hook(lambda _, inputs: fed.append(tuple(inputs[0].shape)))
        settle_buckets(parts, parts.loop, CPU)
        step, _ = next(trainer.micro_batches(trainer.batches()))
        assert fed == [tuple(step.shape)] == [(4, 3, 16, 16)] and parts.plan.train_size == 16
        trainer.release()
    finally:
        dist.destroy_process_group()


def test_the_running_statistics_follow_the_micro_batch_of_slot_zero_alone(tmp_path):
    """--grad-accum 3 on one worker: the step's three micro-batches each normalise with their own batch's statistics,
    and the running statistics afterwards are those one forward of the first (laid-out slot 0) makes from the step's
    start, bit for bit, as at any other world size and accumulation; the plan says so."""
    import copy

    cfg = parse_config(["--preset", "debug", "--grad-accum", "3", "--run-dir", str(tmp_path)])
    parts = build(cfg, tmp_path, CPU, "fp32")
    parts.metrics.close()
    trainer = Trainer(parts, stop=None)
    micro_batches = list(trainer.micro_batches(trainer.batches()))
    alone = copy.deepcopy(parts.raw_model).train()
    with torch.no_grad():
        alone(micro_batches[0][0])
    every = copy.deepcopy(parts.raw_model).train()
    with torch.no_grad():
        for x, _ in micro_batches:
            every(x)
    trainer.train_step(iter(micro_batches))
    kept, first, last = (dict(m.named_buffers()) for m in (parts.raw_model, alone, every))
    assert [k for k in kept if "running_mean" in k] and all(torch.equal(kept[k], first[k]) for k in kept)
    assert not all(torch.equal(kept[k], last[k]) for k in kept)  # the control: every micro-batch would move them
    assert parts.plan.running_statistics.startswith("each step's micro-batch of laid-out slot 0 (rank 0's first)")
