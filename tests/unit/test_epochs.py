"""--epochs and --warmup-epochs: the run's length in passes over the data, turned into steps per layout."""

import pytest

from train.base.errors import ConfigError
from train.cli import parse_config
from train.run.plan import steps_for_epochs
from train.run.preflight import check_steps


# 1000 images, batch 16: an epoch is floor(1000 / workers / 16 / accumulation) steps (the sampler drops the rest)
@pytest.mark.parametrize("workers, accum, per_epoch", [(1, 1, 62), (2, 1, 31), (4, 1, 15), (1, 2, 31), (2, 2, 15),
                                                       (4, 2, 7), (4, 4, 3)])
def test_epochs_become_steps_for_every_layout(workers, accum, per_epoch):
    cfg = parse_config(["--epochs", "90", "--warmup-epochs", "5", "--batch-size", "16", "--grad-accum", str(accum)])
    assert check_steps(1000, workers, cfg.optimisation, cfg.augmentation.ra_reps) == per_epoch
    assert steps_for_epochs(cfg.run, cfg.schedule, per_epoch) == (90 * per_epoch, 5 * per_epoch)
    fractional = parse_config(["--epochs", "3", "--warmup-epochs", "0.5", "--batch-size", "16"])
    assert steps_for_epochs(fractional.run, fractional.schedule, per_epoch) == (3 * per_epoch, round(per_epoch / 2))
    kept = parse_config(["--epochs", "3", "--warmup-steps", "7"])  # a warm-up given in steps stays in steps
    assert steps_for_epochs(kept.run, kept.schedule, per_epoch) == (3 * per_epoch, 7)


def test_without_epochs_the_steps_are_as_given():
    cfg = parse_config(["--max-steps", "123", "--warmup-steps", "4"])
    assert steps_for_epochs(cfg.run, cfg.schedule, 62) == (123, 4)


def test_a_preset_length_gives_way_to_epochs():
    cfg = parse_config(["--preset", "debug", "--epochs", "2"])  # the preset's max_steps is a default, not a choice
    assert cfg.run.epochs == 2


@pytest.mark.parametrize("argv, message", [
    (["--epochs", "2", "--max-steps", "100"], "--epochs and --max-steps both set the same length: give one of them"),
    (["--epochs", "2", "--warmup-epochs", "1", "--warmup-steps", "5"],
     "--warmup-epochs and --warmup-steps both set the same length"),
    (["--warmup-epochs", "1"], "--warmup-epochs 1.0 needs --epochs"),
    (["--epochs", "-1"], "--epochs must be >= 0"),
])
def test_contradictions_are_one_line(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_config(argv)
    assert message in str(e.value)


def test_a_config_file_and_a_flag_that_contradict_are_refused_too(tmp_path):
    config = tmp_path / "recipe.json"
    config.write_text('{"epochs": 90}')
    with pytest.raises(ConfigError, match="--epochs and --max-steps both set"):
        parse_config(["--config", str(config), "--max-steps", "10"])
