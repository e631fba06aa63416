"""A run directory that cannot be made or written: one line per cause, with that cause's fix, the same whether the
checks find it before anything starts (run_dir_problem) or the worker meets the error (write_problem). Each cause
is made for real: a file, a read-only mount, a full tmpfs, another user's folder, an immutable one. The mounts
live in a private mount namespace (`unshare --mount`, as tests/e2e/test_faults.py's disk-full test), so the
cases that need one run in one short process that imports the standard library and train.files.rundir alone."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from train.files import rundir, writable
from train.files.writable import run_dir_problem, write_problem

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534


def meet(run_dir: Path) -> dict:
    """What the checks say of run_dir, then what the worker meets preparing it (train/run/build.py
    prepare_run_dir: the folder, then its first file) and says of that error."""
    found = run_dir_problem(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        rundir.write_status(run_dir, "starting", -1)
    except OSError as e:
        return {"preflight": found, "errno": errno.errorcode[e.errno], "met": write_problem(run_dir, e)}
    return {"preflight": found, "errno": None, "met": None}


def meet_all(cases_file: str) -> None:
    """meet() every case of cases_file ({name: [uid, run_dir]}) as its user; prints {name: what was met} as JSON."""
    cases = json.loads(Path(cases_file).read_text())
    print(json.dumps({name: meet(Path(run_dir)) if uid == 0 else meet_as(uid, Path(run_dir))
                      for name, (uid, run_dir) in cases.items()}))


def write_on_a_full_disk(run_dir: str, out: str) -> None:
    """What a run's writes between checkpoints meet once run_dir's disk filled (its status.json there before it did),
    written to out as JSON: what each error is, the line the worker ends on, and the failure recorded all the same."""
    run_dir, seen = Path(run_dir), {}
    try:
        rundir.write_status(run_dir, "running", 6)
    except OSError as e:
        seen["status"] = [errno.errorcode[e.errno], writable.full_disk_problem(run_dir, e)]
    metrics = rundir.MetricsFile(run_dir)
    try:
        metrics.append({"step": 6, "kind": "train"})
    except OSError as e:  # a line-buffered append: no file named
        seen["metrics"] = [errno.errorcode[e.errno], e.filename, writable.full_disk_problem(run_dir, e)]
    with contextlib.suppress(OSError):
        metrics.close()
    rundir.write_status(run_dir, "failed", 6, error="its disk is full", exit_code=2)
    seen["recorded"] = rundir.read_status(run_dir)
    seen["elsewhere"] = writable.full_disk_problem(run_dir, OSError(errno.ENOSPC, "No space left on device",
                                                                     "/elsewhere/data.idx"))
    Path(out).write_text(json.dumps(seen))


def meet_as(uid: int, run_dir: Path) -> dict:
    """meet() with this process's effective user uid (its group too, no other groups), as that user would."""
    os.setgroups([])
    os.setegid(uid)
    os.seteuid(uid)
    try:
        return meet(run_dir)
    finally:
        os.seteuid(0)
        os.setegid(0)


# ---------------------------------------------------------------- in this process

def test_a_run_directory_that_is_a_file(tmp_path):
    run_dir = tmp_path / "notes.txt"
    run_dir.write_text("x")
    seen = meet(run_dir)
    assert seen["errno"] == "EEXIST"
    assert seen["met"] == seen["preflight"] == (
        f"run directory {run_dir} is a file, not a folder: pass a --run-dir that is a folder or a new path (it is "
        f"made), or move the file")


