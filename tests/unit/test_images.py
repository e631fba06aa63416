"""Every kind of image file becomes the uint8 RGB tensor (3 x H x W) PIL's `Image.open(f).convert("RGB")` makes of
it, in every decode path (the loader workers, --decode gpu's batches, the evaluation's set); a file that yields no
image is one line naming it. Pack's MAX_SIDE and the shards: tests/unit/test_pack.py."""

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from train.base import vision
from train.base.errors import DataError
from train.cli import parse_config
from train.data import build_datasets, image_transforms
from train.data.decode import as_tensor, decode, decode_batch, device_jpegs, load_image, plain_kind, read_bytes

H, W = 21, 34


def pixels(channels: int, dtype=np.uint8, top: int = 256) -> np.ndarray:
    rng = np.random.default_rng(channels * 7 + top)
    shape = (H, W) if channels == 1 else (H, W, channels)
    return rng.integers(0, top, shape, dtype=dtype)


def saved(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def png_rgb16(values: np.ndarray) -> bytes:
    """A 16-bit RGB PNG, written chunk by chunk (PIL writes no such file)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = b"".join(b"\x00" + row.astype(">u2").tobytes() for row in values)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", W, H, 16, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def palette() -> Image.Image:
    return Image.fromarray(pixels(3)).quantize(24)


# (name, the file's bytes, whether torchvision.io decodes it: the plain 8-bit RGB and grey JPEGs and PNGs)
KINDS = [
    ("rgb.png", lambda: saved(Image.fromarray(pixels(3)), "PNG"), "png"),
    ("grey.png", lambda: saved(Image.fromarray(pixels(1)), "PNG"), "png"),
    ("rgb.jpg", lambda: saved(Image.fromarray(pixels(3)), "JPEG"), "jpeg"),
    ("grey.jpg", lambda: saved(Image.fromarray(pixels(1)), "JPEG"), "jpeg"),
    ("grey16.png", lambda: saved(Image.fromarray(pixels(1, np.uint16, 2**16)), "PNG"), None),  # I;16: PIL clips
    ("grey16-low.png", lambda: saved(Image.fromarray(pixels(1, np.uint16, 256)), "PNG"), None),
    ("rgb16.png", lambda: png_rgb16(pixels(3, np.uint16, 2**16)), None),
    ("grey-alpha.png", lambda: saved(Image.fromarray(pixels(2), "LA"), "PNG"), None),
    ("rgba.png", lambda: saved(Image.fromarray(pixels(4)), "PNG"), None),
    ("palette.png", lambda: saved(palette(), "PNG"), None),
    ("palette-transparent.png", lambda: saved(palette(), "PNG", transparency=5), None),
    ("cmyk.jpg", lambda: saved(Image.fromarray(pixels(4), "CMYK"), "JPEG"), None),
    ("1-bit.png", lambda: saved(Image.fromarray(pixels(1) > 127), "PNG"), None),
    ("rgba.webp", lambda: saved(Image.fromarray(pixels(4)), "WEBP", lossless=True), None),
    ("rgb.bmp", lambda: saved(Image.fromarray(pixels(3)), "BMP"), None),
    ("grey16.tif", lambda: saved(Image.fromarray(pixels(1, np.uint16, 2**16)), "TIFF"), None),
]


def pil_rgb(data: bytes) -> torch.Tensor:
    """The reference: what PIL's Image.open(f).convert("RGB") makes of the file, as a 3 x H x W tensor."""
    with Image.open(io.BytesIO(data)) as image:
        return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).contiguous()


