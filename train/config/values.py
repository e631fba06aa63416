"""Every setting's range, and the settings one needs given (check_values): the command line's and a config file's
values, checked once they are a Config (train/cli.py), each mistake one line: the cause and the fix."""

from __future__ import annotations

import math

from train.base.errors import ConfigError
from train.config.settings import Config, Model, flag, settings


def check_values(cfg: Config) -> None:
    """Every setting in its range, and the settings that one needs given: the first mistake is one line."""
    for f in settings():  # nan passes every comparison below, and inf most: neither is a setting's value
        value = cfg.setting(f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"--{flag(f.name)} must be a finite number, got {value}: pass a number"
                              + (f" (its default: {f.default})" if f.default is not None else ""))
    positive = ("max_steps", "batch_size", "grad_accum", "image_size", "train_samples", "val_samples",
                "save_every", "keep_checkpoints", "log_every", "timeout_s", "width", "bucket_cap_mb")
    for name in positive:
        if cfg.setting(name) <= 0:
            raise ConfigError(f"--{flag(name)} must be > 0, got {cfg.setting(name)}: pass a positive value")
    non_negative = ("spawn", "stop_at", "threads", "warmup_steps", "eval_every", "grad_clip", "weight_decay",
                    "momentum", "epochs", "warmup_epochs")
    for name in non_negative:
        if cfg.setting(name) < 0:
            raise ConfigError(f"--{flag(name)} must be >= 0, got {cfg.setting(name)}: pass 0 or more")
    if cfg.data.num_workers < -1:
        raise ConfigError(f"--num-workers must be -1 (auto) or >= 0, got {cfg.data.num_workers}: pass -1, 0 (load "
                          f"in the training process) or a worker count")
    schedule = cfg.schedule
    if cfg.optimisation.lr <= 0:
        raise ConfigError(f"--lr must be > 0, got {cfg.optimisation.lr}: pass a positive learning rate, e.g. "
                          f"--lr 3e-4")
    if not 0 <= schedule.min_lr_ratio <= 1:
        raise ConfigError(f"--min-lr-ratio must be within [0, 1], got {schedule.min_lr_ratio}: pass a fraction of "
                          f"--lr, e.g. 0.1")
    if schedule.warmup_epochs and not cfg.run.epochs:
        raise ConfigError(f"--warmup-epochs {schedule.warmup_epochs} needs --epochs: give the run's length in "
                          f"epochs too, or the warm-up in --warmup-steps")
    _check_recipe(cfg)
    _check_sharded(cfg.model, cfg.regularisation.model_ema)
    if cfg.model.activation_checkpointing and cfg.model.compile:
        raise ConfigError("--activation-checkpointing with --compile is not built yet (the recomputed blocks are not "
                          "proven to compile to the same weights): drop one of them")
    if cfg.data.image_size < 8:
        raise ConfigError(f"--image-size must be at least 8, got {cfg.data.image_size}: pass 8 or more (pixels)")
    for f in settings():
        choices = f.metadata.get("choices")
        if choices and cfg.setting(f.name) not in choices:
            raise ConfigError(f"--{flag(f.name)} must be one of {', '.join(c for c in choices if c)}, "
                              f"got {cfg.setting(f.name)!r}: pass one of those")
    if cfg.checkpoints.checkpoint_format == "sharded":
        if cfg.model.parallel != "fsdp":
            raise ConfigError("--checkpoint-format sharded writes each worker's shards, and under --parallel ddp "
                              "every worker holds the whole state: use it with --parallel fsdp, or drop it")
        if cfg.tracking.mlflow_checkpoints:
            raise ConfigError("--mlflow-checkpoints sends each checkpoint file to MLflow, and a sharded checkpoint "
                              "is a folder of every worker's shards (not built yet): drop one of them (model.pt "
                              "and best.pt go to MLflow either way)")


def _check_recipe(cfg: Config) -> None:
    """The recipe knobs: ranges, and the knobs a setting needs."""
    for name in ("label_smoothing", "random_erase", "warmup_decay"):
        if not 0 <= cfg.setting(name) <= 1:
            raise ConfigError(f"--{flag(name)} must be within [0, 1], got {cfg.setting(name)}: pass a fraction")
    for name in ("ra_reps", "mixup_alpha", "cutmix_alpha", "norm_weight_decay", "bias_weight_decay",
                 "transformer_embedding_decay", "train_crop_size", "val_resize_size", "val_crop_size"):
        if cfg.setting(name) is not None and cfg.setting(name) < 0:
            raise ConfigError(f"--{flag(name)} must be >= 0, got {cfg.setting(name)}: pass 0 or more")
    for name in ("lr_step_size", "model_ema_steps", "augmix_severity"):
        if cfg.setting(name) <= 0:
            raise ConfigError(f"--{flag(name)} must be > 0, got {cfg.setting(name)}: pass a positive value")
    schedule, ema_decay = cfg.schedule, cfg.regularisation.model_ema_decay
    if not 0 < schedule.lr_gamma <= 1 or not 0 < ema_decay < 1:
        raise ConfigError(f"--lr-gamma must be within (0, 1] and --model-ema-decay within (0, 1), got "
                          f"{schedule.lr_gamma} and {ema_decay}: pass fractions, e.g. 0.1 and 0.99998")
    if schedule.lr_scheduler == "multistep" and not schedule.milestones():
        raise ConfigError("--lr-scheduler multistep needs --lr-milestones: pass e.g. --lr-milestones 30,60,80")
    epochs, warmup = cfg.run.epochs, schedule.warmup_epochs
    if schedule.schedule_unit == "epoch" and (not epochs or warmup != int(warmup)):
        raise ConfigError(f"--schedule-unit epoch needs --epochs and a whole --warmup-epochs, got --epochs "
                          f"{epochs} --warmup-epochs {warmup}: give the run in whole epochs, or use "
                          f"--schedule-unit step")


# What --parallel fsdp does not take yet, each with why: refused in one line, never trained otherwise than asked
NOT_SHARDED = (
    ("model_ema", "its average is a whole copy of the model on every worker, what sharding is there to avoid"),
    ("compile", "compiling the sharded blocks one by one is not built yet"),
    ("sync_bn", "SyncBatchNorm under sharding is not built yet"),
    ("channels_last", "channels-last weights under sharding are not built yet"),
)


def _check_sharded(spec: Model, model_ema: bool) -> None:
    """--parallel fsdp (spec: the model's settings) with a setting it does not take (NOT_SHARDED, --model-ema too;
    --precision fp16: its GradScaler unscales whole gradients)."""
    if spec.parallel != "fsdp":
        return
    for name, why in NOT_SHARDED:
        if model_ema if name == "model_ema" else getattr(spec, name):
            raise ConfigError(f"--{flag(name)} is not available with --parallel fsdp ({why}): drop it, or train "
                              f"with --parallel ddp")
    if spec.precision == "fp16":
        raise ConfigError("--precision fp16 is not available with --parallel fsdp (its GradScaler unscales whole "
                          "gradients, not shards): use --precision bf16, or --parallel ddp")
