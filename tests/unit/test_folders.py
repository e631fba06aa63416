"""The ImageFolder scan (train/data/scan.py): torchvision's ImageFolder's classes, samples and order for a folder
without links and for one made of links into a pool, links followed wherever they lead and refused in one line (the
first few named, all counted) when they go round, point nowhere, reach an image twice or put one in both splits."""

import os
import shutil
from pathlib import Path

import pytest

from train.base import vision
from train.base.errors import ConfigError
from train.data.folders import check_imagefolder, imagefolder_split
from train.data.scan import IMAGE_EXTENSIONS, scan_split, scan_splits
from train.pack.command import main as pack_main

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
     "is a link cycle (links that lead to each other, never to a file); and 1 more such link ("),
    ("round-through-the-pool", [("cat/more", "../../elsewhere")], "cat/more/back/cat",
     "is a link cycle: it leads back to"),  # elsewhere/back -> ../train: the split again, below itself
    ("broken", [("cat/gone.jpg", "nothing.jpg")], "cat/gone.jpg",
     "is a broken link (it names nothing.jpg, which does not exist): remove it, or replace it by the file"),
    ("broken-folder", [("cat/photos", "../../nowhere")], "cat/photos", "is a broken link"),
    ("another-class-inside", [("cat/dogs", "../dog")], "cat/dogs", "are the same folder, reached twice through a link"),
    ("a-class-twice", [("kitty", "cat")], "kitty", "are the same folder, reached twice through a link"),
    ("an-image-twice", [("cat/again.jpg", "0.jpg")], "cat/again.jpg", "are the same image, reached twice"),
    ("two-links-to-one", [("cat/t.jpg", "../top.jpg"), ("dog/t.jpg", "../top.jpg")], "dog/t.jpg",
     "are the same image, reached twice"),
    ("one-pool-image-twice", [("cat/p.jpg", "../../outside.jpg"), ("dog/p.jpg", "../../outside.jpg")], "dog/p.jpg",
     "are the same image, reached twice"),
]


@pytest.mark.parametrize("links, named, says", [c[1:] for c in LINKS], ids=[c[0] for c in LINKS])
def test_a_link_that_breaks_the_folders_word_is_one_line_naming_it(tmp_path, links, named, says):
    data = tmp_path / "data"
    make_tree(data / "train", ["cat/0.jpg", "cat/a/1.jpg", "dog/0.jpg", "top.jpg"])
    make_tree(data / "val", ["cat/0.jpg", "dog/0.jpg"])
    make_tree(data, ["elsewhere/0.jpg", "outside.jpg"])  # beside the splits: a pool the links may lead into
    (data / "elsewhere" / "back").symlink_to("../train")
    for link, target in links:
        (data / "train" / link).symlink_to(target)
    with pytest.raises(ConfigError) as refused:
        imagefolder_split(data, "train")
    line = str(refused.value)
    assert "\n" not in line and f"{data / 'train' / named} " in line and says in line, line
    assert line.endswith(("remove the link", "remove those links", "remove it", "the file it should name",
                          "if the image is meant to count twice")), line


def pool_of_links(root: Path, splits: dict[str, list[str]]) -> Path:
    """root/data/{train,val}/<class>/N.jpg, links to root/pool/NNN.jpg (relative and absolute links, one after the
    other), and root/pool/birds/: a NAS's dataset folders made of one pool of images."""
    numbers = {int(Path(name).stem) for names in splits.values() for name in names}
    pool = make_tree(root / "pool", [f"{n:03d}.jpg" for n in sorted(numbers)] + ["birds/0.png", "birds/1.png"])
    for split, names in splits.items():
        for n, name in enumerate(names):
            link = root / "data" / split / name
            link.parent.mkdir(parents=True, exist_ok=True)
            target = pool / f"{int(Path(name).stem):03d}.jpg"
            link.symlink_to(target if n % 2 else os.path.relpath(target, link.parent))
    return root / "data"


def test_a_pool_of_links_lists_as_torchvisions_imagefolder(tmp_path):
    data = pool_of_links(tmp_path, {"train": ["cat/0.jpg", "cat/1.jpg", "dog/2.jpg", "dog/sub/3.jpg", "dog/4.jpg"],
                                    "val": ["cat/5.jpg", "dog/6.jpg"]})
    (data / "train" / "bird").symlink_to(tmp_path / "pool" / "birds")  # a class folder that is a folder of the pool
    make_tree(data / "val", ["bird/9.png"])
    check_imagefolder(data)
    listings = scan_splits(data)
    for split in ("train", "val"):
        theirs = vision.datasets.ImageFolder(str(data / split))
        assert listings[split] == (theirs.classes, theirs.samples) == scan_split(data / split), split
    assert [Path(p).relative_to(data / "train").as_posix() for p, _ in listings["train"][1]] == [
        "bird/0.png", "bird/1.png", "cat/0.jpg", "cat/1.jpg", "dog/2.jpg", "dog/4.jpg", "dog/sub/3.jpg"]


