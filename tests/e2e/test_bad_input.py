"""Every user mistake: one line naming the cause and the fix, exit 2, and existing run data untouched."""

import json
import os
import shutil
import socket
import zlib

import pytest
import torch

from tests.helpers import (Evil, DEBUG, PY, assert_bit_identical, env_for_tests, python_cmd, run, snapshot, start_warm,
                           status, torchrun_cmd)
from tests.processes import children, cmdline
from train.__main__ import main as train_main
from train.launch import launch_main


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("existing") / "run"
    run(python_cmd(*DEBUG, "--max-steps", 10, "--run-dir", run_dir))
    return run_dir


def _files(tmp_path):
    (tmp_path / "bad.json").write_text('{"max_steps": 10,')
    (tmp_path / "bad.toml").write_text("max_steps = = 3")
    (tmp_path / "typo.json").write_text(json.dumps({"lerning_rate": 0.1}))
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "empty" / "train").mkdir(parents=True)
    (tmp_path / "empty" / "val").mkdir(parents=True)
    for split in ("train", "val"):
        (tmp_path / "noimages" / split / "a").mkdir(parents=True)
        (tmp_path / "noimages" / split / "a" / "notes.txt").write_text("not an image")
    from PIL import Image

    for split, classes in (("train", ("a", "b")), ("val", ("a", "c"))):
        for c in classes:
            (tmp_path / "mismatch" / split / c).mkdir(parents=True)
            Image.new("RGB", (8, 8)).save(tmp_path / "mismatch" / split / c / "0.png")
    for folder in ("loop", "in-both"):
        for split in ("train", "val"):
            (tmp_path / folder / split / "a").mkdir(parents=True)
            Image.new("RGB", (8, 8)).save(tmp_path / folder / split / "a" / "0.png")
    (tmp_path / "loop" / "train" / "a" / "loop").symlink_to("..")  # 1 image would have become thousands
    (tmp_path / "in-both" / "val" / "a" / "1.png").symlink_to("../../train/a/0.png")  # val/ linked into train/


