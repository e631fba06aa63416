"""--dataset hf on datasets written by `datasets` itself (tests/sources.py): the layouts it accepts, the Parquet
files' Arrow copy made once, the single saved Dataset an evaluation reads, and each bad row as one line naming it
(a label before any worker starts, an image when the loader meets it). That every form gives the ImageFolder's
samples bit for bit is tests/unit/test_sources.py's."""

import os
import shutil
import subprocess

import pytest

from tests.sources import HF_PYTHON, draw_imagefolder, hf_disk_plan, hf_parquet_plan, listing, write_hf
from train.base.errors import ConfigError, DataError
from train.cli import parse_config
from train.data import build_datasets, check_hf
from train.data.hfrows import hf_splits
from train.data.tarindex import CACHE, FALLBACK
from train.pack.command import main as pack_main


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    """Every dataset of these tests, written in one run of `datasets`."""
    root = tmp_path_factory.mktemp("hf")
    folder = draw_imagefolder(root / "folder", classes=3, train=9, val=6)
    (root / "odd").mkdir()
    (root / "odd" / "empty.png").write_bytes(b"")
    (root / "odd" / "text.png").write_bytes(b"not an image, whatever its name says")
    shutil.copy(sorted((folder / "train" / "disk").iterdir())[0], root / "odd" / "gone.png")
    good = hf_disk_plan(folder)
    train = good["splits"]["train"]
    names = hf_parquet_plan(folder, root / "names")
    plans = {
        "disk": good, "parquet": hf_parquet_plan(folder, root / "parquet"),
        # rows 2, 4, 6 and 8: an empty file, a file that is no image, no image at all, a file gone after writing
        "odd": {"form": "parquet", "splits": {"train": [
            *names["splits"]["train"][:2], [str(root / "odd" / "empty.png"), "disk"], names["splits"]["train"][2],
            [str(root / "odd" / "text.png"), "ring"], names["splits"]["train"][3], [None, "ring"],
            names["splits"]["train"][4], [str(root / "odd" / "gone.png"), "square"]],
            "validation": names["splits"]["validation"]}},
        "unlabelled": {**good, "splits": {"train": train, "test": [[p, -1] for p, _ in train[:3]]}},
        "no-label": {**names, "splits": {**names["splits"], "train": [*names["splits"]["train"][:5],
                                                                      [names["splits"]["train"][5][0], None]]}},
        "new-class": {**names, "splits": {**names["splits"], "validation": [[["bytes", train[0][0]], "hexagon"]]}},
        "one": {**good, "form": "dataset", "splits": {"validation": good["splits"]["validation"]}},
    }
    write_hf({root / name: plan for name, plan in plans.items()})
    (root / "odd" / "gone.png").unlink()
    return {"root": root, "folder": folder, **{name: root / name for name in plans}}


def config(data_dir, *extra):
    return parse_config(["--dataset", "hf", "--data-dir", str(data_dir), "--image-size", "16", "--batch-size", "2",
                         "--num-workers", "0", *map(str, extra)])


def samples(dataset) -> list:
    return [(bytes(dataset[i][0].numpy()), dataset[i][1]) for i in range(len(dataset))]


def test_the_parquet_layouts_of_the_hub_give_the_same_rows(made, tmp_path):
    """data/SPLIT-0000N-of-0000M.parquet (push_to_hub's), SPLIT/*.parquet (the Hub's conversion), NAME-SPLIT.parquet;
    a split in two of them at once is refused."""
    data = made["parquet"] / "data"
    expected = {split: samples(s) for split, s in hf_splits(made["parquet"], "", "", "train", "", ("train", "val"))
                .items()}
    folders, flat = tmp_path / "folders", tmp_path / "flat"
    os.symlink(made["folder"], tmp_path / "folder")  # the training split's paths: ../folder/...
    for name in ("train", "validation"):
        (folders / name).mkdir(parents=True)
        for n, path in enumerate(sorted(data.glob(f"{name}-*.parquet"))):
            shutil.copy(path, folders / name / f"{n:04d}.parquet")
            flat.mkdir(exist_ok=True)
            shutil.copy(path, flat / f"shapes-{name}-{n:05d}-of-00002.parquet")
    for other in (folders, flat):
        got = hf_splits(other, "", "", "train", "", ("train", "val"))
        assert {split: samples(s) for split, s in got.items()} == expected, other
    shutil.copytree(folders / "train", flat / "train")
    with pytest.raises(ConfigError, match=rf"^{flat}: the train split has Parquet files in {flat} and {flat}/train: "
                                          r"which are the split is unclear: keep one layout$"):
        check_hf(flat)


