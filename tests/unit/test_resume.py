"""What a resume may change (train/config/resume.py): the settings a checkpoint fixes, the layout on another number of
workers (the same samples in the same micro-batches), a run made longer (the schedule of its new length), and the
record plan.json keeps of it. No processes."""

import json

import pytest
import torch

from train.base.errors import ConfigError
from train.components.optim import build_optimizer, build_scheduler, schedule_at
from train.config.resume import (FIXED, MAY_CHANGE, Layout, changed_settings, continue_layout, refusal, resume_record,
                                 spliced_lr)
from train.config.settings import Config, settings
from train.files.rundir import to_json
from train.loading import ShardSampler, origin
from train.run.checkpointer import saved_length
from train.run.health import DivergenceGuard


def test_every_setting_is_either_fixed_by_a_checkpoint_or_free_to_change():
    names = {f.name for f in settings()}
    assert FIXED | MAY_CHANGE == names and not FIXED & MAY_CHANGE


def test_a_changed_setting_is_refused_in_one_line_naming_each_difference_and_the_ways_on():
    saved = Config().replace(lr=0.01, max_steps=10).to_dict()
    asked = Config().replace(lr=0.5, optimizer="sgd", model_ema=True, max_steps=20, num_workers=3).to_dict()
    changes = changed_settings(saved, asked)
    assert changes == [("lr", 0.01, 0.5), ("model_ema", False, True), ("optimizer", "adamw", "sgd")]
    line = refusal("runs/a", changes, "runs/a/checkpoints/step_00000010.pt")
    assert "\n" not in line
    assert "(--lr 0.01 -> 0.5, --model-ema off -> on, --optimizer adamw -> sgd)" in line
    assert line.endswith("new --run-dir --weights runs/a/checkpoints/step_00000010.pt")
    assert changed_settings({"lr": 0.01}, asked | {"lr": 0.01}) == []  # an older run's config lacks the rest


@pytest.mark.parametrize("world, expected", [(2, 2), (1, 4), (4, 1)])
def test_another_number_of_workers_keeps_the_global_batch_with_the_accumulation(world, expected):
    assert continue_layout(Layout(4, 16, 1), world, 16, 1, False, "runs/a") == expected
    assert continue_layout(Layout(2, 16, 2), world, 16, 2, False, "runs/a") == expected  # more workers than before


def test_workers_that_cannot_share_the_global_batch_are_refused_with_the_counts_that_can():
    with pytest.raises(ConfigError, match=r"which 3 workers cannot share evenly: resume on 1, 2, 4 workers"):
        continue_layout(Layout(4, 16, 1), 3, 16, 1, False, "runs/a")
    with pytest.raises(ConfigError, match=r"global batch of 64 .* 2 workers x batch 16 x accumulation 3 make 96: "
                                          r"pass the run's --grad-accum 1 \(the workers then share its batch\) or one "
                                          r"that keeps 64"):
        continue_layout(Layout(4, 16, 1), 2, 16, 3, True, "runs/a")
    # a run with --grad-accum 3 resumed by a command without one (accumulation 1): the fix is the run's own
    with pytest.raises(ConfigError, match=r"make 8: pass the run's --grad-accum 3 \(the workers then share its batch"):
        continue_layout(Layout(4, 2, 3), 4, 2, 1, True, "runs/a")
    assert continue_layout(Layout(4, 2, 3), 2, 2, 3, False, "runs/a") == 6  # the run's, on half the workers
    assert continue_layout(Layout(4, 16, 1), 2, 16, 2, True, "runs/a") == 2  # given, and right
    # SyncBatchNorm normalises the workers' micro-batches together: another number of workers is another run
    with pytest.raises(ConfigError, match=r"runs/a trains with --sync-bn on 4 workers: SyncBatchNorm normalises their "
                                          r"micro-batches together, .*: resume on 4 workers"):
        continue_layout(Layout(4, 16, 1), 2, 16, 2, False, "runs/a", sync_bn=True)
    assert continue_layout(Layout(4, 16, 1), 4, 16, 1, False, "runs/a", sync_bn=True) == 1


def steps_of(length, world, accum, batch, layout, seed=5, reps=0, epoch=1):
    """Each optimizer step of an epoch as its micro-batches, keyed by the laid-out run's (rank, micro), each a list of
    (sample, augmentation seed): what every rank's loader would yield, cut as the trainer cuts it."""
    per_rank = {}
    for rank in range(world):
        sampler = ShardSampler(length, rank, world, seed, with_seeds=True, reps=reps, batch_size=batch,
                               grad_accum=accum, layout=layout)
        sampler.set_epoch(epoch)
        per_rank[rank] = list(sampler)
    steps = len(per_rank[0]) // (accum * batch)
    return [{tuple(int(v) for v in origin(rank, micro, world, layout or (world, accum))):
             per_rank[rank][(step * accum + micro) * batch:(step * accum + micro + 1) * batch]
             for rank in range(world) for micro in range(accum)} for step in range(steps)]


@pytest.mark.parametrize("reps", [0, 3])
@pytest.mark.parametrize("world, accum", [(2, 2), (1, 4), (4, 1)])
def test_a_resume_on_other_workers_trains_the_same_micro_batches_with_the_same_seeds(reps, world, accum):
    laid_out = steps_of(1000, 4, 1, 8, None, reps=reps)
    relaid = steps_of(1000, world, accum, 8, (4, 1), reps=reps)
    steps = 1000 // 256 * 256 // 4 // 8 if reps else 1000 // 4 // 8  # --ra-reps: the epoch cut to 256s (768)
    assert len(laid_out) == len(relaid) == steps
    assert relaid == laid_out
    assert all(sum(len(micro) for micro in step.values()) == 32 for step in relaid)


