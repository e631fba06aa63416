"""make pack's shards: the WebDataset layout other tools read, an index for random access, atomic and
verifiable; and the shards dataset, which must give exactly the batches of the loose files it came from."""

import json
import shutil
import tarfile
from pathlib import Path

import pytest
import torch
from PIL import Image

from train.bench.photos import make_photos
from train.config import parse_config
from train.data import ShardSplit, build_datasets, build_train_loader, build_val_loader
from train.errors import ConfigError, DataError
from train.pack import main as pack_main
from train.pack import pack, verify


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("loose")
    for split, count in (("train", 24), ("val", 8)):
        make_photos(root / split, count, classes=3, seed=len(split))
        with Image.open(next((root / split / "class2").iterdir())) as photo:
            photo.resize((60, 45)).save(root / split / "class2" / "zz.png")
    return root


@pytest.fixture(scope="module")
def packed(folder, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("packed") / "shards"
    pack(folder, dst, shard_bytes=200_000)  # several shards
    return dst


def test_the_shards_are_webdataset_tars_other_tools_read(folder, packed):
    index = json.loads((packed / "index.json").read_text())
    train = index["splits"]["train"]
    assert train["samples"] == 25 and len(train["shards"]) > 1 and train["classes"] == ["class0", "class1", "class2"]
    members = {}
    for shard in train["shards"]:
        with tarfile.open(packed / shard["name"]) as tar:
            for member in tar.getmembers():
                members[member.name] = tar.extractfile(member).read()
    keys = sorted({name.split(".")[0] for name in members})
    assert len(keys) == 25 and all(f"{k}.cls" in members for k in keys)
    loose = sorted((p for p in (folder / "train").rglob("*") if p.is_file() and not p.name.startswith(".")),
                   key=lambda p: (p.parent.name, p.name))
    for key, path in zip(keys, loose, strict=True):  # the files' own bytes, in ImageFolder's order
        assert members[f"{key}{path.suffix}"] == path.read_bytes()
        assert int(members[f"{key}.cls"]) == int(path.parent.name[-1])
    wids = json.loads((packed / "train.json").read_text())  # wids' shard index
    assert wids["__kind__"] == "wids-shard-index-v1"
    assert [s["nsamples"] for s in wids["shardlist"]] == [s["samples"] for s in train["shards"]]
    assert not list(packed.glob(".*")), "a temporary file was left behind"


def test_the_index_reads_any_sample_by_its_offset(folder, packed):
    split = ShardSplit(packed, "val")
    images = sorted((p for p in (folder / "val").rglob("*") if p.is_file() and not p.name.startswith(".")),
                    key=lambda p: (p.parent.name, p.name))
    assert len(split) == len(images) == 9
    for i in (8, 0, 5):  # any order
        data, label = split[i]
        assert bytes(data.numpy()) == images[i].read_bytes() and label == int(images[i].parent.name[-1])


def config(root, dataset, decode="cpu", workers=0):
    return parse_config(["--dataset", dataset, "--data-dir", str(root), "--image-size", "48", "--batch-size", "4",
                         "--num-workers", str(workers), "--decode", decode])


def loaded(cfg, start=0, val=False):
    train_set, val_set, classes = build_datasets(cfg)
    assert classes == 3
    if val:
        return list(build_val_loader(cfg, val_set, 0, 1, pin_memory=False))
    loader, sampler = build_train_loader(cfg, train_set, 0, 1, pin_memory=False)
    sampler.set_epoch(1, start=start)
    return list(loader)


def assert_same(a, b):
    assert len(a) == len(b) > 0
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_the_shards_give_the_loose_files_batches_bit_for_bit(folder, packed):
    loose = loaded(config(folder, "imagefolder"))
    assert_same(loaded(config(packed, "shards")), loose)
    assert_same(loaded(config(packed, "shards", workers=2)), loose)  # whatever the worker count
    assert_same(loaded(config(packed, "shards", workers=2), start=8), loose[2:])  # resumed mid-epoch
    assert_same(loaded(config(packed, "shards", decode="gpu")), loose)  # decoded in the training process
    assert_same(loaded(config(packed, "shards"), val=True), loaded(config(folder, "imagefolder"), val=True))


def test_verify_finds_a_damaged_shard_and_reading_it_names_the_sample(packed, tmp_path):
    copy = tmp_path / "shards"
    shutil.copytree(packed, copy)
    assert verify(copy) == []
    shard = copy / "train-000000.tar"
    data = bytearray(shard.read_bytes())
    data[5000] ^= 0xFF
    shard.write_bytes(bytes(data[: len(data) // 2]))
    problems = verify(copy)
    assert len(problems) == 1 and f"{shard} is damaged" in problems[0]
    split = ShardSplit(copy, "train")
    with pytest.raises(DataError, match=f"{shard} is damaged: sample 0+\\d of {shard} is cut short"):
        for i in range(split.starts[1]):
            split[i]


def test_pack_refuses_to_overwrite_and_an_unfinished_pack_is_named(folder, packed, tmp_path, capsys):
    assert pack_main([str(folder), str(packed)]) == 2
    assert "already holds a pack: pick a new DST or delete it first" in capsys.readouterr().err
    unfinished = tmp_path / "half"
    unfinished.mkdir()
    with pytest.raises(ConfigError, match="index.json is missing: pack an ImageFolder with `make pack"):
        ShardSplit(unfinished, "train")
    assert pack_main(["--verify", str(packed)]) == 0