def test_parquet_is_made_arrow_once_beside_it_or_in_the_run_folder(made, tmp_path):
    data = tmp_path / "nas"
    shutil.copytree(made["parquet"], data, ignore=shutil.ignore_patterns(CACHE))
    os.symlink(made["folder"], tmp_path / "folder")  # the training split's paths: ../folder/...
    cfg = config(data)
    assert build_datasets(cfg.replace(dry_run=True))[0] is not None and not (data / CACHE).exists()  # labels alone
    first = build_datasets(cfg)[0]
    made_once = sorted((data / CACHE).glob("hf-train-*.arrow"))
    assert len(made_once) == 2 and (data / CACHE / "hf-train.json").is_file()
    stamps = [p.stat().st_mtime_ns for p in made_once]
    again = build_datasets(cfg)[0]
    assert [p.stat().st_mtime_ns for p in made_once] == stamps  # used again
    assert samples(again.source) == samples(first.source)
    parquet = sorted((data / "data").glob("train-*.parquet"))[1]
    os.utime(parquet, ns=(parquet.stat().st_atime_ns, parquet.stat().st_mtime_ns + 10**9))  # a changed file
    build_datasets(cfg)
    assert made_once[1].stat().st_mtime_ns != stamps[1]
    shutil.rmtree(data / CACHE)
    (data / CACHE).write_text("in the way")  # as a read-only folder would, writing there fails
    run_dir = tmp_path / "run"
    moved = build_datasets(cfg, run_dir=run_dir)[0]
    assert len(list((run_dir / FALLBACK).glob("*/hf-train-*.arrow"))) == 2
    assert samples(moved.source) == samples(first.source)


def test_a_single_saved_dataset_is_an_evaluation_set_not_a_training_set(made):
    with pytest.raises(ConfigError, match=rf"^{made['one']} is one saved Dataset, a single split: training needs a "
                                          r"training and a validation split: save a DatasetDict"):
        check_hf(made["one"])
    _, val, classes = build_datasets(config(made["one"]), train=False)
    trained = build_datasets(config(made["disk"]))[1]
    assert val.source.classes == trained.source.classes == ["disk", "ring", "square"] and classes == 3
    assert samples(val) == samples(trained)


def test_a_dataset_of_one_split_is_told_how_to_make_a_validation_split(made, tmp_path):
    """A DatasetDict saved with its train split alone, and Parquet files of a train split alone: the line gives the
    command that makes one (`datasets`' train_test_split, saved to disk), and that command, run, makes a dataset
    that trains."""
    disk, parquet = tmp_path / "disk", tmp_path / "parquet"
    shutil.copytree(made["disk"] / "train", disk / "train")
    (disk / "dataset_dict.json").write_text('{"splits": ["train"]}')
    (parquet / "data").mkdir(parents=True)
    for path in (made["parquet"] / "data").glob("validation-*.parquet"):  # its images' bytes, not relative paths
        shutil.copy(path, parquet / "data" / path.name.replace("validation", "train"))
    commands = []
    for data, load in ((disk, f"load_from_disk('{disk}/train')"),
                       (parquet, f"load_dataset('{parquet}', split='train')")):
        command = (f"import datasets; datasets.{load}.train_test_split(test_size=0.1, seed=0)"
                   f".save_to_disk('{data}-split')")
        with pytest.raises(ConfigError) as e:
            check_hf(data)
        assert str(e.value) == (f"{data} has only the split 'train', and training needs a validation split too: make "
                                f"one (python -c \"{command}\"), then point --data-dir (make pack: SRC) at "
                                f"{data}-split, whose splits are train and test")
        commands.append(command)
    subprocess.run([str(HF_PYTHON), "-c", "; ".join(commands)], check=True, capture_output=True, timeout=300,
                   env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                        "HF_HOME": str(tmp_path / "hf-home")})
    for data in (disk, parquet):
        train, val, classes = build_datasets(config(f"{data}-split"))
        assert (len(train), len(val), classes) == ((8, 1) if data == disk else (5, 1)) + (3,), data  # 9 and 6 rows


def test_the_splits_a_line_names_are_the_first_eight_and_a_count(made, tmp_path):
    first = sorted((made["parquet"] / "data").glob("validation-*.parquet"))[0]
    (tmp_path / "data").mkdir()
    for n in range(100):
        shutil.copy(first, tmp_path / "data" / f"part{n:03d}-00000-of-00001.parquet")
    with pytest.raises(ConfigError, match=rf"^{tmp_path} has no split 'train' \(it has: part000, part001, part002, "
                                          r"part003, part004, part005, part006, part007 and 92 more\): name the train "
                                          r"split with --train-split$"):
        check_hf(tmp_path)


