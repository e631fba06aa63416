"""The optimizer and its schedule: AdamW or SGD with fused kernels, linear warm-up then cosine decay."""

from __future__ import annotations

import math

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


def build_optimizer(cfg: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]  # norms and biases
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # Fused kernels update every parameter in one pass, on CUDA and on CPU alike (make bench: AdamW's
    # step alone is several times faster on CPU than torch's default there); torch's default otherwise.
    fused = all(_fusable(p) for p in decay + no_decay) or None
    if cfg.optimizer == "sgd":
        optimizer = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0, fused=fused)
    else:
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, fused=fused)
    optimizer.register_load_state_dict_pre_hook(_keep_this_runs_kernels)
    return optimizer


def lr_factor(cfg: Config, step: int) -> float:
    """Linear warm-up to 1, then cosine decay to min_lr_ratio at max_steps."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