# (id, links to make in val/, what the line names: {data}, {real} (DATA_DIR resolved), {pool})
IN_BOTH = [
    ("val-into-train", [("cat/v.jpg", "../../train/cat/own.jpg")],
     "{data}/train/cat/own.jpg and {data}/val/cat/v.jpg are {real}/train/cat/own.jpg"),
    ("both-into-one-pool-file", [("cat/p.jpg", "../../../pool/000.jpg")],
     "{data}/train/cat/0.jpg and {data}/val/cat/p.jpg are {pool}/000.jpg"),
    ("both-into-one-pool-folder", [("bird", "../../pool/birds")],
     "{data}/train/bird and {data}/val/bird are the folder {pool}/birds (its 2 images)"),
]


@pytest.mark.parametrize("links, says", [c[1:] for c in IN_BOTH], ids=[c[0] for c in IN_BOTH])
def test_an_image_that_train_and_val_both_list_is_refused(tmp_path, capsys, links, says):
    data = pool_of_links(tmp_path, {"train": ["cat/0.jpg", "dog/1.jpg"], "val": ["cat/5.jpg", "dog/6.jpg"]})
    make_tree(data / "train", ["cat/own.jpg"])
    (data / "train" / "bird").symlink_to(tmp_path / "pool" / "birds")
    if links[0][0] != "bird":
        make_tree(data / "val", ["bird/9.png"])
    scan_splits(data)  # apart: no image in both
    for link, target in links:
        (data / "val" / link).symlink_to(target)
    with pytest.raises(ConfigError) as refused:
        scan_splits(data)
    line = str(refused.value)
    count = "2 images are" if links[0][0] == "bird" else "1 image is"
    assert line == (f"{data}: {count} in both train/ and val/, reached through links ("
                    f"{says.format(data=data, real=os.path.realpath(data), pool=os.path.realpath(tmp_path / 'pool'))}"
                    f"): the model would be scored on images it trained on: remove those links from one of the "
                    f"splits"), line
    assert pack_main([str(data), str(tmp_path / "shards")]) == 2  # make pack lists it as training does
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {line}"
    assert not (tmp_path / "shards").exists()
    assert imagefolder_split(data, "val").samples  # val/ alone (make evaluate): nothing to compare it with


def test_a_refusal_of_many_links_is_one_line_naming_a_few(tmp_path):
    """A pool moved away (every link broken), a val/ linked to train's pool files: one short line, the first three
    named and all counted, whatever the count."""
    lines = {}
    for count in (5, 100):
        data = pool_of_links(tmp_path / str(count), {"train": [f"cat/{n}.jpg" for n in range(count)],
                                                     "val": [f"cat/{n}.jpg" for n in range(count)]})
        with pytest.raises(ConfigError) as refused:
            scan_splits(data)
        lines[count, "both"] = str(refused.value)
        shutil.rmtree(tmp_path / str(count) / "pool")
        with pytest.raises(ConfigError) as refused:
            scan_splits(data)
        lines[count, "broken"] = str(refused.value)
    assert lines[100, "both"].startswith(f"{tmp_path}/100/data: 100 images are in both train/ and val/")
    assert lines[100, "broken"].startswith(f"{tmp_path}/100/data/train/cat/0.jpg is a broken link (it names ")
    assert ("; and 99 more such links (" in lines[100, "broken"] and
            lines[100, "broken"].endswith(", ...): remove them, or replace each by the file it should name (a moved "
                                          "pool: point the links at its new place)")), lines[100, "broken"]
    assert lines[100, "broken"].count(f"{tmp_path}/100/data/train/cat/") == 4  # the first, and three more named
    assert lines[100, "both"].count(f"{tmp_path}/100/data/val/cat/") == 3
    for kind in ("both", "broken"):
        assert "\n" not in lines[100, kind] and len(lines[100, kind]) < len(lines[5, kind]) + 30, lines[100, kind]


def test_preflight_refuses_the_links_among_the_class_folders_before_any_worker(tmp_path):
    data = tmp_path / "data"
    make_tree(data / "train", ["cat/0.jpg"])
    make_tree(data / "val", ["cat/0.jpg"])
    make_tree(tmp_path / "elsewhere", ["0.jpg"])
    check_imagefolder(data)
    (data / "train" / "dog").symlink_to(tmp_path / "elsewhere")  # a class folder elsewhere on the NAS: followed
    (data / "val" / "dog").symlink_to(tmp_path / "elsewhere")  # and in val/ too: its listing refuses that
    check_imagefolder(data)
    (data / "train" / "dog").unlink()
    (data / "train" / "dog").symlink_to("missing")
    with pytest.raises(ConfigError, match=f"^{data / 'train' / 'dog'} is a broken link"):
        check_imagefolder(data)
    (data / "train" / "dog").unlink()
    (data / "val" / "dog").unlink()
    (data / "val" / "bird").symlink_to("../val")
    with pytest.raises(ConfigError, match=f"^{data / 'val' / 'bird'} is a link cycle: it leads back to"):
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
