"""--weights and --freeze as a user fine-tunes: a model trained on one dataset started on another with another
class count; a linear probe; a resume; every bad input in one line with nothing written. No network: named
weights are tested through the cache (TORCH_HOME) with files placed there."""

import hashlib
import json
import shutil

import torch

from tests.e2e.test_run_outputs import _image_folder
from tests.helpers import DEBUG, assert_bit_identical, env_for_tests, metrics, python_cmd, run, status
from train.__main__ import main as train_main


def test_weights_of_another_class_count_with_a_frozen_backbone(tmp_path, reference_run):
    """A shapes run (10 classes) starts a 3-class ImageFolder run, everything but the head frozen: the head is
    new, every other tensor (BatchNorm statistics included) is the weights' own to the end, and only the head
    has optimizer state."""
    source = tmp_path / "shapes"
    shutil.copytree(reference_run(*DEBUG, workers=1), source)  # the debug run of one process, trained once
    _image_folder(tmp_path / "data")
    run_dir = tmp_path / "probe"
    proc = run(python_cmd(*DEBUG, "--dataset", "imagefolder", "--data-dir", tmp_path / "data", "--batch-size", 4,
                          "--max-steps", 12, "--log-every", 4, "--weights", source / "model.pt", "--freeze", "backbone",
                          "--run-dir", run_dir))
    assert "head head.2: 10 -> 3 classes, initialised anew" in proc.stderr
    weights, trained = (torch.load(d / "model.pt", weights_only=True) for d in (source, run_dir))
    assert trained["head.2.weight"].shape == (3, 32)
    assert all(torch.equal(trained[k], weights[k]) for k in trained if not k.startswith("head.2."))
    assert len(metrics(run_dir, "train")) == 3  # it trained
    optimizer = torch.load(run_dir / "checkpoints" / "step_00000012.pt", weights_only=True)["optimizer"]
    assert len(optimizer["state"]) == 2  # head.2.weight and head.2.bias, nothing for the frozen ones
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["weights"] == str(source / "model.pt")
    assert manifest["weights_sha256"] == hashlib.sha256((source / "model.pt").read_bytes()).hexdigest()


def test_a_run_with_weights_resumes_bit_identically_and_never_reloads_them(tmp_path, reference_run):
    source = tmp_path / "source"
    run(python_cmd(*DEBUG, "--max-steps", 10, "--run-dir", source))
    args = [*DEBUG, "--weights", source / "model.pt"]
    straight = reference_run(*args, workers=1)
    run_dir = tmp_path / "resumed"
    run(python_cmd(*args, "--stop-at", 13, "--run-dir", run_dir), expect=75)
    (source / "model.pt").unlink()  # gone since: the resume takes everything from its checkpoint
    resumed = run(python_cmd(*args, "--run-dir", run_dir))
    assert "resumed from" in resumed.stderr and status(run_dir)["state"] == "done"
    assert_bit_identical(run_dir, straight)


def test_bad_weights_and_freeze_are_one_line_and_nothing_is_written(tmp_path, capsys, monkeypatch):
    """Each refused before any worker starts (python -m train's main, in this process, as in test_bad_input),
    but the damaged cache file, which local rank 0 of a real pair of workers meets."""
    torch_home = tmp_path / "torch-home"
    (torch_home / "hub" / "checkpoints").mkdir(parents=True)
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    cnn = tmp_path / "cnn"
    run(python_cmd(*DEBUG, "--max-steps", 2, "--run-dir", cnn))
    resnet = ["--model", "resnet18"]
    cases = [
        ([*resnet, "--weights", "ResNet18_Weights.IMAGENET1K_V3"], "is neither a file nor torchvision weights (close: "
                                                                    "ResNet18_Weights.IMAGENET1K_V1)"),
        ([*resnet, "--weights", "ResNet50_Weights.DEFAULT"], "are weights of another architecture than --model "
                                                            "resnet18: ResNet18_Weights.DEFAULT fits it"),
        ([*resnet, "--weights", str(cnn / "model.pt")], "do not fit --model resnet18: conv1.weight is missing in the "
                                                        "weights and (64, 3, 7, 7) in the model"),
        (["--weights", str(tmp_path / "garbage.pt")], "cannot be read as weights (UnpicklingError)"),
        (["--weights", str(tmp_path / "nowhere.pt")], "no such file"),
        ([*resnet, "--weights", "ResNet18_Weights.DEFAULT"], "cannot fetch resnet18-f37072fd.pth ("),  # offline
        (["--freeze", "featurs"], "--freeze featurs: no parameter of --model cnn is named so (close: features"),
        (["--epochs", "2", "--max-steps", "9"], "--epochs and --max-steps both set the same length"),
    ]
    offline = f"at {torch_home}/hub/checkpoints/resnet18-f37072fd.pth (TORCH_HOME on the NAS shares it"
    env = env_for_tests(TORCH_HOME=str(torch_home))
    monkeypatch.setenv("TORCH_HOME", str(torch_home))
    for argv, expected in cases:
        run_dir = tmp_path / "run"
        code = train_main([*DEBUG, *argv, "--run-dir", str(run_dir)])
        errors = capsys.readouterr().err.splitlines()  # all of it: one line
        assert code == 2 and len(errors) == 1 and errors[0].startswith("error: ") and expected in errors[0], \
            (argv, code, errors)
        assert not run_dir.exists(), argv  # nothing written
        assert "fetch" not in expected or offline in errors[0], errors[0]  # names the file and where to place it
    # a damaged file in the cache is refused, not loaded, by local rank 0 while the other rank waits for it
    (torch_home / "hub" / "checkpoints" / "resnet18-f37072fd.pth").write_bytes(b"damaged")
    proc = run(python_cmd(*DEBUG, *resnet, "--weights", "ResNet18_Weights.DEFAULT", "--spawn", 2, "--run-dir",
                          tmp_path / "run"), expect=2, env=env, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {torch_home}/hub/checkpoints/resnet18-f37072fd.pth is damaged (its SHA-256 does not "
                      f"start with f37072fd), refused: delete it and run again, or place the file from "
                      f"https://download.pytorch.org/models/resnet18-f37072fd.pth there"], proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()
