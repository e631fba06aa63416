"""The datasets --dataset names, each with what the rest of the trainer asks of it: which built-in tasks read it,
whether it is made in memory, counted by --train-samples/--val-samples, read as encoded bytes, decodable on the GPU,
cut from tokens held in memory, and which settings it alone reads. The command line's rules, the preflight, the
loaders and the tasks ask this catalogue instead of spelling the names; the modules that build a dataset
(train/data/datasets.py, the tasks) map a name to its maker.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    name: str
    tasks: tuple[str, ...]  # the built-in tasks that read it
    holds: str = "labelled images"  # what its items are, as a refusal names them
    in_memory: bool = False  # made from the seed at --image-size: no files to read, decode or transform
    counted: bool = False  # --train-samples / --val-samples are its size
    encoded: bool = False  # a source of (bytes, label) that the loader workers decode: a pack, tars, label files, hf
    gpu_decode: bool = False  # --decode gpu: the workers read its files' bytes, the trainer decodes them
    sliced: bool = False  # its items are slices of tokens held in memory: no loader worker unless --num-workers asks
    generated: bool = False  # made from the seed: nothing is read from --data-dir
    settings: tuple[str, ...] = ()  # the settings it alone, of the sources, reads

    @property
    def transformed(self) -> bool:
        """Image files that classification's transforms resize and crop (--image-size and the crops apply)."""
        return not self.in_memory and "classification" in self.tasks


SOURCES = {s.name: s for s in (
    Source("shapes", ("classification", "segmentation"), in_memory=True, counted=True, generated=True),
    Source("cifar10", ("classification",), settings=("download",)),
    Source("imagefolder", ("classification",), gpu_decode=True),
    Source("csv", ("classification",), encoded=True, gpu_decode=True, settings=("path_column", "label_column")),
    Source("shards", ("classification",), encoded=True, gpu_decode=True, settings=("label_key",)),
    Source("hf", ("classification",), encoded=True, gpu_decode=True,
           settings=("label_column", "image_column", "train_split", "val_split")),
    Source("masks", ("segmentation",), holds="pixel masks"),
    Source("copy", ("lm",), holds="text", counted=True, generated=True),
    Source("text", ("lm",), holds="text", sliced=True),
    Source("synthetic", ("classification",), in_memory=True, counted=True, generated=True),
)}

# The settings that one source or a few read: (settings, what they name, the fix's other choice), for the refusal of
# one given with a source that does not read it.
OWN_SETTINGS = (
    (("download",), "only CIFAR-10 is downloaded", ""),
    (("path_column",), "it names the columns of label files", ", or pass --dataset csv"),
    (("label_column",), "it names the label column of label files or of a Hugging Face dataset",
     ", or pass --dataset csv or hf"),
    (("image_column", "train_split", "val_split"), "it names a column or a split of a Hugging Face dataset",
     ", or pass --dataset hf"),
    (("label_key",), "it names the label of WebDataset tars", ", or pass --dataset shards"),
)


def source(name: str) -> Source:
    """The catalogue's entry of --dataset NAME (the command line's choices hold only these)."""
    return SOURCES[name]


def read_from_files(task: str) -> list[str]:
    """The --dataset names that built-in TASK reads from --data-dir's files."""
    return [s.name for s in SOURCES.values() if task in s.tasks and not s.generated]


def reads(name: str, settings: tuple[str, ...]) -> bool:
    """Whether --dataset NAME reads any of these settings of OWN_SETTINGS."""
    return any(s in SOURCES[name].settings for s in settings)
