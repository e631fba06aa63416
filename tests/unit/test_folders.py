"""The ImageFolder scan (train/data/folders.py): torchvision's ImageFolder's classes, samples and order for a folder
without links, and links held to what the folder says: followed once inside the split, refused in one line when
they lead out, go round, point nowhere or reach an image twice."""

import os
from pathlib import Path

import pytest

from train import vision
from train.data.folders import check_imagefolder, imagefolder_split
from train.data.scan import IMAGE_EXTENSIONS, scan_split
from train.errors import ConfigError

# A tree that exercises torchvision's rules: names in any case, files that are not images, a folder named like an
# image, hidden files, a file named only ".jpg", nested folders whose paths sort apart from their names
# ("a-b" before "a/b": os.walk's roots are sorted as strings), an empty folder, names beyond ASCII.
TREE = ["cat/3.jpg", "cat/1.JPG", "cat/2.Png", "cat/notes.txt", "cat/a/b/9.jpeg", "cat/a/0.webp", "cat/a-b/5.bmp",
        "cat/a.jpg", "cat/.hidden.jpg", "cat/.jpg", "cat/x.jpg/inside.png", "cat/empty/", "cat/é/7.tif",
        "cat/deep/er/est/8.TIFF", "dog/0.ppm", "dog/1.pgm", "dog/2.gif", "dog/3.jpg.txt", "dog/sub/4.jpg",
        "Zebra/0.png", "_x/0.png", "top.jpg"]


def make_tree(root: Path, files=TREE) -> Path:
    for name in files:
        path = root / name
        if name.endswith("/"):
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"")  # the scan reads no file
    return root


def test_the_extensions_are_torchvisions():
    assert IMAGE_EXTENSIONS == vision.datasets.folder.IMG_EXTENSIONS


def test_a_folder_without_links_lists_as_torchvisions_imagefolder(tmp_path):
    make_tree(tmp_path / "data" / "train")
    theirs = vision.datasets.ImageFolder(str(tmp_path / "data" / "train"))
    ours = imagefolder_split(tmp_path / "data", "train")
    assert ours.classes == theirs.classes == ["Zebra", "_x", "cat", "dog"]
    assert ours.class_to_idx == theirs.class_to_idx
    assert ours.samples == theirs.samples and len(ours) == len(theirs.samples) == 17
    assert scan_split(tmp_path / "data" / "train") == (theirs.classes, theirs.samples)


def test_a_link_inside_the_split_that_nothing_else_reaches_is_followed_once(tmp_path):
    train = make_tree(tmp_path / "data" / "train", ["cat/0.jpg", "dog/0.jpg", "top.jpg", "dog/kept.bin"])
    (train / "cat" / "linked.jpg").symlink_to("../top.jpg")  # top.jpg is no class's image
    (train / "dog" / "renamed.png").symlink_to("kept.bin")  # kept.bin is not an image by its name
    (train / "cat" / "notes.txt").symlink_to("/etc/hostname")  # not an image: let be
    ours = imagefolder_split(tmp_path / "data", "train")
    assert ours.samples == vision.datasets.ImageFolder(str(train)).samples
    assert [Path(p).name for p, _ in ours.samples] == ["0.jpg", "linked.jpg", "0.jpg", "renamed.png"]


def test_the_dataset_folder_and_a_split_may_be_links(tmp_path):
    make_tree(tmp_path / "real" / "train", ["cat/0.jpg", "dog/0.jpg"])
    make_tree(tmp_path / "elsewhere" / "val", ["cat/0.jpg", "dog/0.jpg"])
    (tmp_path / "real" / "val").symlink_to(tmp_path / "elsewhere" / "val")
    (tmp_path / "data").symlink_to("real")
    check_imagefolder(tmp_path / "data")
    for split in ("train", "val"):
        ours = imagefolder_split(tmp_path / "data", split)
        assert ours.samples == [(str(tmp_path / "data" / split / c / "0.jpg"), i) for i, c in enumerate(["cat", "dog"])]


