"""Label files (train/data/labelfiles.py): the columns, the classes and their order, and every bad row as one line
naming the file, the line and the fix, before any worker starts; a missing or unreadable image one line naming it
and its line when the loader meets it (no file is asked about up front), and make pack's every missing file in one
line before it writes."""

import json
import re

import pytest
import torch
from PIL import Image

from train.base.errors import ConfigError, DataError
from train.cli import parse_config
from train.data import build_datasets
from train.data.labelfiles import LabelFileSplit, read_labelfiles
from train.pack.command import main as pack_main
from train.run.preflight import preflight

VAL = "path,label\nv.png,cat\n"


def files(root, **contents):
    """Write each file (name with _ for ., e.g. train_csv) into root; return root."""
    for name, text in contents.items():
        path = root / name.replace("_", ".")
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return root


@pytest.mark.parametrize("contents, file, says", [
    ({"train_csv": "path,label\na.png,\n"}, "train.csv", r"line 2: the label is empty: give every row"),
    ({"train_csv": "path,label\n ,cat\n"}, "train.csv", r"line 2: the path is empty"),
    ({"train_csv": "path,label\na\0.png,cat\n"}, "train.csv", r"line 2: the path holds a NUL byte"),
    ({"train_csv": "path,label\na.png,cat\nb.png," + "x" * 140_000 + "\n"}, "train.csv",
     r"line 3: malformed \(field larger than field limit \(131072\)\): fix that line"),
    ({"train_csv": "path,label\na.png,cow\n", "classes_txt": "cat\ndog\n"}, "train.csv",
     r"line 2: the label 'cow' is not one of the classes \(classes.txt, in its order\): fix the label, or add"),
    ({"train_csv": "path,label\na.png,1\nb.png,5\n", "classes_txt": "cat\ndog\n"}, "train.csv",
     r"line 3: the class index 5 is out of range \(2 classes, 0-1, from classes.txt, in its order\): fix"),
    ({"train_csv": "path,label\na.png,cat\nx/../a.png,dog\n"}, "train.csv", r"lines 2 and 3 both list .*/a.png: it"),
    ({"train_csv": "file_name,y\na.png,cat\n"}, "train.csv",
     r"line 1: the header \(file_name, y\) has none of path, image, file, filename, filepath for the image paths"),
    ({"train_csv": "path,label\na.png,cat,x\n"}, "train.csv", r"line 2: 3 fields where the header has 2: quote"),
    ({"train_tsv": "path,label\na.png,cat\n"}, "train.tsv", r"line 1: the header \(path,label\) is one field: its "
                                                          r"fields are separated by commas, and a .tsv file's by "
                                                          r"tabs: rename it train.csv$"),
    ({"train_csv": "path;label\na.png;cat\n"}, "train.csv", r"line 1: the header \(path;label\) is one field: its "
                                                          r"fields are separated by semicolons, and a .csv file's by "
                                                          r"commas: save it with commas$"),
    ({"train_csv": ",".join(f"column{n}" for n in range(5000)) + "\n"}, "train.csv",
     r"line 1: the header \(column0, column1, column2, column3, column4, column5, column6, column7 and 4,992 more\) "
     r"has none of path"),
    ({"train_csv": "path,label\na.png,1\nb.png,cat\n"}, "train.csv",
     r"line 3: the label 'cat' mixes with the indices above"),
    ({"train_csv": "path,label\na.png,cat\n", "val_csv": "path,label\nb.png,cow\n"}, "val.csv",
     r"line 2: the label 'cow' is not one of the classes \(the label names of train.csv, sorted\)"),
    ({"train_csv": "path,label\na.png,0\n", "val_csv": "path,label\nb.png,3\n"}, "val.csv",
     r"line 2: the class index 3 is out of range"),
    ({"train_csv": "path,label\na.png,cat\nb.png,dog\n", "val_csv": "path,label\nc.png,cat\n./b.png,dog\n"},
     "val.csv", r"line 3 lists .*/b.png, which the training split lists too \(line 3\): the model would be scored"),
    ({"train_jsonl": '{"path": "a.png", "label": "cat"}\nnot json\n'}, "train.jsonl", r"line 2: not JSON"),
    ({"train_jsonl": '{"path": "a.png", "label": "cat"}\n{"path": "b.png"}\n'}, "train.jsonl",
     r"line 2: no 'label' key: give every line the same keys"),
    ({"train_jsonl": '{"path": "a.png", "label": 1.5}\n'}, "train.jsonl", r"line 1: the path must be a string and"),
    ({"train_csv": "", "val_csv": VAL}, "train.csv", r"is empty: give a header"),
    ({"train_csv": "path,label\n"}, "train.csv", r"lists no image"),
    ({"train_csv": b"path,label\n\xff\xfe.png,cat\n"}, "train.csv", r"is not UTF-8 text: save it as UTF-8"),
    ({"train_csv": "path,label\na.png,cat\n", "classes_txt": "cat\ncat\n"}, "classes.txt",
     r"names the class 'cat' twice"),
    ({"train_csv": "path,label\na.png,cat\n", "classes_txt": "cat\n", "classes_json": "[]"}, "",
     r"has both classes.txt and classes.json: keep one"),
    ({"train_csv": "path,label\na.png,cat\n", "train_jsonl": "{}"}, "",
     r"has train.csv and train.jsonl: which lists the train split is unclear: keep one"),
    ({"train_csv": "path,label\na.png,cat\n"}, "", r"has no val.csv, val.tsv or val.jsonl"),
])
def test_a_bad_row_is_one_line_naming_the_file_and_its_line(tmp_path, contents, file, says):
    files(tmp_path, **{"val_csv": VAL, **contents} if "has no val" not in says else contents)
    with pytest.raises(ConfigError) as e:
        read_labelfiles(tmp_path)
    message = str(e.value)
    assert "\n" not in message and message.startswith(str(tmp_path / file) if file else str(tmp_path)), message
    assert re.search(says, message) and len(message) < 400, message