def test_on_its_own_layout_the_sampler_is_torchs_distributed_order():
    """Rank r takes every world-th index of the epoch's permutation (torch.utils.data.DistributedSampler's rule, with
    trainbox's seeding), cut to whole steps."""
    for rank in range(3):
        sampler = ShardSampler(100, rank, 3, seed=2, with_seeds=False, batch_size=4, grad_accum=2)
        sampler.set_epoch(1)
        order = torch.randperm(100, generator=torch.Generator().manual_seed(2 * 1_000_003 + 1))
        assert list(sampler) == order[rank:99:3][:32].tolist()  # 33 per rank, 4 steps of 8


@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize("unit", ["step", "epoch"])
@pytest.mark.parametrize("scheduler, extra", [
    ("cosine", {}), ("step", {"lr_step_size": 3}), ("multistep", {"lr_milestones": "4,9"}), ("constant", {})])
def test_a_run_made_longer_continues_on_the_schedule_of_its_new_length(unit, scheduler, extra, warmup):
    """The reference: torch's scheduler of the new length, stepped without a break from the start."""
    schedule = Config().replace(lr_scheduler=scheduler, schedule_unit=unit, warmup_steps=warmup, **extra).schedule
    model = torch.nn.Linear(2, 2)

    def optimizer():
        return build_optimizer(Config().optimisation, model, [{"weight_decay": 0.0, "params": ["weight", "bias"]}])

    before = optimizer()
    first = build_scheduler(schedule, before, 10, warmup)
    for _ in range(6):
        first.step()
    resumed = optimizer()
    resumed.load_state_dict(before.state_dict())  # what the checkpoint brings back
    continued = schedule_at(schedule, resumed, 20, warmup, 6)
    reference_optimizer = optimizer()
    reference = build_scheduler(schedule, reference_optimizer, 20, warmup)
    for _ in range(6):
        reference.step()
    for _ in range(14):
        assert continued.get_last_lr() == reference.get_last_lr()
        continued.step()
        reference.step()


def test_the_learning_rates_as_trained_are_the_earlier_lengths_then_the_new():
    before = {"per": "step", "values": [1, 2, 3, 4]}
    after = {"per": "step", "values": [1, 2, 5, 6, 7, 8]}
    assert spliced_lr(before, after, 2, 2) == {"per": "step", "values": [1, 2, 5, 6, 7, 8]}
    assert spliced_lr(before, after, 3, 2) == {"per": "step", "values": [1, 2, 3, 6, 7, 8]}
    per_epoch = {"per": "epoch", "values": [10, 20, 30, 40]}
    assert spliced_lr(before, per_epoch, 3, 2) == {"per": "epoch", "values": [1, 3, 30, 40]}  # epochs from steps 0, 2
    assert spliced_lr(None, after, 3, 2) == after


def test_a_resume_that_changed_something_is_recorded_with_its_step():
    saved = Config().replace(max_steps=10, grad_accum=1).to_dict()
    now = Config().replace(max_steps=20, grad_accum=2, run_dir="x").to_dict()
    assert resume_record(10, saved, now, 4, 2) == {
        "step": 10, "changed": {"grad_accum": [1, 2], "max_steps": [10, 20], "world_size": [4, 2]}}
    assert resume_record(10, saved, saved, 4, 4) is None
    assert saved_length({"config": {"epochs": 3, "max_steps": 600}}, 16) == 48
    assert saved_length({"max_steps": 7, "config": {}}, 16) == 7


def test_a_loss_that_is_not_finite_is_found_with_its_step_and_learning_rate():
    guard = DivergenceGuard(torch.device("cpu"), fp16=False)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    guard.observe(1, [torch.tensor(0.5)], 0.1)
    assert guard.check(1, scaler) is None
    guard.observe(2, [torch.tensor(0.5), torch.tensor(float("nan"))], 0.2)
    guard.observe(3, [torch.tensor(float("inf"))], 0.3)
    assert guard.check(3, scaler) == "the run diverged: the loss was nan at step 2 at learning rate 0.2"
    healthy = DivergenceGuard(torch.device("cpu"), fp16=False)
    model = torch.nn.Linear(2, 2)
    assert healthy.check(4, scaler, [model]) is None
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    assert healthy.check(4, scaler, [model]) == ("the run diverged: by step 4 its weights (or their running "
                                                "statistics) were no longer finite")


def test_under_fp16_skipped_steps_are_normal_until_the_scale_falls_under_the_floor():
    guard = DivergenceGuard(torch.device("cpu"), fp16=True)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.tensor(1.0))  # a step's loss, scaled
    guard.observe(1, [torch.tensor(float("nan"))], 0.1)  # the scaler skips it
    scaler.update(2.0 ** -10)  # torch's public way to set the scale
    assert guard.check(1, scaler) is None
    scaler.update(2.0 ** -15)
    assert "GradScaler had skipped step after step (its scale fell to 3.05e-05)" in guard.check(9, scaler)


def test_every_json_file_is_strict_json_a_figure_that_is_not_finite_is_null():
    text = to_json({"loss": float("nan"), "top": [float("inf"), 1.5], "nested": {"x": -float("inf")}})
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in strict JSON")) == \
        {"loss": None, "top": [None, 1.5], "nested": {"x": None}}
