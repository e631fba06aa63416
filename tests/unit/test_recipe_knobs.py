"""The recipe knobs against the torch and torchvision objects torchvision's reference recipes are made of:
schedulers, weight-decay groups, EMA, MixUp/CutMix, random erasing, auto-augmentation and crop sizes."""

import pytest
import torch
from torch.optim import lr_scheduler as S
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torchvision.ops._utils import split_normalization_params
from torchvision.transforms import v2

from train.base.errors import ConfigError
from train.cli import parse_config
from train.components.augment import BatchAugment
from train.components.ema import ModelEma, adjusted_decay
from train.components.optim import EMBEDDING_KEYS, build_optimizer, build_scheduler, decay_groups, schedule_lengths
from train.data import image_transforms, eval_steps


def scheduler_of(cfg, optimizer):
    """The trainer's scheduler of cfg over the optimizer, for a run of --max-steps and --warmup-steps."""
    lengths = schedule_lengths(cfg.schedule, cfg.run.epochs, cfg.run.max_steps, cfg.schedule.warmup_steps)
    return build_scheduler(cfg.schedule, optimizer, *lengths)


def lrs(scheduler, optimizer, n):
    out = []
    for _ in range(n):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def reference_scheduler(optimizer, kind, total, warmup, method, decay, **kw):
    """As torchvision's reference train.py builds it: the main scheduler, then the warm-up, then SequentialLR."""
    main = {"cosine": lambda: S.CosineAnnealingLR(optimizer, T_max=total - warmup, eta_min=kw.get("eta_min", 0.0)),
            "step": lambda: S.StepLR(optimizer, step_size=kw.get("step_size", 1), gamma=kw.get("gamma", 0.1)),
            "multistep": lambda: S.MultiStepLR(optimizer, milestones=kw.get("milestones"), gamma=kw.get("gamma")),
            "constant": lambda: S.ConstantLR(optimizer, factor=1.0, total_iters=0)}[kind]()
    if not warmup:
        return main
    first = (S.LinearLR(optimizer, start_factor=decay, total_iters=warmup) if method == "linear" else
             S.ConstantLR(optimizer, factor=decay, total_iters=warmup))
    return S.SequentialLR(optimizer, schedulers=[first, main], milestones=[warmup])


@pytest.mark.parametrize("flags, kind, kw", [
    (["--lr-scheduler", "cosine", "--min-lr-ratio", "0.1"], "cosine", {"eta_min": 0.1 * 0.5}),
    (["--lr-scheduler", "step", "--lr-step-size", "7", "--lr-gamma", "0.5"], "step", {"step_size": 7, "gamma": 0.5}),
    (["--lr-scheduler", "multistep", "--lr-milestones", "10,25", "--lr-gamma", "0.2"], "multistep",
     {"milestones": [10, 25], "gamma": 0.2}),
    (["--lr-scheduler", "constant"], "constant", {}),
])
@pytest.mark.parametrize("method, warmup", [("linear", 5), ("constant", 5), ("linear", 0)])
def test_every_schedule_is_torchs_own_sequence(flags, kind, kw, method, warmup):
    shape = ["--warmup-method", method, "--warmup-decay", "0.03"] if warmup else []  # no warm-up: refused
    cfg = parse_config([*flags, "--lr", "0.5", "--max-steps", "40", "--warmup-steps", str(warmup), *shape])
    ours = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optimisation.lr)
    theirs = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optimisation.lr)
    expected = lrs(reference_scheduler(theirs, kind, 40, warmup, method, 0.03, **kw), theirs, 40)
    assert lrs(scheduler_of(cfg, ours), ours, 40) == expected
    assert len(set(expected)) > (1 if kind == "constant" and warmup else 0)  # the schedule moves where it should


