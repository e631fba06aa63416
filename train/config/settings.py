"""The one config object: its sections (each setting with its default, its help line and its checks), the
presets, and what a config means where it is read (the recipe, the steps of a run given in epochs).

The command line and config files are read into it by train/cli.py (parse_config); a run folder's config.json
by Config.from_dict. Every mistake (unknown key, wrong type, bad value) raises ConfigError with one line that
names the cause and the fix; __main__ prints it and exits 2 before any process starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field, fields

from train.base.errors import ConfigError
from train.config.catalog import SOURCES

SEGMENTATION_MODEL = "lraspp_mobilenet_v3_large"  # --task segmentation's network where --model is not given
# --task lm's network, data and batch where --model, --dataset, --batch-size are not given
LM_MODEL, LM_DATASET, LM_BATCH = "gpt-tiny", "copy", 32


def _field(default, help: str, choices: tuple | None = None):
    """A setting: its default, its help line (--help) and, where it has them, its choices."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class Run:
    """What the run is and how long: its folder, seed, length, a stop, a dry run."""

    run_dir: str = _field("", "run directory (checkpoints, logs, model.pt); re-using one resumes it; empty: "
                              "runs/<timestamp>")
    preset: str = _field("", "named preset applied before the config file and flags", choices=("", "debug", "default"))
    seed: int = _field(0, "seed for the model, the built-in data, sampling and augmentation")
    max_steps: int = _field(600, "total optimizer steps of the run, counted across resumes")
    epochs: int = _field(0, "train for N passes over the training set instead of --max-steps: the steps follow from "
                            "its size, the workers, --batch-size and --grad-accum (printed at start, in plan.json); 0: "
                            "--max-steps")
    stop_at: int = _field(0, "stop after this step as a stop signal would (checkpoint, exit 75); 0: off")
    dry_run: bool = _field(False, "print the run's plan (steps, world size, weight-decay groups, normalisation, "
                                  "transforms, learning rates, EMA, sampler, precision, weights) as JSON on stdout and "
                                  "exit: no run folder, no download, no training")
    deterministic: bool = _field(False, "deterministic kernels, fixed threads, bucket-independent gradient reduction")
    task: str = _field("classification", "what the run trains for: classification (images and class labels), "
                                         "segmentation (a class per pixel), lm (a causal language model of byte "
                                         "tokens), or package.module:factory, a task of your own (docs/tasks.md)")
    task_settings: str = _field("", "a task's own settings (its Settings dataclass), as KEY=VALUE,KEY=VALUE or a "
                                    "JSON object; a config file's [task_settings] table; checked against the task's "
                                    "fields, kept in config.json")


@dataclass(frozen=True)
class Launch:
    """Read by python -m train before any worker starts."""

    spawn: int = _field(0, "start N local worker processes with torch.multiprocessing (0: do not spawn)")
    device: str = _field("auto", "auto: CUDA if available, else CPU", choices=("auto", "cpu", "cuda"))
    timeout_s: int = _field(600, "collective timeout in seconds; a stuck rank fails the job after this long")
    threads: int = _field(0, "CPU threads per process; 0: the cores available divided by the local workers")