def test_a_damaged_parquet_file_is_one_line(made, tmp_path):
    """pyarrow's message for a damaged footer ends in a newline, or names a byte as itself: one printable line."""
    data = tmp_path / "parquet"
    shutil.copytree(made["parquet"], data, ignore=shutil.ignore_patterns(CACHE))
    first = sorted((data / "data").glob("train-*.parquet"))[0]
    whole = first.read_bytes()
    footer = len(whole) - 8 - int.from_bytes(whole[-8:-4], "little")  # the metadata before its length and PAR1
    for at in (1, 0):  # "Couldn't deserialize thrift: TProtocolException: Invalid data\n", "...type: \x0f\n"
        first.write_bytes(whole[:footer + at] + b"\xff" * 6 + whole[footer + at + 6:])
        with pytest.raises(ConfigError) as e:
            check_hf(data)
        line = str(e.value)
        assert line.startswith(f"cannot read {first} (Couldn't deserialize thrift: ") and line.isprintable(), line
        assert line.endswith("): a damaged or incomplete file: copy or save it again"), line


@pytest.mark.parametrize("name, flags, says", [
    ("unlabelled", ["--val-split", "test"], "row 0 of the test split of {data} has the label -1 (-1: a ClassLabel's "
                                            "'no label', as the Hub's unlabelled test splits have): label it, or pick "
                                            "another split with --val-split"),
    ("unlabelled", ["--train-split", "training"], "{data} has no split 'training' (it has: test, train): name the "
                                                  "train split with --train-split"),
    ("no-label", [], "row 5 of the train split of {data} has no label ('labels' is empty): label it, or remove the "
                     "row"),
    ("new-class", [], "row 0 of the validation split of {data}: the label 'hexagon' is not one of the classes (the "
                      "label names of the train split, sorted): fix the label"),
    ("disk", ["--image-column", "label"], "the column 'label' of the train split of {data} holds int64, not images"),
    ("disk", ["--label-column", "class"], "the train split of {data} has no column 'class' (--label-column; it has: "
                                          "image, label)"),
    ("disk", ["--train-split", "validation", "--val-split", "validation"], "{data}: --train-split and --val-split "
                                                                          "both name 'validation'"),
], ids=["an unlabelled test split", "no such train split", "a null label", "a class the training split lacks",
        "an image column of integers", "no such label column", "one split for both"])
def test_a_bad_split_column_or_label_is_one_line_before_any_worker_starts(made, name, flags, says):
    data = made[name]
    given = config(data, *flags).data  # the command line is fine: the data is not
    with pytest.raises(ConfigError) as e:
        check_hf(data, given.image_column, given.label_column, given.train_split, given.val_split)
    assert str(e.value).startswith(says.format(data=data)) and "\n" not in str(e.value), str(e.value)


def test_a_bad_image_is_one_line_naming_its_row_when_the_loader_meets_it(made):
    data = made["odd"]
    train = build_datasets(config(data))[0]
    assert len(train) == 9
    ok = [0, 1, 3, 5, 7]
    assert [train[i][1] for i in ok] == [label for _, label in listing(made["folder"], "train")[1][:5]]
    where = f"the train split of {data}"
    cases = {2: f"cannot read image row 2 of {where} ({made['root']}/odd/empty.png) (an empty file, 0 bytes)",
             4: f"cannot read image row 4 of {where} ({made['root']}/odd/text.png) (not an image torchvision.io or PIL "
                f"can read)",
             6: f"row 6 of {where} has no image (its 'img' is empty): give it one or remove the row, then run the same "
                f"command to resume",
             8: f"cannot read image {made['root']}/odd/gone.png, the image of row 8 of {where} (No such file or "
                f"directory): restore the file, or fix the path in the dataset, then run the same command to resume"}
    for row, says in cases.items():
        with pytest.raises(DataError) as e:
            train[row]
        assert str(e.value).startswith(says) and "\n" not in str(e.value), str(e.value)


def test_make_pack_of_a_bad_row_stops_with_one_line_naming_it(made, tmp_path, capsys):
    dst = tmp_path / "shards"
    assert pack_main([str(made["odd"]), str(dst), "--workers", "2", "--val-split", "validation"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: cannot read image row 2 of the train split of {made['odd']} ({made['root']}/odd/"
                       f"empty.png) (an empty file, 0 bytes): replace the file, then run the same command to continue "
                       f"the pack"), err
    assert not (dst / "index.json").exists()
