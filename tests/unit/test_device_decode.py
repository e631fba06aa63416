"""--decode gpu's logic, run here on the CPU: the loader workers read bytes, the training process decodes
each batch (JPEGs together, other formats one by one) and augments each sample under its own seed. The
batches must equal the CPU path's bit for bit, whatever the worker count or the resume point."""

from pathlib import Path

import pytest
import torch
from PIL import Image

from train.base.errors import DataError
from train.bench.photos import make_photos
from train.cli import parse_config
from train.data import DeviceDecoder, build_datasets
from train.loading import build_train_loader, build_val_loader, sampling


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """Real photographs (JPEG, 500 x 375), plus a PNG and a BMP that nvJPEG cannot read, in two classes."""
    root = tmp_path_factory.mktemp("photos")
    for split, count in (("train", 20), ("val", 6)):
        make_photos(root / split, count, classes=2, seed=len(split))
        with Image.open(next((root / split / "class0").iterdir())) as photo:
            photo.save(root / split / "class1" / "z.png")
            photo.convert("RGB").resize((120, 90)).save(root / split / "class0" / "z.bmp")
    return root


def config(folder, decode, workers=0, size=64):
    return parse_config(["--dataset", "imagefolder", "--data-dir", str(folder), "--image-size", str(size),
                         "--batch-size", "4", "--num-workers", str(workers), "--decode", decode, "--augment",
                         "imagenet"])


def batches(cfg, start=0, epoch=0, val=False):
    train_set, val_set, _ = build_datasets(cfg)
    if val:
        return list(build_val_loader(val_set, cfg.data, cfg.optimisation.batch_size, 0, 1, pin_memory=False,
                                     device=torch.device("cpu")))
    loader, sampler = build_train_loader(train_set, sampling(cfg), cfg.data, 0, 1, pin_memory=False,
                                         device=torch.device("cpu"))
    sampler.set_epoch(epoch, start=start)
    return list(loader)


def assert_same(a, b):
    assert len(a) == len(b) > 0
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert xa.dtype == xb.dtype == torch.uint8 and torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("size", [64, 16], ids=["imagenet-recipe", "cifar-recipe"])
def test_decoding_in_the_training_process_equals_the_loader_workers(folder, size):
    cpu = config(folder, "cpu", size=size)
    assert_same(batches(config(folder, "gpu", size=size)), batches(cpu))
    assert_same(batches(config(folder, "gpu", size=size), val=True), batches(cpu, val=True))


def test_the_result_depends_on_neither_the_worker_count_nor_the_resume_point(folder):
    whole = batches(config(folder, "gpu", workers=0), epoch=1)
    assert_same(batches(config(folder, "gpu", workers=2), epoch=1), whole)
    assert_same(batches(config(folder, "gpu", workers=2), epoch=1, start=8), whole[2:])  # resumed mid-epoch
    assert not torch.equal(batches(config(folder, "gpu"), epoch=2)[0][0], whole[0][0])  # another epoch, others


def test_the_loader_yields_images_decoded_and_labels(folder):
    cfg = config(folder, "gpu")
    train_set, _, classes = build_datasets(cfg)
    loader, _ = build_train_loader(train_set, sampling(cfg), cfg.data, 0, 1, False, torch.device("cpu"))
    assert isinstance(loader, DeviceDecoder) and classes == 2
    x, y = next(iter(loader))
    assert x.shape == (4, 3, 64, 64) and y.shape == (4,)


def test_a_damaged_jpeg_in_a_batch_stops_the_run_naming_the_file(folder, tmp_path):
    import shutil

    copy = tmp_path / "data"
    shutil.copytree(folder, copy)
    victim = sorted((copy / "train" / "class1").glob("*.jpg"))[0]
    victim.write_bytes(victim.read_bytes()[:200])  # the header survives, the picture does not
    with pytest.raises(DataError, match=f"cannot read image {victim}"):
        batches(config(copy, "gpu"))
