"""make chaos refuses what it cannot run in one line, before it trains anything."""

import pytest

from tests import chaos


@pytest.mark.parametrize("args, expected", [
    (["--workers", "3"], "error: --workers '3': give world sizes of at least 2, even for slurm, e.g. --workers 2,4"),
    (["--workers", "1", "--launchers", "torchrun"], "error: --workers '1': give world sizes of at least 2, e.g."),
    (["--workers", "2,x"], "error: --workers '2,x': give world sizes"),
    (["--launchers", "torchrun,mpirun"], "error: unknown launcher or fault ['mpirun']"),
    (["--trials", "0"], "(or --trials < 1)"),
    (["--recipe", "--task", "segmentation"], "error: --recipe's knobs (Mixup/CutMix, random erasing, label smoothing) "
                                             "are classification's: drop --task"),
    (["--checkpoint-format", "sharded"], "error: --checkpoint-format sharded writes each worker's shards of a sharded "
                                         "model: add --parallel fsdp"),
    (["--task", "lm", "--precision", "bf16"], "error: --precision bf16 on a CPU is FSDP2's mixed-precision policy: "
                                              "add --parallel fsdp"),
])
def test_the_drill_refuses_bad_arguments_in_one_line(tmp_path, capsys, args, expected):
    out = tmp_path / "chaos"
    assert chaos.main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1, err
    assert not out.exists()  # nothing was started or written



def test_every_launcher_passes_the_recipe_and_the_world_size_on(tmp_path):
    """--recipe and --workers reach the local launchers' commands, and the Slurm launcher keeps the recipe."""
    torchrun = chaos.Local("torchrun", tmp_path, chaos.RECIPE)
    torchrun.workers = 4
    cmd = torchrun.command(tmp_path, tmp_path / "run")
    assert "--nproc-per-node=4" in cmd and cmd[-len(chaos.RECIPE) - 2:-2] == chaos.RECIPE
    make = chaos.Local("make", tmp_path, chaos.RECIPE)
    make.workers = 3
    cmd = make.command(tmp_path, None)
    assert "GPUS=3" in cmd and cmd[-1].endswith(" ".join(chaos.RECIPE))
    slurm = chaos.Slurm(tmp_path, chaos.RECIPE)
    assert (slurm.extra, slurm.runs) == (chaos.RECIPE, tmp_path / "slurm-runs")
