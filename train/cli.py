"""The command line and config files, read into the one Config (train/config/settings.py): the flags derived from its
sections (one per setting, grouped in --help by section), a .json or .toml file of the same names, a preset's
defaults, and the sizes named --weights bring. A setting the config never reads is refused, never ignored.

Precedence, lowest first: field defaults < --preset < --config FILE < command-line flags.
"""

from __future__ import annotations

import argparse
import json
import typing
from pathlib import Path

from train.base.errors import ConfigError, OneLineParser
from train.base.vision import evaluation_transforms
from train.config.catalog import OWN_SETTINGS, read_from_files, reads, source
from train.config.settings import (IMAGENET_FROM, LM_BATCH, LM_DATASET, LM_MODEL, PRESETS, SECTION_OF,
                                   SECTIONS, SEGMENTATION_MODEL, Config, Schedule, augmentation_recipe, flag,
                                   settings, unknown_key)
from train.config.values import check_values

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli where installed
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None


def _field_type(name: str) -> tuple[type, bool]:
    """The field's type and whether it may be unset; for an optional field (float | None: unset means something of
    its own), its type when set."""
    kind = typing.get_type_hints(SECTIONS[SECTION_OF[name]])[name]
    if not typing.get_args(kind):
        return kind, False
    return next(t for t in typing.get_args(kind) if t is not type(None)), type(None) in typing.get_args(kind)


def _coerce(name: str, value, source: str):
    """Check a value from a config file against the field's type (ints are accepted for floats; null, as config.json
    writes an optional setting left unset, is accepted where the setting may be unset)."""
    kind, optional = _field_type(name)
    if value is None and optional:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is bool and not isinstance(value, bool):
        raise ConfigError(f"{source}: {name} must be true or false, got {value!r}")
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{source}: {name} must be {kind.__name__}, got {value!r}")
    return value


# The settings that only the built-in classification's data, transforms, batch augmentations and loss read.
IMAGE_PIPELINE = ("dataset", "path_column", "label_column", "label_key", "image_column", "train_split", "val_split",
                  "download", "image_size", "train_samples", "val_samples", "decode", "normalize", "augment",
                  "train_crop_size", "val_resize_size", "val_crop_size", "interpolation", "auto_augment",
                  "ra_magnitude", "augmix_severity", "random_erase", "mixup_alpha", "cutmix_alpha", "label_smoothing",
                  "width")


# The image pipeline's settings that --task segmentation never reads.
SEGMENTATION_SKIPS = ("augment", "train_crop_size", "val_resize_size", "val_crop_size", "interpolation", "auto_augment",
                      "ra_magnitude", "augmix_severity", "random_erase", "mixup_alpha", "cutmix_alpha",
                      "label_smoothing", "decode", "width")


def inert(cfg: Config) -> dict[str, str]:
    """The settings this config never reads, each with why and the fix: given by a user, they are refused
    (parse_config), never ignored. The first rule that names a setting gives its reason."""
    found: dict[str, str] = {}
    rules = (*_data_rules(cfg), *_training_rules(cfg.model.model, cfg.optimisation.optimizer, cfg.schedule,
                                                  cfg.regularisation.model_ema, cfg.model.parallel))
    for names, applies, why in rules:
        for name in names if applies else ():
            found.setdefault(name, why)
    return found


