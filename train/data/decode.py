"""Image files to uint8 tensors: their bytes read, decoded by torchvision.io (libjpeg-turbo, libpng, libwebp) or
PIL for what it cannot read, in the loader workers (--decode cpu); or, with --decode gpu, read by the workers
and decoded in the training process on its GPU with nvJPEG, batch by batch (FileBytes, DeviceDecoder).
"""

from __future__ import annotations

import io

import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset

from train import vision
from train.errors import DataError


def read_bytes(path: str) -> torch.Tensor:
    """A file's bytes as a uint8 tensor, failing with one line that names the file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DataError(f"cannot read image {path} ({e}): check the file's permissions and storage, then run the "
                        f"same command to resume") from None
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode(data: torch.Tensor, path: str) -> torch.Tensor:
    """Encoded bytes to a uint8 RGB tensor (3 x H x W): torchvision.io (libjpeg-turbo, libpng, libwebp), PIL
    for what it cannot decode; a file neither reads stops the run with one line that names it."""

    try:
        return vision.io.decode_image(data, mode=vision.io.ImageReadMode.RGB)
    except RuntimeError:
        pass  # a format torchvision.io does not decode (or a damaged file): PIL has the last word
    try:
        with Image.open(io.BytesIO(data.numpy().tobytes())) as image:
            return vision.v2.functional.pil_to_tensor(image.convert("RGB"))
    except UnidentifiedImageError:
        reason = "not an image torchvision.io or PIL can read"
    except (OSError, SyntaxError, ValueError) as e:  # PIL raises all three for damaged files
        reason = str(e)
    raise DataError(f"cannot read image {path} ({reason}): delete or replace the file, then run the same command "
                    f"to resume")


def load_image(path: str) -> torch.Tensor:
    """ImageFolder's loader for --decode cpu: the file decoded in the loader worker."""
    return decode(read_bytes(path), path)


JPEG_START = (0xFF, 0xD8)


def decode_batch(data: list[torch.Tensor], paths: list[str], seeds: list[int], transform,
                 device: torch.device) -> torch.Tensor:
    """--decode gpu, in the training process: a batch of encoded files to augmented uint8 images on the
    device. JPEGs are decoded together on the device (nvJPEG on CUDA), other formats on the CPU; each
    sample is then augmented on the device under its own seed, so a batch equals what the loader workers
    would have made of it, whatever the worker count or the resume point."""

    images: list[torch.Tensor | None] = [None] * len(data)
    jpegs = [i for i, d in enumerate(data) if len(d) > 2 and tuple(d[:2].tolist()) == JPEG_START]
    if jpegs:
        try:
            decoded = vision.io.decode_jpeg([data[i] for i in jpegs], mode=vision.io.ImageReadMode.RGB, device=device)
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
            torch.manual_seed(seed)
            out.append(transform(image))
    return torch.stack(out)


class FileBytes(Dataset):
    """--decode gpu: items are (bytes, label, seed, index); decoding and the transform wait for the training
    process (DeviceDecoder). source yields (bytes, label); name(index) says which file a sample is."""

    def __init__(self, source, transform, name):
        self.source, self.transform, self.name = source, transform, name

    def __len__(self) -> int:
        return len(self.source)

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
