"""Other tools' WebDataset tars (train/data/tars.py): indexed once, in parallel, by one of the processes that start at
once, into a cache beside them (or in the run folder where their folder cannot be written), used again while the tars
stay as they were; a bad sample or a cut, damaged or foreign tar one line naming the tar and the key or member, that
does not grow with the tar, before any worker starts; a member that cannot be read one line when it is met."""

import gzip
import io
import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import tarfile
import time

import pytest
from PIL import Image

from tests.sources import add_member
from train.base.errors import ConfigError, DataError
from train.cli import parse_config
from train.data import build_datasets
from train.data.tarindex import CACHE, FALLBACK, cache_dirs, find_tars, indexing, load_split
from train.data.tars import check_shards, tar_splits
from train.pack.command import main as pack_main
from train.run.preflight import preflight


def png(colour=(200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (12, 12), colour).save(buffer, "PNG")
    return buffer.getvalue()


def write_tar(path, samples) -> None:
    """samples: [(key, {suffix: bytes})], in order."""
    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for suffix, data in members.items():
                add_member(tar, f"{key}.{suffix}", data)


def dataset(root, train=None, val=None):
    """root/train-000.tar, train-001.tar (3 samples each, labels 0-2) and val-000.tar (2), or the samples given."""
    root.mkdir(parents=True, exist_ok=True)
    train = train or [[(f"t{s}{i}", {"png": png(), "cls": str(i).encode()}) for i in range(3)] for s in range(2)]
    for n, samples in enumerate(train):
        write_tar(root / f"train-{n:03d}.tar", samples)
    write_tar(root / "val-000.tar", val or [(f"v{i}", {"png": png(), "cls": str(i).encode()}) for i in range(2)])
    return root


@pytest.mark.parametrize("sample, says", [
    ({"cls": b"1"}, r"train-001.tar: the sample 'bad' has no image \(.jpg, .jpeg, .png.*; it has cls\): add its image"),
    ({"png": png()}, r"train-001.tar: the sample 'bad' has no label \(no bad.cls or bad.json\): add one, pass "
                     r"--label-key"),
    ({"png": png(), "json": b'{"caption": "x"}'}, r"the sample 'bad' has no label \(no bad.cls, and no 'cls' in "
                                                  r"bad.json\)"),
    ({"png": png(), "cls": b"cat"}, r"the label of the sample 'bad' \(bad.cls: 'cat'\) is not a class index"),
    ({"png": png(), "cls": b"-1"}, r"the label of the sample 'bad' \(bad.cls: '-1'\) is not a class index"),
    ({"png": png(), "json": b"{oops"}, r"the sample 'bad' has a bad.json that is not JSON"),
    ({"png": png(), "cls": b"x" * 100_000}, r"\(bad.cls: 'x{40}'... \(100,000 characters\)\) is not a class index"),
])
def test_a_sample_without_an_image_or_a_label_is_one_line_naming_the_tar_and_the_key(tmp_path, sample, says):
    dataset(tmp_path, [[("a", {"png": png(), "cls": b"0"})], [("b", {"png": png(), "cls": b"1"}), ("bad", sample)]])
    with pytest.raises(ConfigError) as e:
        check_shards(tmp_path)
    assert "\n" not in str(e.value) and str(e.value).startswith(str(tmp_path)) and len(str(e.value)) < 500, e.value
    assert re.search(says, str(e.value)), e.value
    assert not (tmp_path / CACHE / "train.json").exists()  # nothing cached that would hide it next time


def test_keys_with_a_dot_are_named_as_the_cause_in_a_line_that_does_not_grow_with_the_tar(tmp_path):
    samples = [(f"img.{i:04d}", {"jpg": png(), "cls": b"0"}) for i in range(500)]  # webdataset: one sample, 'img'
    dataset(tmp_path, [samples])
    with pytest.raises(ConfigError) as e:
        check_shards(tmp_path)
    assert str(e.value) == (f"{tmp_path}/train-000.tar: the sample 'img' has no image: its 1,000 members "
                            f"(img.0000.cls, img.0000.jpg, img.0001.cls and 997 more) are one sample to webdataset, "
                            f"which takes a member's key up to the first dot of its name (img.0000.jpg: the key 'img', "
                            f"the part '0000.jpg', not an image): write the tars again with keys that hold no dot "
                            f"(img_0000.jpg)")
    dataset(tmp_path, [[("k", {f"part{i}": b"x" for i in range(500)})]])
    with pytest.raises(ConfigError, match=r"the sample 'k' has no image \(.*; it has part0, part1, part10 and 497 "
                                          r"more\): add its image, or remove the sample$"):
        check_shards(tmp_path)


def test_a_label_that_names_no_class_is_one_line(tmp_path):
    dataset(tmp_path)
    (tmp_path / "classes.txt").write_text("cat\ndog\n")
    with pytest.raises(ConfigError, match=r"train-000.tar: the label 2 of the sample 't02' names no class \(2: "
                                          r"classes.txt, in its order\) in the train split: fix the label, or add"):
        check_shards(tmp_path)
    (tmp_path / "classes.txt").unlink()
    write_tar(tmp_path / "val-000.tar", [("v", {"png": png(), "cls": b"7"})])  # beyond the training labels 0-2
    with pytest.raises(ConfigError, match=r"val-000.tar: the label 7 of the sample 'v' names no class \(3: the labels"):
        check_shards(tmp_path)


@pytest.mark.parametrize("damage, says", [
    ("gzip", r"cannot be read as a plain tar .*: a damaged, compressed \(.tar.gz\) or other file"),
    ("text", r"cannot be read as a plain tar"),
    ("empty-tar", r"holds no sample"),
    ("a-header-damaged", r"is damaged \(after the member t11.cls, at byte {t12}, comes neither a member's header nor "
                         r"the end of the tar\): copy the tar again"),
])
def test_a_damaged_compressed_or_foreign_file_is_one_line(tmp_path, damage, says):
    dataset(tmp_path)
    tar = tmp_path / "train-001.tar"
    if damage == "gzip":
        tar.write_bytes(gzip.compress(tar.read_bytes()))
    elif damage == "text":
        tar.write_text("not a tar at all\n" * 100)
    elif damage == "empty-tar":
        write_tar(tar, [])
    else:  # the header of t12.png overwritten: tarfile would end the tar there without a word
        with tarfile.open(tar) as whole:
            t12 = whole.getmember("t12.png").offset
        with open(tar, "r+b") as f:
            f.seek(t12)
            f.write(b"x" * 512)
        says = says.format(t12=f"{t12:,}")
    with pytest.raises(ConfigError, match=f"^{tar}: |^{tar} |^cannot read {tar}") as e:
        check_shards(tmp_path)
    assert re.search(says, str(e.value)) and "\n" not in str(e.value), e.value


NO_END = r"without the two blocks of zeros that end a tar\)"


def cut_at(tar, where: str) -> int:
    """Where in the whole tar a cut falls (its members: t10.png, t10.cls, t11.png, t11.cls, then t12's, then with a
    long name, its pax header first)."""
    with tarfile.open(tar) as whole:
        members = {m.name.rsplit("/", 1)[-1]: m for m in whole.getmembers()}
        end = whole.offset  # the end of the last member: the two blocks of zeros that end a tar follow
    return {"in-a-member's-data": members["t12.png"].offset_data + 5,
            "between-a-sample's-members": members["t11.cls"].offset,  # t11 loses its label, t12 all
            "between-samples": members["t12.png"].offset,
            "in-a-header": members["t12.png"].offset + 100,
            "in-a-long-name's-header": members["t12.png"].offset + 512 + 10,  # in the pax header's records
            "before-the-end-blocks": end,
            "in-the-end-blocks": end + 512}[where]


@pytest.mark.parametrize("where, says", [
    ("in-a-member's-data", r"\(it ends inside the member t12.png\)"),
    ("between-a-sample's-members", rf"\(it ends after the member t11.png, {NO_END}"),
    ("between-samples", rf"\(it ends after the member t11.cls, {NO_END}"),
    ("in-a-header", r"\(it ends inside the header after the member t11.cls\)"),
    ("in-a-long-name's-header", r"\(it ends inside the header after the member t11.cls\)"),
    ("before-the-end-blocks", rf"\(it ends after the member t12.cls, {NO_END}"),
    ("in-the-end-blocks", rf"\(it ends after the member t12.cls, {NO_END}"),
], ids=lambda value: value if " " not in value else "")
def test_a_tar_cut_short_anywhere_is_one_line(tmp_path, where, says):
    key = "t12" if where != "in-a-long-name's-header" else "x" * 100 + "/t12"  # over 100 characters: a pax header
    data = dataset(tmp_path, [[(f"t0{i}", {"png": png(), "cls": str(i).encode()}) for i in range(3)],
                              [(k, {"png": png(), "cls": str(i).encode()}) for i, k in enumerate(["t10", "t11", key])]])
    tar = data / "train-001.tar"
    os.truncate(tar, cut_at(tar, where))
    with pytest.raises(ConfigError, match=rf"^{tar} is cut short {says}: copy the tar again$"):
        check_shards(data)
    assert not (data / CACHE / "train.json").exists()


def test_a_cut_tar_stops_training_and_make_pack_before_they_start(tmp_path, capsys):
    data = dataset(tmp_path / "data", [[(f"s{i:02d}", {"png": png((i, 0, 0)), "cls": str(i % 3).encode()})
                                        for i in range(32)]])
    tar = data / "train-000.tar"
    with tarfile.open(tar) as whole:
        os.truncate(tar, whole.getmember("s16.png").offset)  # halfway, between samples: tarfile alone reads 16
    line = rf"{tar} is cut short \(it ends after the member s15.cls, {NO_END}: copy the tar again"
    with pytest.raises(ConfigError, match=f"^{line}$"):  # the launcher's check, before any worker starts
        preflight(parse_config(["--dataset", "shards", "--data-dir", str(data), "--dry-run"]))
    with pytest.raises(ConfigError, match=f"^{line}$"):  # the run's own index (rank 0's)
        tar_splits(data, ("train",), "cls")
    assert pack_main([str(data), str(tmp_path / "packed")]) == 2  # make pack
    assert re.fullmatch(f"error: {line}\n", capsys.readouterr().err)
    assert not (tmp_path / "packed" / "index.json").exists()


def test_an_index_made_of_a_cut_tar_before_cut_tars_were_refused_is_not_used(tmp_path):
    data = dataset(tmp_path)
    load_split(data, "train", "cls")
    tar = data / "train-001.tar"
    with tarfile.open(tar) as whole:
        os.truncate(tar, whole.getmember("t12.png").offset)  # t12 gone: the index of 3 + 2 samples it made
    cache = data / CACHE
    record = json.loads((cache / "train.json").read_text())
    record["format"] = 1
    record["tars"][1].update(bytes=tar.stat().st_size, mtime_ns=tar.stat().st_mtime_ns, samples=2)
    (cache / "train.json").write_text(json.dumps(record))
    (cache / "train.idx").write_bytes((cache / "train.idx").read_bytes()[:24 * 5])
    (cache / "train.names").write_text("\n".join((cache / "train.names").read_text().split("\n")[:5]))
    with pytest.raises(ConfigError, match=rf"^{tar} is cut short \(it ends after the member t11.cls"):
        check_shards(data)


def test_the_layouts_and_their_ambiguity(tmp_path):
    dataset(tmp_path / "flat")
    assert [p.name for p in find_tars(tmp_path / "flat")["train"]] == ["train-000.tar", "train-001.tar"]
    nested = tmp_path / "nested"
    for split in ("train", "val"):
        (nested / split).mkdir(parents=True)
        for name in ("b-10.tar", "b-9.tar", "a.tar"):  # sorted as names: a, b-10, b-9
            write_tar(nested / split / name, [(name[:-4], {"png": png(), "cls": b"0"})])
    assert [p.name for p in find_tars(nested)["val"]] == ["a.tar", "b-10.tar", "b-9.tar"]
    write_tar(nested / "train-000.tar", [("x", {"png": png(), "cls": b"0"})])
    with pytest.raises(ConfigError, match=r"holds tars both as train-\*.tar and in train/: .* keep one layout"):
        find_tars(nested)
    (tmp_path / "noval").mkdir()
    write_tar(tmp_path / "noval" / "train-0.tar", [("x", {"png": png(), "cls": b"0"})])
    with pytest.raises(ConfigError, match=r"has no val shards: a shards dataset is a trainbox pack"):
        check_shards(tmp_path / "noval")


def test_the_index_is_cached_beside_the_tars_and_made_again_when_a_tar_changes(tmp_path, monkeypatch):
    dataset(tmp_path)
    monkeypatch.setenv("TRAINBOX_PROGRESS_EVERY", "0")  # a progress line at every tar indexed
    lines = io.StringIO()
    first = load_split(tmp_path, "train", "cls", stream=lines)
    assert first.where == tmp_path / CACHE and (tmp_path / CACHE / "train.json").is_file()
    assert re.search(rf"indexing the tars in {tmp_path}: 2/2 tars \(100.0%\)", lines.getvalue()), lines.getvalue()
    said = lines.getvalue()
    again = load_split(tmp_path, "train", "cls", stream=lines)
    assert lines.getvalue() == said and again.where == first.where  # read from the cache: nothing indexed
    assert [r.tolist() for r in again.rows] == [r.tolist() for r in first.rows] and again.names == first.names
    write_tar(tmp_path / "train-001.tar", [("n", {"png": png((0, 0, 255)), "cls": b"1"})])
    changed = load_split(tmp_path, "train", "cls")
    assert [len(r) for r in changed.rows] == [3, 1] and changed.member_names(1) == ["n.png"]
    record = json.loads((tmp_path / CACHE / "train.json").read_text())
    assert [t["samples"] for t in record["tars"]] == [3, 1] and record["label_key"] == "cls"


def test_where_the_folder_cannot_be_written_the_index_goes_into_the_run_folder(tmp_path):
    data = dataset(tmp_path / "nas")
    (data / CACHE).write_text("in the way")  # as a read-only folder would, writing the cache there fails
    run_dir = tmp_path / "run"
    index = load_split(data, "train", "cls", run_dir)
    assert index.where.parent == run_dir / FALLBACK and (index.where / "train.json").is_file()
    assert load_split(data, "train", "cls", run_dir).where == index.where  # read from there next time
    assert load_split(data, "train", "cls").where is None  # without a run folder (a dry run): in memory


def test_a_runs_check_indexes_a_read_only_folder_into_its_run_folder_once_and_leaves_none_when_it_refuses(
        tmp_path, monkeypatch, capsys):
    data = dataset(tmp_path / "nas")
    (data / CACHE).write_text("in the way")
    monkeypatch.setenv("TRAINBOX_PROGRESS_EVERY", "0")  # a progress line at every tar indexed
    run_dir = tmp_path / "run"
    preflight(parse_config(["--dataset", "shards", "--data-dir", str(data), "--run-dir", str(run_dir)]))
    assert "indexing the tars" in capsys.readouterr().err
    splits = tar_splits(data, ("train", "val"), "cls", run_dir)  # the run's ranks: the check's index, read
    assert "indexing" not in capsys.readouterr().err and splits["train"].index.where.parent == run_dir / FALLBACK
    write_tar(data / "val-000.tar", [("v", {"png": png()})])  # no label
    refused = tmp_path / "refused"
    with pytest.raises(ConfigError, match="the sample 'v' has no label"):
        preflight(parse_config(["--dataset", "shards", "--data-dir", str(data), "--run-dir", str(refused)]))
    assert not refused.exists()


def _index_train(data, run_dir, said) -> None:
    with open(said, "w") as stream:
        load_split(data, "train", "cls", run_dir, stream=stream)


def _hold_the_lock(folder, data, ready) -> None:
    with indexing([folder], "train", data, quiet=True, stream=None):
        ready.set()
        time.sleep(60)


def test_processes_that_start_at_once_share_one_indexing_of_a_read_only_folder(tmp_path, monkeypatch):
    data = dataset(tmp_path / "nas")
    (data / CACHE).write_text("in the way")  # its index goes into the run folder, which both processes share
    run_dir = tmp_path / "run"
    folder = cache_dirs(data, run_dir)[-1]
    monkeypatch.setenv("TRAINBOX_PROGRESS_EVERY", "0")
    fork = multiprocessing.get_context("fork")
    ready = fork.Event()
    holder = fork.Process(target=_hold_the_lock, args=(folder, data, ready))  # until both have started: at once
    holder.start()
    assert ready.wait(30)
    said = [tmp_path / f"said-{n}" for n in range(2)]
    starts = [fork.Process(target=_index_train, args=(data, run_dir, s)) for s in said]
    for process in starts:
        process.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(p.is_alive() for p in starts) and \
            not all(s.exists() and "waiting" in s.read_text() for s in said):
        time.sleep(0.02)
    os.kill(holder.pid, signal.SIGKILL)  # its lock goes with it
    for process in [holder, *starts]:
        process.join(30)
    assert [p.exitcode for p in starts] == [0, 0]
    texts = [s.read_text() for s in said]
    waiting = f"waiting for {socket.gethostname()} pid {holder.pid}, which is indexing the train split of {data}"
    assert all(waiting in t for t in texts), texts
    assert sum("indexing the tars" in t for t in texts) == 1, texts  # the other read its index
    assert (folder / "train.json").is_file()


def test_a_member_that_cannot_be_read_or_decoded_is_one_line_when_met(tmp_path):
    data = dataset(tmp_path, val=[("v0", {"png": b"not a png" * 20, "cls": b"0"}), ("v1", {"png": png(),
                                                                                           "cls": b"1"})])
    cfg = parse_config(["--dataset", "shards", "--data-dir", str(data), "--num-workers", "0"])
    train_set, val_set, classes = build_datasets(cfg)
    assert classes == 3 and len(train_set) == 6 and len(val_set) == 2
    with pytest.raises(DataError, match=rf"^cannot read image {data}/val-000.tar member v0.png \(not an image"):
        val_set[0]
    splits = tar_splits(data, ("train",), "cls")
    shutil.copy(data / "train-001.tar", tmp_path / "copy.tar")
    os.truncate(data / "train-001.tar", 2000)  # changed under a running run
    with pytest.raises(DataError, match=rf"^{data}/train-001.tar is damaged: {data}/train-001.tar member t12.png is "
                                        r"cut short: the tar changed after it was indexed"):
        splits["train"][5]


def test_label_key_reads_the_json_and_has_no_effect_on_a_pack(tmp_path):
    data = dataset(tmp_path / "json", [[(f"k{i}", {"jpg": png(), "json": json.dumps({"y": i}).encode()})
                                        for i in range(3)]], [("v", {"png": png(), "json": b'{"y": "2"}'})])
    splits = tar_splits(data, ("train", "val"), "y")
    assert [splits["train"][i][1] for i in range(3)] == [0, 1, 2] and splits["val"][0][1] == 2
    assert splits["train"].classes == ["0", "1", "2"]
    (tmp_path / "pack").mkdir()
    (tmp_path / "pack" / "index.json").write_text(json.dumps({"splits": {}}))
    with pytest.raises(ConfigError, match=r"--label-key y has no effect on .*pack, a trainbox pack \(its labels are in "
                                          r"its index\): drop it"):
        check_shards(tmp_path / "pack", "y")
    with pytest.raises(ConfigError, match=r"^--label-key y has no effect with --dataset csv"):
        parse_config(["--dataset", "csv", "--label-key", "y"])
    preflight(parse_config(["--dataset", "shards", "--data-dir", str(data), "--label-key", "y", "--dry-run"]))