def _data_rules(cfg: Config) -> list[tuple[tuple[str, ...], bool, str]]:
    """(settings, whether this config leaves them unread, why and the fix) for the task, the data and its
    transforms."""
    small = ("--augment cifar" if cfg.augmentation.augment == "cifar"
             else f"--image-size {cfg.data.image_size} is below {IMAGENET_FROM}")
    own = ":" in cfg.run.task  # a task of the user's: its own data and model, none of the image pipeline's
    masks = cfg.run.task == "segmentation"
    name = cfg.data.dataset
    data = source(name)
    return [
        (SEGMENTATION_SKIPS, masks, "with --task segmentation (its images and masks take the segmentation reference's "
                                    "joint transforms, its loss no label smoothing, its batches no mixing): drop it"),
        (tuple(s for s in IMAGE_PIPELINE if s not in ("dataset", "train_samples", "val_samples")),
         cfg.run.task == "lm", "with --task lm (byte tokens, no images: the image pipeline is classification's): drop "
                               "it"),
        (IMAGE_PIPELINE, own, f"with --task {cfg.run.task} (a task of your own reads its own data: the built-in "
                              f"image pipeline, its sources, transforms and augmentations, is classification's): drop "
                              f"it, or read the setting in your task (docs/tasks.md)"),
        (("augment", "train_crop_size", "val_resize_size", "val_crop_size", "interpolation", "auto_augment",
          "ra_magnitude", "augmix_severity", "num_workers"), data.in_memory and not own,
         f"with --dataset {name} (images made in memory at --image-size: no files to resize, crop, augment "
         f"or load): drop it, or train on image files (--dataset imagefolder, csv, shards, hf or cifar10)"),
        (("augment", "train_crop_size", "val_resize_size", "val_crop_size", "interpolation", "auto_augment",
          "ra_magnitude", "augmix_severity", "decode"), cfg.data.dataset == "masks",
         "with --dataset masks (the loader workers decode each image and its mask and move them together at "
         "--image-size, as torchvision's segmentation reference: a random resize, flip and crop; for evaluation a "
         "resize and centre crop): drop it"),
        (("data_dir",), data.generated and not own,
         f"with --dataset {name} (made from the seed: no files are read): drop it, or name the kind of files under it "
         f"(--dataset {_one_of(read_from_files(cfg.run.task))})"),
        (("train_samples", "val_samples"), not data.counted,
         f"with --dataset {name} (its size is its files'): drop it"),
        (("train_crop_size", "val_resize_size", "val_crop_size", "interpolation"),
         not data.in_memory and augmentation_recipe(cfg.data, cfg.augmentation) == "cifar",
         f"under the cifar recipe ({small}: a bilinear resize and centre crop to --image-size): drop it, or pass "
         f"--augment imagenet"),
        (("ra_magnitude",), not data.in_memory and cfg.augmentation.auto_augment != "ra",
         f"with --auto-augment {cfg.augmentation.auto_augment}: drop it, or pass --auto-augment ra"),
        (("augmix_severity",), not data.in_memory and cfg.augmentation.auto_augment != "augmix",
         f"with --auto-augment {cfg.augmentation.auto_augment}: drop it, or pass --auto-augment augmix"),
        (("tokenizer",), cfg.run.task != "lm" or name != "text",
         f"with --task {cfg.run.task} --dataset {name} (a tokenizer.json turns a text folder's files into "
         f"tokens for a language model): drop it, or pass --task lm --dataset text"),
        *((settings, not reads(name, settings), f"with --dataset {name} ({why}): drop it{fix}")
          for settings, why, fix in OWN_SETTINGS),
    ]


def _one_of(names: list[str]) -> str:
    """a, b or c (a task that reads no files, or one not yet known, names none)."""
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)


def _training_rules(model: str, optimizer: str, schedule: Schedule, model_ema: bool,
                    parallel: str) -> list[tuple[tuple[str, ...], bool, str]]:
    """The same for the model (--model), the optimiser (--optimizer), the schedule, the EMA (--model-ema) and the
    spread over the workers (--parallel)."""
    scheduler = schedule.lr_scheduler
    return [
        (("static_graph", "bucket_cap_mb"), parallel != "ddp",
         f"with --parallel {parallel} (DDP's gradient buckets: FSDP reduces each block's gradients as one): drop it"),
        (("width",), model != "cnn", f"with --model {model} (it sizes the built-in cnn): drop it"),
        (("momentum", "nesterov"), optimizer != "sgd",
         f"with --optimizer {optimizer}: drop it, or pass --optimizer sgd"),
        (("lr_step_size",), scheduler != "step",
         f"with --lr-scheduler {scheduler}: drop it, or pass --lr-scheduler step"),
        (("lr_gamma",), scheduler not in ("step", "multistep"),
         f"with --lr-scheduler {scheduler}: drop it, or pass --lr-scheduler step or multistep"),
        (("lr_milestones",), scheduler != "multistep",
         f"with --lr-scheduler {scheduler}: drop it, or pass --lr-scheduler multistep"),
        (("min_lr_ratio",), scheduler != "cosine",
         f"with --lr-scheduler {scheduler}: drop it, or pass --lr-scheduler cosine"),
        (("warmup_method", "warmup_decay"), not (schedule.warmup_epochs or schedule.warmup_steps),
         "without a warm-up (--warmup-steps 0): drop it, or give the warm-up a length"),
        (("model_ema_steps", "model_ema_decay"), not model_ema,
         "without --model-ema: drop it, or pass --model-ema"),
    ]


