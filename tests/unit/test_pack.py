"""make pack's shards: the WebDataset layout other tools read, an index for random access, atomic and
verifiable; and the shards dataset, which must give exactly the batches of the loose files it came from.
Packing with workers, resizing (--max-side) and continuing a stopped pack, in this process
(tests/e2e/test_pack.py kills a running one)."""

import io
import json
import multiprocessing
import os
import re
import shutil
import signal
import tarfile
import threading
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.sources import assert_same_batches, batches
from train.base import vision
from train.base.errors import ConfigError, DataError
from train.bench.photos import make_photos
from train.cli import parse_config
from train.cluster.identity import usable_cores
from train.data import ShardSplit, build_datasets
from train.data.decode import load_image
from train.data.folders import imagefolder_split
from train.data.tars import check_shards
from train.pack.command import main as pack_main
from train.pack.command import pack, verify
from train.pack.images import shrink
from train.pack.shards import JOURNAL, write_shard


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
    assert build_datasets(cfg)[2] == 3
    return batches(cfg, start, val)


def test_the_shards_give_the_loose_files_batches_bit_for_bit(folder, packed):
    loose = loaded(config(folder, "imagefolder"))
    assert_same_batches(loaded(config(packed, "shards")), loose)
    assert_same_batches(loaded(config(packed, "shards", workers=2)), loose)  # whatever the worker count
    assert_same_batches(loaded(config(packed, "shards", workers=2), start=8), loose[2:])  # resumed mid-epoch
    assert_same_batches(loaded(config(packed, "shards", decode="gpu")), loose)  # decoded in the training process
    assert_same_batches(loaded(config(packed, "shards"), val=True), loaded(config(folder, "imagefolder"), val=True))


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
    with pytest.raises(ConfigError, match=f"^{shard} holds [0-9,]+ bytes, and index.json records [0-9,]+: a shard cut "
                                          f"short, changed or removed: run `python -m train.pack --verify {copy}`"):
        check_shards(copy)  # before any worker starts
    split = ShardSplit(copy, "train")
    with pytest.raises(DataError, match=f"{shard} is damaged: sample 0+\\d of {shard} is cut short"):
        for i in range(split.starts[1]):
            split[i]


def test_pack_refuses_to_overwrite_and_an_unfinished_pack_is_named(folder, packed, tmp_path, capsys):
    assert pack_main([str(folder), str(packed)]) == 2
    assert "already holds a pack: pick a new DST or delete it first" in capsys.readouterr().err
    unfinished = tmp_path / "half"
    unfinished.mkdir()
    with pytest.raises(ConfigError, match="index.json is missing: pack an ImageFolder with `make pack.*an unfinished "
                                          "pack: the same command continues it"):
        ShardSplit(unfinished, "train")
    assert pack_main(["--verify", str(packed)]) == 0


# ---------------------------------------------------------------- workers, --max-side, continuing

SMALL_SHARDS = 40_000  # a few resized photos per shard


@pytest.fixture(scope="module")
def resized(folder, tmp_path_factory) -> tuple[Path, str]:
    """The folder packed with --max-side 256 by 3 worker processes, and its progress lines."""
    dst = tmp_path_factory.mktemp("resized") / "shards"
    lines = io.StringIO()
    pack(folder, dst, SMALL_SHARDS, workers=3, max_side=256, progress_to=lines, progress_every=0.02)
    return dst, lines.getvalue()


