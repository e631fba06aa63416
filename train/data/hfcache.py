"""A Parquet split of a Hugging Face dataset as Arrow files, made once: Parquet compresses its pages, so one row cannot
be read without its row group (about 100 images), and the sampler asks for rows in random order. `datasets` does the
same (load_dataset writes Arrow files it then memory-maps); here only the image column is kept, one Arrow file per
Parquet file, written a row group at a time (its memory: one row group).

  DIR/.trainbox-index/hf-SPLIT.json           the format, the column, each Parquet file's name, size and modification
                                              time, and its Arrow file: written last, it makes them valid
  DIR/.trainbox-index/hf-SPLIT-00000.arrow    the image column of the first Parquet file, ... (an Arrow IPC stream)

Beside the files (as the tars' index, train/data/tarindex.py), else where DIR cannot be written in the run folder
(RUN_DIR/data-index/), else in a temporary folder removed when the process ends. Used again while every Parquet file
keeps its size and modification time. The ranks of a run read rank 0's.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

from train.base.errors import ConfigError
from train.base.progress import Progress
from train.cluster.distributed import broadcast_from_main
from train.cluster.identity import is_main
from train.data.hfdisk import SplitFiles, arrow, arrow_error
from train.data.tarindex import cache_dirs, file_stats
from train.files.rundir import atomic_write, to_json

FORMAT = 1
_temporary: list[Path] = []  # this process's own cache folder, where no other place could be written


def _record(split: SplitFiles, column: str, stats: list[dict]) -> dict:
    return {"format": FORMAT, "column": column,
            "files": [{**stat, "arrow": f"hf-{split.name}-{i:05d}.arrow"} for i, stat in enumerate(stats)]}


def _cached(folder: Path, split: SplitFiles, record: dict) -> list[Path] | None:
    try:
        if json.loads((folder / f"hf-{split.name}.json").read_text()) != record:
            return None
    except (OSError, ValueError):
        return None
    files = [folder / f["arrow"] for f in record["files"]]
    return files if all(f.is_file() for f in files) else None


def _convert(root: Path, split: SplitFiles, column: str, folder: Path, record: dict, quiet: bool, stream) -> list[Path]:
    """Each Parquet file's column into its Arrow file (under a temporary name first), then the record."""
    pa = arrow()
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    label = f"converting the Parquet files of the {split.name} split of {root} to Arrow (once)"
    with Progress(label, total=len(split.files), unit="files", stream=stream, quiet=quiet) as progress:
        for path, entry in zip(split.files, record["files"], strict=True):
            final = folder / entry["arrow"]
            tmp = folder / f".{entry['arrow']}.tmp.{os.getpid()}"
            try:
                parquet = pa.parquet.ParquetFile(path)
                schema = parquet.schema_arrow
                with pa.OSFile(str(tmp), "wb") as sink, \
                        pa.ipc.new_stream(sink, pa.schema([schema.field(column)])) as writer:
                    for group in range(parquet.num_row_groups):
                        writer.write_table(parquet.read_row_group(group, columns=[column]))
                os.replace(tmp, final)
            except (KeyError, pa.ArrowException) as e:
                tmp.unlink(missing_ok=True)
                raise ConfigError(f"cannot read the column {column!r} of {path} ({arrow_error(e)}): a damaged "
                                  f"or incomplete Parquet file, or one without that column: copy it again, or give "
                                  f"every file of the split the same columns") from None
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            files.append(final)
            progress.advance()
    atomic_write(folder / f"hf-{split.name}.json", to_json(record, indent=1).encode())
    return files


def _temporary_folder() -> Path:
    if not _temporary:
        _temporary.append(Path(tempfile.mkdtemp(prefix="trainbox-hf-")))
        atexit.register(shutil.rmtree, _temporary[0], True)
    return _temporary[0]


def arrow_files(root: Path, split: SplitFiles, column: str, run_dir: Path | None = None, quiet: bool = False,
                stream=None) -> list[Path]:
    """The split's image column as Arrow files, one per Parquet file, in order: from a cache that matches them,
    else converted (beside them, else in the run folder, else in a temporary folder)."""
    record = _record(split, column, file_stats(root, split.files))
    folders = cache_dirs(root, run_dir)
    for folder in folders:
        if (found := _cached(folder, split, record)) is not None:
            return found
    for folder in [*folders, None]:
        try:
            return _convert(root, split, column, folder or _temporary_folder(), record, quiet, stream)
        except OSError:
            if folder is None:
                raise
            continue  # a read-only NAS folder: the next place


def shared_arrow_files(root: Path, split: SplitFiles, column: str, run_dir: Path | None) -> list[Path]:
    """arrow_files on every rank of a run: rank 0 first (it converts, if anyone must), then the others read its
    files, or, where they cannot see them (its temporary folder, on another node), convert their own."""
    error, files = None, None
    if is_main():
        try:
            files = [str(f) for f in arrow_files(root, split, column, run_dir)]
        except (ConfigError, OSError) as e:
            error = str(e) if isinstance(e, ConfigError) else f"cannot convert {root}'s Parquet files ({e}): check " \
                                                              f"the storage and the room on it"
    error, files = broadcast_from_main((error, files))
    if error:
        raise ConfigError(error)
    if files and all(Path(f).is_file() for f in files):
        return [Path(f) for f in files]
    return arrow_files(root, split, column, run_dir, quiet=True)