def check_no_effect(unread: dict[str, str], given: dict[str, str]) -> None:
    """A setting the user gave (given: name -> where) that the config never reads (unread: inert's) is one line, not
    ignored."""
    for name, why in unread.items():
        if name in given:
            raise ConfigError(f"{given[name]} has no effect {why}")


def load_config_file(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} not found: pass an existing .json or .toml file to --config")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise ConfigError(f"cannot read config file {path} ({why}): pass a readable UTF-8 .json or .toml "
                          f"file") from None
    try:
        if p.suffix == ".toml":
            if tomllib is None:
                raise ConfigError(f"config file {path}: TOML needs Python >= 3.11 (or tomli): use a .json file")
            data = tomllib.loads(text)
        elif p.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"config file {path}: use a .json or .toml file")
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"config file {path} is malformed ({str(e).splitlines()[0]}): fix the syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table of keys, not {type(data).__name__}")
    out = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in SECTION_OF:
            raise unknown_key(key, f"config file {path}")
        if name == "task_settings" and isinstance(value, dict):  # a [task_settings] table
            value = json.dumps(value, sort_keys=True)
        out[name] = _coerce(name, value, f"config file {path}")
    return out


def canonical_settings(text: str) -> str:
    """A task's own settings as one JSON object with sorted keys (what config.json keeps and a resume compares): from a
    JSON object, or KEY=VALUE,KEY=VALUE with each value read as JSON where it parses (64, 0.5, true), else a
    string."""
    text = text.strip()
    if not text:
        return ""
    if text.startswith("{"):
        try:
            values = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"--task-settings {text}: not a JSON object ({e}): pass KEY=VALUE,KEY=VALUE or a JSON "
                              f"object") from None
    else:
        values = {}
        for pair in (p.strip() for p in text.split(",") if p.strip()):
            key, sep, value = pair.partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"--task-settings {text}: {pair!r} is not KEY=VALUE: pass KEY=VALUE,KEY=VALUE")
            try:
                values[key.strip()] = json.loads(value)
            except ValueError:
                values[key.strip()] = value
    if not isinstance(values, dict):
        raise ConfigError(f"--task-settings {text}: not a JSON object: pass KEY=VALUE,KEY=VALUE or a JSON object")
    return json.dumps(values, sort_keys=True)


