"""The optimizer and its schedule: AdamW or SGD with fused kernels, weight-decay groups as torchvision's
reference forms them, and torch's own schedulers (warm-up, then cosine, step, multistep or constant)."""

from __future__ import annotations

import warnings

import torch

from train.base.errors import ConfigError
from train.components.models import BATCH_NORMS, INSTANCE_NORMS
from train.config.settings import Optimisation, Schedule


def _fusable(p: torch.Tensor) -> bool:
    """Fused optimizer kernels take real tensors stored densely: a strided view would be updated wrongly."""
    layouts = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)
    return p.is_floating_point() and any(p.is_contiguous(memory_format=f) for f in layouts)


def _keep_this_runs_kernels(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """A saved optimizer's param groups carry the kernels it ran with; a resume keeps this run's choice."""
    for saved, current in zip(state_dict["param_groups"], optimizer.param_groups, strict=False):
        saved["fused"], saved["foreach"] = current.get("fused"), current.get("foreach")
    return state_dict


# The modules whose parameters --norm-weight-decay covers (torchvision's reference and torchvision.ops' own list).
NORM_CLASSES = (*BATCH_NORMS, torch.nn.LayerNorm, torch.nn.GroupNorm, *INSTANCE_NORMS, torch.nn.LocalResponseNorm)
# --transformer-embedding-decay's parameter names, the reference's list as it stands (torchvision's ViT names its
# position embedding pos_embedding, which this list does not match: there it takes --weight-decay, as in the
# reference).
EMBEDDING_KEYS = ("class_token", "position_embedding", "relative_position_bias_table")


def decay_groups(opt: Optimisation, model: torch.nn.Module, model_name: str) -> list[dict]:
    """The trainable parameters' names in the weight-decay groups of torchvision's reference (its
    utils.set_weight_decay): a parameter named `bias` takes --bias-weight-decay and one of EMBEDDING_KEYS
    --transformer-embedding-decay, each only when given; else one of a normalisation layer --norm-weight-decay,
    only when given; every other --weight-decay. Empty groups are left out; the order is the reference's (other,
    norm, bias, the embedding keys). A parameter two modules share counts once, under the name named_parameters()
    gives it. A decay given for parameters the model does not have is one line."""
    custom = {**({"bias": opt.bias_weight_decay} if opt.bias_weight_decay is not None else {}),
              **({key: opt.transformer_embedding_decay for key in EMBEDDING_KEYS}
                 if opt.transformer_embedding_decay is not None else {})}
    decay = {"other": opt.weight_decay, "norm": opt.norm_weight_decay, **custom}
    names: dict[str, list[str]] = {key: [] for key in decay}
    seen: set[int] = set()  # a parameter shared by two modules (a head tied to an embedding) is in one group, once
    for prefix, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                norm = opt.norm_weight_decay is not None and isinstance(module, NORM_CLASSES)
                key = name if name in custom else "norm" if norm else "other"
                names[key].append(f"{prefix}.{name}" if prefix else name)
    unused = [flag for flag, keys in (("norm-weight-decay", ["norm"] if opt.norm_weight_decay is not None else []),
                                      ("bias-weight-decay", ["bias"] if "bias" in custom else []),
                                      ("transformer-embedding-decay", [k for k in EMBEDDING_KEYS if k in custom]))
              if keys and not any(names[k] for k in keys)]
    if unused:
        raise ConfigError(f"--{unused[0]} has no effect: --model {model_name} has no trainable parameter it covers "
                          f"({_covers(unused[0])}): drop it")
    return [{"weight_decay": decay[key], "params": params} for key, params in names.items() if params]


def _covers(flag: str) -> str:
    return {"norm-weight-decay": "of a normalisation layer", "bias-weight-decay": "named bias",
            "transformer-embedding-decay": "named " + ", ".join(EMBEDDING_KEYS)}[flag]


def build_optimizer(opt: Optimisation, model: torch.nn.Module, groups: list[dict]) -> torch.optim.Optimizer:
    """The optimizer over `groups` (decay_groups: the parameters by name, with their weight decay)."""
    by_name = dict(model.named_parameters())
    groups = [{"params": [by_name[n] for n in g["params"]], "weight_decay": g["weight_decay"]} for g in groups]
    # Fused kernels update every parameter in one pass, on CUDA and on CPU alike (make bench: AdamW's
    # step alone is several times faster on CPU than torch's default there); torch's default otherwise.
    fused = all(_fusable(p) for g in groups for p in g["params"]) or None
    if opt.optimizer == "sgd":
        nesterov = opt.nesterov and opt.momentum > 0
        optimizer = torch.optim.SGD(groups, lr=opt.lr, momentum=opt.momentum, nesterov=nesterov, fused=fused)
    else:
        optimizer = torch.optim.AdamW(groups, lr=opt.lr, fused=fused)
    optimizer.register_load_state_dict_pre_hook(_keep_this_runs_kernels)
    return optimizer


def schedule_lengths(schedule: Schedule, epochs: int, max_steps: int, warmup_steps: int) -> tuple[int, int]:
    """(the schedule's length, its warm-up) in its unit: the run's optimizer steps (max_steps, warmup_steps: the
    plan's), or epochs (--schedule-unit epoch: --epochs)."""
    if schedule.schedule_unit == "epoch":
        return epochs, int(schedule.warmup_epochs)
    return max_steps, warmup_steps


def build_scheduler(schedule: Schedule, optimizer: torch.optim.Optimizer, total: int,
                    warmup: int) -> torch.optim.lr_scheduler.LRScheduler:
    """torch's schedulers as torchvision's reference combines them: --warmup-method over the warm-up
    (starting at --warmup-decay times --lr), then --lr-scheduler: cosine (to --min-lr-ratio times --lr at
    the end), step (times --lr-gamma every --lr-step-size), multistep (at each of --lr-milestones) or
    constant. The trainer steps it once per optimizer step, or once per epoch with --schedule-unit epoch;
    total and warmup are in that unit (schedule_lengths)."""
    sched = torch.optim.lr_scheduler
    if schedule.lr_scheduler == "cosine":
        # A warm-up as long as the run leaves the cosine no step: one keeps torch's scheduler defined.
        main = sched.CosineAnnealingLR(optimizer, T_max=max(1, total - warmup),
                                       eta_min=optimizer.defaults["lr"] * schedule.min_lr_ratio)
    elif schedule.lr_scheduler == "step":
        main = sched.StepLR(optimizer, step_size=schedule.lr_step_size, gamma=schedule.lr_gamma)
    elif schedule.lr_scheduler == "multistep":
        main = sched.MultiStepLR(optimizer, milestones=schedule.milestones(), gamma=schedule.lr_gamma)
    else:
        main = sched.ConstantLR(optimizer, factor=1.0, total_iters=0)
    if warmup == 0:
        return main
    kind = sched.LinearLR if schedule.warmup_method == "linear" else sched.ConstantLR
    first = kind(optimizer, schedule.warmup_decay, total_iters=warmup)  # LinearLR: start_factor; ConstantLR: factor
    return sched.SequentialLR(optimizer, schedulers=[first, main], milestones=[warmup])


def schedule_at(schedule: Schedule, optimizer: torch.optim.Optimizer, total: int, warmup: int,
                steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """The schedule of `total` (and `warmup`) as an uninterrupted run of that length has it after `steps` of its own
    steps: built anew from the optimizer's initial rates and stepped there (a resume that changed the run's length;
    the optimizer's own steps were taken before it)."""
    for group in optimizer.param_groups:
        group["lr"] = group.get("initial_lr", group["lr"])
    scheduler = build_scheduler(schedule, optimizer, total, warmup)
    with warnings.catch_warnings():  # stepped without optimizer steps: those were taken before
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            scheduler.step()
    return scheduler
