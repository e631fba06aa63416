"""Checkpoint files: atomic, verified, pruned, and loaded as data only."""

import os

import pytest
import torch

from tests.helpers import Evil
from train.base.errors import ConfigError
from train.files import checkpoint_io as ckpt
from train.files import rundir


def _state(step):
    return {"model": {"w": torch.full((4,), float(step))}, "step": step}


def test_save_prunes_to_the_newest_k_and_loads_back(tmp_path):
    for step in (10, 20, 30, 40):
        ckpt.save_checkpoint(tmp_path, step, _state(step), keep=2)
    names = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert names == ["step_00000030.pt", "step_00000040.pt"]
    assert sorted(p.name for p in ckpt.checkpoint_dir(tmp_path).iterdir()) == [
        "step_00000030.pt", "step_00000030.pt.crc32", "step_00000040.pt", "step_00000040.pt.crc32"]
    latest = ckpt.newest_valid(tmp_path)
    assert ckpt.load_checkpoint(latest, torch.device("cpu"))["step"] == 40


@pytest.mark.parametrize("damage", ["truncate", "flip", "no-sidecar"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, damage):
    ckpt.save_checkpoint(tmp_path, 1, _state(1), keep=3)
    newest = ckpt.save_checkpoint(tmp_path, 2, _state(2), keep=3)
    data = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        newest.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    else:
        newest.with_name(newest.name + ".crc32").unlink()
    assert ckpt.verify(newest) is not None
    assert ckpt.newest_valid(tmp_path).name == "step_00000001.pt"


def test_a_checkpoint_with_a_sha256_sidecar_from_an_earlier_version_still_verifies(tmp_path):
    import hashlib

    path = ckpt.save_checkpoint(tmp_path, 5, _state(5), keep=3)
    path.with_name(path.name + ".crc32").unlink()
    legacy = path.with_name(path.name + ".sha256")
    legacy.write_text(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n")
    assert ckpt.verify(path) is None
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # the last byte changed, whatever it was
    assert ckpt.verify(path) == "checksum mismatch (file corrupted)"


def test_a_save_after_resuming_from_an_older_checkpoint_replaces_the_damaged_newer_one(tmp_path):
    for step in (10, 20, 30):
        ckpt.save_checkpoint(tmp_path, step, _state(step), keep=2)
    damaged = ckpt.list_checkpoints(tmp_path)[-1]
    damaged.write_bytes(b"garbage")
    assert ckpt.newest_valid(tmp_path).name == "step_00000020.pt"  # resume from 20, train on, save 25
    ckpt.save_checkpoint(tmp_path, 25, _state(25), keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000020.pt", "step_00000025.pt"]


def test_failed_write_leaves_nothing_behind(tmp_path):
    class Boom(Exception):
        pass

    target = tmp_path / "x.bin"
    target.write_bytes(b"old")
    real_fsync = os.fsync

    def failing_fsync(fd):
        raise Boom

    os.fsync = failing_fsync
    try:
        with pytest.raises(Boom):
            rundir.atomic_write(target, b"new contents")
    finally:
        os.fsync = real_fsync
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin"]




def test_a_pickle_with_code_is_refused_not_executed(tmp_path):
    path = tmp_path / "checkpoints" / "step_00000005.pt"
    path.parent.mkdir()
    torch.save({"model": Evil(tmp_path / "pwned")}, path)
    with pytest.raises(ConfigError, match="is not a weights-only checkpoint, refused without running it"):
        ckpt.load_checkpoint(path, torch.device("cpu"))
    assert not (tmp_path / "pwned").exists()
    torch.load(path, weights_only=False)  # proof the payload is real: an unsafe load runs it
    assert (tmp_path / "pwned").exists()


def test_every_load_in_the_trainer_is_weights_only():
    """Checkpoints and user files are data: no torch.load in train/ may run pickled code."""
    import re
    from pathlib import Path

    calls = []
    for source in (Path(__file__).resolve().parents[2] / "train").rglob("*.py"):
        for match in re.finditer(r"torch\.load\((.*?)\)", source.read_text(), flags=re.S):
            calls.append((source.name, match.group(1)))
    assert calls, "no torch.load found: the scan is looking in the wrong place"
    for name, args in calls:
        assert "weights_only=True" in args, f"{name}: torch.load({args}) without weights_only=True"
    assert not [p for p in (Path(__file__).resolve().parents[2] / "train").rglob("*.py")
                if re.search(r"\bpickle\.loads?\(", p.read_text())], "pickle.load in train/"


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_an_optimizer_saved_with_torchs_default_kernels_resumes_fused(name):
    """A checkpoint's param groups name the kernels they ran with; loading one made by torch's default
    optimizer must not switch this run's fused kernels off (under fp16's GradScaler the mix fails)."""
    from train.cli import parse_config
    from train.components.models import SmallCNN
    from train.components.optim import build_optimizer, decay_groups

    torch.manual_seed(0)
    model = SmallCNN(10, 8)
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    cfg = parse_config(["--optimizer", name, "--norm-weight-decay", "0", "--bias-weight-decay", "0"])  # 3 groups
    named, by_name = decay_groups(cfg.optimisation, model, "cnn"), dict(model.named_parameters())
    groups = [{"params": [by_name[n] for n in g["params"]]} for g in named]  # the same groups, default kernels
    old = torch.optim.SGD(groups, lr=0.1, momentum=0.9) if name == "sgd" else torch.optim.AdamW(groups, lr=0.1)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    old.step()

    optimizer = build_optimizer(cfg.optimisation, model, named)
    optimizer.load_state_dict(old.state_dict())
    assert all(g["fused"] for g in optimizer.param_groups)
    scaler = torch.amp.GradScaler("cpu")
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
    scaler.step(optimizer)
    scaler.update()
    after = list(model.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(b, p) for b, p in zip(before, after, strict=True))


def test_a_strided_parameter_is_left_to_torchs_default_optimizer():
    """Fused kernels would update a non-dense view wrongly: such a model keeps torch's default kernels."""
    from train.cli import parse_config
    from train.components.optim import build_optimizer, decay_groups

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(4, 8)[:, ::2])
    opt = parse_config([]).optimisation
    optimizer = build_optimizer(opt, model, decay_groups(opt, model, "a strided parameter"))
    assert not optimizer.param_groups[0]["fused"]
    expected = model.w.detach().clone()
    group = optimizer.param_groups[0]
    reference = torch.optim.AdamW([torch.nn.Parameter(expected)], lr=group["lr"], weight_decay=group["weight_decay"])
    for opt, p in ((optimizer, model.w), (reference, reference.param_groups[0]["params"][0])):
        p.grad = torch.ones_like(p)
        opt.step()
    torch.testing.assert_close(model.w.detach(), reference.param_groups[0]["params"][0].detach())
