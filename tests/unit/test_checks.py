"""The user-facing checks that need no run: GPUS, CUDA_VISIBLE_DEVICES, a GPU per worker."""

import pytest

from train.base.errors import ConfigError
from train.cluster.spawn import workers_for
from train.run.preflight import check_gpu_per_worker, visible_devices_problem


@pytest.mark.parametrize("value, host, problem", [
    ("0,7", 2, "CUDA_VISIBLE_DEVICES=0,7 names GPU 7 but this host has 2 (0-1)"), ("1", 2, None), ("", 2, None),
    ("GPU-5d1c9b9a", 2, None), ("3", None, None),
])
def test_visible_devices_check(value, host, problem):
    found = visible_devices_problem(value, host)
    assert found == problem or problem in found


@pytest.mark.parametrize("gpus, visible, expected", [
    ("", 0, (1, True)), ("", 4, (4, False)), ("0", 4, (1, True)), ("2", 0, (2, True)), ("3", 4, (3, False)),
])
def test_gpus_knob(gpus, visible, expected):
    assert workers_for(gpus, visible) == expected


@pytest.mark.parametrize("gpus, visible, message", [
    ("8", 2, "GPUS=8 but 2 GPU(s) visible: set GPUS<=2 or CUDA_VISIBLE_DEVICES"),
    ("four", 2, "GPUS='four' is not a number"),
    ("-1", 2, "GPUS=-1: a count of workers cannot be negative: give 0 for the CPU or a positive count (GPUS=1"),
    (" -4 ", 0, "GPUS=-4: a count of workers cannot be negative: give 0 for the CPU"),
    ("-x", 2, "GPUS='-x' is not a number"),
    ("\u00b2", 2, "GPUS='\u00b2' is not a number"),  # a superscript two: a digit to str.isdigit, not to int()
    ("-\u00b2", 2, "GPUS='-\u00b2' is not a number"),
])
def test_gpus_knob_errors(gpus, visible, message):
    with pytest.raises(ConfigError) as e:
        workers_for(gpus, visible)
    assert message in str(e.value)


def test_a_gpu_per_worker():
    check_gpu_per_worker(2, 2)
    check_gpu_per_worker(1, 8)
    with pytest.raises(ConfigError) as e:
        check_gpu_per_worker(4, 2)
    assert str(e.value).startswith("4 workers on this node but 2 GPU(s) visible: start at most 2 (torchrun")
