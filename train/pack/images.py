"""make pack's image work (train/pack/command.py): each image as its shard holds it, its own bytes or, over --max-side,
decoded as training decodes it, resized as torchvision's Resize does and re-encoded as a JPEG; prepared by worker
processes and handed back in the source's order, so the shards are the same bytes whatever their number."""

from __future__ import annotations

import io
import multiprocessing
import signal
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from PIL import Image

from train.base import vision
from train.base.errors import DataError
from train.data.decode import as_tensor, decode
from train.data.sources import name_of, read_reference, suffix_of

QUALITY = 90  # the JPEG quality of a resized image unless --quality says otherwise
CHUNK = 8  # images per task handed to a worker: few round trips for small files, little memory for big ones


def shrink(image: torch.Tensor, max_side: int) -> torch.Tensor:
    """A uint8 image (C x H x W) with its longer side brought down to max_side: torchvision's
    Resize(size=None, max_size=max_side), bilinear and antialiased."""
    return vision.v2.functional.resize(image, size=None, max_size=max_side, antialias=True)


def _longer_side(data: bytes, path: str) -> int:
    """From the image's header (PIL reads no pixels for it); decoded where PIL cannot read the header."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return max(image.size)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return max(decode(as_tensor(data), path).shape[1:])


def prepared(reference, max_side: int | None, quality: int | None) -> tuple[bytes, str, bool]:
    """The image as its shard holds it: (bytes, member suffix, whether it was resized). Without max_side, or
    with its longer side at most max_side, the file's (or tar member's) own bytes; else decoded as training decodes
    it, shrunk and encoded as a JPEG. reference: a file's path, or a tar member (train/data/sources.py)."""
    reference = str(reference) if isinstance(reference, Path) else reference
    data, name = read_reference(reference, "run the same command to continue the pack"), name_of(reference)
    if not data:  # a shard would hold an empty sample, which no decoder reads
        raise DataError(f"cannot read image {name} (an empty file, 0 bytes): replace the file, then run the same "
                        f"command to continue the pack")
    if max_side is None or _longer_side(data, name) <= max_side:
        return data, suffix_of(reference, data), False
    image = shrink(decode(as_tensor(data), name), max_side)
    return bytes(vision.io.encode_jpeg(image, quality=quality).numpy()), ".jpg", True


def prepare_chunk(references: list, max_side: int | None, quality: int | None) -> list[tuple[bytes, str, bool]]:
    return [prepared(reference, max_side, quality) for reference in references]


def _worker_start() -> None:
    torch.set_num_threads(1)  # one core per worker: WORKERS=N uses N cores
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the pack in its main process alone


class Workers:
    """`count` processes that prepare the images (read, and resize with max_side), handed back in order;
    with count 1, this process at one thread. A few chunks per worker are in flight, not the whole split."""

    def __init__(self, count: int, max_side: int | None, quality: int | None):
        self.count, self.max_side, self.quality = count, max_side, quality
        self.pool: ProcessPoolExecutor | None = None
        self.threads = torch.get_num_threads()

    def __enter__(self) -> Workers:
        if self.count > 1:
            if self.max_side:
                vision.preload("io", "v2")
            # Forked (a fast start): every worker is started by the first submit, before any thread runs here.
            self.pool = ProcessPoolExecutor(self.count, mp_context=multiprocessing.get_context("fork"),
                                            initializer=_worker_start)
            self.pool.submit(int).result()
        else:
            torch.set_num_threads(1)
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
        torch.set_num_threads(self.threads)

    def prepared(self, references: list) -> Iterator[tuple[bytes, str, bool]]:
        step = max(1, min(CHUNK, len(references) // (4 * self.count)))  # a few chunks per worker, even for a few
        chunks = (references[i:i + step] for i in range(0, len(references), step))
        if self.pool is None:
            for chunk in chunks:
                yield from prepare_chunk(chunk, self.max_side, self.quality)
            return
        pending: deque = deque()
        try:
            for chunk in chunks:
                pending.append(self.pool.submit(prepare_chunk, chunk, self.max_side, self.quality))
                if len(pending) >= 2 * self.count:
                    yield from pending.popleft().result()
            while pending:
                yield from pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