def test_an_epoch_schedule_counts_in_epochs():
    cfg = parse_config(["--epochs", "12", "--warmup-epochs", "2", "--schedule-unit", "epoch", "--lr-scheduler",
                        "step", "--lr-step-size", "4", "--lr", "0.1"])
    ours = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optimisation.lr)
    theirs = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optimisation.lr)
    expected = lrs(reference_scheduler(theirs, "step", 12, 2, "linear", 0.01, step_size=4, gamma=0.1), theirs, 12)
    assert lrs(scheduler_of(cfg, ours), ours, 12) == expected


@pytest.mark.parametrize("flags", [["--schedule-unit", "epoch"], ["--epochs", "3", "--warmup-epochs", "0.5",
                                                                   "--schedule-unit", "epoch"],
                                   ["--lr-scheduler", "multistep"], ["--lr-milestones", "3,x"]])
def test_an_impossible_schedule_is_one_line(flags):
    from train.base.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        cfg = parse_config(flags)
        cfg.schedule.milestones()
    assert "\n" not in str(e.value) and ": " in str(e.value)


def reference_groups(model, weight_decay, norm_weight_decay=None, bias_weight_decay=None,
                     transformer_embedding_decay=None) -> list[tuple[float, list[str]]]:
    """torchvision's references/classification: train.py's custom keys and utils.set_weight_decay, transcribed
    (parameters by name instead of by object): [(weight decay, names)] in the reference's group order."""
    custom = []
    if bias_weight_decay is not None:
        custom.append(("bias", bias_weight_decay))
    if transformer_embedding_decay is not None:
        for key in ["class_token", "position_embedding", "relative_position_bias_table"]:
            custom.append((key, transformer_embedding_decay))
    params = {"other": [], "norm": []}
    decay = {"other": weight_decay, "norm": norm_weight_decay}
    for key, value in custom:
        params[key], decay[key] = [], value
    norm_classes = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.LayerNorm, torch.nn.GroupNorm,
                    torch.nn.modules.instancenorm._InstanceNorm, torch.nn.LocalResponseNorm)

    def add(module, prefix=""):
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            full = f"{prefix}.{name}" if prefix else name
            for key, _ in custom:
                if key == (full if prefix != "" and "." in key else name):
                    params[key].append(full)
                    break
            else:
                in_norm = norm_weight_decay is not None and isinstance(module, norm_classes)
                params["norm" if in_norm else "other"].append(full)
        for child_name, child in module.named_children():
            add(child, f"{prefix}.{child_name}" if prefix else child_name)

    add(model)
    return [(decay[key], names) for key, names in params.items() if names]


DECAY_FLAGS = {"norm_weight_decay": "--norm-weight-decay", "bias_weight_decay": "--bias-weight-decay",
               "transformer_embedding_decay": "--transformer-embedding-decay"}


@pytest.mark.parametrize("model_name", ["cnn", "resnet18", "vit_b_16", "swin_t", "mobilenet_v3_small"])
@pytest.mark.parametrize("given", [{}, {"norm_weight_decay": 0.0}, {"bias_weight_decay": 2e-5},
                                   {"norm_weight_decay": 0.0, "bias_weight_decay": 1e-3},
                                   {"transformer_embedding_decay": 0.0},
                                   {"norm_weight_decay": 0.0, "bias_weight_decay": 0.0,
                                    "transformer_embedding_decay": 0.1}])
