"""The config object: defaults, presets, files, flags, and one-line errors."""

import dataclasses
import importlib
import json
from pathlib import Path

import pytest

from train.cli import get_args_parser, parse_config
from train.config.settings import PRESETS, SECTION_OF, Config, ConfigError, settings
from train.config.values import check_values
from train.files.rundir import write_run_files

RECIPES = Path(__file__).resolve().parents[2] / "train" / "recipes"


def test_every_field_has_a_default_and_help():
    for f in settings():
        assert f.default is not dataclasses.MISSING, f.name
        assert f.metadata["help"].strip(), f.name
    check_values(Config())


def test_flags_are_derived_from_the_fields():
    help_text = get_args_parser().format_help()
    for f in settings():
        assert "--" + f.name.replace("_", "-") in help_text


def test_precedence_defaults_preset_file_flags(tmp_path):
    assert parse_config([]).run.max_steps == Config().run.max_steps
    assert parse_config(["--preset", "debug"]).run.max_steps == PRESETS["debug"]["max_steps"]
    file = tmp_path / "c.json"
    file.write_text(json.dumps({"preset": "debug", "max_steps": 77, "lr": 1}))
    cfg = parse_config(["--config", str(file)])
    assert (cfg.run.max_steps, cfg.optimisation.lr, cfg.model.width) == (77, 1.0, PRESETS["debug"]["width"])
    assert isinstance(cfg.optimisation.lr, float)
    assert parse_config(["--config", str(file), "--max-steps", "5"]).run.max_steps == 5


def test_toml_config_file(tmp_path):
    file = tmp_path / "c.toml"
    file.write_text('batch-size = 8\ndeterministic = true\nmodel = "resnet18"\n')
    cfg = parse_config(["--config", str(file)])
    assert (cfg.optimisation.batch_size, cfg.run.deterministic, cfg.model.model) == (8, True, "resnet18")


