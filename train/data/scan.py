"""An ImageFolder split's listing (DATA_DIR/train/<class>/..., DATA_DIR/val/<class>/...): the classes and the
images with their labels, as torchvision's ImageFolder lists them, with links followed wherever they lead and held to
what the folders say (FolderScan; scan_splits: train and val apart). Training, make evaluate, make pack and the
preflight checks read a folder through it. Standard library only: it asks the disk for folder listings and where
links lead, nothing else.
"""

from __future__ import annotations

import errno
import operator
import os
import stat
from pathlib import Path

from train.base.errors import ConfigError

# torchvision's IMG_EXTENSIONS (tests/unit/test_folders.py holds them equal): a file counts by its name, in any case
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
BY_NAME = operator.attrgetter("name")
NAMED = 3  # the refused links, or the images in both splits, a line names (then their count)

# Each kind of refused link: what it breaks, and the fix for one and for several
FIXES = {
    "cycle": ("remove the link", "remove those links"),
    "broken": ("remove it, or replace it by the file it should name",
               "remove them, or replace each by the file it should name (a moved pool: point the links at its new "
                "place)"),
    "twice": ("remove the link, or replace it by a copy if the image is meant to count twice",
              "remove those links, or replace each by a copy if its image is meant to count twice"),
    "unreadable": ("check the permissions of what it names", "check the permissions of what they name"),
}


