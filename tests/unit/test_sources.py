"""Every source of the same images gives the same samples: an ImageFolder (and one made of links into it, as a NAS's
folders are made of links into one pool), label files (csv, tsv, jsonl), WebDataset
tars written by webdataset's own ShardWriter, tars written by Python's tarfile, and Hugging Face datasets written by
`datasets` itself (save_to_disk, and Parquet), each in the ImageFolder's order (tests/sources.py), give the same
(image, label) batches bit for bit (whatever the loader workers, the resume point or --decode), the same plan counts
and classes, and the same packed shards."""

import json
import os
import shutil
import tarfile

import pytest

from tests.sources import (assert_same_batches, batches, draw_imagefolder, link_imagefolder, write_hf_sources,
                           write_label_files, write_plain_tars, write_wds_shards)
from train.cli import parse_config
from train.data import build_datasets
from train.data.tarindex import load_split
from train.pack.command import main as pack_main
from train.pack.command import pack
from train.run.plan import dry_run

SOURCES = ["imagefolder", "imagefolder-links", "csv", "tsv", "jsonl", "webdataset", "tarfile", "hf-disk", "hf-parquet"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    """Each source's flags (--dataset, --data-dir and its own), the same images in each."""
    root = tmp_path_factory.mktemp("sources")
    folder = draw_imagefolder(root / "folder")
    disk, parquet = write_hf_sources(folder, root / "hf-disk", root / "hf-parquet")
    return {
        "imagefolder": ["--dataset", "imagefolder", "--data-dir", folder],
        "imagefolder-links": ["--dataset", "imagefolder", "--data-dir", link_imagefolder(folder, root / "links")],
        "csv": ["--dataset", "csv", "--data-dir", write_label_files(folder, root / "csv")],
        "tsv": ["--dataset", "csv", "--data-dir", write_label_files(folder, root / "tsv", ".tsv")],
        "jsonl": ["--dataset", "csv", "--data-dir", write_label_files(folder, root / "jsonl", ".jsonl")],
        "webdataset": ["--dataset", "shards", "--data-dir", write_wds_shards(folder, root / "wds")],
        "tarfile": ["--dataset", "shards", "--data-dir", write_plain_tars(folder, root / "tarfile"),
                    "--label-key", "label"],
        "hf-disk": ["--dataset", "hf", "--data-dir", disk],
        "hf-parquet": ["--dataset", "hf", "--data-dir", parquet],
    }


def config(flags, decode="cpu", workers=0, *extra):
    return parse_config([*map(str, flags), "--image-size", "16", "--augment", "imagenet", "--batch-size", "4",
                         "--num-workers", str(workers), "--decode", decode, *extra])


@pytest.fixture(scope="module")
def reference(sources) -> tuple[list, list]:
    cfg = config(sources["imagefolder"])
    return batches(cfg), batches(cfg, val=True)


@pytest.mark.parametrize("source", SOURCES[1:])
def test_every_source_gives_the_imagefolders_samples_bit_for_bit(sources, reference, source):
    train, val = reference
    assert_same_batches(batches(config(sources[source])), train)
    assert_same_batches(batches(config(sources[source]), val=True), val)
    assert_same_batches(batches(config(sources[source], "gpu")), train)  # read by the workers, decoded by the trainer


@pytest.mark.parametrize("source", ["csv", "webdataset", "hf-parquet"])
def test_loader_workers_and_a_resume_mid_epoch_change_nothing(sources, reference, source):
    train, _ = reference
    assert_same_batches(batches(config(sources[source], "cpu", 2)), train)
    assert_same_batches(batches(config(sources[source], "cpu", 2), start=8), train[2:])


def test_every_source_plans_the_same_counts_and_classes(sources):
    plans = {source: dry_run(config(flags), 2).to_dict() for source, flags in sources.items()}
    same = ("train_samples", "val_samples", "num_classes", "classes", "steps_per_epoch")
    for source, plan in plans.items():
        assert {k: plan[k] for k in same} == {k: plans["imagefolder"][k] for k in same}, source
    assert plans["imagefolder"]["classes"] == ["disk", "ring", "square"]
    assert (plans["imagefolder"]["train_samples"], plans["imagefolder"]["val_samples"]) == (30, 12)
    kinds = {source: (plan["source"]["kind"], plan["source"]["classes_from"]) for source, plan in plans.items()}
    assert kinds == {
        "imagefolder": ("imagefolder", "the class folders' names, sorted"),
        "imagefolder-links": ("imagefolder", "the class folders' names, sorted"),
        "csv": ("csv", "the label names of train.csv, sorted"),
        "tsv": ("csv", "the label names of train.tsv, sorted"),
        "jsonl": ("csv", "the label names of train.jsonl, sorted"),
        "webdataset": ("shards (WebDataset tars of another tool)", "classes.txt, in its order"),
        "tarfile": ("shards (WebDataset tars of another tool)", "classes.json, in its order"),
        "hf-disk": ("hf (a Hugging Face dataset)", "the ClassLabel names of the column 'label', in their order"),
        "hf-parquet": ("hf (a Hugging Face dataset)", "the label names of the train split, sorted"),
    }
    assert plans["csv"]["source"]["order"] == "the label file's rows, in its order"
    assert plans["webdataset"]["source"]["train"].startswith("5 tar(s) in ")  # 30 images, 7 a shard


def test_an_evaluation_of_the_validation_split_alone_has_the_runs_classes(sources, tmp_path):
    for source in ("csv", "webdataset"):
        flags = sources[source]
        trained = build_datasets(config(flags))[0]
        alone = tmp_path / source
        alone.mkdir()
        for path in flags[3].iterdir():  # the validation split and the class list, without the training split
            if path.name.startswith(("val", "classes")):
                shutil.copy(path, alone / path.name)
        if source == "csv":
            (alone / "classes.txt").write_text("disk\nring\nsquare\n")
        _, val, classes = build_datasets(config([*flags[:3], alone, *flags[4:]]), train=False)
        assert val.source.classes == trained.source.classes and classes == 3


def test_pack_makes_the_same_shards_from_every_source(sources, tmp_path):
    packed = {}
    for workers, source in enumerate(SOURCES, 1):
        flags = sources[source]
        options = {"label_key": "label"} if source == "tarfile" else {}
        index = pack(flags[3], tmp_path / source, shard_bytes=20_000, workers=1 + workers % 2, **options)
        packed[source] = {split: (info["classes"], [(s["name"], s["sha256"]) for s in info["shards"]])
                          for split, info in index["splits"].items()}
        assert index["source_kind"] == {"imagefolder": "imagefolder", "imagefolder-links": "imagefolder",
                                        "webdataset": "tars", "tarfile": "tars",
                                        "hf-disk": "hf", "hf-parquet": "hf"}.get(source, "csv")
    for source in SOURCES:
        assert packed[source] == packed["imagefolder"], source
    assert len(packed["csv"]["train"][1]) > 1
    # and the pack trains as its source does
    index = json.loads((tmp_path / "csv" / "index.json").read_text())
    assert index["splits"]["train"]["samples"] == 30


@pytest.mark.parametrize("source", ["csv", "webdataset"])
def test_a_pack_of_a_new_source_stopped_by_a_bad_image_continues_with_max_side(sources, tmp_path, capsys, source):
    """WORKERS, MAX_SIDE and continuing as for an ImageFolder: stopped by an image that cannot be read (one line),
    continued by the same command once it is mended, the shards those of the ImageFolder packed at once."""
    folder = tmp_path / "folder"
    shutil.copytree(sources["imagefolder"][3], folder)
    if source == "csv":  # a listed file that is no image (a missing one is refused before anything is written)
        src = write_label_files(folder, tmp_path / "src")
        bad = sorted((folder / "train" / "ring").iterdir())[2]
        kept = bad.read_bytes()
        bad.write_bytes(b"not an image")
        says = f"cannot read image {bad} ("
    else:  # an image member that does not decode, in a tar whose index is cached (the same size and time)
        src = write_wds_shards(folder, tmp_path / "src")
        load_split(src, "train", "cls")
        bad = src / "train-000002.tar"
        kept, stamp = bad.read_bytes(), bad.stat()
        with tarfile.open(bad) as tar:
            member = tar.getmembers()[1]  # s00014.jpg or .png, after s00014.cls
        bad.write_bytes(kept[:member.offset_data] + b"\0" * member.size + kept[member.offset_data + member.size:])
        os.utime(bad, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
        says = f"cannot read image {bad} (the member at byte {member.offset_data}) ("
    dst = tmp_path / "shards"
    args = [str(src), str(dst), "--workers", "2", "--max-side", "16", "--shard-mb", str(2_000 / 2**20)]
    assert pack_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {says}") and "run the same command" in err[-1], err
    assert not (dst / "index.json").exists() and len((dst / ".pack-journal.jsonl").read_text().splitlines()) > 2
    bad.write_bytes(kept)
    if source == "webdataset":
        os.utime(bad, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert pack_main(args) == 0
    assert "continuing the pack in" in capsys.readouterr().err
    pack(folder, tmp_path / "whole", 2_000, workers=1, max_side=16)
    packed, whole = (json.loads((d / "index.json").read_text()) for d in (dst, tmp_path / "whole"))
    assert packed["splits"] == whole["splits"] and packed["splits"]["train"]["resized"] == 30