@dataclass(frozen=True)
class Data:
    """The dataset and how it is read."""

    dataset: str = _field("shapes", "shapes: built-in, no download; cifar10; imagefolder (DATA_DIR/train, "
                                    "DATA_DIR/val); csv (label files: DATA_DIR/train.csv and val.csv, or .tsv, "
                                    ".jsonl: a path and a label per row); shards (make pack's, or WebDataset tars of "
                                    "another tool); hf (a Hugging Face dataset: save_to_disk's folder, or Parquet "
                                    "files); masks (segmentation: DATA_DIR/train/images/<path>.jpg, .png, ... and "
                                    "DATA_DIR/train/masks/<path>.png, the same under val/, each mask's pixels a class "
                                    "index or 255, ignored; class names in DATA_DIR/classes.txt, else the values); "
                                    "copy (--task lm: copy documents from the seed, their floor exact; the default "
                                    "there); text (--task lm: DATA_DIR/train/**/*.txt, DATA_DIR/val/**/*.txt, byte tokens); "
                                    "synthetic: random images for benchmarks (learns nothing)",
                                    choices=tuple(SOURCES))
    data_dir: str = _field("data", "dataset root for cifar10, imagefolder, csv, shards, hf, masks and text")
    path_column: str = _field("", "csv: the label files' column of image paths; empty: the first of path, image, "
                                  "file, filename, filepath")
    label_column: str = _field("", "csv: the label files' column of labels (class names, or indices into "
                                   "classes.txt); empty: the first of label, class, category, target; hf: the "
                                   "dataset's label column; empty: label, else labels, else its one ClassLabel")
    label_key: str = _field("cls", "shards of another tool: each sample's label is the integer in its <key>.LABEL_KEY "
                                   "member, else its .json member's LABEL_KEY field")
    image_column: str = _field("", "hf: the dataset's image column (an Image feature, bytes or paths); empty: image, "
                                   "else img, else its one Image column")
    train_split: str = _field("train", "hf: the split to train on")
    val_split: str = _field("", "hf: the split to evaluate on; empty: the first of validation, val, test it has")
    download: bool = _field(False, "download CIFAR-10 into --data-dir if it is missing (local rank 0 of each node)")
    tokenizer: str = _field("", "--task lm --dataset text: a Hugging Face tokenizer.json (the tokenizers package) "
                                "that turns each UTF-8 file into tokens; empty: byte tokens")
    image_size: int = _field(32, "image side in pixels (shapes generates at it; others resize to it); with named "
                                 "--weights on image files: their crop unless given")
    train_samples: int = _field(12000, "shapes/synthetic: number of training images")
    val_samples: int = _field(2000, "shapes/synthetic: number of validation images")
    num_workers: int = _field(-1, "DataLoader workers per process; -1: 0 for shapes (in memory), else every core of "
                                  "the process's share but one")
    decode: str = _field("cpu", "image files: cpu (loader workers decode and augment) or gpu (workers only read the "
                                "files; the training process decodes each batch on its GPU with nvJPEG and augments it "
                                "there, each sample with its own seed)", choices=("cpu", "gpu"))
    normalize: str = _field("auto", "input normalisation: imagenet (ImageNet's mean and std), trainbox (0.5, 0.25); "
                                    "auto: the named --weights' own (their transforms()), else trainbox",
                                    choices=("auto", "imagenet", "trainbox"))


@dataclass(frozen=True)
class Augmentation:
    """The recipe per image and per batch."""

    augment: str = _field("auto", "file datasets' recipe: cifar (resize, padded random crop, flip) or imagenet "
                                  "(RandomResizedCrop + flip; eval: resize to size/0.875, centre crop); auto: "
                                  "imagenet from 128 px up", choices=("auto", "cifar", "imagenet"))
    train_crop_size: int = _field(0, "imagenet recipe: RandomResizedCrop's size; 0: --image-size")
    val_resize_size: int = _field(0, "imagenet recipe: the evaluation's resize (shorter side); 0: "
                                     "--val-crop-size / 0.875")
    val_crop_size: int = _field(0, "imagenet recipe: the evaluation's centre crop; 0: --image-size")
    interpolation: str = _field("bilinear", "resizing of the imagenet recipe (train crop, eval resize); "
                                            "--auto-augment resamples bilinearly (on tensors its ops take no "
                                            "bicubic)", choices=("bilinear", "bicubic"))
    auto_augment: str = _field("none", "file datasets: after the crop and flip, v2.TrivialAugmentWide "
                                       "(ta_wide), RandAugment (ra), AugMix (augmix) or AutoAugment's ImageNet "
                                       "policy (imagenet)",
                                       choices=("none", "ta_wide", "ra", "augmix", "imagenet"))
    ra_magnitude: int = _field(9, "--auto-augment ra: RandAugment's magnitude")
    augmix_severity: int = _field(3, "--auto-augment augmix: AugMix's severity")
    ra_reps: int = _field(0, "the repeated-augmentation sampler of torchvision's reference (RASampler): each "
                             "image N times per epoch, augmented apart, the epoch cut to a multiple of 256; 0: "
                             "off")
    random_erase: float = _field(0.0, "v2.RandomErasing's probability, per image after normalisation (as "
                                      "torchvision's reference applies it); 0: off")
    mixup_alpha: float = _field(0.0, "v2.MixUp's alpha on each training batch (with --cutmix-alpha: one of the "
                                     "two at random per batch); 0: off")
    cutmix_alpha: float = _field(0.0, "v2.CutMix's alpha on each training batch; 0: off")


