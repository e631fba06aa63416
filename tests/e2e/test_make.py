"""The Makefile as users type it: help, train (1 and 2 workers, ARGS), the default run, errors."""

import json
import re
import shutil

import pytest

from tests.helpers import REPO, make, metrics, status

pytestmark = [pytest.mark.skipif(shutil.which("make") is None, reason="needs make")]


def test_help_lists_every_target_with_a_description():
    out = make("help").stdout
    targets = re.findall(r"^([a-z][a-zA-Z_-]*):", (REPO / "Makefile").read_text(), flags=re.M)
    for target in targets:
        assert re.search(rf"make {target}\s+\S", out), f"make help does not describe {target}"
    assert {"train", "test", "setup", "help"} <= set(targets)


def test_make_train_passes_args_unchanged(tmp_path):
    run_dir = tmp_path / "run"
    proc = make("train", "RUNTIME=local", f"ARGS=--preset debug --max-steps 20 --seed 3 --run-dir {run_dir}")
    assert "trainbox: local environment" in proc.stderr and "1 worker on CPU (gloo)" in proc.stderr
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["max_steps"], config["seed"], config["preset"]) == (20, 3, "debug")
    assert status(run_dir)["state"] == "done"


def test_make_train_gpus_2_runs_two_workers_via_torchrun(tmp_path):
    run_dir = tmp_path / "run"
    proc = make("train", "RUNTIME=local", "GPUS=2", f"ARGS=--preset debug --max-steps 20 --run-dir {run_dir}")
    assert "2 workers on CPU (gloo) via torchrun" in proc.stderr
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert (manifest["launcher"], manifest["world_size"]) == ("torchrun", 2)


def test_make_train_bad_gpus_is_one_line():
    proc = make("train", "RUNTIME=local", "GPUS=two", expect=2)
    assert "error: GPUS='two' is not a number: use GPUS=0 (CPU), GPUS=1, GPUS=4, ..." in proc.stderr
    # DATA_DIR is the local run's --data-dir: another one in ARGS would win unsaid (in the container, DATA_DIR is
    # the mount and a --data-dir in ARGS may name a folder under it)
    proc = make("train", "RUNTIME=local", "DATA_DIR=/nas/pets", "ARGS=--dataset imagefolder --data-dir /nas/cars",
                expect=2)
    assert "error: DATA_DIR=/nas/pets and --data-dir in ARGS both name the data: give one\n" in proc.stderr


def test_default_make_train_learns(default_run):
    """The quickstart: no flags but a run directory. Chance is 10%; the README states the figure."""
    final = metrics(default_run, "eval")[-1]
    assert final["samples"] == 2000
    assert final["accuracy"] > 0.9, final


def test_torch_flavour_selects_lock_and_base_together():
    default = make("-n", "build", "DOCKER=docker").stdout
    assert "LOCK_FILE=requirements.lock" in default
    assert "BASE_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04" in default
    lock = make("-n", "lock", "TORCH_FLAVOUR=cu128").stdout
    assert "--index https://download.pytorch.org/whl/cu128" in lock and "docker/locks/cu128.lock" in lock


def test_a_flavour_without_its_lock_is_one_clear_error():
    proc = make("build", "TORCH_FLAVOUR=cu126", "DOCKER=docker", expect=2)
    assert ("error: docker/locks/cu126.lock is missing: run 'make lock TORCH_FLAVOUR=cu126' where "
            "download.pytorch.org is reachable") in proc.stderr


@pytest.mark.parametrize("target, tool", [("enroot", "enroot"), ("apptainer", "apptainer")])
def test_image_conversion_without_the_tool_is_one_line_before_any_build(target, tool):
    if shutil.which(tool):
        pytest.skip(f"{tool} is installed here")
    proc = make(target, "DOCKER=/nonexistent/docker", expect=2)
    assert f"error: {tool} not found: install" in proc.stderr
    assert "docker" not in proc.stdout  # refused before the image step
