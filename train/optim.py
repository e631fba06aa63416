"""The optimizer and its schedule: AdamW or SGD with fused kernels, weight-decay groups as torchvision's
reference forms them, and torch's own schedulers (warm-up, then cosine, step, multistep or constant)."""

from __future__ import annotations

import torch

from train.config import Config


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
NORM_CLASSES = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.LayerNorm, torch.nn.GroupNorm,
                torch.nn.modules.instancenorm._InstanceNorm, torch.nn.LocalResponseNorm)


def param_groups(cfg: Config, model: torch.nn.Module) -> list[dict]:
    """The trainable parameters in torchvision's reference groups: a parameter named `bias` takes
    --bias-weight-decay, one of a normalisation layer --norm-weight-decay, every other --weight-decay
    (empty groups left out, the order as the reference's: other, norm, bias)."""
    groups: dict[str, list] = {"other": [], "norm": [], "bias": []}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad:
                groups["bias" if name == "bias" else "norm" if isinstance(module, NORM_CLASSES) else "other"].append(p)
    decay = {"other": cfg.weight_decay, "norm": cfg.norm_weight_decay, "bias": cfg.bias_weight_decay}
    return [{"params": params, "weight_decay": decay[key]} for key, params in groups.items() if params]


def build_optimizer(cfg: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    groups = param_groups(cfg, model)
    # Fused kernels update every parameter in one pass, on CUDA and on CPU alike (make bench: AdamW's
    # step alone is several times faster on CPU than torch's default there); torch's default otherwise.
    fused = all(_fusable(p) for g in groups for p in g["params"]) or None
    if cfg.optimizer == "sgd":
        nesterov = cfg.nesterov and cfg.momentum > 0
        optimizer = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=nesterov, fused=fused)
    else:
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, fused=fused)
    optimizer.register_load_state_dict_pre_hook(_keep_this_runs_kernels)
    return optimizer


def schedule_lengths(cfg: Config) -> tuple[int, int]:
    """(the schedule's length, its warm-up) in its unit: optimizer steps, or epochs (--schedule-unit epoch)."""
    if cfg.schedule_unit == "epoch":
        return cfg.epochs, int(cfg.warmup_epochs)
    return cfg.max_steps, cfg.warmup_steps


def build_scheduler(cfg: Config, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """torch's schedulers as torchvision's reference combines them: --warmup-method over the warm-up
    (starting at --warmup-decay times --lr), then --lr-scheduler: cosine (to --min-lr-ratio times --lr at
    the end), step (times --lr-gamma every --lr-step-size), multistep (at each of --lr-milestones) or
    constant. The trainer steps it once per optimizer step, or once per epoch with --schedule-unit epoch."""
    sched = torch.optim.lr_scheduler
    total, warmup = schedule_lengths(cfg)
    if cfg.lr_scheduler == "cosine":
        # A warm-up as long as the run leaves the cosine no step: one keeps torch's scheduler defined.
        main = sched.CosineAnnealingLR(optimizer, T_max=max(1, total - warmup), eta_min=cfg.lr * cfg.min_lr_ratio)
    elif cfg.lr_scheduler == "step":
        main = sched.StepLR(optimizer, step_size=cfg.lr_step_size, gamma=cfg.lr_gamma)
    elif cfg.lr_scheduler == "multistep":
        main = sched.MultiStepLR(optimizer, milestones=cfg.milestones(), gamma=cfg.lr_gamma)
    else:
        main = sched.ConstantLR(optimizer, factor=1.0, total_iters=0)
    if warmup == 0:
        return main
    kind = sched.LinearLR if cfg.warmup_method == "linear" else sched.ConstantLR
    first = kind(optimizer, cfg.warmup_decay, total_iters=warmup)  # LinearLR: start_factor; ConstantLR: factor
    return sched.SequentialLR(optimizer, schedulers=[first, main], milestones=[warmup])