def is_image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def within(path: str, folder: str) -> bool:
    """Whether `path` is `folder` or inside it (two real paths: a string test, nothing asked of the disk)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def how_many(number: int, one: str, many: str | None = None) -> str:
    return f"{number:,} {one if number == 1 else many or one + 's'}"


class FolderScan:
    """One split of an ImageFolder (SPLIT/<class>/...) listed as torchvision's ImageFolder lists it: the class
    folders sorted, each one's images in os.walk's order (its folders sorted by path, each folder's files by
    name). Symbolic links are followed wherever they lead (a pool of images on a NAS that train/ and val/ link
    into, the split's folder itself or DATA_DIR a link), and held to what the folder says: a link cycle, a broken
    link and an image or folder reached twice are refused, all of them in one line (the first few named, and their
    count). Only links are resolved: ordinary files cost no stat (os.scandir's file types), every folder's real path
    is its parent's plus its name, and a link's is its target's folder's (resolved once per folder) plus its name,
    so one reached twice is known without asking the disk again."""

    def __init__(self, split_dir: Path, counted=None):
        self.top = str(split_dir)  # samples are named by the path as given, as torchvision names them
        self.counted = counted  # called with the entries of each folder listed (a progress line)
        try:
            self.real_top = os.path.realpath(self.top, strict=True)
        except OSError as e:
            kind, _, cause = self._link_error(self.top, e)
            raise ConfigError(f"{cause}: {FIXES[kind][0]}") from None
        if not os.path.isdir(self.real_top):
            raise ConfigError(f"{self.top} is not a folder: put images in {self.top}/<class>/")
        self.reached: dict[str, str] = {}  # every folder walked: its real path -> the path that reached it
        self.linked: dict[str, str] = {}  # every image reached through a link to a file: its real path -> the link
        self.images_in: dict[str, int] = {}  # the images listed as themselves (not links) in each real folder
        self.refused: list[tuple[str, str, str]] = []  # (kind, the link, its line's cause), in the order met
        self._folders: dict[str, str] = {}  # the folder a link's target names, as it names it -> its real path

    def classes(self) -> list[tuple[str, str, str]]:
        """(name, path, real path) of every class folder, sorted by name; links among them followed and checked."""
        found = []
        for entry in self._entries(self.top):
            if entry.is_symlink():
                real, is_dir = self._follow(entry.path, self.real_top)
                if is_dir:
                    found.append((entry.name, entry.path, real))
            elif entry.is_dir(follow_symlinks=False):
                found.append((entry.name, entry.path, os.path.join(self.real_top, entry.name)))
        self.raise_refused()
        return sorted(found)

    def images(self, path: str, real: str) -> list[str]:
        """The images under a class folder (`path`, whose real path is `real`), in torchvision's order."""
        folders = []
        stack = [(path, real)]
        while stack:
            path, real = stack.pop()
            if real in self.reached:
                first = self.reached[real]
                if within(path, first):  # it descends from itself: links that lead round
                    self.refused.append(("cycle", path, f"{path} is a link cycle: it leads back to {first}, which "
                                                        f"holds it, so the same images would be read again and again"))
                else:
                    self.refused.append(("twice", path, f"{first} and {path} are the same folder, reached twice "
                                                        f"through a link: its images would count twice (or under two "
                                                        f"classes)"))
                continue
            self.reached[real] = path
            names, own = [], 0
            for entry in self._entries(path):
                if entry.is_symlink():
                    target, is_dir = self._follow(entry.path, real)
                    if is_dir:
                        stack.append((entry.path, target))
                    elif target and is_image_name(entry.name):
                        if target in self.linked:
                            self._twice(self.linked[target], entry.path)
                        else:
                            self.linked[target] = entry.path
                            names.append(entry.path)
                elif entry.is_dir(follow_symlinks=False):
                    stack.append((entry.path, os.path.join(real, entry.name)))
                elif is_image_name(entry.name):
                    if not entry.is_file(follow_symlinks=False):
                        raise ConfigError(f"{entry.path} is not a file (a FIFO, socket or device) but is named as an "
                                          f"image: remove it, or rename it")
                    names.append(entry.path)
                    own += 1
            if own:
                self.images_in[real] = own
            folders.append((path, names))  # the entries' paths, sorted by name: os.path.join(path, name) each
        images = []
        for _, paths in sorted(folders):
            images += paths
        return images

    def check_linked_images(self) -> None:
        """An image reached through a link to a file and also as itself (its folder walked): refused."""
        for real, link in self.linked.items():
            folder, name = os.path.split(real)
            if folder in self.reached and is_image_name(name):
                self._twice(os.path.join(self.reached[folder], name), link)

    def listing(self) -> tuple[list[str], list[tuple[str, int]]]:
        """(classes, [(image path, label)]): scan_split's."""
        classes = self.classes()
        if not classes:
            raise ConfigError(f"{self.top} has no class folders: put images in {self.top}/<class>/")
        samples, empty = [], []
        for label, (name, path, real) in enumerate(classes):
            images = self.images(path, real)
            samples += [(image, label) for image in images]
            if not images:
                empty.append(name)
        self.check_linked_images()
        self.raise_refused()
        if empty:
            raise ConfigError(f"{self.top}: no image in the class folder(s) {', '.join(empty[:5])}"
                              f"{' and more' if len(empty) > 5 else ''} (read: {', '.join(IMAGE_EXTENSIONS)}, in any "
                              f"case): put images in {self.top}/<class>/")
        return [name for name, _, _ in classes], samples

    def raise_refused(self) -> None:
        """Every refused link in one line: the first one's cause, the others of its kind named (the first few) and
        counted, the other kinds counted."""
        if not self.refused:
            return
        kind, _, cause = self.refused[0]
        alike = [link for k, link, _ in self.refused if k == kind]
        others = len(self.refused) - len(alike)
        if len(alike) > 1:
            more = alike[1:1 + NAMED]
            cause += (f"; and {how_many(len(alike) - 1, 'more such link')} ({', '.join(more)}"
                      f"{', ...' if len(alike) - 1 > len(more) else ''})")
        if others:
            cause += f" (and {how_many(others, 'link')} refused for another cause, named once these are mended)"
        raise ConfigError(f"{cause}: {FIXES[kind][len(alike) > 1]}")

    def _entries(self, path: str) -> list[os.DirEntry]:
        try:
            with os.scandir(path) as entries:
                found = sorted(entries, key=BY_NAME)  # the same line names the same link every time
        except OSError as e:  # torchvision's os.walk would skip the folder without a word
            raise ConfigError(f"cannot list {path} ({e.strerror}): check its permissions and the storage") from None
        if self.counted is not None:
            self.counted(len(found))
        return found

    def _follow(self, link: str, holder: str) -> tuple[str, bool]:
        """A link's real target (in the folder `holder`, a real path) and whether it is a folder; ("", False) for a
        refused one: broken, a cycle, unreadable. A link to a file that would not be an image of a class (say
        notes.txt -> /elsewhere) is let be."""
        try:
            real, is_dir = self._resolve(link, holder)
        except OSError as e:
            self.refused.append(self._link_error(link, e))
            return "", False
        if is_dir and within(holder, real):
            self.refused.append(("cycle", link, f"{link} is a link cycle: it leads back to {real}, which holds it, "
                                                f"so the same images would be read again and again"))
            return "", False
        return real, is_dir

    def _resolve(self, link: str, holder: str) -> tuple[str, bool]:
        """os.path.realpath(link, strict=True) and whether it is a folder, at a readlink and an lstat a link: its
        target's folder is resolved once (a pool's folder, which thousands of links name), then the target's own
        name looked at."""
        target = os.readlink(link)
        parent, _, name = (target if target.startswith("/") else f"{holder}/{target}").rpartition("/")
        if name in ("", ".", "..") or not parent:
            real = os.path.realpath(os.path.join(holder, target), strict=True)
            return real, os.path.isdir(real)
        real_parent = self._folders.get(parent)
        if real_parent is None:
            real_parent = self._folders[parent] = os.path.realpath(parent, strict=True).rstrip("/")
        real = f"{real_parent}/{name}"  # string joins: a call less per link (os.sep is "/" where links are)
        mode = os.lstat(real).st_mode
        if stat.S_ISLNK(mode):  # a link to a link
            real = os.path.realpath(real, strict=True)
            mode = os.stat(real).st_mode
        return real, stat.S_ISDIR(mode)

    def _twice(self, first: str, second: str) -> None:
        self.refused.append(("twice", second, f"{first} and {second} are the same image, reached twice through a "
                                              f"link: it would count twice"))

    @staticmethod
    def _link_error(link: str, error: OSError) -> tuple[str, str, str]:
        """(kind, link, cause) of a link that cannot be followed."""
        if error.errno == errno.ELOOP:
            return "cycle", link, f"{link} is a link cycle (links that lead to each other, never to a file)"
        if error.errno in (errno.ENOENT, errno.ENOTDIR):
            target = os.readlink(link) if os.path.islink(link) else link
            return "broken", link, f"{link} is a broken link (it names {target}, which does not exist)"
        return "unreadable", link, f"cannot follow the link {link} ({error.strerror})"


def images_in_both(train: FolderScan, val: FolderScan) -> tuple[int, list[str]]:
    """The images that train and val both list, reached through links (the splits' folders are apart): their
    count, and the first few places named (train's path, val's path, the file or folder), then "..." if more."""
    shown, total, places = [], 0, 0

    def found(number: int, ours: str, theirs: str, real: str) -> None:
        nonlocal total, places
        total, places = total + number, places + 1
        if len(shown) < NAMED:
            shown.append(f"{ours} and {theirs} are {real}")

    def listed_as_itself(scan: FolderScan, real: str) -> str | None:
        folder, name = os.path.split(real)
        return os.path.join(scan.reached[folder], name) if folder in scan.reached and is_image_name(name) else None

    for real, link in train.linked.items():
        theirs = val.linked.get(real) or listed_as_itself(val, real)
        if theirs:
            found(1, link, theirs, real)
    for real, link in val.linked.items():
        ours = None if real in train.linked else listed_as_itself(train, real)
        if ours:
            found(1, ours, link, real)
    for real, path in train.reached.items():
        if real in val.reached and train.images_in.get(real):
            found(train.images_in[real], path, val.reached[real], f"the folder {real} (its "
                                                                    f"{how_many(train.images_in[real], 'image')})")
    return total, shown + (["..."] if places > len(shown) else [])


def scan_split(split_dir: Path, counted=None) -> tuple[list[str], list[tuple[str, int]]]:
    """(classes, [(image path, label)]) of one split, as torchvision's ImageFolder gives them for a folder without
    links (tests/unit/test_folders.py compares the two); links as FolderScan says. Every class must hold an image."""
    return FolderScan(split_dir, counted).listing()


def scan_splits(root: Path, splits: tuple[str, ...] = ("train", "val"), counted=None) -> dict[str, tuple]:
    """{split: scan_split's listing} of DATA_DIR's splits; with train and val both, an image that both list (a link
    from one into the other, or links from both to one file of a pool) is refused in one line: the model would be
    scored on images it trained on."""
    scans = {split: FolderScan(root / split, counted) for split in splits}
    listings = {split: scan.listing() for split, scan in scans.items()}
    if len(scans) == 2:
        total, shown = images_in_both(scans["train"], scans["val"])
        if total:
            raise ConfigError(f"{root}: {how_many(total, 'image is', 'images are')} in both train/ and val/, reached "
                              f"through links ({'; '.join(shown)}): the model would be scored on images it trained "
                              f"on: remove those links from one of the splits")
    return listings
