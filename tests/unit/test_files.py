"""The one way trainbox writes a file (rundir.atomic_file: temp name, fsync, rename, fsync of the folder) and reads a
file's digest (rundir.file_digest), on real files."""

import hashlib
import os

import pytest

from train.files import rundir


@pytest.fixture
def fsynced(monkeypatch):
    """The paths os.fsync is called on (the real fsync runs too), read from /proc/self/fd."""
    seen, real = [], os.fsync

    def spy(fd):
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return seen


def test_an_atomic_write_fsyncs_the_file_then_its_folder_and_leaves_no_temporary_file(tmp_path, fsynced):
    path = tmp_path / "status.json"
    path.write_text("old")
    rundir.atomic_write(path, b"new")
    assert path.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]
    assert len(fsynced) == 2 and fsynced[0].startswith(str(tmp_path / ".status.json.tmp.")) and \
        fsynced[1] == str(tmp_path), fsynced


def test_a_writer_that_fails_leaves_the_old_file_and_nothing_else(tmp_path):
    path = tmp_path / "figure.png"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="half-way"), rundir.atomic_file(path, suffix=".png") as tmp:
        assert tmp.name.endswith(".png") and tmp.parent == tmp_path
        tmp.write_bytes(b"half")
        raise RuntimeError("half-way")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["figure.png"]


@pytest.mark.parametrize("python_3_10", [False, True])
def test_a_file_digest_is_hashlibs_of_its_bytes_also_without_file_digest(tmp_path, monkeypatch, python_3_10):
    if python_3_10:  # hashlib.file_digest came with Python 3.11: the loop beside it
        monkeypatch.delattr(hashlib, "file_digest", raising=False)
    data = os.urandom(3 << 20) + b"tail"
    (tmp_path / "f").write_bytes(data)
    assert rundir.file_digest(tmp_path / "f") == hashlib.sha256(data).hexdigest()
    assert rundir.file_digest(tmp_path / "f", "md5") == hashlib.md5(data).hexdigest()