def files_of(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def members(root: Path, split: str) -> list[tuple[str, bytes]]:
    """Every image member of a split's shards, in order: (name, bytes)."""
    out = []
    for shard in json.loads((root / "index.json").read_text())["splits"][split]["shards"]:
        with tarfile.open(root / shard["name"]) as tar:
            out += [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if not m.name.endswith(".cls")]
    return out


def test_packing_is_exact_whatever_the_workers(folder, resized, tmp_path):
    one = tmp_path / "one"
    pack(folder, one, SMALL_SHARDS, workers=1, max_side=256)
    by_one, by_three = files_of(one), files_of(resized[0])
    assert sum(name.endswith(".tar") for name in by_one) >= 6
    assert by_one.keys() == by_three.keys()
    for name in by_one:  # every shard, .idx, wids index and index.json, byte for byte
        assert by_one[name] == by_three[name], name
    for split in ("train", "val"):  # and the samples are the folder's, in its order, with its labels
        names = [name for name, _ in members(one, split)]
        labels = [label for _, label in ShardSplit(one, split)]
        loose = sorted((p for p in (folder / split).rglob("*") if p.is_file() and not p.name.startswith(".")),
                       key=lambda p: (p.parent.name, p.name))
        assert [n.split(".")[0] for n in names] == [f"{i:09d}" for i in range(len(loose))]
        assert labels == [int(p.parent.name[-1]) for p in loose]


def test_max_side_resizes_as_torchvision_resize_and_keeps_smaller_images_as_they_are(folder, resized):
    dst = resized[0]
    index = json.loads((dst / "index.json").read_text())
    assert (index["max_side"], index["quality"]) == (256, 90)  # the settings, recorded
    resize = vision.v2.Resize(size=None, max_size=256, antialias=True)  # torchvision's own transform
    kept = 0
    for split in ("train", "val"):
        loose = sorted((p for p in (folder / split).rglob("*") if p.is_file() and not p.name.startswith(".")),
                       key=lambda p: (p.parent.name, p.name))
        packed = members(dst, split)
        assert len(packed) == len(loose)
        for path, (name, data) in zip(loose, packed, strict=True):
            original = load_image(str(path))  # decoded as training decodes the loose file
            if max(original.shape[1:]) <= 256:  # the 60 x 45 PNG: its own bytes, its own format
                assert name.endswith(path.suffix) and data == path.read_bytes()
                kept += 1
                continue
            expected = resize(original)
            assert max(expected.shape[1:]) == 256
            assert torch.equal(shrink(original, 256), expected)  # the pixels before encoding: Resize's, exactly
            assert name.endswith(".jpg") and data == bytes(vision.io.encode_jpeg(expected, quality=90).numpy())
        assert index["splits"][split]["resized"] == len(loose) - 1
    assert kept == 2


def test_the_progress_line_comes_every_period_while_a_pack_runs(resized):
    lines = resized[1].splitlines()
    periodic = [line for line in lines if re.fullmatch(r"pack: \d+/34 images \(.*%\), [\d.,]+ images/s, ETA .*", line)]
    assert len(periodic) >= 2, lines
    assert re.fullmatch(r"pack: 34/34 images \(100\.0%\), [\d.,]+ images/s, \d+ s", lines[-1]), lines
    assert len(lines) < 200  # a line per period, not per image


@pytest.mark.parametrize("content", [b"not an image", b""], ids=["not-an-image", "empty"])
def test_a_pack_stopped_by_a_bad_image_continues_where_it_stopped(folder, tmp_path, capsys, content):
    src, dst = tmp_path / "src", tmp_path / "shards"
    shutil.copytree(folder, src)
    bad = src / "train" / "class1" / "zz.jpg"  # in the middle of the train split
    bad.write_bytes(content)
    args = [str(src), str(dst), "--workers", "2", "--max-side", "256", "--shard-mb", str(SMALL_SHARDS / 2**20)]
    assert pack_main(args) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"error: cannot read image {bad} (") and "run the same command" in err[-1]
    assert not (dst / "index.json").exists()
    finished = [json.loads(line)["name"] for line in (dst / JOURNAL).read_text().splitlines()[1:]]
    assert len(finished) >= 3
    stamps = {name: ((dst / name).stat().st_ino, (dst / name).stat().st_mtime_ns) for name in finished}

    before = files_of(dst)
    other = {"--max-side 128": "MAX_SIDE=256 (now 128)", "--quality 80": "QUALITY=90 (now 80)",
             "--shard-mb 1": "--shard-mb 0.038147 (now 1)"}
    for flags, named in other.items():
        assert pack_main([*args, *flags.split()]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {dst} holds an unfinished pack made with ")
        assert named in err[0] and err[0].endswith("run the command that started it to finish it, or pick a new DST")
    shutil.copy(next((src / "train" / "class0").iterdir()), src / "train" / "class0" / "new.jpg")
    assert pack_main(args) == 2
    assert "another listing of SRC (images added, removed or renamed since)" in capsys.readouterr().err
    (src / "train" / "class0" / "new.jpg").unlink()
    assert files_of(dst) == before  # a refusal writes nothing

    shutil.copy(next((src / "train" / "class1").iterdir()), bad)  # the image replaced: the same command,
    assert pack_main(args[:2] + args[4:]) == 0  # here without --workers: every usable core, the same shards
    out, err = capsys.readouterr()
    assert f"continuing the pack in {dst}: " in err and f"by {usable_cores()} worker(s)" in out
    assert {name: ((dst / name).stat().st_ino, (dst / name).stat().st_mtime_ns) for name in finished} == stamps
    assert verify(dst) == [] and not list(dst.glob(".*"))
    whole = tmp_path / "whole"
    pack(src, whole, SMALL_SHARDS, workers=1, max_side=256)
    assert files_of(dst) == files_of(whole)


def test_bad_pack_knobs_are_one_line(folder, tmp_path, capsys):
    dst = tmp_path / "shards"
    for flags, says in ((["--workers", "0"], "WORKERS=0: give 1 or more processes"),
                        (["--max-side", "0"], "MAX_SIDE=0: give the longest side to keep in pixels"),
                        (["--max-side", "512", "--quality", "101"], "QUALITY=101: give a JPEG quality from 1 to 100"),
                        (["--quality", "80"], "QUALITY=80 applies to the images MAX_SIDE resizes: set MAX_SIDE"),
                        (["--max-side", "big"], "argument --max-side: invalid int value: 'big'")):
        assert pack_main([str(folder), str(dst), *flags]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {says}"), err
    assert not dst.exists()
    (dst).mkdir()
    (dst / "train-000000.tar").write_bytes(b"someone's")  # shards that no journal explains: never overwritten
    assert pack_main([str(folder), str(dst)]) == 2
    assert "holds shards but no record of the pack that wrote them" in capsys.readouterr().err
    assert (dst / "train-000000.tar").read_bytes() == b"someone's"


def test_a_worker_killed_mid_pack_is_one_line_and_the_same_command_continues(folder, tmp_path, capsys):
    dst = tmp_path / "shards"
    args = [str(folder), str(dst), "--workers", "2", "--max-side", "64", "--shard-mb", str(4_000 / 2**20)]

    def kill_a_worker():  # as the OOM killer would, once the pack has finished a shard
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if (dst / JOURNAL).is_file() and len((dst / JOURNAL).read_text().splitlines()) >= 2:
                os.kill(multiprocessing.active_children()[0].pid, signal.SIGKILL)
                return
            time.sleep(0.001)

    killer = threading.Thread(target=kill_a_worker)
    killer.start()
    code = pack_main(args)
    killer.join()
    err = capsys.readouterr().err.splitlines()
    assert code == 1 and err[-1] == f"error: a pack worker died (killed, or out of memory): run the same command to " \
        f"continue the pack in {dst}, with fewer WORKERS if memory is short"
    assert pack_main(args) == 0 and "continuing the pack in" in capsys.readouterr().err
    whole = tmp_path / "whole"
    pack(folder, whole, 4_000, workers=1, max_side=64)
    assert files_of(dst) == files_of(whole)


# ---------------------------------------------------------------- what SRC holds, and where DST may be

def test_pack_lists_src_as_training_lists_the_imagefolder(tmp_path, capsys):
    """Nested folders (a folder's own files before its subfolders', as os.walk gives them), names in any case,
    files that are not images (a GIF among them: torchvision's ImageFolder reads none): the shards hold the
    ImageFolder's samples, in its order, with its labels. A link cycle in SRC is refused in one line before
    anything is written."""
    src = tmp_path / "src"
    for split in ("train", "val"):
        for i, name in enumerate(["b/1.PNG", "b/a/2.png", "b/a-z/3.png", "b/0.png", "b/z.png", "b/x.gif",
                                        "a/9.Jpg", "a/n.txt"]):
            path = src / split / name
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (8, 8), (i * 30, 0, 0)).save(path, "PNG" if "png" in name.lower() else "JPEG")
    pack(src, tmp_path / "shards")
    for split in ("train", "val"):
        loose = imagefolder_split(src, split)
        packed = ShardSplit(tmp_path / "shards", split)
        assert packed.classes == loose.classes and len(packed) == len(loose.samples) == 6
        for i, (path, label) in enumerate(loose.samples):
            assert bytes(packed[i][0].numpy()) == Path(path).read_bytes() and packed[i][1] == label
    (src / "train" / "b" / "a" / "loop").symlink_to("..")
    assert pack_main([str(src), str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {src / 'train' / 'b' / 'a' / 'loop'} is a link cycle"), err
    assert not (tmp_path / "again").exists()


def test_pack_refuses_a_dst_in_src_or_holding_files_it_did_not_write(folder, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(folder, src)
    (tmp_path / "into-src").symlink_to(src / "val")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a user's")
    (tmp_path / "a-file").write_text("a user's")
    (tmp_path / "dangling").symlink_to("gone")
    before = {p: p.lstat().st_mtime_ns for p in tmp_path.rglob("*")}
    for dst, says in ((src, f"DST {src} is SRC {src}: the shards would be written into the folder they are made "
                            f"from: pick a DST outside SRC"),
                      (src / "shards", f"DST {src / 'shards'} is inside SRC {src}: "),
                      (tmp_path / "into-src" / "shards", f"DST {tmp_path / 'into-src' / 'shards'} is inside SRC {src} "
                                                         f"({src / 'val' / 'shards'} in {src}): "),
                      (tmp_path / "mine", f"DST {tmp_path / 'mine'} holds 1 file(s) a pack did not write (notes.txt): "
                                          f"pick a new or empty DST, or move them out"),
                      (tmp_path / "a-file", f"DST {tmp_path / 'a-file'} is a file: pick a folder"),
                      (tmp_path / "dangling", f"DST {tmp_path / 'dangling'} is a broken link (it names gone): create")):
        assert pack_main([str(src), str(dst)]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {says}"), err
    assert {p: p.lstat().st_mtime_ns for p in tmp_path.rglob("*")} == before  # nothing written, nothing touched
    (tmp_path / "fresh-disk" / "lost+found").mkdir(parents=True)  # a new filesystem's top folder is no one's
    assert pack_main([str(folder), str(tmp_path / "fresh-disk")]) == 0
    assert verify(tmp_path / "fresh-disk") == []


def test_an_empty_image_is_refused_also_where_nothing_is_resized(folder, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(folder, src)
    (src / "val" / "class0" / "empty.png").write_bytes(b"")
    assert pack_main([str(src), str(tmp_path / "shards"), "--workers", "1"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: cannot read image {src / 'val' / 'class0' / 'empty.png'} (an empty file, 0 bytes): replace the "
        f"file, then run the same command to continue the pack")


def test_max_side_resizes_every_kind_of_image_as_pil_converts_it(tmp_path):
    """16-bit, alpha, palette, CMYK, 1-bit: decoded as training decodes them (PIL's convert("RGB")), then resized."""
    from tests.unit.test_images import KINDS, pil_rgb

    src = tmp_path / "src"
    for split in ("train", "val"):
        for name, make, _ in KINDS:
            (src / split / "c").mkdir(parents=True, exist_ok=True)
            (src / split / "c" / name).write_bytes(make())
    pack(src, tmp_path / "shards", max_side=16, quality=95)
    loose = imagefolder_split(src, "train").samples
    packed = members(tmp_path / "shards", "train")
    assert len(packed) == len(loose) == len(KINDS)
    for (path, _), (name, data) in zip(loose, packed, strict=True):
        expected = vision.v2.Resize(size=None, max_size=16, antialias=True)(pil_rgb(Path(path).read_bytes()))
        assert name.endswith(".jpg") and data == bytes(vision.io.encode_jpeg(expected, quality=95).numpy()), path


def test_an_empty_record_in_a_shard_is_one_line_naming_it(packed, tmp_path):
    """A pack made before empty files were refused may hold one: reading it names the sample, not a traceback."""
    copy = tmp_path / "shards"
    shutil.copytree(packed, copy)
    write_shard(copy, "train-000000.tar", iter([(b"", ".jpg", False, 0, 0), (b"x", ".jpg", False, 1, 0)]))
    split = ShardSplit(copy, "train")
    with pytest.raises(DataError) as empty:
        split[0]
    assert str(empty.value) == (f"sample 000000000 of {copy / 'train-000000.tar'} is empty (0 bytes: its image was an "
                                f"empty file when it was packed): replace that image in the ImageFolder and pack it "
                                f"into a new DST")