CASES = [
    # (id, argv with {tmp} for the test folder, expected text (with {tmp} too))
    ("unknown-flag", ["--learning-rate", "1"], "unrecognized arguments: --learning-rate"),
    ("wrong-type", ["--batch-size", "big"], "invalid int value: 'big'"),
    ("zero-batch", ["--batch-size", "0"], "--batch-size must be > 0"),
    ("negative-steps", ["--max-steps", "-5"], "--max-steps must be > 0"),
    ("negative-threads", ["--threads", "-1"], "--threads must be >= 0"),
    ("zero-save-every", ["--save-every", "0"], "--save-every must be > 0"),
    ("bad-choice", ["--optimizer", "lion"], "invalid choice: 'lion'"),
    ("unknown-preset", ["--preset", "fast"], "invalid choice: 'fast'"),
    ("malformed-json", ["--config", "{tmp}/bad.json"], "is malformed"),
    ("malformed-toml", ["--config", "{tmp}/bad.toml"], "is malformed"),
    ("unknown-config-key", ["--config", "{tmp}/typo.json"], "unknown key 'lerning_rate'"),
    ("missing-config", ["--config", "{tmp}/nope.json"], "not found"),
    ("missing-module", ["--model", "nosuchpkg.models:net"], "cannot import nosuchpkg.models"),
    ("missing-factory", ["--model", "tests.models:nothing_here"], "has no attribute 'nothing_here'"),
    ("not-callable", ["--model", "tests.models:NOT_CALLABLE"], "is a int, not callable"),
    ("unknown-model", ["--model", "resnet9000"], "is not cnn, a torchvision classification model"),
    ("fp16-on-cpu", ["--device", "cpu", "--precision", "fp16"], "--precision fp16 needs a CUDA GPU"),
    ("bf16-on-cpu", ["--device", "cpu", "--precision", "bf16"], "--precision bf16 needs a CUDA GPU"),
    ("syncbn-on-cpu", ["--device", "cpu", "--sync-bn"], "--sync-bn needs CUDA GPUs"),
    ("gpu-decode-on-cpu", ["--device", "cpu", "--decode", "gpu", "--dataset", "imagefolder", "--data-dir",
                           "{tmp}/mismatch"], "--decode gpu needs a CUDA GPU (nvJPEG): use --decode cpu on CPU"),
    ("gpu-decode-without-files", ["--decode", "gpu"],
     "--decode gpu decodes image files, and --dataset shapes has none"),
    ("unknown-recipe", ["--augment", "autoaugment"], "invalid choice: 'autoaugment'"),
    ("missing-imagefolder", ["--dataset", "imagefolder", "--data-dir", "{tmp}/none"], "is missing"),
    ("empty-imagefolder", ["--dataset", "imagefolder", "--data-dir", "{tmp}/empty"], "has no class folders"),
    ("no-images-in-class", ["--dataset", "imagefolder", "--data-dir", "{tmp}/noimages", "--run-dir", "{tmp}/r"],
     "put images in"),
    ("mismatched-classes", ["--dataset", "imagefolder", "--data-dir", "{tmp}/mismatch"],
     "train and val hold different classes (only in one: b, c)"),
    ("imagefolder-link-cycle", ["--dataset", "imagefolder", "--data-dir", "{tmp}/loop", "--run-dir", "{tmp}/r"],
     "{tmp}/loop/train/a/loop is a link cycle: it leads back to"),
    ("imagefolder-image-in-both-splits", ["--dataset", "imagefolder", "--data-dir", "{tmp}/in-both", "--run-dir",
                                          "{tmp}/r"],
     "{tmp}/in-both: 1 image is in both train/ and val/, reached through links ({tmp}/in-both/train/a/0.png and "
     "{tmp}/in-both/val/a/1.png are "),
    ("cifar-not-downloaded", ["--dataset", "cifar10", "--data-dir", "{tmp}/none"], "pass --download"),
    ("run-dir-is-a-file", ["--run-dir", "{tmp}/a_file"], "a_file is a file, not a folder: pass a --run-dir that is a "
                                                         "folder or a new path"),
    ("run-dir-inside-a-file", ["--run-dir", "{tmp}/a_file/run"], "/run cannot be made: {tmp}/a_file is a file, not a "
                                                                 "folder"),
    ("resume-other-model", ["--width", "16"], "which its checkpoint fixes (--width 8 -> 16)"),
    ("nas-not-mounted", ["--run-dir", "/nonexistent-nas/runs/exp1"],
     "/nonexistent-nas/runs does not exist (is the NAS mounted?)"),
    ("zero-grad-accum", ["--grad-accum", "0"], "--grad-accum must be > 0"),
    ("zero-timeout", ["--timeout-s", "0"], "--timeout-s must be > 0"),
    ("tiny-images", ["--image-size", "4"], "--image-size must be at least 8"),
    ("negative-spawn", ["--spawn", "-2"], "--spawn must be >= 0"),
    ("fewer-samples-than-a-step", ["--train-samples", "8", "--batch-size", "16"],
     "8 training samples are fewer than one step needs (1 workers x 16 x 1)"),
    ("mlflow-not-a-server", ["--mlflow-uri", "ftp://nas/mlruns"], "MLflow tracking URI 'ftp://nas/mlruns' is not "
                                                                  "an MLflow server's address: use http(s)://"),
    ("mlflow-password-in-uri", ["--mlflow-uri", "http://me:secret@mlflow:5000"],
     "pass it in MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD instead"),
    ("mlflow-server-down", ["--mlflow-uri", "http://127.0.0.1:9"],  # the discard port: nothing listens
     "the MLflow server at http://127.0.0.1:9 does not answer (Connection refused): start it (make mlflow)"),
]
if not torch.cuda.is_available():
    CASES.append(("cuda-without-gpu", ["--device", "cuda"], "--device cuda but no CUDA GPU is visible"))