def get_args_parser() -> argparse.ArgumentParser:
    """The command line, derived from Config: one flag per field, grouped in --help by the field's section."""
    parser = OneLineParser(prog="python -m train", description="trainbox: PyTorch DDP trainer",
                           argument_default=argparse.SUPPRESS, allow_abbrev=False)
    groups = {name: parser.add_argument_group(name, kind.__doc__) for name, kind in SECTIONS.items()}
    groups["run"].add_argument("--config", help="a .json or .toml file of config keys (flags override it)")
    for f in settings():
        group, (kind, _) = groups[SECTION_OF[f.name]], _field_type(f.name)
        help_text = f.metadata['help'] + ("" if f.default is None else f" (default: {f.default!r})")
        option = f"--{flag(f.name)}"
        if kind is bool:
            group.add_argument(option, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            choices = f.metadata.get("choices")
            group.add_argument(option, type=kind, help=help_text, metavar=None if choices else f.name.upper(),
                               choices=[c for c in choices if c] if choices else None)
    return parser


def parse_config(argv: list[str] | None = None) -> Config:
    """Build the resolved Config from defaults, preset, config file and flags; raise ConfigError."""
    args = vars(get_args_parser().parse_args(argv))
    config_path = args.pop("config", None)
    file_values = load_config_file(config_path) if config_path else {}
    preset = args.get("preset", file_values.get("preset", ""))
    if preset not in PRESETS and preset != "":
        raise ConfigError(f"unknown preset {preset!r}: use one of {', '.join(PRESETS)}")
    given = {**file_values, **args}  # what the user set (a preset's values are defaults, not choices)
    chosen = _chosen(file_values, args, preset)
    for length, steps in (("epochs", "max_steps"), ("warmup_epochs", "warmup_steps")):
        if chosen.get(length) and steps in chosen:
            raise ConfigError(f"--{flag(length)} and --{flag(steps)} both set the same length: give one of them")
    values = {**PRESETS.get(preset, {}), **file_values, **args}
    if values.get("task_settings"):
        values["task_settings"] = canonical_settings(values["task_settings"])
    if values.get("task") == "segmentation" and "model" not in given:  # the task's own default network
        values["model"] = SEGMENTATION_MODEL
    if values.get("task") == "lm":  # its own default network, data and batch (nanoGPT's CPU batch of 64-token windows)
        values.update({k: v for k, v in (("model", LM_MODEL), ("dataset", LM_DATASET), ("batch_size", LM_BATCH))
                       if k not in given and k not in PRESETS.get(preset, {})})
    cfg = Config.from_dict(values)
    check_values(cfg)
    cfg = _weights_sizes(cfg, given)
    where = {**{k: f"{k} = {v!r} in {config_path}" for k, v in file_values.items() if k in chosen},
             **{k: f"--{'no-' if v is False else ''}{flag(k)}{'' if isinstance(v, bool) else f' {v}'}"
                for k, v in args.items()}}
    check_no_effect(inert(cfg), where)
    return cfg


def _chosen(file_values: dict, args: dict, preset: str) -> dict:
    """What the user chose, of a config file's settings and the flags. A config file that sets every setting is a
    run's record (its config.json: the settings as that run resolved them); those at the value the preset or the
    defaults give anyway are the record's, not choices, so that `--config runs/X/config.json` runs X's settings
    again. Any other is a choice, as in every file: one the setup never reads is refused."""
    if not set(SECTION_OF) <= set(file_values):
        return {**file_values, **args}
    base = Config.from_dict(PRESETS.get(preset, {})).to_dict()
    return {**{k: v for k, v in file_values.items() if v != base[k]}, **args}


def _weights_sizes(cfg: Config, given: dict) -> Config:
    """Named --weights bring their own evaluation transforms (resize R, crop C, interpolation): on image files they
    are the defaults of the sizes the user left unset: the image size C, the evaluation's resize the crop x R / C
    (R itself at C), their interpolation where the recipes offer it. Sizes the user gives win. --dataset masks reads
    --image-size alone (train/data/masks.py), as the segmentation weights' own transforms give no crop."""
    if not cfg.model.weights or not source(cfg.data.dataset).transformed:
        return cfg
    own = evaluation_transforms(cfg.model.model, cfg.model.weights)  # torchvision is imported for named weights only
    if own is None:  # a file
        return cfg
    resize, crop, interpolation = own
    image_size = cfg.data.image_size if "image_size" in given else crop
    sizes = {"image_size": image_size}
    if "val_resize_size" not in given:
        sizes["val_resize_size"] = (cfg.augmentation.val_crop_size or image_size) * resize // crop
    if "interpolation" not in given and interpolation in ("bilinear", "bicubic"):
        sizes["interpolation"] = interpolation
    return cfg.replace(**sizes)
