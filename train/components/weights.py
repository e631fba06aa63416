"""Starting from trained weights (--weights); freezing parts of a model (--freeze) is train/components/models.py's.

  --weights ResNet50_Weights.IMAGENET1K_V2   torchvision's named weights (DEFAULT: the model's default), fetched
                                             once per node into TORCH_HOME (put it on the NAS), checked against
                                             the SHA-256 prefix in the file's name
  --weights runs/a/model.pt                  a trainbox model.pt, best.pt or checkpoint, or a plain state_dict

The head (the task says which tensors: a classifier's last linear layer with as many outputs as classes, a segmentation
model's convolutions to its classes) is initialised anew when the weights have another class count; every other tensor
must fit exactly (fitted; the task's start_from).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import urllib.request
from pathlib import Path

import torch
from torch import nn

from train.base.errors import ConfigError
from train.base.progress import Progress
from train.base.vision import named_weights
from train.cluster.distributed import gather
from train.cluster.identity import identity
from train.config.settings import Model
from train.data.transforms import MEAN, STD
from train.files import shards
from train.files.downloads import private_name, publish
from train.files.rundir import file_digest

log = logging.getLogger("train")
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


# ---------------------------------------------------------------- --weights

def resolve(spec: Model):
    """The torchvision weights enum entry that --weights names, or None for a file."""
    return named_weights(spec.model, spec.weights)


def normalisation(normalize: str, spec: Model) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The input's mean and std (--normalize): auto takes the named --weights' own (their transforms(): ImageNet's
    for most, 0.5 for EfficientNet-V2-L, ...), else trainbox's (0.5, 0.25); imagenet forces ImageNet's."""
    if normalize == "imagenet":
        return IMAGENET
    entry = resolve(spec) if normalize == "auto" else None
    if entry is not None:
        preset = entry.transforms()
        return tuple(preset.mean), tuple(preset.std)
    return (MEAN,) * 3, (STD,) * 3


def cached_file(entry) -> Path:
    """Where the named weights' file lies: TORCH_HOME/hub/checkpoints/<its name>, as torch.hub keeps it."""
    return Path(torch.hub.get_dir()) / "checkpoints" / Path(entry.url).name


def fetch(entry) -> Path:
    """The named weights' file, on this node: local rank 0 fetches it once, its progress shown (or checks the
    cached copy against the SHA-256 prefix in its name); every rank learns whether that worked, and none waits
    without bound."""
    path = cached_file(entry)
    prefix = re.search(r"-([a-f0-9]+)\.", path.name)
    error = None
    if identity().local_rank == 0:
        try:
            placed = False
            if not path.is_file():
                path.parent.mkdir(parents=True, exist_ok=True)
                placed = download(entry.url, path, prefix.group(1) if prefix else None)
            if not placed and prefix and not file_digest(path).startswith(prefix.group(1)):
                error = (f"{path} is damaged (its SHA-256 does not start with {prefix.group(1)}), refused: delete it "
                         f"and run again, or place the file from {entry.url} there")
        except DamagedDownload as e:
            error = (f"fetched {path.name} from {entry.url}, but {e} (a proxy or a cut connection?), refused: run "
                     f"again, or place the file from there at {path}")
        except (OSError, RuntimeError) as e:
            error = (f"cannot fetch {path.name} ({str(e).splitlines()[0][:120]}): offline? place the file from "
                     f"{entry.url} at {path} (TORCH_HOME on the NAS shares it with every node)")
    failed = [e for e in gather(error) if e]  # the other ranks wait here for local rank 0, bounded
    if failed:
        raise ConfigError(failed[0])
    return path


class DamagedDownload(ValueError):
    """A download whose bytes are not the file its name promises."""


