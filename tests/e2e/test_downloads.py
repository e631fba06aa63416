"""Several nodes fetching into one shared folder at once, for real: processes in PID namespaces of their own (as
containers on two nodes are: the same process ids) start together and download the named weights into one
TORCH_HOME and CIFAR-10 into one --data-dir, from a slow HTTP server on 127.0.0.1, so that their downloads
overlap. Every process succeeds, the files are whole and verified, and a reader watching the folder never sees
a half-written file or folder."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import threading
import time

import pytest

from tests.helpers import PY, FileServer, env_for_tests, small_cifar, wait_for

RACERS = 2
# One racer: ready, wait for the start, fetch the weights, download CIFAR-10 (the test's own archive, in its
# layout and with its checksums, through torchvision's download and checks), read both splits with torchvision.
RACER = """
import json, os, sys, time
from pathlib import Path
from types import SimpleNamespace
from torchvision.datasets import CIFAR10
from train.data.folders import download_cifar
from train.components.weights import fetch

spec, ready, go = json.loads(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
dataset = type("SmallCIFAR", (CIFAR10,), spec["cifar"])
ready.touch()
while not go.exists():
    time.sleep(0.001)
weights = fetch(SimpleNamespace(url=spec["weights_url"]))
placed = download_cifar(Path(spec["data_dir"]), dataset)
sizes = [len(dataset(spec["data_dir"], train=train)) for train in (True, False)]
print(json.dumps({"weights": str(weights), "placed": placed, "sizes": sizes}), flush=True)
os._exit(0)  # the work is done: not the seconds torch takes to tear down
"""


def _own_pid_namespace() -> list[str]:
    """Each racer is process 1 of a PID namespace of its own; as a normal user via a user namespace."""
    if not shutil.which("unshare"):
        pytest.fail("unshare (util-linux) is needed to give each racer the process id a container has")
    user = [] if os.geteuid() == 0 else ["--map-root-user"]
    return ["unshare", *user, "--pid", "--fork", "--kill-child"]


def _watch(path, whole, seen: list, stop: threading.Event) -> None:
    """A reader on the shared folder: the first moment `path` exists, is it whole?"""
    while not stop.is_set():
        if os.path.exists(path):
            seen.append(whole())
            return
        time.sleep(0.001)


def test_nodes_downloading_into_one_shared_folder_at_once_all_succeed_with_whole_verified_files(tmp_path):
    weights = os.urandom(2 << 20)
    weights_name = f"net-{hashlib.sha256(weights).hexdigest()[:10]}.pth"
    archive, checksums, contents = small_cifar(400)  # about 7 MB
    torch_home, data_dir = tmp_path / "nas" / "torch", tmp_path / "nas" / "data"
    final_weights = torch_home / "hub" / "checkpoints" / weights_name
    final_cifar = data_dir / "cifar-10-batches-py"
    go = tmp_path / "go"
    seen_weights, seen_cifar, stop = [], [], threading.Event()
    watchers = [threading.Thread(target=_watch, args=(final_weights, lambda: final_weights.read_bytes() == weights,
                                                      seen_weights, stop)),
                threading.Thread(target=_watch, args=(final_cifar, lambda: contents == {
                    p.name: p.read_bytes() for p in final_cifar.iterdir()}, seen_cifar, stop))]
    # 64 KiB every 15 ms: 0.5 s for the weights, 1.7 s for the archive, so every racer is mid-download when
    # another one ends
    with FileServer({weights_name: weights, "cifar-10-python.tar.gz": archive}, delay=0.015) as server:
        spec = {"weights_url": f"{server.url}/{weights_name}", "data_dir": str(data_dir),
                "cifar": {**checksums, "url": f"{server.url}/cifar-10-python.tar.gz"}}
        racers = [subprocess.Popen([*_own_pid_namespace(), PY, "-c", RACER, json.dumps(spec),
                                    str(tmp_path / f"ready{i}"), str(go)],
                                   env=env_for_tests(TORCH_HOME=str(torch_home)), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for i in range(RACERS)]
        try:
            wait_for(lambda: all((tmp_path / f"ready{i}").exists() for i in range(RACERS)), 120, "the racers to start")
            for watcher in watchers:
                watcher.start()
            go.touch()
            results = [racer.communicate(timeout=120) for racer in racers]
        finally:
            stop.set()
            for racer in racers:
                racer.kill()
    for racer, (_, err) in zip(racers, results, strict=True):
        assert racer.returncode == 0, "\n".join(line for line in err.splitlines() if "%" not in line)[-3000:]
    reports = [json.loads(out.splitlines()[-1]) for out, _ in results]

    for name in (weights_name, "cifar-10-python.tar.gz"):  # every racer downloaded it, all at the same time
        transfers = server.whole(name)
        assert len(transfers) == RACERS and max(s for s, _ in transfers) < min(e for _, e in transfers), transfers
    assert final_weights.read_bytes() == weights and all(r["weights"] == str(final_weights) for r in reports)
    assert {p.name: p.read_bytes() for p in final_cifar.iterdir()} == contents
    assert seen_weights == [True] and seen_cifar == [True]  # a reader never saw either half-written
    assert all(r["sizes"] == [5 * 400, 400] for r in reports)  # torchvision's own checksums and loading
    assert sorted(r["placed"] for r in reports) == [False] * (RACERS - 1) + [True]  # one placed, the rest dropped
    assert os.listdir(final_weights.parent) == [weights_name] and os.listdir(data_dir) == ["cifar-10-batches-py"]