@dataclass(frozen=True)
class Model:
    """The network, its starting weights and how it runs."""

    model: str = _field("cnn", "cnn (small built-in), a torchvision classification model name, or "
                               "package.module:factory; --task segmentation: a torchvision segmentation model name "
                               f"(default {SEGMENTATION_MODEL})")
    weights: str = _field("", "start from these weights: torchvision's by name (ResNet50_Weights.IMAGENET1K_V2, or "
                              "DEFAULT for --model's default; fetched once per node into TORCH_HOME) or a file "
                              "(model.pt, best.pt, a checkpoint, a state_dict; a sharded checkpoint's step_N.dcp "
                              "folder too); a head of another class count is replaced; a resume ignores it")
    freeze: str = _field("", "freeze parameters: backbone (all but the classifier head) or name prefixes, "
                             "comma-separated (no gradient, no optimizer state, BatchNorm statistics kept)")
    width: int = _field(32, "cnn: channels of the first stage (doubles per stage)")
    sync_bn: bool = _field(False, "convert BatchNorm layers to SyncBatchNorm (multi-GPU)")
    channels_last: bool = _field(False, "use the channels_last memory format for model and inputs")
    compile: bool = _field(False, "wrap the model with torch.compile")
    bucket_cap_mb: int = _field(25, "DDP gradient bucket size in MiB (smaller: communication starts earlier)")
    static_graph: bool = _field(False, "DDP static_graph: faster when the graph never changes and every parameter gets "
                                       "a gradient every step")
    precision: str = _field("auto", "auto: bf16 on GPUs that support it, fp32 on CPU; fp16 uses a GradScaler; "
                                    "under --parallel fsdp bf16 is FSDP2's policy (bf16 weights gathered, fp32 "
                                    "reduction and shards)",
                                    choices=("auto", "fp32", "bf16", "fp16"))
    parallel: str = _field("ddp", "ddp: every worker holds the whole model, its gradients and optimizer state "
                                  "(DistributedDataParallel); fsdp: each holds 1/N of them (FSDP2's fully_shard per "
                                  "block the task names, then the whole model), gathered for each block's forward "
                                  "and backward: for a model that does not fit one GPU (docs/training.md)",
                                  choices=("ddp", "fsdp"))
    activation_checkpointing: bool = _field(False, "recompute each block's activations (the blocks the task names: "
                                                   "the language model's transformer blocks) in the backward pass "
                                                   "instead of keeping them: less memory, one more forward of each "
                                                   "block, the same weights")


@dataclass(frozen=True)
class Optimisation:
    """The batch, the optimizer and its weight-decay groups."""

    batch_size: int = _field(64, "images per worker per micro-batch")
    grad_accum: int = _field(1, "micro-batches per optimizer step (gradients synchronised on the last only)")
    optimizer: str = _field("adamw", "optimizer", choices=("adamw", "sgd"))
    lr: float = _field(3e-3, "peak learning rate")
    weight_decay: float = _field(0.05, "weight decay")
    momentum: float = _field(0.9, "sgd momentum")
    nesterov: bool = _field(True, "sgd: Nesterov momentum (torchvision's reference --opt sgd is without it)")
    norm_weight_decay: float | None = _field(None, "weight decay of normalisation layers' parameters "
                                                   "(BatchNorm, LayerNorm, ...); unset: --weight-decay, in no "
                                                   "group of their own (torchvision's reference)")
    bias_weight_decay: float | None = _field(None, "weight decay of parameters named bias, ahead of the norm "
                                                   "rule; unset: no group of their own (torchvision's "
                                                   "reference)")
    transformer_embedding_decay: float | None = _field(None, "weight decay of parameters named class_token, "
                                                             "position_embedding or "
                                                             "relative_position_bias_table (torchvision's "
                                                             "reference and its key list); unset: no group of "
                                                             "their own")
    grad_clip: float = _field(1.0, "clip the global gradient norm to this (0: off)")