def download(url: str, path: Path, sha256_prefix: str | None) -> bool:
    """url to path, its progress shown (train/base/progress.py), checked against the SHA-256 prefix before it takes
    the file's name: a cut or damaged download leaves nothing behind. Safe when several nodes fetch into one
    shared TORCH_HOME at once: each writes a file of its own (a name no other process, on any node, holds),
    and the first checked copy takes the name; a later one is discarded. Whether this copy took it (False:
    another process's had, and the caller checks that one)."""
    partial = private_name(path)
    digest = hashlib.sha256()
    request = urllib.request.Request(url, headers={"User-Agent": "torch.hub"})  # what torch.hub sends
    try:
        # O_EXCL: no other process can hold this name, even on another node of an NFS share (v3 and later)
        with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f, \
                urllib.request.urlopen(request, timeout=60) as response:
            progress = Progress(f"fetching {path.name}", total=int(response.headers.get("Content-Length") or 0) / 1e6,
                                unit="MB", last=None).start()
            try:
                while chunk := response.read(1 << 20):
                    f.write(chunk)
                    digest.update(chunk)
                    progress.update(len(chunk) / 1e6)
            finally:
                progress.close()
            f.flush()
            os.fsync(f.fileno())  # whole on the disk (or the NAS) before any process can open it by its name
        if sha256_prefix and not digest.hexdigest().startswith(sha256_prefix):
            raise DamagedDownload(f"its SHA-256 does not start with {sha256_prefix}")
        return publish(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def read_weights(spec: Model, fetched: bool = True) -> tuple[dict, dict]:
    """(state_dict, what the manifest records) of --weights: named weights fetched once per node, a file read
    memory-mapped (fetched=False: the checks before any worker starts, which skip the SHA-256)."""
    entry = resolve(spec)
    path = fetch(entry) if entry is not None else Path(spec.weights)
    if path.is_dir() and path.suffix == shards.SUFFIX:  # a sharded checkpoint: its model, read whole; its CHECKSUMS
        problem = shards.verify(path)  # (every file's CRC32) is what the manifest's digest pins
        if problem is not None:
            raise ConfigError(f"--weights {path} cannot be read ({problem}): give another checkpoint or model.pt")
        return shards.read_model(path), {"weights": spec.weights, "weights_file": str(path),
                                         "weights_sha256": file_digest(path / shards.CHECKSUMS) if fetched else None}
    if not path.is_file():
        raise ConfigError(f"--weights {spec.weights}: no such file: give a model.pt, checkpoint or state_dict file, or "
                          f"torchvision weights such as ResNet50_Weights.DEFAULT")
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:  # a file in torch.save's legacy format cannot be memory-mapped
            if "mmap" not in str(e):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same answer
        raise ConfigError(f"--weights {path} cannot be read as weights ({type(e).__name__}): give a model.pt, "
                          f"checkpoint or state_dict file saved by torch.save") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):  # a trainbox checkpoint or best.pt
        state = state["model"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"--weights {path} holds no state_dict of tensors: give a model.pt, checkpoint or "
                          f"state_dict file")
    return state, {"weights": spec.weights, "weights_file": str(path), "weights_sha256": file_digest(path) if fetched
                   else None}


def fitted(spec: Model, state: dict, model: nn.Module, head: list[str], sized: bool = True,
           network: str | None = None) -> dict:
    """state, fitted to model: the head's tensors (`head`: keys of the model's state_dict, those whose size is the
    data's class count) left to the model, initialised anew, where their shapes differ, or always when the data is not
    read yet (sized False: the checks before any worker, on a head of a stand-in size); any other difference is one
    line naming the first key (network: what the line calls the model; default --model's)."""
    own = model.state_dict()
    keys = [k for k in head if k in own]
    if keys and keys[0] in state and (not sized or any(state[k].shape != own[k].shape for k in keys if k in state)):
        if sized:
            log.info("head %s: %d -> %d classes, initialised anew", ", ".join(dict.fromkeys(k.rsplit(".", 1)[0]
                                                                                            for k in keys)),
                     state[keys[0]].shape[0], own[keys[0]].shape[0])
        state = {**{k: v for k, v in state.items() if k not in keys}, **{k: own[k] for k in keys}}
    mismatch = next((k for k in own if k not in state or state[k].shape != own[k].shape), None) or \
        next((k for k in state if k not in own), None)
    if mismatch is not None:
        theirs = tuple(state[mismatch].shape) if mismatch in state else "missing"
        ours = tuple(own[mismatch].shape) if mismatch in own else "missing"
        raise ConfigError(f"--weights {spec.weights} do not fit {network or f'--model {spec.model}'}: {mismatch} is "
                          f"{theirs} in the weights and {ours} in the model: give weights of this architecture")
    return state
