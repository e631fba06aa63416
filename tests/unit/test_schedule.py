"""The learning-rate schedule: linear warm-up, then cosine decay to --min-lr-ratio."""

import pytest

from train.config import parse_config
from train.optim import lr_factor


def test_learning_rate_warms_up_then_follows_the_cosine():
    cfg = parse_config(["--max-steps", "110", "--warmup-steps", "10", "--min-lr-ratio", "0.1"])
    assert [lr_factor(cfg, s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_factor(cfg, 10) == pytest.approx(1.0)
    assert lr_factor(cfg, 60) == pytest.approx(0.55)  # halfway down: 0.1 + 0.9 * 0.5
    assert lr_factor(cfg, 110) == pytest.approx(0.1) and lr_factor(cfg, 500) == pytest.approx(0.1)