@dataclass(frozen=True)
class Schedule:
    """The learning rate over the run."""

    warmup_steps: int = _field(50, "linear warm-up steps before the cosine decay")
    warmup_epochs: float = _field(0.0, "the warm-up in epochs (with --epochs) instead of --warmup-steps; 0: "
                                       "--warmup-steps")
    lr_scheduler: str = _field("cosine", "after the warm-up: cosine (to --min-lr-ratio), step (x --lr-gamma every "
                                         "--lr-step-size), multistep (x --lr-gamma at --lr-milestones) or constant",
                                         choices=("cosine", "step", "multistep", "constant"))
    min_lr_ratio: float = _field(0.02, "final learning rate as a fraction of --lr")
    lr_step_size: int = _field(30, "--lr-scheduler step: its period, in the schedule's unit")
    lr_gamma: float = _field(0.1, "--lr-scheduler step/multistep: the factor at each decay")
    lr_milestones: str = _field("", "--lr-scheduler multistep: comma-separated points, in the schedule's unit")
    warmup_method: str = _field("linear", "warm-up: linear from --warmup-decay x --lr to --lr, or constant at "
                                          "--warmup-decay x --lr", choices=("linear", "constant"))
    warmup_decay: float = _field(0.01, "the warm-up's starting factor (torchvision's lr-warmup-decay)")
    schedule_unit: str = _field("step", "the schedule advances every optimizer step (lengths in steps), or every "
                                        "epoch as torchvision's reference does (needs --epochs; lengths in epochs)",
                                        choices=("step", "epoch"))

    def milestones(self) -> list[int]:
        """--lr-milestones as a list of ints."""
        try:
            return [int(m) for m in self.lr_milestones.split(",") if m.strip()]
        except ValueError:
            raise ConfigError(f"--lr-milestones {self.lr_milestones!r} is not a list of whole numbers: pass "
                              f"e.g. --lr-milestones 30,60,80") from None


@dataclass(frozen=True)
class Regularisation:
    """Label smoothing and the EMA of the weights."""

    label_smoothing: float = _field(0.0, "cross-entropy label smoothing (torch's label_smoothing)")
    model_ema: bool = _field(False, "keep an exponential moving average of the weights (AveragedModel, "
                                    "buffers included), evaluated beside the model and saved as model_ema.pt")
    model_ema_steps: int = _field(32, "--model-ema: update the average every N optimizer steps of an epoch")
    model_ema_decay: float = _field(0.99998, "--model-ema: the decay before torchvision's adjustment for the "
                                             "batch, world size, update period and epochs")


@dataclass(frozen=True)
class Checkpoints:
    """Checkpoints, evaluations and logging."""

    save_every: int = _field(200, "save a checkpoint every N steps (and always at the end or on a stop signal)")
    keep_checkpoints: int = _field(3, "keep the newest K checkpoints")
    checkpoint_format: str = _field("full", "full: the whole state gathered into one file (step_N.pt) by rank 0; "
                                            "sharded (--parallel fsdp): each worker writes its shards into a folder "
                                            "(step_N.dcp, torch.distributed.checkpoint), for a state too large to "
                                            "gather on one rank; either resumes at any number of workers",
                                    choices=("full", "sharded"))
    eval_every: int = _field(200, "evaluate every N steps (and at the end); 0: only at the end")
    log_every: int = _field(50, "log loss and throughput every N steps")
    tensorboard: bool = _field(True, "write TensorBoard event files into the run directory")