def test_a_run_directory_inside_a_file(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    run_dir = tmp_path / "notes.txt" / "run"
    seen = meet(run_dir)
    assert seen["errno"] == "ENOTDIR"
    assert seen["met"] == seen["preflight"]
    assert seen["met"].startswith(f"run directory {run_dir} cannot be made: {tmp_path / 'notes.txt'} is a file, not "
                                  f"a folder: pass a --run-dir that is a folder")


def test_a_writable_run_directory_has_no_problem(tmp_path):
    assert run_dir_problem(tmp_path / "new" / "run") is None
    assert meet(tmp_path / "new" / "run") == {"preflight": None, "errno": None, "met": None}


# ---------------------------------------------------------------- read-only, full, another user's, immutable

@pytest.fixture(scope="module")
def mounted():
    """Every case that needs a mount or another user, met in one process in a private mount namespace:
    read-only: a run folder on a read-only bind mount (resuming from a NAS mounted :ro) and a new one on a
        read-only tmpfs
    full: a 64 KiB tmpfs filled up
    filled: a 64 KiB tmpfs filled up under a run folder that has its status.json (write_on_a_full_disk, in a second
        process: filled.json)
    theirs / own-read-only: as uid 65534, a folder of root's, and a folder of its own with mode 0555
    immutable: as root, a folder marked chattr +i (root may not write in it either)
    The folder is made with tempfile (mode 0755), so that uid 65534 may enter it."""
    if os.geteuid() != 0:
        pytest.skip("mounts, another user and chattr need root (the tests run as root)")
    for tool in ("unshare", "mount", "chattr"):
        if not shutil.which(tool):
            pytest.fail(f"{tool} (util-linux, e2fsprogs) is needed to make the run directory's faults for real")
    root = Path(tempfile.mkdtemp(prefix="trainbox-run-dir-"))
    root.chmod(0o755)
    for name in ("nas", "ro", "full", "filled", "theirs", "own", "immutable"):
        (root / name).mkdir()
    (root / "nas" / "run").mkdir()
    (root / "nas" / "run" / "status.json").write_text('{"state": "stopped", "step": 20}\n')
    os.chown(root / "own", NOBODY, NOBODY)
    (root / "own").chmod(0o555)
    cases = {"read-only": (0, root / "nas" / "run"), "read-only-new": (0, root / "ro" / "run"),
             "full": (0, root / "full" / "run"), "theirs": (NOBODY, root / "theirs" / "run"),
             "own-read-only": (NOBODY, root / "own" / "run"), "immutable": (0, root / "immutable" / "run")}
    (root / "cases.json").write_text(json.dumps({name: [uid, str(path)] for name, (uid, path) in cases.items()}))
    script = f"""
        set -eu
        mount --bind {root}/nas {root}/nas && mount -o remount,bind,ro {root}/nas
        mount -t tmpfs -o ro,size=1m tmpfs {root}/ro
        mount -t tmpfs -o size=64k tmpfs {root}/full
        dd if=/dev/zero of={root}/full/filler bs=4k 2>/dev/null || true
        mount -t tmpfs -o size=64k tmpfs {root}/filled
        mkdir {root}/filled/run && echo '{{"state": "running", "step": 5}}' >{root}/filled/run/status.json
        dd if=/dev/zero of={root}/filled/filler bs=4k 2>/dev/null || true
        chattr +i {root}/immutable
        trap 'chattr -i {root}/immutable' EXIT
        {sys.executable} -c 'from tests.unit.test_run_dir import meet_all; meet_all("{root}/cases.json")'
        {sys.executable} -c 'from tests.unit.test_run_dir import write_on_a_full_disk as w
w("{root}/filled/run", "{root}/filled.json")'
    """
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        proc = subprocess.run(["unshare", "--mount", "bash", "-c", script], env=env, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        yield root, json.loads(proc.stdout)
    finally:
        shutil.rmtree(root)


def test_a_read_only_file_system(mounted):
    root, seen = mounted
    for case, run_dir, mount in (("read-only", root / "nas" / "run", root / "nas"),
                                 ("read-only-new", root / "ro" / "run", root / "ro")):
        assert seen[case]["errno"] == "EROFS", seen[case]
        assert seen[case]["met"] == seen[case]["preflight"] == (
            f"run directory {run_dir} is on a read-only file system ({mount} is mounted read-only): pass a --run-dir "
            f"on a writable disk, or mount {mount} read-write")


def test_a_full_disk(mounted):
    root, seen = mounted
    assert seen["full"]["errno"] == "ENOSPC", seen["full"]  # the folder is made; its first file is not
    assert seen["full"]["met"] == seen["full"]["preflight"] == (
        f"run directory {root / 'full' / 'run'}: its disk is full (0.0 MiB free on {root / 'full'}): free space on "
        f"{root / 'full'}, or pass a --run-dir on another disk; then run the same command (a run resumes from its "
        f"newest checkpoint)")


def test_a_disk_that_fills_while_a_run_trains(mounted):
    """Its next write of status.json or metrics.jsonl meets ENOSPC: the worker's line names the disk and the fix (a
    full disk elsewhere is not the run directory's); the failure is recorded all the same, over the old record."""
    root, _ = mounted
    run_dir, mount = root / "filled" / "run", root / "filled"
    line = (f"run directory {run_dir}: its disk is full (0.0 MiB free on {mount}): free space on {mount}, or pass a "
            f"--run-dir on another disk; then run the same command (a run resumes from its newest checkpoint)")
    filled = json.loads((root / "filled.json").read_text())  # write_on_a_full_disk's
    assert filled["status"] == ["ENOSPC", line] and filled["metrics"] == ["ENOSPC", None, line], filled
    assert {k: v for k, v in filled["recorded"].items() if k != "updated"} == \
        {"state": "failed", "step": 6, "error": "its disk is full", "exit_code": 2}
    assert filled["elsewhere"] is None


def test_a_log_line_a_full_disk_keeps_out_is_left_out_without_a_traceback(capsys):
    """train.log's handler on /dev/full, where every write meets ENOSPC as on a full disk: nothing said (the run's next
    write ends it on its one line); logging's own FileHandler prints a traceback of each line."""
    from train.report.metrics import RunLog

    record = logging.LogRecord("train", logging.INFO, __file__, 0, "step 6", None, None)
    for handler in (RunLog("/dev/full"), logging.FileHandler("/dev/full")):
        handler.emit(record)
        with contextlib.suppress(OSError):
            handler.close()
    assert capsys.readouterr().err.count("--- Logging error ---") == 1  # the FileHandler's alone


def test_another_users_folder_is_the_one_case_for_chown(mounted):
    root, seen = mounted
    assert seen["theirs"]["errno"] == "EACCES", seen["theirs"]
    in_a_container = " (from the host: `make env`, then the container runs as you)" if Path("/.dockerenv").exists() \
        else ""
    assert seen["theirs"]["met"] == seen["theirs"]["preflight"] == (
        f"run directory {root / 'theirs' / 'run'} is not writable by uid {NOBODY}: {root / 'theirs'} belongs to uid 0: "
        f"give uid {NOBODY} write access (as root: chown -R {NOBODY}:{NOBODY} {root / 'theirs'}){in_a_container}, or "
        f"pass a writable --run-dir")


def test_a_folder_of_ones_own_without_write_permission(mounted):
    root, seen = mounted
    assert seen["own-read-only"]["errno"] == "EACCES", seen["own-read-only"]
    assert seen["own-read-only"]["met"] == seen["own-read-only"]["preflight"] == (
        f"run directory {root / 'own' / 'run'} is not writable: {root / 'own'} belongs to uid {NOBODY} itself but its "
        f"mode dr-xr-xr-x leaves out write: `chmod u+w {root / 'own'}`, or pass another --run-dir")


def test_an_immutable_folder(mounted):
    root, seen = mounted
    assert seen["immutable"]["errno"] == "EPERM", seen["immutable"]
    assert seen["immutable"]["met"] == seen["immutable"]["preflight"] == (
        f"run directory {root / 'immutable' / 'run'} cannot be written: {root / 'immutable'} is immutable (chattr +i), "
        f"for root too: `chattr -i {root / 'immutable'}` as root, or pass another --run-dir")


def test_only_ownership_gets_the_chown_advice(tmp_path, mounted):
    _, seen = mounted
    (tmp_path / "f").write_text("x")
    lines = {case: s["met"] for case, s in seen.items()} | {"file": meet(tmp_path / "f")["met"]}
    assert [case for case, line in lines.items() if "chown" in line] == ["theirs"]


def test_the_worker_says_the_same_line_when_it_meets_the_problem(tmp_path):
    """The worker's own preparation of its run directory (every rank learns rank 0's line, as a ConfigError)."""
    from train.run.build import prepare_run_dir
    from train.base.errors import ConfigError

    run_dir = tmp_path / "notes.txt"
    run_dir.write_text("x")
    with pytest.raises(ConfigError) as e:
        prepare_run_dir(run_dir)
    assert str(e.value) == run_dir_problem(run_dir) == meet(run_dir)["met"]


def test_without_run_dir_the_checks_look_at_the_folder_runs_is_made_in(tmp_path, monkeypatch):
    """runs/<start time>, made by the run: a file named runs in the working folder stops it before any worker."""
    from train.run.preflight import preflight
    from train.cli import parse_config
    from train.base.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("x")
    with pytest.raises(ConfigError) as e:
        preflight(parse_config(["--preset", "debug"]))
    assert " cannot be made: runs is a file, not a folder: pass a --run-dir" in str(e.value)
    assert str(e.value).startswith("run directory runs/")
    preflight(parse_config(["--preset", "debug", "--dry-run"]))  # a dry run makes no folder: not asked
