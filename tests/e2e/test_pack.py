"""`make pack` as users run it: its knobs (WORKERS, MAX_SIDE, QUALITY) through make, a pack killed with kill -9
while it writes and run again, and a training run on the shards that says how they were packed."""

import json
import os
import signal
import subprocess
import time

from tests.helpers import DEBUG, PY, env_for_tests, make, python_cmd, run
from tests.processes import alive, in_session
from train.base import vision
from train.bench.photos import make_photos
from train.data import ShardSplit, load_image
from train.pack.command import pack, verify
from train.pack.images import shrink
from train.pack.shards import JOURNAL


def photos(root, train: int, val: int):
    make_photos(root / "train", train, classes=3, seed=1)
    make_photos(root / "val", val, classes=3, seed=2)
    return root


def test_a_pack_killed_while_it_writes_continues_and_equals_an_uninterrupted_one(tmp_path):
    src = photos(tmp_path / "photos", 150, 9)
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    flags = ["--workers", "2", "--max-side", "96", "--shard-mb", "0.01"]  # a few images per shard
    proc = subprocess.Popen([PY, "-m", "train.pack", src, killed, *flags], env=env_for_tests(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not ((killed / JOURNAL).is_file() and len((killed / JOURNAL).read_text().splitlines()) >= 3
                   and list(killed.glob(".train-*.tar.tmp"))):  # two shards complete, another being written
            assert proc.poll() is None, f"the pack ended ({proc.returncode}) before it could be killed"
            assert time.monotonic() < deadline, "the pack wrote no shard in 120 s"
            time.sleep(0.002)
        os.killpg(proc.pid, signal.SIGKILL)  # the pack and its workers, at once
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in in_session(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (killed / "index.json").exists()
    finished = [json.loads(line)["name"] for line in (killed / JOURNAL).read_text().splitlines()[1:] if line]
    stamps = {name: ((killed / name).stat().st_ino, (killed / name).stat().st_mtime_ns) for name in finished}

    again = run([PY, "-m", "train.pack", src, killed, *flags])  # the same command
    assert "continuing the pack in" in again.stderr
    assert "pack: 159/159 images (100.0%)" in again.stderr
    assert verify(killed) == []  # what --verify checks: every shard's count, size and SHA-256
    # the shards finished before the kill are kept as they were, not written again
    assert {name: ((killed / name).stat().st_ino, (killed / name).stat().st_mtime_ns) for name in finished} == stamps
    pack(src, whole, shard_bytes=int(0.01 * 2**20), workers=1, max_side=96)
    files = sorted(p.name for p in whole.iterdir())
    assert sorted(p.name for p in killed.iterdir()) == files and len(files) > 2 * len(finished)
    for name in files:  # byte for byte, index.json included
        assert (killed / name).read_bytes() == (whole / name).read_bytes(), name


def test_make_pack_takes_its_knobs_and_a_run_on_the_shards_says_how_they_were_packed(tmp_path):
    src, dst = photos(tmp_path / "photos", 12, 6), tmp_path / "shards"
    proc = make("pack", f"SRC={src}", f"DST={dst}", "WORKERS=2", "MAX_SIDE=128", "QUALITY=80")
    assert "18 image(s) resized to a longer side of 128 px (JPEG quality 80)" in proc.stdout
    assert f"packed into {dst} by 2 worker(s)" in proc.stdout
    assert "pack: 18/18 images (100.0%)" in proc.stderr
    index = json.loads((dst / "index.json").read_text())
    assert (index["max_side"], index["quality"]) == (128, 80)
    first = sorted((src / "train" / "class0").glob("*.jpg"))[0]
    data, _ = ShardSplit(dst, "train")[0]
    expected = vision.io.encode_jpeg(shrink(load_image(str(first)), 128), quality=80)
    assert bytes(data.numpy()) == bytes(expected.numpy())

    run_dir = tmp_path / "run"
    trained = run(python_cmd(*DEBUG, "--dataset", "shards", "--data-dir", dst, "--image-size", 32, "--batch-size", 4,
                             "--num-workers", 0, "--max-steps", 2, "--eval-every", 0, "--spawn", 2,
                             "--run-dir", run_dir))
    said = f"data: shards in {dst}: packed with MAX_SIDE=128 QUALITY=80 (every image whose longer side was over " \
           f"128 px resized to it and re-encoded as JPEG)"
    assert (run_dir / "train.log").read_text().count(said) == 1  # rank 0's log, once
    assert (trained.stdout + trained.stderr).count(said) == 1
