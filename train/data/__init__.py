"""The image wing: the images the built-in tasks train on, from every source, decoded and transformed, one job per
module (the samplers and loaders every task uses are train/loading/):

  shapes      the built-in datasets, made in memory from the seed (shapes; synthetic for benchmarks)
  folders     file datasets on disk: an ImageFolder, packed shards (read by offset), CIFAR-10, and their checks
  scan        an ImageFolder split's listing: its classes and images, as torchvision's, links followed and checked
  masks       images and their segmentation masks on disk (DATA_DIR/<split>/images, masks/), their check, their
              joint transforms
  labelfiles  label files (train.csv / .tsv / .jsonl: a path and a label per row), classes.txt, their checks
  tars        WebDataset tars of other tools, read by offset as packed shards, their classes and checks
  tarindex    where such tars are, and their index: made once in parallel, cached beside them or in the run folder
  hfdisk      a Hugging Face dataset on disk (save_to_disk's folder, or Parquet files): its splits, columns, labels
  hfcache     a Parquet split's image column as Arrow files, made once (beside it, or in the run folder)
  hfrows      such a dataset read row by row from memory-mapped Arrow files, its checks, make pack's listing of it
  sources     each source as (path, tar member or dataset row, label) pairs in its fixed order: what make pack packs
  decode      file bytes to uint8 RGB tensors (torchvision.io, or PIL as convert("RGB") makes them), in the loader
              workers or on the GPU (--decode gpu)
  transforms  the per-image recipe (torchvision's reference presets), the evaluation's steps, normalisation
  datasets    the image datasets of a classification run, from every source, and what the plan says of them

This face hands on what the rest of trainbox uses.
"""

from train.data.datasets import build_datasets, class_names, source_of
from train.data.decode import DeviceDecoder, load_image
from train.data.folders import ShardSplit, check_cifar, check_imagefolder, packed_with, read_idx, read_index
from train.data.hfrows import check_hf
from train.data.labelfiles import check_labelfiles
from train.data.masks import check_mask_folder, mask_datasets, mask_transforms
from train.data.shapes import SHAPE_CLASSES, ShapeMasks, ShapesDataset, make_shape_masks, make_shapes
from train.data.tars import check_shards
from train.data.transforms import eval_resize, eval_steps, image_transforms, preprocessing, prepare_inputs, train_size

__all__ = ["SHAPE_CLASSES", "DeviceDecoder", "ShapeMasks", "ShapesDataset", "ShardSplit", "build_datasets",
           "check_cifar", "check_hf", "check_imagefolder", "check_labelfiles", "check_mask_folder", "check_shards",
           "class_names", "eval_resize", "eval_steps", "image_transforms", "load_image", "make_shape_masks",
           "make_shapes", "mask_datasets", "mask_transforms", "packed_with", "prepare_inputs", "preprocessing",
           "read_idx", "read_index", "source_of", "train_size"]
