"""Sharded checkpoints as files (train/files/shards.py): a DCP folder written under a temporary name, checksummed,
renamed into place, verified file by file, pruned beside step_N.pt files, and its model read whole in one process.
Written here by DCP in one process (no process group: DCP writes one rank's files); the workers' own saves and their
resumes at other world sizes are tests/e2e/test_lm.py's."""

import warnings

import pytest
import torch

from train.base.errors import ConfigError
from train.files import checkpoint_io as ckpt
from train.files import shards


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(8, 6)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def _save_folder(run_dir, step, model, optimizer, keep=3):
    """What Checkpointer._save_shards does on each rank and then on rank 0, for one rank."""
    import torch.distributed.checkpoint as dcp

    temp = shards.temp_of(ckpt.prepare(run_dir) / f"step_{step:08d}{shards.SUFFIX}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP says it assumes one process: it is one
        index = dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=temp)
    written = [*sorted({stored.relative_path for stored in index.storage_data.values()}), ".metadata"]
    assert sorted(written) == sorted(p.name for p in temp.iterdir())  # DCP's record: every file it wrote
    sums = [shards.checksum_share(temp, written, 0, 1)]
    path = shards.finish(temp, ckpt.serialise({"step": step, "config": {}, "param_groups": []}), sums)
    ckpt.prune(run_dir, path, keep)
    return path


def test_a_folder_is_renamed_into_place_with_every_file_checksummed_and_its_model_read_whole_alone(tmp_path):
    model, optimizer = _trained()
    path = _save_folder(tmp_path, 7, model, optimizer)
    assert path.name == "step_00000007.dcp" and ckpt.list_checkpoints(tmp_path) == [path]
    assert [p.name for p in ckpt.checkpoint_dir(tmp_path).iterdir()] == [path.name]  # no temporary left
    listed = sorted(line.split()[-1] for line in (path / shards.CHECKSUMS).read_text().splitlines())
    assert listed == sorted(p.name for p in path.iterdir() if p.name != shards.CHECKSUMS)
    assert {".metadata", "state.pt"} < set(listed) and any(n.endswith(".distcp") for n in listed)
    assert ckpt.verify(path) is None and ckpt.newest_valid(tmp_path) == path
    assert ckpt.load_checkpoint(path, torch.device("cpu"))["step"] == 7  # state.pt: the rest of the state
    read = shards.read_model(path)
    assert read.keys() == model.state_dict().keys()  # the model's tensors, buffers too, and no optimizer's
    assert all(torch.equal(read[k], v) and read[k].dtype == v.dtype for k, v in model.state_dict().items())


@pytest.mark.parametrize("damage", ["cut", "flip", "missing", "unfinished"])
def test_a_damaged_folder_is_named_and_the_newest_checkpoint_that_verifies_wins(tmp_path, damage, caplog):
    model, optimizer = _trained()
    older = ckpt.save_checkpoint(tmp_path, 5, {"model": model.state_dict(), "step": 5}, keep=3)  # the other kind
    path = _save_folder(tmp_path, 10, model, optimizer)
    shard = next(p for p in path.iterdir() if p.suffix == ".distcp")
    data = shard.read_bytes()
    if damage == "cut":
        shard.write_bytes(data[:-10])
    elif damage == "flip":
        shard.write_bytes(data[:50] + bytes([data[50] ^ 0xFF]) + data[51:])
    elif damage == "missing":
        shard.unlink()
    else:
        (path / shards.CHECKSUMS).unlink()
    why = {"cut": f"{shard.name} is {len(data) - 10} bytes but {len(data)} were saved (file truncated)",
           "flip": f"{shard.name}: checksum mismatch (file corrupted)", "missing": f"{shard.name} is missing",
           "unfinished": "no CHECKSUMS in it (the save did not finish)"}[damage]
    assert ckpt.verify(path) == why
    assert ckpt.newest_valid(tmp_path) == older
    assert f"skipping checkpoint {path}: {why}" in caplog.text


def test_a_killed_save_leaves_a_temporary_folder_that_is_never_listed_and_goes_at_the_next_save(tmp_path):
    model, optimizer = _trained()
    _save_folder(tmp_path, 1, model, optimizer)
    torn = ckpt.checkpoint_dir(tmp_path) / ".step_00000002.dcp.tmp"
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"x" * 1000)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000001.dcp"]
    assert ckpt.remove_partial(tmp_path) == 1000 and not torn.exists()


def test_pruning_keeps_the_newest_of_both_kinds_and_removes_folders_whole(tmp_path):
    model, optimizer = _trained()
    _save_folder(tmp_path, 1, model, optimizer, keep=2)
    ckpt.save_checkpoint(tmp_path, 2, {"model": model.state_dict(), "step": 2}, keep=2)
    _save_folder(tmp_path, 3, model, optimizer, keep=2)
    ckpt.save_checkpoint(tmp_path, 4, {"model": model.state_dict(), "step": 4}, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000003.dcp", "step_00000004.pt"]
    assert sorted(p.name for p in ckpt.checkpoint_dir(tmp_path).iterdir()) == [
        "step_00000003.dcp", "step_00000004.pt", "step_00000004.pt.crc32"]


def test_evaluate_and_export_refuse_a_damaged_folder_in_one_line(tmp_path):
    from train.config.settings import Config
    from train.evaluate import read_run
    from train.run.scoring import load_weights
    from train.files.rundir import to_json

    model, optimizer = _trained()
    (tmp_path / "config.json").write_text(to_json(Config().to_dict()))
    (tmp_path / "classes.json").write_text('["a", "b", "c"]')
    path = _save_folder(tmp_path, 3, model, optimizer)
    source = read_run(tmp_path, str(path))[2]
    assert load_weights(source, tmp_path).keys() == model.state_dict().keys()
    shard = next(p for p in path.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(ConfigError) as refused:
        load_weights(read_run(tmp_path, str(path))[2], tmp_path)
    assert str(refused.value) == (f"{path} cannot be read ({shard.name} is {shard.stat().st_size} bytes but "
                                  f"{shard.stat().st_size + 1} were saved (file truncated)): pass another checkpoint "
                                  f"of the run, model.pt or best.pt")
    folder = path.parent  # a folder, but not a checkpoint's
    with pytest.raises(ConfigError) as refused:
        load_weights(read_run(tmp_path, str(folder))[2], tmp_path)
    assert str(refused.value) == (f"{folder} is a folder, not a checkpoint: pass model.pt, best.pt, a step_N.pt file "
                                  f"or a step_N.dcp folder of the run")


def test_a_folder_is_a_runs_starting_weights_too(tmp_path):
    """--weights step_N.dcp (the out-of-memory advice names a run's newest checkpoint): its model, read whole; the
    manifest pins its CHECKSUMS; a damaged folder is one line."""
    from train.cli import parse_config
    from train.components.weights import read_weights
    from train.files.rundir import file_digest

    model, optimizer = _trained()
    path = _save_folder(tmp_path, 4, model, optimizer)
    state, recorded = read_weights(parse_config(["--weights", str(path)]).model)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items()) and state.keys() == \
        model.state_dict().keys()
    assert recorded["weights_sha256"] == file_digest(path / shards.CHECKSUMS)
    (path / "state.pt").unlink()
    with pytest.raises(ConfigError, match=r"cannot be read \(state.pt is missing\): give another checkpoint"):
        read_weights(parse_config(["--weights", str(path)]).model)
