"""train/files/downloads.py: a complete file or folder takes its name whole, and only the first one does; a
download into a folder where another process already placed the file leaves that file as it is (a real HTTP
server on 127.0.0.1). Several real processes racing on one folder: tests/e2e/test_downloads.py."""

import hashlib
import os
from types import SimpleNamespace

import pytest

from tests.helpers import FileServer, small_cifar
from train.base.errors import ConfigError
from train.components.weights import download, fetch
from train.data.folders import cifar_split, download_cifar
from train.files.downloads import private_name, publish


def test_the_first_complete_file_or_folder_takes_the_name_and_a_later_one_does_not(tmp_path):
    path = tmp_path / "weights.pth"
    first, second = private_name(path), private_name(path)
    assert first != second and first.name.startswith(".weights.pth.") and first.name.endswith(".partial")
    first.write_bytes(b"first")
    second.write_bytes(b"second")
    assert publish(first, path) and not publish(second, path)
    assert path.read_bytes() == b"first" and path.stat().st_ino == first.stat().st_ino  # the same file, linked

    folder = tmp_path / "cifar-10-batches-py"
    for name, content in (("a", b"first"), ("b", b"second")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "data_batch_1").write_bytes(content)
    assert publish(tmp_path / "a", folder) and not publish(tmp_path / "b", folder)
    assert (folder / "data_batch_1").read_bytes() == b"first" and (tmp_path / "b").is_dir()


def test_a_download_keeps_the_file_another_process_placed_meanwhile(tmp_path, monkeypatch):
    """The file appears while this download runs (another node won): it is not replaced, which a reader
    holding it open would see as a stale handle on NFS, and this copy leaves nothing behind."""
    body = os.urandom(300_000)
    name = f"net-{hashlib.sha256(body).hexdigest()[:8]}.pth"
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    path = tmp_path / "torch-home" / "hub" / "checkpoints" / name
    path.parent.mkdir(parents=True)
    with FileServer({name: body}) as server:
        path.write_bytes(body)
        placed = path.stat()
        assert download(f"{server.url}/{name}", path, name[4:12]) is False
        assert (path.stat().st_ino, path.stat().st_mtime_ns) == (placed.st_ino, placed.st_mtime_ns)
        assert os.listdir(path.parent) == [name]
        path.write_bytes(body[:-1])  # another process's copy, damaged: refused, named, left for the user
        with pytest.raises(ConfigError, match=rf"^{path} is damaged \(its SHA-256 does not start with"):
            fetch(SimpleNamespace(url=f"{server.url}/{name}"))


def test_a_damaged_cifar_folder_is_one_line_and_stays_as_it_is(tmp_path):
    """--download does not overwrite a folder already there that fails torchvision's checksums: it says so."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    (folder / "data_batch_1").write_bytes(b"cut short")
    with pytest.raises(ConfigError, match=rf"^CIFAR-10 under {tmp_path} is incomplete or corrupted \(a file fails its "
                                          rf"MD5\): delete {folder} and pass --download$"):
        cifar_split(tmp_path, train=True, transform=None, download=True)
    assert os.listdir(tmp_path) == [folder.name] and os.listdir(folder) == ["data_batch_1"]


def test_a_cifar_archive_placed_by_hand_is_used_without_the_network_and_kept(tmp_path):
    from torchvision.datasets import CIFAR10

    archive, checksums, contents = small_cifar(20)
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(archive)
    dataset = type("SmallCIFAR", (CIFAR10,), {**checksums, "url": "http://127.0.0.1:9/unreachable.tar.gz"})
    assert download_cifar(tmp_path, dataset) is True
    assert {p.name: p.read_bytes() for p in (tmp_path / "cifar-10-batches-py").iterdir()} == contents
    assert sorted(os.listdir(tmp_path)) == ["cifar-10-batches-py", "cifar-10-python.tar.gz"]
    assert download_cifar(tmp_path, dataset) is False and len(dataset(str(tmp_path), train=False)) == 20
