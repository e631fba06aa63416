"""Image files to uint8 RGB tensors (3 x H x W): their bytes read, then decoded by torchvision.io (libjpeg-turbo,
libpng) when they are a plain 8-bit RGB or grey JPEG or PNG, and by PIL, as `Image.open(f).convert("RGB")` makes
them, when they are anything else (16-bit, alpha, palette, 1-bit, CMYK, WebP, BMP, TIFF, ...); in the loader
workers (--decode cpu), or, with --decode gpu, read by the workers and decoded in the training process, the plain
JPEGs on its GPU with nvJPEG, batch by batch (FileBytes, DeviceDecoder). A file that yields no such image (empty,
cut short, not an image, a format neither reads) stops the run with one line that names it (DataError).
"""

from __future__ import annotations

import io

import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset

from train.base import vision
from train.base.errors import DataError

PNG_START = b"\x89PNG\r\n\x1a\n"
JPEG_START = (0xFF, 0xD8)
# The markers that start a JPEG frame (SOF0-15 but DHT, JPG and DAC): precision and components follow
JPEG_FRAMES = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def as_tensor(data: bytes) -> torch.Tensor:
    """Bytes as a uint8 tensor (torch.frombuffer refuses an empty buffer: an empty file is an empty tensor)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def read_bytes(path: str) -> torch.Tensor:
    """A file's bytes as a uint8 tensor, failing with one line that names the file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DataError(f"cannot read image {path} ({e}): check the file's permissions and storage, then run the "
                        f"same command to resume") from None
    return as_tensor(data)