def test_weight_decay_groups_are_the_references_by_name(model_name, given):
    """Every trainable parameter in the reference's group with the reference's decay, by name: a group of its own
    only for the decays given (on the meta device: no memory, no weights)."""
    from train.components.models import build_model

    cfg_args = ["--model", model_name, "--weight-decay", "1e-4"]
    for key, value in given.items():
        cfg_args += [DECAY_FLAGS[key], str(value)]
    with torch.device("meta"):
        model = build_model(parse_config(["--model", model_name]).model, 10)
    names = [n for n, _ in model.named_parameters()]
    model.get_parameter(names[len(names) // 2]).requires_grad_(False)  # frozen: in no group
    expected = reference_groups(model, 1e-4, **given)
    has_embedding = any(n.rsplit(".", 1)[-1] in EMBEDDING_KEYS for n, p in model.named_parameters() if p.requires_grad)
    if "transformer_embedding_decay" in given and not has_embedding:
        with pytest.raises(ConfigError, match="--transformer-embedding-decay has no effect"):
            decay_groups(parse_config(cfg_args).optimisation, model, model_name)
        return
    groups = decay_groups(parse_config(cfg_args).optimisation, model, model_name)
    assert [(g["weight_decay"], g["params"]) for g in groups] == expected
    if given == {"norm_weight_decay": 0.0}:  # the norm rule alone: torchvision.ops' own split of the parameters
        by_id = {id(p): n for n, p in model.named_parameters()}
        norm, other = split_normalization_params(model)
        assert [[by_id[id(p)] for p in ps if p.requires_grad] for ps in (other, norm)] == \
            [g["params"] for g in groups] + [[]] * (2 - len(groups))
    assert len(groups) == 1 + sum(1 for key in ("norm_weight_decay", "bias_weight_decay") if key in given) \
        + ("transformer_embedding_decay" in given) * sum(1 for k in EMBEDDING_KEYS if any(
            n.rsplit(".", 1)[-1] == k for n, _ in model.named_parameters()))
    # What the trainer builds carries them: every parameter once, with its group's decay.
    with torch.device("cpu"):
        real = build_model(parse_config(["--model", "cnn"]).model, 10) if model_name == "cnn" else None
    if real is not None:
        opt = parse_config(cfg_args).optimisation
        optimizer = build_optimizer(opt, real, decay_groups(opt, real, model_name))
        by_id = {id(p): n for n, p in real.named_parameters()}
        assert [(g["weight_decay"], [by_id[id(p)] for p in g["params"]]) for g in optimizer.param_groups] == \
            reference_groups(real, 1e-4, **given)


def test_the_published_resnet50_grouping_keeps_batchnorm_biases_out_of_decay():
    """The published command: --weight-decay 0.00002 --norm-weight-decay 0.0 and no --bias-weight-decay: all 106
    BatchNorm weights and biases take 0, the convolutions and the head (fc.bias included) 2e-5."""
    from torchvision.models import resnet50

    with torch.device("meta"):
        model = resnet50()
    groups = decay_groups(parse_config(["--weight-decay", "2e-5", "--norm-weight-decay", "0"]).optimisation, model,
                          "resnet50")
    decay = {name: g["weight_decay"] for g in groups for name in g["params"]}
    assert len(decay) == 161 and sum(1 for n in decay if "bn" in n or "downsample.1" in n) == 106
    assert all(v == 0.0 for n, v in decay.items() if "bn" in n or "downsample.1" in n)
    assert decay["fc.bias"] == decay["fc.weight"] == decay["conv1.weight"] == 2e-5


def test_the_ema_is_averaged_model_with_torchs_ema_function_without_reading_the_device():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.LazyLinear(2))
    model(torch.randn(2, 3, 6, 6))
    ours = ModelEma(model, 0.9, torch.device("cpu"))
    theirs = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    for update in range(6):
        model.train()(torch.randn(4, 3, 6, 6))  # BatchNorm statistics move: the buffers are averaged too
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ours.update_parameters(model)
        theirs.update_parameters(model)
        if update == 2:  # the reference's warm-up reset: the next update copies
            ours.restart()
            theirs.n_averaged.fill_(0)
        for a, b in zip(ours.state_dict().values(), theirs.state_dict().values(), strict=True):
            assert torch.equal(a, b)
    assert not torch.equal(ours.module[0].weight, model[0].weight)  # an average, not a copy
    cfg = parse_config(["--batch-size", "32", "--model-ema", "--model-ema-steps", "32", "--model-ema-decay", "0.99998"])
    assert adjusted_decay(cfg.regularisation, 8 * 32, 600) == 1 - min(1.0, (1 - 0.99998) * 8 * 32 * 32 / 600)


def test_mixup_cutmix_and_random_erasing_are_v2s_on_the_batch_seed():
    cfg = parse_config(["--mixup-alpha", "0.2", "--cutmix-alpha", "1.0", "--random-erase", "0.5"])
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    before = torch.get_rng_state()
    ours = BatchAugment(cfg.augmentation, 10)(x, y, seed=1234)
    assert torch.equal(torch.get_rng_state(), before)  # the run's own streams untouched
    torch.manual_seed(1234)
    erase = v2.RandomErasing(p=0.5)
    expected = v2.RandomChoice([v2.MixUp(alpha=0.2, num_classes=10), v2.CutMix(alpha=1.0, num_classes=10)])(
        torch.stack([erase(image) for image in x]), y)
    assert torch.equal(ours[0], expected[0]) and torch.equal(ours[1], expected[1])
    assert ours[1].shape == (8, 10) and not torch.equal(ours[0], x)  # soft targets, changed images


@pytest.mark.parametrize("policy, made", [
    ("ta_wide", lambda m: v2.TrivialAugmentWide(interpolation=m)),
    ("ra", lambda m: v2.RandAugment(interpolation=m, magnitude=7)),
    ("augmix", lambda m: v2.AugMix(interpolation=m, severity=2)),
    ("imagenet", lambda m: v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET, interpolation=m)),
])
def test_the_train_transforms_are_the_reference_presets(policy, made):
    knob = {"ra": ["--ra-magnitude", "7"], "augmix": ["--augmix-severity", "2"]}.get(policy, [])  # its own only
    cfg = parse_config(["--dataset", "imagefolder", "--augment", "imagenet", "--image-size", "64",
                        "--train-crop-size", "48", "--interpolation", "bicubic", "--auto-augment", policy, *knob])
    mode = v2.InterpolationMode.BICUBIC  # the crop's; the policies' rotations on tensors take bilinear at most
    reference = v2.Compose([v2.ToImage(), v2.RandomResizedCrop(48, interpolation=mode, antialias=True),
                            v2.RandomHorizontalFlip(), made(v2.InterpolationMode.BILINEAR),
                            v2.ToDtype(torch.uint8, scale=True)])
    image = torch.randint(0, 256, (3, 80, 70), dtype=torch.uint8)
    for seed in range(5):
        torch.manual_seed(seed)
        expected = reference(image)
        torch.manual_seed(seed)
        assert torch.equal(image_transforms(cfg.data, cfg.augmentation, train=True)(image), expected)


