"""train/recipes/*.toml against the published commands: each recipe's plan (what --dry-run prints and the trainer
trains from) at the global batch the command states (8 workers), compared with what the command means in
torchvision's reference train.py, worked out here from the command's own flags and the reference's defaults:
every parameter's weight decay by name, the learning rate of every epoch (torch's schedulers as the reference
builds them), the EMA's decay, the sampler, the transforms, the loss, the optimizer and the precision."""

import argparse
import shlex
from pathlib import Path

import pytest
import torch
from torch.optim import lr_scheduler as S
from torchvision.transforms import v2

from tests.unit.test_recipe_knobs import reference_groups
from train.cli import parse_config
from train.components.models import build_model
from train.run.plan import dry_run

RECIPES = Path(__file__).resolve().parents[2] / "train" / "recipes"
# The published command lines (torchvision's references/classification README), and the top-1 each reached.
PUBLISHED = {
    "resnet50_classic.toml": ("76.130", "torchrun --nproc_per_node=8 train.py --model resnet50"),
    "resnet50.toml": ("80.858", "torchrun --nproc_per_node=8 train.py --model resnet50 --batch-size 128 --lr 0.5 "
                                "--lr-scheduler cosineannealinglr --lr-warmup-epochs 5 --lr-warmup-method linear "
                                "--auto-augment ta_wide --epochs 600 --random-erase 0.1 --weight-decay 0.00002 "
                                "--norm-weight-decay 0.0 --label-smoothing 0.1 --mixup-alpha 0.2 --cutmix-alpha 1.0 "
                                "--train-crop-size 176 --model-ema --val-resize-size 232 --ra-sampler --ra-reps 4"),
    "vit_b_16.toml": ("81.072", "torchrun --nproc_per_node=8 train.py --model vit_b_16 --epochs 300 --batch-size 512 "
                                "--opt adamw --lr 0.003 --wd 0.3 --lr-scheduler cosineannealinglr "
                                "--lr-warmup-method linear --lr-warmup-epochs 30 --lr-warmup-decay 0.033 --amp "
                                "--label-smoothing 0.11 --mixup-alpha 0.2 --auto-augment ra --clip-grad-norm 1 "
                                "--ra-sampler --cutmix-alpha 1.0 --model-ema"),
}


def reference_args(command: str) -> tuple[int, argparse.Namespace]:
    """(workers, the reference's args): the flags of torchvision's references/classification/train.py that a
    recipe touches, with the reference's defaults."""
    words = shlex.split(command)
    workers = int(next(w.split("=")[1] for w in words if w.startswith("--nproc_per_node=")))
    p = argparse.ArgumentParser()
    for flag, default, kind in [
        ("--model", "resnet18", str), ("--batch-size", 32, int), ("--epochs", 90, int), ("--opt", "sgd", str),
        ("--lr", 0.1, float), ("--momentum", 0.9, float), ("--norm-weight-decay", None, float),
        ("--bias-weight-decay", None, float), ("--transformer-embedding-decay", None, float),
        ("--label-smoothing", 0.0, float), ("--mixup-alpha", 0.0, float), ("--cutmix-alpha", 0.0, float),
        ("--lr-scheduler", "steplr", str), ("--lr-warmup-epochs", 0, int), ("--lr-warmup-method", "constant", str),
        ("--lr-warmup-decay", 0.01, float), ("--lr-step-size", 30, int), ("--lr-gamma", 0.1, float),
        ("--lr-min", 0.0, float), ("--auto-augment", None, str), ("--ra-magnitude", 9, int),
        ("--augmix-severity", 3, int), ("--random-erase", 0.0, float), ("--model-ema-steps", 32, int),
        ("--model-ema-decay", 0.99998, float), ("--interpolation", "bilinear", str), ("--val-resize-size", 256, int),
        ("--val-crop-size", 224, int), ("--train-crop-size", 224, int), ("--clip-grad-norm", None, float),
        ("--ra-reps", 3, int)]:
        p.add_argument(flag, default=default, type=kind)
    p.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
    for flag in ("--amp", "--model-ema", "--ra-sampler"):
        p.add_argument(flag, action="store_true")
    return workers, p.parse_args(words[words.index("train.py") + 1:])


