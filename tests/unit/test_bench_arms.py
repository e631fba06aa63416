"""The bench's GPU arms are trainer command lines the trainer accepts: checked here on the CPU, where the GPU rows
never run, so a refusal (a flag that has no effect) is found before a GPU is lent."""

import pytest

from train.bench.__main__ import SIZES
from train.bench.gpu import gpu_base, on_files
from train.cli import parse_config


@pytest.mark.parametrize("decode", ["cpu", "gpu"])
def test_the_jpeg_rows_run_the_gpu_rows_run_on_files_and_the_trainer_accepts_it(tmp_path, decode):
    base = gpu_base(SIZES["full"])
    assert base[:2] == ["--spawn", 1]  # the launcher's flag, then the trainer's
    parse_config([str(a) for a in base[2:]])  # the synthetic run itself
    files = [str(a) for a in on_files(base, tmp_path)[2:]] + ["--decode", decode]
    cfg = parse_config(files)
    assert cfg.data.dataset == "imagefolder" and cfg.data.data_dir == str(tmp_path) and cfg.data.decode == decode
    changed = {k: v for k, v in cfg.to_dict().items() if parse_config([str(a) for a in base[2:]]).to_dict()[k] != v}
    assert set(changed) <= {"dataset", "data_dir", "decode", "train_samples", "val_samples"}  # the same run, on files