@pytest.fixture(scope="module")
def kinds(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("kinds")
    for name, make, _ in KINDS:
        (folder / name).write_bytes(make())
    return {name: folder / name for name, _, _ in KINDS}


@pytest.mark.parametrize("name, plain", [(k[0], k[2]) for k in KINDS], ids=[k[0] for k in KINDS])
def test_every_kind_of_image_decodes_as_pils_convert_rgb(kinds, name, plain):
    data = kinds[name].read_bytes()
    image = load_image(str(kinds[name]))  # the loader workers' path (--decode cpu)
    assert image.dtype == torch.uint8 and image.shape == (3, H, W)
    assert torch.equal(image, pil_rgb(data))
    assert plain_kind(as_tensor(data)) == plain
    if plain:  # on torchvision.io's decoder, as before: the bit-identity of the existing runs holds
        assert torch.equal(image, vision.io.decode_image(as_tensor(data), mode=vision.io.ImageReadMode.RGB))


def test_a_16_bit_grey_png_is_clipped_at_255_as_pil_does():
    """PIL's I;16 to RGB clips (it does not scale): documented in docs/training.md."""
    values = np.array([[0, 100, 255, 256, 1000, 65535]], dtype=np.uint16)
    image = decode(as_tensor(saved(Image.fromarray(values), "PNG")), "in memory")
    assert image[0, 0].tolist() == [0, 100, 255, 255, 255, 255]


def odd_jpeg_frames() -> list[bytes]:
    """A CMYK JPEG and a 12-bit one (its frame header says so): no JPEG for nvJPEG."""
    rgb = bytearray(saved(Image.fromarray(pixels(3)), "JPEG"))
    rgb[rgb.index(b"\xff\xc0") + 4] = 12
    return [saved(Image.fromarray(pixels(4), "CMYK"), "JPEG"), bytes(rgb)]


def test_gpu_decoding_takes_only_the_plain_jpegs_the_others_go_to_the_cpu_path(kinds):
    """--decode gpu: the JPEGs nvJPEG decodes as the CPU path does are decoded together on the device; CMYK (and
    12-bit) JPEGs, PNGs and the rest one by one on the CPU. Run here with device=cpu: the routing and the pixels."""
    batch = [as_tensor(kinds[name].read_bytes()) for name in ("rgb.jpg", "cmyk.jpg", "grey.jpg", "rgb16.png",
                                                               "palette.png", "rgb.png")]
    cmyk, twelve = odd_jpeg_frames()
    assert device_jpegs(batch) == [0, 2]
    assert device_jpegs([as_tensor(twelve), as_tensor(b""), *batch[:1]]) == [2]
    names = [f"file {i}" for i in range(len(batch))]
    images = decode_batch(batch, names, list(range(len(batch))), lambda image: image, torch.device("cpu"))
    assert images.dtype == torch.uint8 and images.shape == (len(batch), 3, H, W)
    for image, data in zip(images, batch, strict=True):
        assert torch.equal(image, pil_rgb(bytes(data.numpy())))


def test_the_evaluations_set_decodes_every_kind_as_pil_converts_it(kinds, tmp_path):
    """make evaluate (and the trainer's evaluations) read the validation split through build_datasets(train=False):
    each image is the evaluation's resize and crop of PIL's convert("RGB")."""
    for split in ("train", "val"):
        for i, path in enumerate(kinds.values()):
            folder = tmp_path / split / f"class{i % 2}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / path.name).write_bytes(path.read_bytes())
    for where in ("cpu", "gpu"):
        cfg = parse_config(["--dataset", "imagefolder", "--data-dir", str(tmp_path), "--image-size", "16",
                            "--decode", where, "--num-workers", "0"])
        _, val_set, classes = build_datasets(cfg, train=False)
        steps = image_transforms(cfg.data, cfg.augmentation, False)
        source = val_set.source if where == "gpu" else val_set
        assert classes == 2 and len(source.samples) == len(KINDS)
        for index, (path, _) in enumerate(source.samples):
            expected = steps(pil_rgb(Path(path).read_bytes()))
            if where == "cpu":
                assert torch.equal(val_set[index][0], expected), path
            else:
                data, _, seed, _ = val_set[index]
                assert torch.equal(decode_batch([data], [path], [seed], steps, torch.device("cpu"))[0], expected)


def photo_cut_short() -> bytes:
    return saved(Image.fromarray(pixels(3)), "JPEG")[:200]  # the header survives, the picture does not


# (id, the file's bytes, what the line says of it)
UNREADABLE = [
    ("empty", lambda: b"", "an empty file, 0 bytes"),
    ("cut-short-jpeg", photo_cut_short, ""),
    ("not-an-image", lambda: b"<html>a page saved as a .jpg</html>", "not an image torchvision.io or PIL can read"),
    ("12-bit-jpeg", lambda: odd_jpeg_frames()[1], "not an image torchvision.io or PIL can read"),
    ("png-cut-in-its-header", lambda: saved(Image.fromarray(pixels(3)), "PNG")[:20], ""),
]


@pytest.mark.parametrize("make, says", [u[1:] for u in UNREADABLE], ids=[u[0] for u in UNREADABLE])
def test_a_file_that_yields_no_image_is_one_line_naming_it_in_every_path(tmp_path, make, says):
    path = tmp_path / "broken.jpg"
    path.write_bytes(make())
    ending = "): delete or replace the file, then run the same command to resume"
    with pytest.raises(DataError) as workers:
        load_image(str(path))
    with pytest.raises(DataError) as on_device:
        good = as_tensor(saved(Image.fromarray(pixels(3)), "JPEG"))
        decode_batch([good, read_bytes(str(path)), good], ["a", str(path), "b"], [0, 1, 2], lambda image: image,
                     torch.device("cpu"))
    for error in (workers.value, on_device.value):
        line = str(error)
        assert "\n" not in line and line.startswith(f"cannot read image {path} (") and line.endswith(ending), line
        assert says in line