def test_the_evaluation_sizes_follow_the_crop_flags():
    cfg = parse_config(["--dataset", "imagefolder", "--image-size", "176", "--val-crop-size", "224",
                        "--val-resize-size", "232", "--interpolation", "bicubic"])
    assert eval_steps(cfg.data, cfg.augmentation) == (232, 224, "bicubic")
    image = torch.randint(0, 256, (3, 300, 400), dtype=torch.uint8)
    expected = v2.Compose([v2.Resize(232, interpolation=v2.InterpolationMode.BICUBIC, antialias=True),
                           v2.CenterCrop(224)])(image)
    assert torch.equal(image_transforms(cfg.data, cfg.augmentation, train=False)(image), expected)
    plain = parse_config(["--dataset", "imagefolder", "--image-size", "224"])
    assert eval_steps(plain.data, plain.augmentation) == (256, 224, "bilinear")


def test_a_warm_up_as_long_as_the_run_is_a_schedule_too():
    """--preset debug warms up for 5 steps: a 5-step run is all warm-up (the cosine gets no step)."""
    cfg = parse_config(["--preset", "debug", "--max-steps", "5"])
    ours = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optimisation.lr)
    theirs = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optimisation.lr)
    warmup = S.LinearLR(theirs, start_factor=0.01, total_iters=5)
    assert lrs(scheduler_of(cfg, ours), ours, 5) == lrs(warmup, theirs, 5)