def _refused(finished_run, capsys, argv, expected):
    before = snapshot(finished_run)
    has_run_dir = "--run-dir" in argv
    code = train_main([*DEBUG, *([] if has_run_dir else ["--run-dir", str(finished_run)]), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert expected in err[0]
    assert snapshot(finished_run) == before


@pytest.mark.parametrize("argv, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(finished_run, tmp_path, capsys, argv, expected):
    """... and a new run's folder ({tmp}/r) is not made: not even by a refusal met while the worker lists the data."""
    _files(tmp_path)
    _refused(finished_run, capsys, [a.replace("{tmp}", str(tmp_path)) for a in argv],
             expected.replace("{tmp}", str(tmp_path)))
    assert not (tmp_path / "r").exists()


def test_a_busy_rendezvous_port_is_named(finished_run, capfd, monkeypatch):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))
        # capfd: --spawn's checks run in a child of the workers' fork server (train/cluster/spawn.py), which writes the
        # line to the launcher's stderr itself
        _refused(finished_run, capfd, ["--spawn", "2"], f"rendezvous port {port} is in use on this host")
    # The fork server went with the refusal: it would otherwise wait on, holding the launcher's output open.
    assert not [p for p in children(os.getpid()) if "multiprocessing.forkserver" in cmdline(p)]


def test_too_few_samples_for_the_workers_is_refused_before_torchrun(finished_run, capsys):
    # 24 samples make one step of 16 on one worker, but none on two: the launcher knows it will start two.
    before = snapshot(finished_run)
    code = launch_main(["--gpus", "2", "--", *DEBUG, "--train-samples", "24", "--batch-size", "16",
                               "--run-dir", str(finished_run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "24 training samples are fewer than one step needs (2 workers x 16 x 1)" in err[0]
    assert snapshot(finished_run) == before


def test_a_max_restarts_that_is_not_a_number_stops_make_train_before_torchrun(finished_run, capsys):
    before = snapshot(finished_run)
    code = launch_main(["--gpus", "2", "--max-restarts", "abc", "--", *DEBUG, "--run-dir", str(finished_run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["error: MAX_RESTARTS='abc' is not a number: use 0, 1, 3, ..."], err
    assert snapshot(finished_run) == before


def test_an_mlflow_server_that_does_not_answer_stops_a_new_run_before_torchrun(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    code = launch_main(["--gpus", "2", "--", *DEBUG, "--run-dir", str(tmp_path / "new")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: the MLflow server at http://127.0.0.1:9 does not answer")
    assert not (tmp_path / "new").exists()


def test_cuda_visible_devices_naming_a_missing_gpu(finished_run, capsys, monkeypatch):
    """On a GPU host NVML counts the GPUs and the line names the index the host lacks; on a host without a
    driver nothing can be counted and no GPU is visible at all: the generic line, which must not claim a
    count. (The index check itself, with counts: tests/unit/test_checks.py.)"""
    from train.run.preflight import host_gpu_count

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    gpus = host_gpu_count()
    if gpus is not None and gpus <= 7:
        expected = f"error: CUDA_VISIBLE_DEVICES=7 names GPU 7 but this host has {gpus} (0-{gpus - 1}): fix"
    else:
        assert not torch.cuda.is_available()
        expected = "error: --device cuda but no CUDA GPU is visible (CUDA_VISIBLE_DEVICES=7): use --device cpu"
    _refused(finished_run, capsys, ["--device", "cuda"], expected.removeprefix("error: "))


def _trainer_refuses(run_dir, argv, expected):
    """In the trainer (after the process group would start): one error line, exit 2, no traceback, and the
    run's data (checkpoints, model, metrics, config) unchanged; train.log and status.json record the attempt."""
    def data():
        return {k: v for k, v in snapshot(run_dir).items() if k not in ("train.log", "status.json")}
    existed = run_dir.exists()
    before = data() if existed else None
    proc = run(python_cmd(*argv, "--run-dir", run_dir), expect=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    if existed:
        assert data() == before


# Training a finished run on for more steps loads its newest checkpoint (the same --max-steps would find
# the run finished and load nothing).
MORE = 20


def test_a_checkpoint_that_runs_code_is_refused_not_executed(finished_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    evil = run_dir / "checkpoints" / "step_99999999.pt"
    torch.save({"model": Evil(tmp_path / "pwned")}, evil)
    data = evil.read_bytes()  # a sidecar that matches: the file passes the checksum, the load must refuse it
    evil.with_name(evil.name + ".crc32").write_text(f"crc32:{zlib.crc32(data):08x} size:{len(data)}  {evil.name}\n")
    _trainer_refuses(run_dir, [*DEBUG, "--max-steps", MORE], "is not a weights-only checkpoint, refused")
    assert not (tmp_path / "pwned").exists()


def test_a_checkpoint_of_another_model_is_refused(finished_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    (run_dir / "config.json").unlink()  # only the checkpoint itself knows its model now
    _trainer_refuses(run_dir, [*DEBUG, "--max-steps", MORE, "--width", 16], "its checkpoint fixes (--width 8 -> 16)")


def test_a_checkpoint_that_does_not_fit_the_model_is_refused(finished_run, tmp_path):
    from train.files import checkpoint_io as ckpt

    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    newest = ckpt.newest_valid(run_dir)
    state = torch.load(newest, weights_only=True)
    state["model"] = {f"renamed.{k}": v for k, v in state["model"].items()}  # the model's code changed
    ckpt.save_checkpoint(run_dir, state["step"], state, keep=3)
    _trainer_refuses(run_dir, [*DEBUG, "--max-steps", MORE], "does not fit this model")


# The broken file, what it holds, and the rank whose shard holds it: under --spawn 2, rank 1's error must be the
# run's exit code, not the kill of rank 0 that the launcher sends when rank 1 ends.
@pytest.mark.parametrize("broken, content, launch, rank", [("b/3", b"\x89PNG\r\n\x1a\n not really", [], 0),
                                                           ("a/0", b"\x89PNG\r\n\x1a\n not really", ["--spawn", 2], 1),
                                                           ("b/3", b"", [], 0)],
                         ids=["one-process", "spawn-rank-1", "empty-file-replaced-then-resumed"])
def test_an_unreadable_image_stops_the_run_naming_the_file(tmp_path, broken, content, launch, rank):
    """Documented choice: a damaged image fails the run (skipping would silently change the dataset): one line,
    exit 2, status.json "failed" with that line; once the file is replaced, the same command trains to the end.
    The folder also holds a 16-bit grey PNG and a palette PNG with transparency: they train as PIL converts them."""
    import numpy as np
    from PIL import Image

    for split in ("train", "val"):
        for c in ("a", "b"):
            (tmp_path / "data" / split / c).mkdir(parents=True)
            for i in range(8):
                Image.new("RGB", (12, 12), (i * 20, 0, 0)).save(tmp_path / "data" / split / c / f"{i}.png")
        Image.fromarray(np.full((12, 12), 40000, np.uint16)).save(tmp_path / "data" / split / "a" / "0.png")
        Image.new("P", (12, 12), 3).save(tmp_path / "data" / split / "b" / "0.png", transparency=3)
    broken = tmp_path / "data" / "train" / f"{broken}.png"
    broken.write_bytes(content)
    args = [*DEBUG, "--dataset", "imagefolder", "--data-dir", tmp_path / "data", "--image-size", 12, "--batch-size", 4,
            "--num-workers", 1, "--max-steps", 8, *launch]
    line = f"cannot read image {broken} ("
    _trainer_refuses(tmp_path / "run", args, f"[rank {rank}] {line}")
    failed = status(tmp_path / "run")
    assert failed["state"] == "failed" and failed["exit_code"] == 2, failed
    assert failed["error"].startswith(line) and failed["error"].endswith("then run the same command to resume"), failed
    if content:
        return
    Image.new("RGB", (12, 12)).save(broken)
    run(python_cmd(*args, "--run-dir", tmp_path / "run"))
    assert status(tmp_path / "run")["state"] == "done"


def test_bad_input_from_the_command_line_prints_no_traceback(finished_run):
    proc = run(python_cmd("--batch-size", "-1", "--run-dir", finished_run), expect=2)
    assert proc.stderr.strip() == "error: --batch-size must be > 0, got -1: pass a positive value"
    assert proc.stdout == ""


def test_spawn_inside_torchrun_is_refused(finished_run):
    env = env_for_tests(RANK="0", WORLD_SIZE="1", TORCHELASTIC_RUN_ID="L1")  # a torchrun worker's (the variables
    proc = run([PY, "-m", "train", "--spawn", "2", "--run-dir", str(finished_run)], expect=2, env=env)  # alone:
    assert "--spawn inside torchrun or srun would start workers twice" in proc.stderr  # tests/unit/test_identity.py)




def test_a_command_from_the_warm_interpreter_says_and_exits_as_from_a_fresh_one(finished_run, tmp_path, monkeypatch):
    """tests/warm.py, which most tests' `python -m train` commands go through: the same exit code, stdout and stderr
    as a fresh interpreter's, byte for byte: a refusal before torch loads, an evaluation's and an export's, a team's
    task module (found in the working folder, as -m finds it) that raises as it loads, after torch (its traceback
    once, then the line naming boom.py:1, exit 2), a dry run's plan, and --spawn's check child refusing (its fork server forked, not started afresh); and a
    --spawn run's weights, bit for bit. A plain torchrun's workers, forked too: a refusal in the workers (the exit
    code and trainbox's line; torchrun's own lines name pids and times), and a 2-worker run's weights, bit for bit
    those of the fresh --spawn run (every launcher trains the same weights: tests/e2e/test_launchers.py)."""
    monkeypatch.delenv("TRAINBOX_TESTS_COLD", raising=False)  # this test asks for both ways itself
    (tmp_path / "boom.py").write_text("raise RuntimeError('broken on purpose')\n")
    commands = [python_cmd("--batch-size", "-1", "--run-dir", finished_run),
                python_cmd(*DEBUG, "--task", "boom:make", "--run-dir", tmp_path / "r"),
                python_cmd(*DEBUG, "--task", "lm", "--dry-run", "--run-dir", tmp_path / "r"),
                [PY, "-m", "train.evaluate", str(tmp_path)],
                [PY, "-m", "train.export", str(finished_run), "--format", "tflite"],
                python_cmd(*DEBUG, "--spawn", 2, "--train-samples", 24, "--batch-size", 16,
                           "--run-dir", tmp_path / "r")]
    for cmd in commands:
        with start_warm(cmd, tmp_path, env_for_tests()) as warm:
            out, err = warm.communicate(timeout=120)
        monkeypatch.setenv("TRAINBOX_TESTS_COLD", "1")
        fresh = run(cmd, expect=None, cwd=tmp_path)
        monkeypatch.delenv("TRAINBOX_TESTS_COLD")
        assert (warm.returncode, out, err) == (fresh.returncode, fresh.stdout, fresh.stderr), cmd
        assert fresh.returncode != 0 or out
        assert "boom:make" not in cmd or (fresh.returncode, err.count("Traceback")) == (2, 1) and err.endswith(
            "error: RuntimeError: broken on purpose (raised in your code, "
            f"{tmp_path.resolve()}/boom.py:1, in <module>: its traceback above): fix it there, then run the same "
            "command\n"), err
    trained = [python_cmd(*DEBUG, "--spawn", 2, "--max-steps", 10, "--run-dir", tmp_path / name) for name in "ab"]
    trained += [torchrun_cmd(2, *DEBUG, "--max-steps", 10, "--run-dir", tmp_path / "c")]  # as b's, any launcher
    refused = torchrun_cmd(2, *DEBUG, "--dataset", "imagefolder", "--data-dir", tmp_path / "none", "--run-dir",
                           tmp_path / "r")
    forked = tmp_path / "forked"  # each torchrun worker forked from the warm interpreter writes its pid there
    warm_ran = []
    for cmd in (refused, trained[0], trained[2]):
        with start_warm(cmd, tmp_path, env_for_tests(TRAINBOX_TESTS_FORKED=str(forked))) as warm:
            out, err = warm.communicate(timeout=300)
        warm_ran.append((warm.returncode, out, err))
    assert len(forked.read_text().split()) == 4  # the refusal's 2 workers (no restarts), the run's 2
    monkeypatch.setenv("TRAINBOX_TESTS_COLD", "1")
    fresh = [run(cmd, expect=None, cwd=tmp_path) for cmd in (refused, trained[1])]
    errors = [[line for line in err.splitlines() if line.startswith("error:")] for _, _, err in warm_ran]
    assert errors[0] == [line for line in fresh[0].stderr.splitlines() if line.startswith("error:")]
    assert len(errors[0]) == 1 and f"{tmp_path}/none" in errors[0][0], warm_ran[0][2][-3000:]
    assert [code for code, _, _ in warm_ran] == [proc.returncode for proc in fresh] + [0] == [1, 0, 0]
    assert_bit_identical(tmp_path / "a", tmp_path / "b")
    assert_bit_identical(tmp_path / "c", tmp_path / "b")  # torchrun's forked workers, against a fresh --spawn run
