"""Sharded checkpoints (--checkpoint-format sharded, --parallel fsdp): one folder per step, written by every worker
together with torch.distributed.checkpoint (DCP), for a state that is not to be gathered on one rank.

  RUN_DIR/checkpoints/step_00001500.dcp/__R_I.distcp  the workers' shards of the model and the optimizer (DCP's files)
                                       .metadata     DCP's index of them: a tensor's whole shape, where each piece lies
                                       state.pt      rank 0's: the position, every rank's RNG, the layout, the schedule,
                                                     the config (a full checkpoint's other keys)
                                       CHECKSUMS     every file's CRC32 and size, written last

A folder is written as .step_00001500.dcp.tmp and renamed into place once every worker's files are in it and
checksummed (each worker checksums its share of them), so a save killed halfway never counts; a shard cut short or
damaged is named when the folder is verified. DCP reshards as it loads: a folder saved at N workers resumes at any M.
`read_model` gives the model's tensors alone, whole, in one process (make evaluate, make export): no optimizer.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path

import torch

from train.files.rundir import atomic_write, file_crc32, fsync_dir

SUFFIX = ".dcp"
STATE = "state.pt"
CHECKSUMS = "CHECKSUMS"
_TEMP = re.compile(r"\.step_\d{8}\.dcp\.tmp$")


def temp_of(folder: Path) -> Path:
    """Where `folder` is written before it is renamed into place."""
    return folder.with_name(f".{folder.name}.tmp")


def is_temp(path: Path) -> bool:
    return bool(_TEMP.fullmatch(path.name))


def checksum_share(folder: Path, names: list[str], rank: int, world: int) -> list[tuple[str, str, int]]:
    """This rank's share of the files DCP wrote into `folder` (`names`, the same list on every rank: every world-th),
    each read back: its name, CRC32 and size. Called by every rank after the save, so the reading is spread over
    them."""
    return [(name, file_crc32(folder / name), (folder / name).stat().st_size) for name in names[rank::world]]


def finish(temp: Path, rest: bytes, sums: list[list[tuple[str, str, int]]]) -> Path:
    """Rank 0, once every rank's shards are in `temp`: the rest of the state (state.pt), the checksums of every
    file (the ranks' `sums`, state.pt's), fsynced, and the folder renamed into place (the checkpoints folder fsynced
    too). Returns the folder's final path."""
    atomic_write(temp / STATE, rest)
    lines = [*(entry for share in sums for entry in share), (STATE, file_crc32(temp / STATE), len(rest))]
    atomic_write(temp / CHECKSUMS, "".join(f"crc32:{crc} size:{size}  {name}\n"
                                           for name, crc, size in sorted(lines)).encode())
    final = temp.with_name(temp.name[1:-len(".tmp")])
    if final.exists():  # a folder of this step that did not verify (a resume skipped it)
        shutil.rmtree(final)
    os.rename(temp, final)
    fsync_dir(final.parent)
    return final


def verify(folder: Path) -> str | None:
    """None if every file CHECKSUMS names is in `folder` with its size and CRC32, else why not (the file named)."""
    sums = folder / CHECKSUMS
    if not sums.is_file():
        return f"no {CHECKSUMS} in it (the save did not finish)"
    listed = set()
    for line in sums.read_text().splitlines():
        fields = line.split()
        values = dict(field.split(":", 1) for field in fields[:2] if ":" in field)
        name = fields[-1] if len(fields) == 3 else ""
        listed.add(name)
        path = folder / name
        if not name or "crc32" not in values or "size" not in values:
            return f"{CHECKSUMS} is damaged (line {line!r})"
        if not path.is_file():
            return f"{name} is missing"
        if str(path.stat().st_size) != values["size"]:
            return f"{name} is {path.stat().st_size} bytes but {values['size']} were saved (file truncated)"
        if file_crc32(path) != values["crc32"]:
            return f"{name}: checksum mismatch (file corrupted)"
    missing = {STATE, ".metadata"} - listed
    return f"{CHECKSUMS} does not list {', '.join(sorted(missing))}" if missing else None


def size_of(folder: Path) -> int:
    """The bytes of a sharded checkpoint on disk (all its files)."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def read_state(folder: Path, device: torch.device) -> dict:
    """state.pt: the checkpoint's keys but the model and the optimizer (weights_only: data, never code)."""
    return torch.load(folder / STATE, map_location=device, weights_only=True)


def read_model(folder: Path) -> dict:
    """The model's tensors alone, whole, in this process (no process group): their shapes and types from DCP's index,
    read from every worker's shards. No optimizer state is read."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    index = FileSystemReader(folder).read_metadata()
    model = {}
    for key, meta in index.state_dict_metadata.items():
        path = index.planner_data[key]  # the key's place in the saved dict: ("model", "blocks.0.attn.qkv.weight")
        if path[0] == "model" and isinstance(meta, TensorStorageMetadata):
            model[path[1]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    state = {"model": model}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process": it is
        load(state, checkpoint_id=folder, no_dist=True)
    return state["model"]
