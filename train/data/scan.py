"""An ImageFolder split's listing (DATA_DIR/train/<class>/..., DATA_DIR/val/<class>/...): the classes and the
images with their labels, as torchvision's ImageFolder lists them, with links held to what the folder says
(FolderScan). Training, make evaluate, make pack and the preflight checks read a folder through it. Standard
library only: it asks the disk for folder listings and where links lead, nothing else.
"""

from __future__ import annotations

import errno
import operator
import os
from pathlib import Path

from train.errors import ConfigError

# torchvision's IMG_EXTENSIONS (tests/unit/test_folders.py holds them equal): a file counts by its name, in any case
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
BY_NAME = operator.attrgetter("name")


def is_image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def within(path: str, folder: str) -> bool:
    """Whether `path` is `folder` or inside it (two real paths: a string test, nothing asked of the disk)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


class FolderScan:
    """One split of an ImageFolder (SPLIT/<class>/...) listed as torchvision's ImageFolder lists it: the class
    folders sorted, each one's images in os.walk's order (its folders sorted by path, each folder's files by
    name). Symbolic links are held to what the folder says: a link to a file or folder inside the split (the
    split's folder resolved first: it, or DATA_DIR, may be a link) that nothing else reaches is followed once;
    a link out of the split, a link cycle, a broken link and an image or folder reached twice are each refused
    in one line. Only links are resolved: ordinary files cost no stat (os.scandir's file types), and every
    folder's real path is its parent's plus its name, so one reached twice is known without asking the disk."""

    def __init__(self, split_dir: Path, counted=None):
        self.top = str(split_dir)  # samples are named by the path as given, as torchvision names them
        self.counted = counted  # called with the entries of each folder listed (a progress line)
        try:
            self.real_top = os.path.realpath(self.top, strict=True)
        except OSError as e:
            raise self._link_error(self.top, e) from None
        if not os.path.isdir(self.real_top):
            raise ConfigError(f"{self.top} is not a folder: put images in {self.top}/<class>/")
        self.reached: dict[str, str] = {}  # every folder walked: its real path -> the path that reached it
        self.linked: dict[str, str] = {}  # every image reached through a link to a file: its real path -> the link

    def classes(self) -> list[tuple[str, str, str]]:
        """(name, path, real path) of every class folder, sorted by name; links among them followed and checked."""
        found = []
        for entry in self._entries(self.top):
            if entry.is_symlink():
                real, is_dir = self._follow(entry.path, self.real_top, in_a_class=False)
                if is_dir:
                    found.append((entry.name, entry.path, real))
            elif entry.is_dir(follow_symlinks=False):
                found.append((entry.name, entry.path, os.path.join(self.real_top, entry.name)))
        return sorted(found)

    def images(self, path: str, real: str) -> list[str]:
        """The images under a class folder (`path`, whose real path is `real`), in torchvision's order."""
        folders = []
        stack = [(path, real)]
        while stack:
            path, real = stack.pop()
            if real in self.reached:
                raise ConfigError(f"{self.reached[real]} and {path} are the same folder, reached twice through a link: "
                                  f"its images would count twice (or under two classes): remove the link")
            self.reached[real] = path
            names = []
            for entry in self._entries(path):
                if entry.is_symlink():
                    target, is_dir = self._follow(entry.path, real)
                    if is_dir:
                        stack.append((entry.path, target))
                    elif is_image_name(entry.name):
                        if target in self.linked:
                            raise self._twice(self.linked[target], entry.path)
                        self.linked[target] = entry.path
                        names.append(entry.name)
                elif entry.is_dir(follow_symlinks=False):
                    stack.append((entry.path, os.path.join(real, entry.name)))
                elif entry.name.lower().endswith(IMAGE_EXTENSIONS):
                    if not entry.is_file(follow_symlinks=False):
                        raise ConfigError(f"{entry.path} is not a file (a FIFO, socket or device) but is named as an "
                                          f"image: remove it, or rename it")
                    names.append(entry.name)
            folders.append((path, sorted(names)))
        images = []
        for folder, names in sorted(folders):
            prefix = os.path.join(folder, "")  # prefix + name is os.path.join(folder, name), a call less per image
            images += [prefix + name for name in names]
        return images

    def check_linked_images(self) -> None:
        """An image reached through a link to a file and also as itself (its folder walked): refused."""
        for real, link in self.linked.items():
            folder, name = os.path.split(real)
            if folder in self.reached and is_image_name(name):
                raise self._twice(os.path.join(self.reached[folder], name), link)

    def _entries(self, path: str) -> list[os.DirEntry]:
        try:
            with os.scandir(path) as entries:
                found = sorted(entries, key=BY_NAME)  # the same line names the same link every time
        except OSError as e:  # torchvision's os.walk would skip the folder without a word
            raise ConfigError(f"cannot list {path} ({e.strerror}): check its permissions and the storage") from None
        if self.counted is not None:
            self.counted(len(found))
        return found

    def _follow(self, link: str, holder: str, in_a_class: bool = True) -> tuple[str, bool]:
        """A link's real target and whether it is a folder; refused when it is broken, a cycle, or leads out of the
        split (a link to a file that would not be an image of a class, say notes.txt -> /elsewhere, is let be)."""
        try:
            real = os.path.realpath(link, strict=True)
        except OSError as e:
            raise self._link_error(link, e) from None
        is_dir = os.path.isdir(real)
        if is_dir and within(holder, real):
            raise ConfigError(f"{link} is a link cycle: it leads back to {real}, which holds it, so the same images "
                              f"would be read again and again: remove the link")
        if (is_dir or in_a_class and is_image_name(link)) and not within(real, self.real_top):
            raise ConfigError(f"{link} is a link out of the dataset's folder ({real} is outside {self.real_top}): "
                              f"replace the link by a copy of what it names (cp -rL), or move those files into "
                              f"{self.real_top}")
        return real, is_dir

    @staticmethod
    def _link_error(link: str, error: OSError) -> ConfigError:
        if error.errno == errno.ELOOP:
            return ConfigError(f"{link} is a link cycle (links that lead to each other, never to a file): remove it")
        if error.errno in (errno.ENOENT, errno.ENOTDIR):
            target = os.readlink(link) if os.path.islink(link) else link
            return ConfigError(f"{link} is a broken link (it names {target}, which does not exist): remove it, or "
                               f"replace it by the file it should name")
        return ConfigError(f"cannot follow the link {link} ({error.strerror}): check the permissions of what it names")

    @staticmethod
    def _twice(first: str, second: str) -> ConfigError:
        return ConfigError(f"{first} and {second} are the same image, reached twice through a link: it would count "
                           f"twice: remove the link, or replace it by a copy if the image is meant to count twice")


def scan_split(split_dir: Path, counted=None) -> tuple[list[str], list[tuple[str, int]]]:
    """(classes, [(image path, label)]) of one split, as torchvision's ImageFolder gives them for a folder without
    links (tests/unit/test_folders.py compares the two); links as FolderScan says. Every class must hold an image."""
    scan = FolderScan(split_dir, counted)
    classes = scan.classes()
    if not classes:
        raise ConfigError(f"{split_dir} has no class folders: put images in {split_dir}/<class>/")
    samples, empty = [], []
    for label, (name, path, real) in enumerate(classes):
        images = scan.images(path, real)
        samples += [(image, label) for image in images]
        if not images:
            empty.append(name)
    scan.check_linked_images()
    if empty:
        raise ConfigError(f"{split_dir}: no image in the class folder(s) {', '.join(empty[:5])}"
                          f"{' and more' if len(empty) > 5 else ''} (read: {', '.join(IMAGE_EXTENSIONS)}, in any "
                          f"case): put images in {split_dir}/<class>/")
    return [name for name, _, _ in classes], samples