def _jpeg_frame(head: memoryview) -> tuple[int, int] | None:
    """A JPEG's (bits per sample, components) from its frame header, found by walking the markers before it (a few
    reads, whatever the EXIF block's size); None where the header is damaged."""
    i = 2
    while i + 4 <= len(head):
        if head[i] != 0xFF:
            return None
        marker = head[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
        elif marker in JPEG_FRAMES:
            return (head[i + 4], head[i + 9]) if i + 10 <= len(head) else None
        elif marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
        elif marker in (0xD9, 0xDA):  # the end, or the scan, before any frame header
            return None
        else:
            i += 2 + (head[i + 2] << 8 | head[i + 3])
    return None


def plain_kind(data: torch.Tensor) -> str | None:
    """"jpeg" or "png" for a file torchvision.io decodes exactly as PIL's convert("RGB") does: an 8-bit JPEG of 1 or
    3 components (grey, YCbCr or RGB), an 8-bit PNG of grey or RGB; None for anything else (PIL's), from the
    header alone."""
    head = memoryview(data.numpy())
    if len(head) >= 26 and bytes(head[:8]) == PNG_START and bytes(head[12:16]) == b"IHDR":
        return "png" if head[24] == 8 and head[25] in (0, 2) else None  # bit depth, colour type: grey, RGB
    if len(head) > 2 and (head[0], head[1]) == JPEG_START:
        return "jpeg" if _jpeg_frame(head) in ((8, 1), (8, 3)) else None
    return None


def decode(data: torch.Tensor, path: str) -> torch.Tensor:
    """Encoded bytes to a uint8 RGB tensor (3 x H x W): torchvision.io for a plain 8-bit RGB or grey JPEG or PNG,
    PIL's Image.open(f).convert("RGB") for every other kind; a file that yields no image stops the run with one
    line that names it."""
    if len(data) == 0:
        reason = "an empty file, 0 bytes"
    else:
        if plain_kind(data):
            try:
                return vision.io.decode_image(data, mode=vision.io.ImageReadMode.RGB)
            except RuntimeError:
                pass  # damaged: PIL says what is wrong with it (or reads what libjpeg-turbo refused)
        try:
            with Image.open(io.BytesIO(data.numpy().tobytes())) as image:
                return vision.v2.functional.pil_to_tensor(image.convert("RGB"))
        except UnidentifiedImageError:
            reason = "not an image torchvision.io or PIL can read"
        except MemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - PIL's plugins raise many kinds for a damaged or unsupported file
            reason = str(e) or type(e).__name__
    raise DataError(f"cannot read image {path} ({reason}): delete or replace the file, then run the same command "
                    f"to resume")


def load_image(path: str) -> torch.Tensor:
    """ImageFolder's loader for --decode cpu: the file decoded in the loader worker."""
    return decode(read_bytes(path), path)


def device_jpegs(data: list[torch.Tensor]) -> list[int]:
    """Which files of a batch --decode gpu decodes together on the device: the plain JPEGs (plain_kind), which
    nvJPEG decodes as libjpeg-turbo does; CMYK, 12-bit and damaged headers go to the CPU path with the rest."""
    return [i for i, d in enumerate(data) if plain_kind(d) == "jpeg"]


_DECODE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def device_decode(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Plain JPEGs decoded together on the device. On CUDA on a stream of their own: torchvision's decode_jpeg
    takes its output from the caching allocator on the current stream but nvJPEG writes it without waiting for that
    stream, so on the training stream it could be handed a block that the step's queued kernels still read, and
    overwrite their inputs (pytorch/vision#9606; make bench's --decode gpu arm diverged so on an H200). The decode
    stream's blocks are only its own outputs, which record the training stream, so the allocator hands one back
    only once every kernel that read it has run."""
    if device.type != "cuda":
        return vision.io.decode_jpeg(data, mode=vision.io.ImageReadMode.RGB, device=device)
    if device not in _DECODE_STREAMS:
        _DECODE_STREAMS[device] = torch.cuda.Stream(device)
    stream = _DECODE_STREAMS[device]
    with torch.cuda.stream(stream):
        decoded = vision.io.decode_jpeg(data, mode=vision.io.ImageReadMode.RGB, device=device)
    stream.synchronize()  # decoded, before the training stream reads it (and nothing left queued on the stream)
    training = torch.cuda.current_stream(device)
    for image in decoded:
        image.record_stream(training)
    return decoded


def decode_batch(data: list[torch.Tensor], paths: list[str], seeds: list[int], transform,
                 device: torch.device) -> torch.Tensor:
    """--decode gpu, in the training process: a batch of encoded files to augmented uint8 images on the
    device. Plain JPEGs (device_jpegs) are decoded together on the device (nvJPEG on CUDA), other files on the
    CPU (decode); each
    sample is then augmented on the device under its own seed, so a batch equals what the loader workers
    would have made of it, whatever the worker count or the resume point."""

    images: list[torch.Tensor | None] = [None] * len(data)
    jpegs = device_jpegs(data)
    if jpegs:
        try:
            decoded = device_decode([data[i] for i in jpegs], device)
        except RuntimeError:  # one damaged file fails the batch: find it, and name it
            decoded = [decode(data[i], paths[i]).to(device) for i in jpegs]
        for i, image in zip(jpegs, decoded, strict=True):
            images[i] = image
    for i, image in enumerate(images):
        if image is None:
            images[i] = decode(data[i], paths[i]).to(device, non_blocking=True)
    out = []
    for image, seed in zip(images, seeds, strict=True):
        with torch.random.fork_rng(devices=[]):  # the draws come from the CPU generator, as in a worker
            torch.default_generator.manual_seed(seed)  # it alone: the GPU's generator is the trainer's
            out.append(transform(image))
    return torch.stack(out)


class FileBytes(Dataset):
    """--decode gpu: items are (bytes, label, seed, index); decoding and the transform wait for the training
    process (DeviceDecoder). source yields (bytes, label); name(index) says which file a sample is."""

    seeded = True  # asked for as (index, seed): the seed goes with the bytes to the transform on the device

    def __init__(self, source, transform, name):
        self.source, self.transform, self.name = source, transform, name

    def __len__(self) -> int:
        return len(self.source)

    @staticmethod
    def collate(batch):
        """Its DataLoader's collate: the files' bytes as a list, the labels as a tensor."""
        return collate_files(batch)

    def loader_on(self, loader: DataLoader, device: torch.device) -> DeviceDecoder:
        """Its loader, decoding and transforming each batch on the training device (train/loading/loaders.py)."""
        return DeviceDecoder(loader, self, device)

    def __getitem__(self, item):
        index, seed = item if isinstance(item, tuple) else (item, 0)
        data, label = self.source[index]
        return data, label, seed, index


class Decoded(Dataset):
    """--decode cpu over a source of (bytes, label), such as a pack's split: decoded and transformed here."""

    def __init__(self, source, transform, name):
        self.source, self.transform, self.name = source, transform, name

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int):
        data, label = self.source[index]
        return self.transform(decode(data, self.name(index))), label


def collate_files(batch):
    data, labels, seeds, indices = zip(*batch, strict=True)
    return list(data), torch.tensor(labels), list(seeds), list(indices)


class DeviceDecoder:
    """A loader of FileBytes batches that yields (images on the device, labels), as the CPU path's loader
    yields (images, labels): the trainer's prepare_inputs then normalises them where they already are."""

    def __init__(self, loader: DataLoader, files: FileBytes, device: torch.device):
        self.loader, self.files, self.device = loader, files, device

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for data, labels, seeds, indices in self.loader:
            names = [self.files.name(i) for i in indices]
            yield decode_batch(data, names, seeds, self.files.transform, self.device), labels
