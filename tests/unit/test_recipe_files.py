"""train/recipes/*.toml: each parses, and its per-epoch schedule at the global batch it states (8 GPUs) is
the one torchvision's reference builds from the published command line, with torch's own schedulers."""

from pathlib import Path

import pytest
import torch
from torch.optim import lr_scheduler as S

from tests.unit.test_recipe_knobs import lrs
from train.config import parse_config
from train.optim import build_scheduler

RECIPES = Path(__file__).resolve().parents[2] / "train" / "recipes"
# The published command lines' values (torchvision's references/classification README).
PUBLISHED = {
    "resnet50_classic.toml": dict(batch=8 * 32, lr=0.1, epochs=90, main=lambda o: S.StepLR(o, 30, 0.1), warmup=0,
                                  wd=1e-4, accuracy="76.130", ra_reps=0),
    "resnet50.toml": dict(batch=8 * 128, lr=0.5, epochs=600, main=lambda o: S.CosineAnnealingLR(o, T_max=595),
                          warmup=5, decay=0.01, wd=2e-5, accuracy="80.858", ra_reps=4),
    "vit_b_16.toml": dict(batch=8 * 512, lr=0.003, epochs=300, main=lambda o: S.CosineAnnealingLR(o, T_max=270),
                          warmup=30, decay=0.033, wd=0.3, accuracy="81.072", ra_reps=3),
}


def test_every_recipe_file_is_checked():
    assert sorted(p.name for p in RECIPES.glob("*.toml")) == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_recipe_file_gives_the_published_schedule(name):
    cfg, ref = parse_config(["--config", str(RECIPES / name)]), PUBLISHED[name]
    text = (RECIPES / name).read_text()
    assert f"{ref['accuracy']} % top-1" in text and "global batch" in text and "1 GPU x 128" in text
    stated = (8 * cfg.batch_size, cfg.lr, cfg.epochs, cfg.weight_decay, cfg.ra_reps)
    assert stated == (ref["batch"], ref["lr"], ref["epochs"], ref["wd"], ref["ra_reps"])
    assert cfg.schedule_unit == "epoch"  # the reference steps its scheduler once per epoch
    ours = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    theirs = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=ref["lr"])
    main = ref["main"](theirs)
    reference = S.SequentialLR(theirs, [S.LinearLR(theirs, start_factor=ref["decay"], total_iters=ref["warmup"]),
                                        main], milestones=[ref["warmup"]]) if ref["warmup"] else main
    assert lrs(build_scheduler(cfg, ours), ours, cfg.epochs) == lrs(reference, theirs, ref["epochs"])
