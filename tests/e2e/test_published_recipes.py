"""A published recipe's knobs in a real run: EMA, MixUp/CutMix, label smoothing, random erasing, repeated
augmentation and an epoch schedule together, on 2 workers, stopped and resumed bit for bit; the EMA evaluated
and shipped."""

import json
import shutil

import pytest
import torch
from torch.optim import lr_scheduler as S

from tests.helpers import (DEBUG, PY, assert_bit_identical, assert_same_final_figures, load_model, make, metrics,
                           python_cmd, run, status)

# 512 images / (2 workers x 16) = 16 steps per epoch (--ra-reps: 512 // 256 x 256 / 2 per rank, as many): 3 epochs,
# the first a warm-up.
RECIPE = [*DEBUG, "--epochs", 3, "--warmup-epochs", 1, "--schedule-unit", "epoch", "--model-ema",
          "--model-ema-steps", 2, "--model-ema-decay", "0.99", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0",
          "--label-smoothing", "0.1", "--random-erase", "0.25", "--ra-reps", 2, "--log-every", 1]


@pytest.fixture
def recipe_run(reference_run):
    return reference_run(*RECIPE)


def test_a_recipe_run_stopped_mid_epoch_resumes_bit_identically_ema_included(recipe_run, tmp_path):
    resumed = tmp_path / "resumed"
    run(python_cmd(*RECIPE, "--spawn", 2, "--run-dir", resumed, "--stop-at", 21), expect=75)
    run(python_cmd(*RECIPE, "--spawn", 2, "--run-dir", resumed))
    assert_bit_identical(recipe_run, resumed)
    assert (recipe_run / "model_ema.pt").read_bytes() == (resumed / "model_ema.pt").read_bytes()
    assert_same_final_figures(recipe_run, resumed)
    assert "val_ema_accuracy" in status(resumed)
    # The control: the batch knobs took effect (the same run without them ends elsewhere).
    plain = tmp_path / "plain"
    run(python_cmd(*RECIPE, "--mixup-alpha", 0, "--cutmix-alpha", 0, "--label-smoothing", 0, "--random-erase", 0,
                   "--spawn", 2, "--run-dir", plain))
    differ = [k for k, v in load_model(plain).items() if not torch.equal(v, load_model(resumed)[k])]
    assert len(differ) > 10, differ