# (id, links to make under DATA_DIR/train: (link, target), the refused path as the line names it, what the line says)
LINKS = [
    ("the-users-loop", [("cat/loop", "..")], "cat/loop", "is a link cycle: it leads back to"),
    ("a-folder-to-itself", [("cat/a/here", ".")], "cat/a/here", "is a link cycle: it leads back to"),
    ("links-to-each-other", [("cat/p.jpg", "q.jpg"), ("cat/q.jpg", "p.jpg")], "cat/p.jpg",
     "is a link cycle (links that lead to each other, never to a file): remove it"),
    ("broken", [("cat/gone.jpg", "nothing.jpg")], "cat/gone.jpg",
     "is a broken link (it names nothing.jpg, which does not exist): remove it, or replace it by the file"),
    ("broken-folder", [("cat/photos", "../../nowhere")], "cat/photos", "is a broken link"),
    ("an-image-out", [("cat/out.jpg", "../../outside.jpg")], "cat/out.jpg", "is a link out of the dataset's folder"),
    ("a-folder-out", [("cat/more", "../../elsewhere")], "cat/more", "is a link out of the dataset's folder"),
    ("a-class-out", [("bird", "../elsewhere")], "bird", "is a link out of the dataset's folder"),
    ("train-into-val", [("cat/v.jpg", "../../val/cat/0.jpg")], "cat/v.jpg", "is a link out of the dataset's folder"),
    ("another-class-inside", [("cat/dogs", "../dog")], "cat/dogs", "are the same folder, reached twice through a link"),
    ("a-class-twice", [("kitty", "cat")], "kitty", "are the same folder, reached twice through a link"),
    ("an-image-twice", [("cat/again.jpg", "0.jpg")], "cat/again.jpg", "are the same image, reached twice"),
    ("two-links-to-one", [("cat/t.jpg", "../top.jpg"), ("dog/t.jpg", "../top.jpg")], "dog/t.jpg",
     "are the same image, reached twice"),
]


@pytest.mark.parametrize("links, named, says", [c[1:] for c in LINKS], ids=[c[0] for c in LINKS])
def test_a_link_that_breaks_the_folders_word_is_one_line_naming_it(tmp_path, links, named, says):
    data = tmp_path / "data"
    make_tree(data / "train", ["cat/0.jpg", "cat/a/1.jpg", "dog/0.jpg", "top.jpg"])
    make_tree(data / "val", ["cat/0.jpg", "dog/0.jpg"])
    make_tree(data, ["elsewhere/0.jpg", "outside.jpg"])  # beside the splits: outside train/, the links' folder
    for link, target in links:
        (data / "train" / link).symlink_to(target)
    with pytest.raises(ConfigError) as refused:
        imagefolder_split(data, "train")
    line = str(refused.value)
    assert "\n" not in line and f"{data / 'train' / named} " in line and says in line, line
    assert line.endswith(("remove the link", "remove it", "the file it should name", "into " +
                          os.path.realpath(data / "train"), "if the image is meant to count twice")), line


def test_preflight_refuses_the_links_among_the_class_folders_before_any_worker(tmp_path):
    data = tmp_path / "data"
    make_tree(data / "train", ["cat/0.jpg"])
    make_tree(data / "val", ["cat/0.jpg"])
    make_tree(tmp_path / "elsewhere", ["0.jpg"])
    check_imagefolder(data)
    (data / "train" / "dog").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match=f"^{data / 'train' / 'dog'} is a link out of the dataset's folder"):
        check_imagefolder(data)
    (data / "train" / "dog").unlink()
    (data / "train" / "dog").symlink_to("missing")
    with pytest.raises(ConfigError, match=f"^{data / 'train' / 'dog'} is a broken link"):
        check_imagefolder(data)


def test_a_validation_split_that_is_the_training_split_is_refused(tmp_path):
    data = tmp_path / "data"
    make_tree(data / "train", ["cat/0.jpg"])
    (data / "val").symlink_to("train")
    with pytest.raises(ConfigError, match=f"^{data}/train and {data}/val are the same folder, or one holds the "
                                          f"other .*: give val/ its own class folders$"):
        check_imagefolder(data)
    check_imagefolder(data, ("val",))  # make evaluate reads val/ alone: nothing to compare with


def test_an_entry_named_as_an_image_that_is_no_file_is_refused(tmp_path):
    make_tree(tmp_path / "train", ["cat/0.jpg"])
    os.mkfifo(tmp_path / "train" / "cat" / "pipe.jpg")  # reading it would wait for ever
    with pytest.raises(ConfigError, match=r"cat/pipe.jpg is not a file \(a FIFO, socket or device\)"):
        scan_split(tmp_path / "train")


def test_a_class_without_images_is_named(tmp_path):
    make_tree(tmp_path / "train", ["cat/0.jpg", "dog/notes.txt", "emu/"])
    with pytest.raises(ConfigError, match=r"no image in the class folder\(s\) dog, emu \(read: .jpg, .jpeg, .png, "
                                          r".*in any case\): put images in"):
        scan_split(tmp_path / "train")