def reference_lrs(args) -> list[float]:
    """The learning rate of each epoch, from the schedulers the reference builds for these args, stepped once
    per epoch as it steps them."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.lr)
    main = {"steplr": lambda: S.StepLR(optimizer, step_size=args.lr_step_size, gamma=args.lr_gamma),
            "cosineannealinglr": lambda: S.CosineAnnealingLR(optimizer, T_max=args.epochs - args.lr_warmup_epochs,
                                                             eta_min=args.lr_min)}[args.lr_scheduler]()
    if args.lr_warmup_epochs > 0:
        warmup = (S.LinearLR(optimizer, start_factor=args.lr_warmup_decay, total_iters=args.lr_warmup_epochs)
                  if args.lr_warmup_method == "linear" else
                  S.ConstantLR(optimizer, factor=args.lr_warmup_decay, total_iters=args.lr_warmup_epochs))
        main = S.SequentialLR(optimizer, schedulers=[warmup, main], milestones=[args.lr_warmup_epochs])
    values = []
    for _ in range(args.epochs):
        values.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        main.step()
    return values


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """An ImageFolder of 2 x 2,100 empty .jpg files: enough for one step of 8 x 512 with repeated augmentation;
    a plan lists files and never opens one."""
    root = tmp_path_factory.mktemp("imagefolder")
    for split, count in (("train", 2100), ("val", 1)):
        for label in ("a", "b"):
            (root / split / label).mkdir(parents=True)
            for i in range(count):
                (root / split / label / f"{i}.jpg").touch()
    return root


def test_every_recipe_file_is_checked():
    assert sorted(p.name for p in RECIPES.glob("*.toml")) == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_recipe_plans_what_the_published_command_means(name, images):
    accuracy, command = PUBLISHED[name]
    text = (RECIPES / name).read_text()
    assert f"{accuracy} % top-1" in text and "global batch" in text and "--dry-run" in text and "departs" in text
    workers, ref = reference_args(command)
    plan = dry_run(parse_config(["--config", str(RECIPES / name), "--data-dir", str(images)]), workers)

    assert (plan.world_size, plan.global_batch, plan.epochs) == (workers, workers * ref.batch_size, ref.epochs)
    # Every parameter's weight decay, by name: the reference's groups for the command's decay flags.
    with torch.device("meta"):
        model = build_model(parse_config(["--model", ref.model]).model, plan.num_classes)
    expected = reference_groups(model, ref.weight_decay, ref.norm_weight_decay, ref.bias_weight_decay,
                                ref.transformer_embedding_decay)
    assert [(g["weight_decay"], g["params"]) for g in plan.param_groups] == expected
    assert plan.lr == {"per": "epoch", "values": reference_lrs(ref)}
    # The optimizer: SGD with momentum, no Nesterov (--opt sgd), or AdamW with torch's defaults; gradient clipping.
    settings = {"name": "SGD", "momentum": ref.momentum, "dampening": 0, "nesterov": False} if ref.opt == "sgd" \
        else {"name": "AdamW", "betas": (0.9, 0.999), "eps": 1e-8}
    assert plan.optimizer == {**settings, "grad_clip": ref.clip_grad_norm}
    # The EMA: the reference's adjustment of --model-ema-decay, updated every --model-ema-steps.
    if ref.model_ema:
        adjust = workers * ref.batch_size * ref.model_ema_steps / ref.epochs
        assert plan.ema["decay"] == 1.0 - min(1.0, (1.0 - ref.model_ema_decay) * adjust)
        assert plan.ema["every_steps"] == ref.model_ema_steps
    else:
        assert plan.ema is None
    # The sampler: RASampler with --ra-reps copies on more than one worker, else a plain shuffle.
    if ref.ra_sampler:
        assert "RASampler" in plan.sampler and f"each image {ref.ra_reps} times" in plan.sampler
    else:
        assert "RASampler" not in plan.sampler and "shuffled pass" in plan.sampler
    # The transforms: the reference's presets for these args, in order.
    mode = v2.InterpolationMode(ref.interpolation)
    augment = {None: [], "ta_wide": [v2.TrivialAugmentWide(interpolation=mode)],
               "ra": [v2.RandAugment(interpolation=mode, magnitude=ref.ra_magnitude)],
               "augmix": [v2.AugMix(interpolation=mode, severity=ref.augmix_severity)]}[ref.auto_augment]
    assert_in_order(plan.train_transform, [v2.RandomResizedCrop(ref.train_crop_size, interpolation=mode,
                                                                antialias=True), v2.RandomHorizontalFlip(0.5),
                                           *augment])
    assert_in_order(plan.eval_transform, [v2.Resize(ref.val_resize_size, interpolation=mode, antialias=True),
                                          v2.CenterCrop(ref.val_crop_size)])
    mixers = ([v2.MixUp(alpha=ref.mixup_alpha, num_classes=plan.num_classes)] if ref.mixup_alpha else []) + \
        ([v2.CutMix(alpha=ref.cutmix_alpha, num_classes=plan.num_classes)] if ref.cutmix_alpha else [])
    batch = ([v2.RandomErasing(p=ref.random_erase)] if ref.random_erase else []) + \
        ([v2.RandomChoice(mixers)] if mixers else [])
    assert_in_order(plan.batch_transform, batch) if batch else None
    assert ("RandomErasing" in plan.batch_transform) == bool(ref.random_erase)
    assert ("MixUp" in plan.batch_transform, "CutMix" in plan.batch_transform) == \
        (bool(ref.mixup_alpha), bool(ref.cutmix_alpha))
    assert plan.loss == f"CrossEntropyLoss(label_smoothing={ref.label_smoothing})"
    assert plan.normalize == {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}  # the reference's presets
    assert plan.precision == ("fp16" if ref.amp else "fp32")


def assert_in_order(text: str, transforms: list) -> None:
    """Each transform's repr appears in text, in this order."""
    at = -1
    for transform in transforms:
        found = text.find(repr(transform), at + 1)
        assert found > at, f"{transform!r} not found (in order) in {text}"
        at = found


def test_one_worker_samples_plainly_as_the_reference_does_outside_distributed_runs(images):
    plan = dry_run(parse_config(["--config", str(RECIPES / "resnet50.toml"), "--data-dir", str(images)]), 1)
    assert "RASampler" not in plan.sampler and "--ra-reps 4 on one worker samples plainly at random" in plan.sampler
    assert plan.train_samples == 4200 and plan.steps_per_epoch == 4200 // 128  # the whole set, not cut to 256s