def test_the_epoch_schedule_is_torchs_stepped_once_per_epoch(recipe_run):
    """The lr of every step equals torch's LinearLR + CosineAnnealingLR in SequentialLR stepped at each epoch's
    end, as torchvision's reference steps it."""
    cfg = json.loads((recipe_run / "config.json").read_text())
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg["lr"])
    main = S.CosineAnnealingLR(optimizer, T_max=2, eta_min=cfg["lr"] * cfg["min_lr_ratio"])
    warmup = S.LinearLR(optimizer, start_factor=0.01, total_iters=1)
    scheduler = S.SequentialLR(optimizer, schedulers=[warmup, main], milestones=[1])
    after = [optimizer.param_groups[0]["lr"]]  # the lr after k of the scheduler's steps
    for _ in range(3):
        optimizer.step()
        scheduler.step()
        after.append(optimizer.param_groups[0]["lr"])
    logged = [m["lr"] for m in metrics(recipe_run, "train")]  # after each step: the lr of the next one
    assert [m["step"] for m in metrics(recipe_run, "train")] == list(range(1, 49))
    assert logged == [after[step // 16] for step in range(1, 49)]  # epochs end at steps 16, 32 and 48
    assert len(set(after)) == 4


def test_the_ema_is_evaluated_beside_the_model_and_evaluate_scores_it_again(recipe_run, tmp_path):
    evals = metrics(recipe_run, "eval")
    assert evals and all({"ema_loss", "ema_accuracy"} <= e.keys() for e in evals)
    assert any(e["ema_accuracy"] != e["accuracy"] for e in evals)  # two models, two figures
    log = (recipe_run / "train.log").read_text()
    assert log.count("eval step 48: EMA loss") == 1
    out = tmp_path / "ema.json"
    run([PY, "-m", "train.evaluate", str(recipe_run), "--checkpoint", "ema", "--spawn", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    final = status(recipe_run)
    assert (report["loss"], report["accuracy"]) == (final["val_ema_loss"], final["val_ema_accuracy"])
    # the loss of both is the training criterion's, which both records name
    assert report["criterion"] == evals[-1]["criterion"] == "CrossEntropyLoss(label_smoothing=0.1)"
    refused = run([PY, "-m", "train.evaluate", str(recipe_run.parent), "--checkpoint", "ema"], expect=2)
    assert "error:" in refused.stderr and "Traceback" not in refused.stderr
    # best_ema.pt: the EMA's best evaluation, apart from the model's best.pt; status.json names both.
    best, best_ema = final["best"], final["best_ema"]
    assert best_ema["path"] == "best_ema.pt" and best["path"] == "best.pt"
    by_step = {e["step"]: e for e in evals}
    top = max(e["ema_accuracy"] for e in evals)
    assert best_ema["val_accuracy"] == top == by_step[best_ema["step"]]["ema_accuracy"]
    saved = torch.load(recipe_run / "best_ema.pt", weights_only=True)
    assert saved["step"] == best_ema["step"] and saved["model"].keys() == load_model(recipe_run).keys()
    # Exported under its own name, beside the model's.
    copy = tmp_path / "run"
    shutil.copytree(recipe_run, copy)
    run([PY, "-m", "train.export", str(copy), "--checkpoint", "ema"])
    assert (copy / "model_ema.pt2").is_file() and not (copy / "model.pt2").exists()
    assert json.loads((copy / "model_ema.pt2.json").read_text())["weights"].endswith("model_ema.pt")


def test_a_recipe_on_image_files_equals_it_on_shards_and_resumes_exactly(tmp_path):
    """The loader-side knobs (TrivialAugmentWide after the crop and flip, the repeated-augmentation sampler) and
    the device-side ones (random erasing, Mixup) on PNG files that loader workers decode: the same
    model from their shards (`make pack`), uninterrupted, and from the loose files in a run stopped inside an epoch
    and resumed."""
    import random

    from PIL import Image

    rng = random.Random(0)
    data = tmp_path / "data"
    for split, count in (("train", 70), ("val", 8)):  # 280 training images: --ra-reps keeps 256 of an epoch
        for c in range(4):
            (data / split / f"c{c}").mkdir(parents=True)
            for i in range(count):
                image = Image.new("RGB", (20, 20), tuple(rng.randrange(256) for _ in range(3)))
                image.putpixel((rng.randrange(20), rng.randrange(20)), (255, 255, 255))
                image.save(data / split / f"c{c}" / f"{i}.png")
    packed = tmp_path / "shards"
    out = make("pack", f"SRC={data}", f"DST={packed}").stdout  # as users pack: the make target
    assert "train: 280 images of 4 classes in 1 shard(s)" in out and f"--dataset shards --data-dir {packed}" in out
    assert make("pack", f"DST={packed}", expect=2).stderr.splitlines()[0] == \
        "error: give both folders: make pack SRC=/nas/datasets/mydata DST=/nas/datasets/mydata-shards"
    args = [*DEBUG, "--augment", "imagenet", "--image-size", 16, "--auto-augment", "ta_wide", "--random-erase", "0.25",
            "--ra-reps", 2, "--mixup-alpha", "0.2", "--batch-size", 8, "--num-workers", 1, "--max-steps", 24,
            "--eval-every", 0, "--spawn", 2]  # 16 steps per epoch: 256 / (2 x 8)
    shards, resumed = tmp_path / "on-shards", tmp_path / "resumed"
    run(python_cmd(*args, "--dataset", "shards", "--data-dir", packed, "--run-dir", shards))
    assert metrics(shards, "eval")[-1]["samples"] == 32  # 2 workers: each validation sample counted once
    common = [*args, "--dataset", "imagefolder", "--data-dir", data, "--run-dir", resumed]
    run(python_cmd(*common, "--stop-at", 11), expect=75)
    run(python_cmd(*common))
    assert_bit_identical(shards, resumed)  # the files' model (stopped and resumed) is the shards' (uninterrupted)
    control = tmp_path / "control"  # without the auto-augmentation the same run ends elsewhere
    run(python_cmd(*args, "--auto-augment", "none", "--dataset", "imagefolder", "--data-dir", data,
                   "--run-dir", control))
    assert any(not torch.equal(v, load_model(resumed)[k]) for k, v in load_model(control).items())


# The EMA's runs: 96 images, 6 steps an epoch; a checkpoint at every step (the weights the EMA was fed), the loss of
# every step. Trained once each (reference_run): read by the EMA's test, the steps' run by label smoothing's too.
EMA = [*DEBUG, "--train-samples", 96, "--model-ema", "--model-ema-steps", 4, "--model-ema-decay", "0.999",
       "--save-every", 1, "--keep-checkpoints", 1000, "--eval-every", 0, "--log-every", 1]
BY_EPOCH = ["--schedule-unit", "epoch", "--epochs", 4, "--warmup-epochs", 1]
BY_STEP = ["--max-steps", 20, "--warmup-steps", 5]


def test_label_smoothing_alone_changes_what_the_trainer_learns(reference_run, tmp_path):
    """--label-smoothing and nothing else (no Mixup or CutMix, whose soft targets would hide it): the run's loss
    is torch's smoothed cross-entropy, so its first logged loss and its weights differ from the plain run's (the
    EMA's run by steps: the same flags but --label-smoothing)."""
    plain = reference_run(*EMA, *BY_STEP, workers=1)
    smoothed = tmp_path / "smoothed"
    run(python_cmd(*EMA, *BY_STEP, "--label-smoothing", "0.2", "--run-dir", smoothed))
    losses = [[m["loss"] for m in metrics(d, "train")] for d in (plain, smoothed)]
    assert metrics(smoothed, "train")[0]["step"] == metrics(plain, "train")[0]["step"] == 1
    assert losses[0][0] != losses[1][0]  # the same first batch and weights: only the loss differs
    assert any(not torch.equal(v, load_model(plain)[k]) for k, v in load_model(smoothed).items())


@pytest.mark.parametrize("schedule", [BY_EPOCH, BY_STEP])
def test_the_trainers_ema_is_torchs_averaged_model_driven_by_the_same_weights(schedule, reference_run):
    """The EMA in model_ema.pt equals torch's AveragedModel (EMA function, buffers averaged) fed the trainer's own
    weights as the reference feeds them: after the optimizer step of every --model-ema-steps-th batch of an epoch
    (counted from 0), restarted (n_averaged 0) during the warm-up, with the reference's decay adjustment. The
    weights after each step are read from a checkpoint per step."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from train.cli import parse_config
    from train.components.models import build_model

    run_dir = reference_run(*EMA, *schedule, workers=1)
    steps_per_epoch, epoch_unit = 96 // 16, "epoch" in schedule
    max_steps = 4 * steps_per_epoch if epoch_unit else 20
    epochs = 4 if epoch_unit else max_steps / steps_per_epoch
    decay = 1.0 - min(1.0, (1.0 - 0.999) * 1 * 16 * 4 / epochs)  # the reference: world x batch x steps / epochs
    cfg = parse_config([*map(str, DEBUG), "--train-samples", "96"])
    model = build_model(cfg.model, 10)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
    updates = 0
    for step in range(1, max_steps + 1):
        index, epoch = (step - 1) % steps_per_epoch, (step - 1) // steps_per_epoch  # the batch's, in its epoch
        if index % 4:
            continue
        state = torch.load(run_dir / "checkpoints" / f"step_{step:08d}.pt", weights_only=True)["model"]
        model.load_state_dict(state)
        ema.update_parameters(model)
        updates += 1
        if (epoch < 1) if epoch_unit else (step - 1 < 5):  # in the warm-up: the next update copies again
            ema.n_averaged.fill_(0)
    theirs = ema.module.state_dict()
    ours = torch.load(run_dir / "model_ema.pt", weights_only=True)
    assert updates > 4 and ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert any(not torch.equal(ours[k], load_model(run_dir)[k]) for k in ours)  # an average, not the last weights