def test_boolean_flags_both_ways():
    assert parse_config(["--deterministic"]).run.deterministic is True
    assert parse_config(["--no-tensorboard"]).checkpoints.tensorboard is False


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "0"], "--batch-size must be > 0"),
    (["--max-steps", "-3"], "--max-steps must be > 0"),
    (["--batch-size", "ten"], "invalid int value"),
    (["--lr", "fast"], "invalid float value"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--batch"], "unrecognized arguments"),  # no silent prefix matching
    (["--precision", "fp8"], "invalid choice"),
    (["--preset", "huge"], "invalid choice"),
    (["--min-lr-ratio", "2"], "--min-lr-ratio must be within [0, 1]"),
    (["--num-workers", "-2"], "--num-workers must be -1"),
    # nan passes every range check and inf most: torch's AdamW raised a traceback on the first, the second trained
    # to a diverged loss, and a weight decay of nan trained until the loss was nan
    (["--lr", "nan"], "--lr must be a finite number, got nan: pass a number (its default: 0.003)"),
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--weight-decay=-inf"], "--weight-decay must be a finite number, got -inf"),
    (["--norm-weight-decay", "nan"], "--norm-weight-decay must be a finite number, got nan: pass a number"),
    (["--grad-clip", "inf"], "--grad-clip must be a finite number"),
])
def test_bad_flags_raise_one_line(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_config(argv)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("command, argv, line", [
    ("train.__main__:main", ["--bogus"], "unrecognized arguments: --bogus (see python -m train --help)"),
    ("train.launch:launch_main", ["--gpus"], "argument --gpus: expected one argument (see python -m train.launch "
                                             "--help)"),
    ("train.doctor:main", ["--workers", "2", "--bogus"], "unrecognized arguments: --bogus (see python -m "
                                                         "train.doctor --help)"),
    ("train.bench.__main__:main", ["--rounds", "three"], "argument --rounds: invalid int value: 'three' (see python "
                                                         "-m train.bench --help)"),
    ("train.pack.command:main", ["src", "dst", "--shard-mb"], "argument --shard-mb: expected one argument (see python "
                                                              "-m train.pack --help)"),
])
def test_every_commands_mistake_on_its_command_line_is_one_line_naming_its_help(command, argv, line, capsys):
    """argparse's own refusals (an unknown flag, a missing or bad value) in every command users type: one line, exit 2,
    no usage block; make evaluate's and make export's: tests/unit/test_finished_run_commands.py."""
    module, _, name = command.partition(":")
    assert getattr(importlib.import_module(module), name)(argv) == 2
    assert capsys.readouterr().err == f"error: {line}\n"


def test_unknown_config_key_suggests_the_right_one(tmp_path):
    file = tmp_path / "c.json"
    file.write_text(json.dumps({"batch_sise": 4}))
    with pytest.raises(ConfigError, match="unknown key 'batch_sise': did you mean batch_size"):
        parse_config(["--config", str(file)])


@pytest.mark.parametrize("content, message", [
    ('{"max_steps": "ten"}', "max_steps must be int"),
    ('{"deterministic": 1}', "deterministic must be true or false"),
    ('{"max_steps": 10,', "is malformed"),
    ('[1, 2]', "must hold a table"),
    ('{"lr": NaN}', "--lr must be a finite number, got nan"),  # JSON's NaN, as Python's json writes it
    ('{"max_steps": null}', "max_steps must be int, got None"),  # null: unset, for a setting that may be unset only
])
def test_bad_config_file_values(tmp_path, content, message):
    file = tmp_path / "c.json"
    file.write_text(content)
    with pytest.raises(ConfigError, match=message):
        parse_config(["--config", str(file)])


def test_missing_or_unsupported_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        parse_config(["--config", str(tmp_path / "nope.json")])
    (tmp_path / "c.yaml").write_text("a: 1")
    with pytest.raises(ConfigError, match="use a .json or .toml file"):
        parse_config(["--config", str(tmp_path / "c.yaml")])
    (tmp_path / "latin1.toml").write_bytes('name = "caf\xe9"'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"cannot read config file .*latin1.toml \(not UTF-8 text\)"):
        parse_config(["--config", str(tmp_path / "latin1.toml")])


@pytest.mark.parametrize("argv", [
    ["--preset", "debug"], ["--preset", "default"], ["--task", "segmentation", "--preset", "debug"], ["--task", "lm"],
    ["--task", "lm", "--dataset", "text", "--data-dir", "d"], ["--epochs", "3"], ["--warmup-epochs", "1", "--epochs", "2"],
    ["--model", "resnet18", "--optimizer", "sgd", "--momentum", "0.8", "--lr-scheduler", "multistep",
     "--lr-milestones", "3,6"],
    ["--model-ema", "--precision", "bf16", "--norm-weight-decay", "0"], ["--parallel", "fsdp"],
    ["--preset", "debug", "--task-settings", '{"a": 1}'],
    ["--model", "resnet18", "--weights", "ResNet18_Weights.IMAGENET1K_V1", "--dataset", "imagefolder", "--data-dir", "d"],
    ["--config", str(RECIPES / "resnet50.toml")],
])
def test_a_runs_config_json_given_to_config_is_that_runs_config(argv, tmp_path):
    """config.json as the run folder's writer writes it (every setting; null for an optional one left unset; those
    the setup never reads at their defaults), read back by --config: the same Config, so it runs that run again."""
    cfg = parse_config(argv)
    write_run_files(tmp_path, cfg.to_dict(), [], {})
    assert parse_config(["--config", str(tmp_path / "config.json")]) == cfg


def test_a_record_is_refused_a_setting_its_setup_never_reads_as_any_file_is(tmp_path):
    """In a run's record, a setting its setup never reads at any value but the default is a choice, refused in one
    line; in a file that sets some settings only, it is refused at its default too, as before."""
    cfg = parse_config(["--task", "lm"])
    write_run_files(tmp_path, {**cfg.to_dict(), "image_size": 99}, [], {})
    with pytest.raises(ConfigError, match=f"^image_size = 99 in {tmp_path / 'config.json'} has no effect"):
        parse_config(["--config", str(tmp_path / "config.json")])
    (tmp_path / "c.json").write_text(json.dumps({"task": "lm", "image_size": cfg.data.image_size}))
    with pytest.raises(ConfigError, match=f"^image_size = {cfg.data.image_size} in {tmp_path / 'c.json'} has no"):
        parse_config(["--config", str(tmp_path / "c.json")])


@pytest.mark.parametrize("argv, setting", [
    (["--dataset", "imagefolder", "--train-crop-size", "100000"], "--train-crop-size 100000"),  # cifar recipe (32 px)
    (["--dataset", "cifar10", "--val-crop-size", "24"], "--val-crop-size 24"),
    (["--dataset", "cifar10", "--val-resize-size", "36"], "--val-resize-size 36"),
    (["--dataset", "imagefolder", "--image-size", "224", "--augment", "cifar", "--interpolation", "bicubic"],
     "--interpolation bicubic"),
    (["--auto-augment", "ta_wide"], "--auto-augment ta_wide"),  # shapes: made in memory, nothing to augment
    (["--train-crop-size", "24"], "--train-crop-size 24"),
    (["--num-workers", "4"], "--num-workers 4"),
    (["--data-dir", "/nas/cifar"], "--data-dir /nas/cifar"),  # shapes, synthetic and copy are made from the seed
    (["--dataset", "synthetic", "--data-dir", "/nas/cifar"], "--data-dir /nas/cifar"),
    (["--task", "lm", "--data-dir", "/nas/text"], "--data-dir /nas/text"),
    (["--dataset", "imagefolder", "--train-samples", "100"], "--train-samples 100"),
    (["--dataset", "imagefolder", "--auto-augment", "ta_wide", "--ra-magnitude", "5"], "--ra-magnitude 5"),
    (["--dataset", "imagefolder", "--auto-augment", "ra", "--augmix-severity", "2"], "--augmix-severity 2"),
    (["--download"], "--download"),
    (["--dataset", "imagefolder", "--path-column", "file"], "--path-column file"),
    (["--dataset", "shards", "--label-column", "y"], "--label-column y"),
    (["--dataset", "csv", "--label-key", "y"], "--label-key y"),
    (["--dataset", "hf", "--path-column", "file"], "--path-column file"),
    (["--dataset", "csv", "--image-column", "img"], "--image-column img"),
    (["--dataset", "imagefolder", "--train-split", "train"], "--train-split train"),
    (["--dataset", "shards", "--val-split", "test"], "--val-split test"),
    (["--model", "resnet18", "--width", "8"], "--width 8"),
    (["--momentum", "0.5"], "--momentum 0.5"),
    (["--no-nesterov"], "--no-nesterov"),
    (["--lr-step-size", "3"], "--lr-step-size 3"),
    (["--lr-gamma", "0.5"], "--lr-gamma 0.5"),
    (["--lr-scheduler", "step", "--lr-milestones", "3,6"], "--lr-milestones 3,6"),
    (["--lr-scheduler", "constant", "--min-lr-ratio", "0.1"], "--min-lr-ratio 0.1"),
    (["--warmup-steps", "0", "--warmup-decay", "0.1"], "--warmup-decay 0.1"),
    (["--model-ema-steps", "4"], "--model-ema-steps 4"),
    (["--parallel", "fsdp", "--static-graph"], "--static-graph"),
    (["--parallel", "fsdp", "--bucket-cap-mb", "10"], "--bucket-cap-mb 10"),
])
def test_a_setting_that_has_no_effect_is_refused_in_one_line(argv, setting, tmp_path):
    with pytest.raises(ConfigError) as e:
        parse_config(argv)
    message = str(e.value)
    assert message.startswith(f"{setting} has no effect ") and ": drop it" in message and "\n" not in message
    # The same setting from a config file names the file; in the setup where it acts, it is accepted.
    flag, *value = setting.split(" ")
    key = flag.removeprefix("--").removeprefix("no-").replace("-", "_")
    file = tmp_path / "c.json"
    file.write_text(json.dumps({key: _typed(value[0]) if value else not flag.startswith("--no-")}))
    with pytest.raises(ConfigError, match=f"^{key} = .* in {file} has no effect"):
        parse_config([a for a in argv if a not in (flag, *value)] + ["--config", str(file)])


def _typed(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


@pytest.mark.parametrize("argv", [
    ["--dataset", "imagefolder", "--image-size", "224", "--train-crop-size", "176", "--val-resize-size", "232",
     "--val-crop-size", "224", "--interpolation", "bicubic", "--auto-augment", "ra", "--ra-magnitude", "5"],
    ["--dataset", "cifar10", "--auto-augment", "augmix", "--augmix-severity", "2", "--download"],
    ["--optimizer", "sgd", "--momentum", "0.5", "--no-nesterov"],
    ["--lr-scheduler", "step", "--lr-step-size", "3", "--lr-gamma", "0.5"],
    ["--lr-scheduler", "multistep", "--lr-milestones", "3,6"],
    ["--min-lr-ratio", "0.1", "--warmup-decay", "0.1", "--warmup-method", "constant"],
    ["--model-ema", "--model-ema-steps", "4", "--model-ema-decay", "0.9"],
    ["--train-samples", "100", "--val-samples", "50"],
    ["--dataset", "csv", "--path-column", "file", "--label-column", "y"],
    ["--dataset", "shards", "--label-key", "y"],
    ["--dataset", "hf", "--image-column", "img", "--label-column", "fine_label", "--train-split", "train",
     "--val-split", "test"],
])
def test_the_same_settings_where_they_act_are_accepted(argv):
    parse_config(argv)


def test_the_config_cannot_change_under_a_run():
    cfg = parse_config(["--preset", "debug"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run.max_steps = 3  # what a run derives goes into its plan (train/run/plan.py), never back into the config
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run = cfg.run  # nor a section swapped


def test_the_config_is_in_sections_inside_and_flat_outside():
    """Each setting lives in one section; the command line, config files and config.json name it alone."""
    from train.config.settings import SECTIONS

    names = [f.name for kind in SECTIONS.values() for f in dataclasses.fields(kind)]
    assert len(names) == len(set(names)) == len(SECTION_OF)  # no two sections share a name
    assert [f.name for f in dataclasses.fields(Config)] == list(SECTIONS)
    cfg = parse_config(["--preset", "debug", "--lr", "0.5", "--model-ema"])
    flat = cfg.to_dict()
    assert list(flat) == names and flat["lr"] == cfg.optimisation.lr == 0.5 and flat["model_ema"] is True
    assert Config.from_dict(flat) == cfg
    assert cfg.replace(lr=0.25).optimisation == dataclasses.replace(cfg.optimisation, lr=0.25)
    assert cfg.replace(lr=0.25).model == cfg.model  # the other sections as they were
    with pytest.raises(ConfigError, match="unknown key 'learning_rate'"):
        Config.from_dict({**flat, "learning_rate": 1.0})


def test_modules_of_one_concern_take_their_section():
    """docs/development.md: a module that reads one concern takes its section, not the whole config."""
    import inspect

    from train.components import augment
    from train.components import ema
    from train.components import models
    from train.components import optim
    from train.report import tracker
    from train.report import mlflow_tracking
    from train.components import weights

    takes = {models.build_model: "Model", models.check_model_spec: "Model", weights.read_weights: "Model",
             weights.fitted: "Model", models.frozen_names: "Model", models.trainable_model: "Model",
             weights.resolve: "Model",
             optim.build_optimizer: "Optimisation", optim.decay_groups: "Optimisation",
             optim.build_scheduler: "Schedule", augment.BatchAugment: "Augmentation",
             augment.BatchAugment.wanted: "Augmentation", ema.adjusted_decay: "Regularisation",
             tracker.start_tracking: "Tracking", mlflow_tracking.tracking_uri: "Tracking",
             mlflow_tracking.experiment_name: "Tracking"}
    for function, section in takes.items():
        first = next(p for p in inspect.signature(function).parameters.values() if p.name != "self")
        assert first.annotation == section, (function.__qualname__, first.annotation)


def test_help_groups_the_flags_by_the_section_each_field_declares():
    from train.config.settings import SECTIONS

    assert list(SECTIONS) == ["run", "launch", "data", "augmentation", "model", "optimisation", "schedule",
                              "regularisation", "checkpoints", "tracking"]
    text = get_args_parser().format_help()
    headings = [line[:-1] for line in text.splitlines() if line[:-1] in SECTIONS and line.endswith(":")]
    assert headings == list(SECTIONS)
    starts = {name: text.index(f"\n{name}:\n") for name in SECTIONS}
    ends = dict(zip(SECTIONS, [*list(starts.values())[1:], len(text)], strict=True))
    for f in settings():
        section = SECTION_OF[f.name]
        assert section in SECTIONS, f.name
        flag = "--" + f.name.replace("_", "-")
        assert starts[section] < text.index(f"  {flag}") < ends[section], (f.name, section)


@pytest.mark.parametrize("argv", [["--model-ema"], ["--compile"], ["--sync-bn"], ["--channels-last"],
                                  ["--precision", "fp16"]])
def test_what_a_sharded_model_does_not_take_yet_is_refused_in_one_line(argv):
    """--parallel fsdp with a knob not built for it: one line saying why and the way on, never trained otherwise."""
    parse_config(argv)  # taken under DDP
    with pytest.raises(ConfigError) as e:
        parse_config(["--parallel", "fsdp", *argv])
    line = str(e.value)
    assert line.startswith(argv[0]) and " is not available with --parallel fsdp (" in line and "\n" not in line
    assert "--parallel ddp" in line


def test_sharded_checkpoints_of_a_replicated_model_or_sent_to_mlflow_are_refused_in_one_line():
    assert parse_config(["--parallel", "fsdp", "--checkpoint-format", "sharded"]).checkpoints.checkpoint_format == \
        "sharded"
    with pytest.raises(ConfigError, match=r"^--checkpoint-format sharded writes each worker's shards, and under "
                                          r"--parallel ddp every worker holds the whole state: use it with "
                                          r"--parallel fsdp, or drop it$"):
        parse_config(["--checkpoint-format", "sharded"])
    with pytest.raises(ConfigError, match=r"^--mlflow-checkpoints sends each checkpoint file to MLflow, and a sharded "
                                          r"checkpoint is a folder"):
        parse_config(["--parallel", "fsdp", "--checkpoint-format", "sharded", "--mlflow-checkpoints"])


def test_a_sharded_model_on_one_worker_is_refused_before_any_worker_starts():
    from train.run.preflight import preflight

    preflight(parse_config(["--parallel", "fsdp", "--spawn", "2", "--dry-run"]))
    with pytest.raises(ConfigError, match=r"^--parallel fsdp shards the model over the workers, and this launch starts "
                                          r"one: start several \(--spawn N, "):
        preflight(parse_config(["--parallel", "fsdp", "--dry-run"]))


def test_activation_checkpointing_of_a_model_whose_task_names_no_blocks_is_refused_before_any_worker_starts():
    from train.run.preflight import preflight

    preflight(parse_config(["--task", "lm", "--activation-checkpointing", "--dry-run"]))  # its transformer blocks
    preflight(parse_config(["--model", "vit_b_16", "--activation-checkpointing", "--dry-run"]))  # its encoder layers
    own = "tests.models:tiny_groupnorm_cnn"  # a network of no shape the image tasks know: no blocks
    with pytest.raises(ConfigError, match=r"^--activation-checkpointing recomputes the blocks a task names, and --task "
                                          rf"classification names none of --model {own}'s \(Task.blocks\): drop it$"):
        preflight(parse_config(["--model", own, "--activation-checkpointing", "--dry-run"]))
    with pytest.raises(ConfigError, match=r"^--activation-checkpointing would run features\.0\.1 twice a step"):
        preflight(parse_config(["--activation-checkpointing", "--dry-run"]))  # the built-in CNN's stages: BatchNorm
    with pytest.raises(ConfigError, match=r"^--activation-checkpointing with --compile is not built yet"):
        parse_config(["--task", "lm", "--activation-checkpointing", "--compile"])


def test_blocks_named_wrongly_and_a_recomputed_block_with_running_statistics_are_refused_in_one_line():
    """Task.blocks that are not the model's module names are one line naming the method, where a run uses them; a
    block with BatchNorm, recomputed in the backward, would update its running statistics twice a step."""
    from torch import nn

    from train.run.preflight import check_blocks
    from train.tasks.task import Task

    class Stages(Task):
        name = "stages"

        def network(self, spec):
            return nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4)),
                                 nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4)))

        def blocks(self, model):
            return ["0", "1"]

    cfg = parse_config(["--task", "lm", "--activation-checkpointing"])
    for wrong in (["2"], "0", [0]):  # a name the model has not, a string, a number: one line naming the method
        Stages.blocks = lambda self, model, wrong=wrong: wrong
        with pytest.raises(ConfigError, match=r"^--task stages's blocks\(\) gave .*, not a list of its model's "
                                              r"module names: return names from model.named_modules\(\)"):
            check_blocks(parse_config(["--parallel", "fsdp"]).model, Stages(cfg))
    Stages.blocks = lambda self, model: ["0", "1"]
    with pytest.raises(ConfigError, match=r"^--activation-checkpointing would run 1\.1 twice a step, which updates its "
                                          r"running statistics twice \(not the weights trained without it\): drop it$"):
        check_blocks(cfg.model, Stages(cfg))
