"""One of another tool's WebDataset tars read as samples (train/data/tarindex.py indexes the tars by it): the run of
consecutive members that share a key (webdataset's rule), its image's offset, size and member name (tarfile gives them
from the members' headers) and its label, read from the small label member. Run in the indexing processes.

A tar must end as a whole tar does, in two blocks of zeros after its last member: tarfile alone stops without a word
where a file is cut at a member's end or inside a header, or where a header is damaged, and the samples after it
would be lost.
"""

from __future__ import annotations

import json
import re
import tarfile
from array import array
from pathlib import Path

from train.base.errors import ConfigError, first_few
from train.data.scan import IMAGE_EXTENSIONS

IMAGE_SUFFIXES = tuple(e[1:] for e in IMAGE_EXTENSIONS)  # the ImageFolder's, in the order a sample's image is taken
KEY = re.compile(r"^((?:.*/|)[^./][^.]*)\.([^/]*)$")  # webdataset's base_plus_ext: key, suffix


def _label(tar: tarfile.TarFile, members: dict, key: str, label_key: str, path: str) -> int:
    """The sample's label: the integer in <key>.<label_key>, else <key>.json's value at label_key."""
    if label_key in members:
        text, where = tar.extractfile(members[label_key]).read().decode("utf-8", "replace").strip(), \
            f"{key}.{label_key}"
    elif "json" in members:
        try:
            record = json.loads(tar.extractfile(members["json"]).read())
        except ValueError as e:
            raise ConfigError(f"{path}: the sample {key!r} has a {key}.json that is not JSON ({e}): repair or remove "
                              f"the sample") from None
        if not isinstance(record, dict) or label_key not in record:
            raise ConfigError(f"{path}: the sample {key!r} has no label (no {key}.{label_key}, and no "
                              f"{label_key!r} in {key}.json): pass --label-key with the name its label has, or "
                              f"remove the sample")
        text, where = record[label_key], f"{key}.json's {label_key!r}"
        text = str(text).strip() if isinstance(text, (int, str)) and not isinstance(text, bool) else repr(text)
    else:
        raise ConfigError(f"{path}: the sample {key!r} has no label (no {key}.{label_key} or {key}.json): add one, "
                          f"pass --label-key with the name its label has, or remove the sample")
    if not (text.isascii() and text.isdigit()):
        shown = repr(text) if len(text) <= 40 else f"{text[:40]!r}... ({len(text):,} characters)"
        raise ConfigError(f"{path}: the label of the sample {key!r} ({where}: {shown}) is not a class index (a whole "
                          f"number from 0): give the index, with the names in {Path(path).parent}/classes.txt")
    return int(text)


def _no_image(path: str, key: str, members: dict) -> ConfigError:
    """A sample without an image: its image missing, or a key with a dot in it (webdataset's key is a member's name
    up to its first dot, so img.0000.jpg, img.0001.jpg ... are parts of one sample 'img', not its images)."""
    parts = sorted(members)
    dotted = [s for s in parts if "." in s and s.rsplit(".", 1)[1].lower() in IMAGE_SUFFIXES]
    if dotted:
        example, named = f"{key}.{dotted[0]}", [f"{key}.{s}" for s in parts]
        fixed = f"{key}_{dotted[0].replace('.', '_', dotted[0].count('.') - 1)}"
        return ConfigError(f"{path}: the sample {key!r} has no image: its {len(named):,} members ({first_few(named)}) "
                           f"are one sample to webdataset, which takes a member's key up to the first dot of its name "
                           f"({example}: the key {key!r}, the part {dotted[0]!r}, not an image): write the tars again "
                           f"with keys that hold no dot ({fixed})")
    return ConfigError(f"{path}: the sample {key!r} has no image ({', '.join(f'.{s}' for s in IMAGE_SUFFIXES)}; it "
                       f"has {first_few(parts)}): add its image, or remove the sample")


def _cut_or_damaged(path: str, tar: tarfile.TarFile, error: str | None = None) -> ConfigError | None:
    """Whether the tar ends as a whole tar does (two blocks of zeros where the next header would be), else the
    line that says where it stops: tarfile ends its members without a word at a file cut at a member's end or
    inside a header, and at a header it cannot read. error: what tarfile raised, if it did."""
    after = f"after the member {tar.members[-1].name}" if tar.members else "before any member"
    if error == "unexpected end of data":  # tarfile's word for a file that ends inside a member's data
        return ConfigError(f"{path} is cut short (it ends inside the member {tar.members[-1].name}): copy the tar "
                           f"again")
    if error in ("truncated header", "empty header"):  # inside a long name's or a pax header's blocks
        return ConfigError(f"{path} is cut short (it ends inside the header {after}): copy the tar again")
    if error is not None:
        return ConfigError(f"{path} is damaged ({after}: {error}): copy the tar again")
    tar.fileobj.seek(tar.offset)
    end = tar.fileobj.read(2 * tarfile.BLOCKSIZE)
    if end == bytes(2 * tarfile.BLOCKSIZE):
        return None
    if not any(end):
        return ConfigError(f"{path} is cut short (it ends {after}, without the two blocks of zeros that end a tar): "
                           f"copy the tar again")
    if len(end) < tarfile.BLOCKSIZE:
        return ConfigError(f"{path} is cut short (it ends inside the header {after}): copy the tar again")
    return ConfigError(f"{path} is damaged ({after}, at byte {tar.offset:,}, comes neither a member's header nor the "
                       f"end of the tar): copy the tar again")


def index_tar(path: str, label_key: str) -> tuple[bytes, str]:
    """One tar's samples: their rows (offset, size, label; int64 x 3, as bytes) and their image members' names, one a
    line. Runs in an indexing process."""
    rows, names = array("q"), []

    def close(key: str | None, members: dict) -> None:
        if key is None:
            return
        image = next((members[s] for s in IMAGE_SUFFIXES if s in members), None)
        if image is None:
            raise _no_image(path, key, members)
        if "\n" in image.name:
            raise ConfigError(f"{path}: the sample {key!r} has a line break in its name: rename it")
        rows.extend((image.offset_data, image.size, _label(tar, members, key, label_key, path)))
        names.append(image.name)

    try:
        tar = tarfile.open(path, mode="r:")
    except (tarfile.ReadError, EOFError) as e:
        raise ConfigError(f"{path} cannot be read as a plain tar ({e}): a damaged, compressed (.tar.gz) or other file; "
                          f"reading by offset needs uncompressed tars: copy it again, or decompress it") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path} ({e.strerror}): check its permissions and the storage") from None
    with tar:
        key, members = None, {}
        try:
            for member in tar:
                match = KEY.match(member.name) if member.isfile() else None
                if match is None:
                    continue  # folders, links, files without a suffix: not a sample's part (webdataset skips them)
                if match[1] != key:
                    close(key, members)
                    key, members = match[1], {}
                members[match[2].lower() if match[2].lower() in IMAGE_SUFFIXES else match[2]] = member
            problem = _cut_or_damaged(path, tar)  # before the last sample: a cut there takes its label or image
        except (tarfile.ReadError, EOFError) as e:
            problem = _cut_or_damaged(path, tar, str(e))
        except OSError as e:
            raise ConfigError(f"cannot read {path} ({e.strerror}): check its permissions and the storage") from None
        if problem:
            raise problem
        close(key, members)
    if not names:
        raise ConfigError(f"{path} holds no sample (members named <key>.<suffix>): remove it from {Path(path).parent}")
    return rows.tobytes(), "\n".join(names)