def test_a_column_given_by_name_must_be_in_the_header(tmp_path):
    files(tmp_path, train_csv="img,y\na.png,cat\n", val_csv="img,y\nb.png,cat\n")
    with pytest.raises(ConfigError, match=r"train.csv line 1: the header \(img, y\) has no column 'file' "
                                          r"\(--path-column\)"):
        read_labelfiles(tmp_path, "file", "y")
    listing = read_labelfiles(tmp_path, "img", "y")["train"]
    assert (listing.path(0), listing.classes) == (str(tmp_path / "a.png"), ["cat"])


def test_columns_labels_and_classes_as_documented(tmp_path):
    """Defaults found in any case, a byte-order mark, blank lines, surrounding spaces, absolute and relative paths;
    names sorted; integers without a class list are their own classes; a class list's order and its names or
    indices."""
    files(tmp_path, train_csv="\ufeffImage, Class\n\nb.png, dog\n/abs/a.png,cat \n\n",
          val_csv="path,label\nc.png,dog\n")
    listing = read_labelfiles(tmp_path)["train"]
    assert listing.classes == ["cat", "dog"] and list(listing.labels) == [1, 0] and list(listing.lines) == [3, 4]
    assert [listing.path(i) for i in range(2)] == [str(tmp_path / "b.png"), "/abs/a.png"]
    files(tmp_path, train_csv="path,label\na.png,2\nb.png,0\n", val_csv="path,label\nc.png,1\n")
    listing = read_labelfiles(tmp_path)["train"]
    assert listing.classes == ["0", "1", "2"] and list(listing.labels) == [2, 0]
    (tmp_path / "train.csv").unlink()
    (tmp_path / "val.csv").unlink()
    files(tmp_path, train_tsv="path\tlabel\na.png\tzebra\nb.png\t0\n", val_jsonl='{"path": "c.png", "label": 1}\n',
          classes_json=json.dumps(["ant", "zebra"]))
    listings = read_labelfiles(tmp_path)
    assert listings["train"].classes == ["ant", "zebra"] and list(listings["train"].labels) == [1, 0]
    assert list(listings["val"].labels) == [1] and listings["val"].classes_from == "classes.json, in its order"


def test_the_check_runs_before_any_worker_starts(tmp_path):
    files(tmp_path, train_csv="path,label\na.png,\n", val_csv=VAL)
    with pytest.raises(ConfigError, match=r"train.csv line 2: the label is empty"):
        preflight(parse_config(["--dataset", "csv", "--data-dir", str(tmp_path), "--dry-run"]))


def test_a_missing_or_bad_image_is_one_line_naming_it_and_its_line_when_read(tmp_path):
    """No file is asked about up front (the listing passes); reading the row names the file and its line."""
    Image.new("RGB", (20, 20), (200, 30, 30)).save(tmp_path / "good.png")
    (tmp_path / "bad.png").write_bytes(b"not an image")
    files(tmp_path, train_csv="path,label\ngood.png,cat\nmissing.png,dog\nbad.png,dog\n", val_csv=VAL)
    split = LabelFileSplit(read_labelfiles(tmp_path)["train"])
    data, label = split[0]
    assert label == 0 and data.dtype == torch.uint8 and bytes(data.numpy()) == (tmp_path / "good.png").read_bytes()
    with pytest.raises(DataError) as e:
        split[1]
    assert str(e.value) == (f"cannot read image {tmp_path}/missing.png, listed on line 3 of {tmp_path}/train.csv (No "
                            f"such file or directory): correct the path on that line, restore the file or remove the "
                            f"line, then run the same command to resume")
    cfg = parse_config(["--dataset", "csv", "--data-dir", str(tmp_path), "--num-workers", "0"])
    train_set = build_datasets(cfg)[0]
    with pytest.raises(DataError, match=rf"^cannot read image {tmp_path}/bad.png \(train.csv line 4\) \(not an image "
                                        r"torchvision.io or PIL can read\): delete or replace the file"):
        train_set[2]


def test_make_pack_names_every_missing_file_with_its_line_before_it_writes(tmp_path, capsys):
    """make pack reads every file: the missing ones in one line before anything is written, the first three named
    with their file and line, all counted."""
    src = tmp_path / "src"
    src.mkdir()
    names = [f"{'here' if n % 2 else 'gone'}{n}.png" for n in range(200)]
    for name in ["a.png", "b.png", *names[1::2]]:
        (src / name).write_bytes(b"")  # looked at, not read
    rows = [f"{name},cat" for name in names]  # 100 gone
    files(src, train_csv="path,label\na.png,cat\n" + "\n".join(rows) + "\n", val_csv="path,label\ngone.png,cat\n")
    assert pack_main([str(src), str(tmp_path / "dst")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: 101 images the label files list are missing: {src}/train.csv line 3 ({src}/gone0.png), "
                       f"{src}/train.csv line 5 ({src}/gone2.png), {src}/train.csv line 7 ({src}/gone4.png), ...: "
                       f"correct the paths on those lines, restore the files or remove the lines"), err
    assert not (tmp_path / "dst").exists()
    files(src, train_csv="path,label\na.png,cat\nb.png,cat\n")
    assert pack_main([str(src), str(tmp_path / "dst")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: the image listed on {src}/val.csv line 2 ({src}/gone.png) is missing: correct the path on that line, "
        f"restore the file or remove the line")