@dataclass(frozen=True)
class Tracking:
    """MLflow, off unless a server is named."""

    mlflow_uri: str = _field("", "MLflow tracking server, http(s)://HOST:PORT; empty: $MLFLOW_TRACKING_URI, and no "
                                 "tracking when that is unset too")
    mlflow_experiment: str = _field("", "MLflow experiment; empty: $MLFLOW_EXPERIMENT_NAME, else trainbox")
    mlflow_checkpoints: bool = _field(False, "also send every checkpoint to MLflow as an artifact (model.pt and "
                                             "manifest.json always are)")


@dataclass(frozen=True)
class Config:
    """The run's settings, one section each (--help groups the flags by them). The command line, config files
    and config.json name each setting by its own name alone: no two sections share a name."""

    run: Run = field(default_factory=Run)
    launch: Launch = field(default_factory=Launch)
    data: Data = field(default_factory=Data)
    augmentation: Augmentation = field(default_factory=Augmentation)
    model: Model = field(default_factory=Model)
    optimisation: Optimisation = field(default_factory=Optimisation)
    schedule: Schedule = field(default_factory=Schedule)
    regularisation: Regularisation = field(default_factory=Regularisation)
    checkpoints: Checkpoints = field(default_factory=Checkpoints)
    tracking: Tracking = field(default_factory=Tracking)

    @classmethod
    def from_dict(cls, values: dict) -> Config:
        """The config of flat settings (a config.json, the parsed command line); an unknown name is a ConfigError."""
        parts: dict[str, dict] = {name: {} for name in SECTIONS}
        for name, value in values.items():
            if name not in SECTION_OF:
                raise unknown_key(name, "config")
            parts[SECTION_OF[name]][name] = value
        return cls(**{name: kind(**parts[name]) for name, kind in SECTIONS.items()})

    def to_dict(self) -> dict:
        """Every setting by its own name, flat, in --help's order: config.json, the checkpoints, MLflow's params."""
        return {name: value for section in SECTIONS
                for name, value in dataclasses.asdict(getattr(self, section)).items()}

    def replace(self, **values) -> Config:
        """This config with these settings (by their own names) changed."""
        return Config.from_dict({**self.to_dict(), **values})

    def setting(self, name: str):
        """One setting by its own name, as the command line and config files name it."""
        return getattr(getattr(self, SECTION_OF[name]), name)



SECTIONS: dict[str, type] = typing.get_type_hints(Config)  # each section's name and class, in --help's order
SECTION_OF: dict[str, str] = {f.name: name for name, kind in SECTIONS.items() for f in fields(kind)}


def settings() -> list[dataclasses.Field]:
    """Every setting's field, section by section, in --help's order."""
    return [f for kind in SECTIONS.values() for f in fields(kind)]


# Presets change defaults only; the config file and flags still override them.
PRESETS: dict[str, dict] = {
    "default": {},
    # Seconds on a CPU: a tiny model on a small built-in set. The integration tests run this.
    "debug": dict(max_steps=40, train_samples=512, val_samples=256, image_size=16, width=8, batch_size=16,
                  warmup_steps=5, save_every=20, eval_every=20, log_every=10, lr=1e-2),
}

IMAGENET_FROM = 128  # --augment auto: the ImageNet recipe from this image size up, the CIFAR recipe below


def augmentation_recipe(data: Data, aug: Augmentation) -> str:
    """The augmentation recipe of a file dataset: --augment, or by --image-size when it is auto."""
    if aug.augment != "auto":
        return aug.augment
    return "imagenet" if data.image_size >= IMAGENET_FROM else "cifar"


def flag(name: str) -> str:
    return name.replace("_", "-")


def unknown_key(key: str, source: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(SECTION_OF), n=1)
    hint = f": did you mean {close[0]}?" if close else ": see python -m train --help"
    return ConfigError(f"{source}: unknown key {key!r}{hint}")
