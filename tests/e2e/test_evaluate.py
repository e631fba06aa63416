"""make evaluate / python -m train.evaluate: a run's model scored again, under any launcher, equal to the run's
own final evaluation on the same data and layout."""

import json
import os
import shutil

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import DEBUG, PEAKED, PY, REPO, env_for_tests, make, python_cmd, run, status


def _equal_to_the_final_evaluation(run_dir, report):
    final = status(run_dir)
    assert (report["loss"], report["accuracy"], report["top5"], report["samples"]) == \
        (final["val_loss"], final["val_accuracy"], final["val_top5"], final["val_samples"])  # bit for bit
    confusion = torch.tensor(report["confusion"])
    assert confusion.sum() == report["samples"] and confusion.diag().sum() / report["samples"] == report["accuracy"]
    for i, name in enumerate(report["classes"]):
        assert report["per_class_accuracy"][name] == (confusion[i, i] / confusion[i].sum()).item()


def test_make_evaluate_equals_the_final_evaluation_of_one_process(tmp_path):
    run_dir = tmp_path / "run"
    run(python_cmd(*DEBUG, "--run-dir", run_dir))
    proc = make("evaluate", f"RUN={run_dir}")
    assert f"{run_dir}/model.pt: loss" in proc.stdout
    report = json.loads((run_dir / "eval-model.json").read_text())
    _equal_to_the_final_evaluation(run_dir, report)
    assert report["classes"] == json.loads((run_dir / "classes.json").read_text()) and report["world_size"] == 1
    assert (run_dir / "eval-model.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    board = EventAccumulator(str(run_dir / "tensorboard" / "eval-model"))
    board.Reload()
    assert board.Scalars("eval/accuracy")[0].value == report["accuracy"]


def test_evaluate_under_torchrun_and_spawn_counts_each_sample_once(tmp_path):
    """255 validation images on 2 workers (128 + 127, no padding): the 2-worker run's figures, from either
    launcher; best.pt scored the same way."""
    run_dir = tmp_path / "run"
    run(python_cmd(*DEBUG, "--val-samples", 255, "--spawn", 2, "--run-dir", run_dir))
    run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "train.evaluate",
         str(run_dir)])
    report = json.loads((run_dir / "eval-model.json").read_text())
    assert report["samples"] == 255 and report["world_size"] == 2
    _equal_to_the_final_evaluation(run_dir, report)
    run([PY, "-m", "train.evaluate", str(run_dir), "--checkpoint", "best", "--spawn", "2"])
    best = json.loads((run_dir / "eval-best.json").read_text())
    recorded = status(run_dir)["best"]
    assert (best["loss"], best["accuracy"], best["samples"]) == \
        (recorded["val_loss"], recorded["val_accuracy"], recorded["val_samples"])


def test_make_evaluate_weights_best_scores_the_best_evaluation_not_the_last(reference_run, tmp_path):
    """A run whose best evaluation (best.pt) came before its last (model.pt): CHECKPOINT=best gives the best's figures
    and CHECKPOINT=model the final ones, and the two differ."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference_run(*PEAKED, workers=1), run_dir)
    make("evaluate", f"RUN={run_dir}", "CHECKPOINT=best")
    make("evaluate", f"RUN={run_dir}")
    best, final = (json.loads((run_dir / f"eval-{w}.json").read_text()) for w in ("best", "model"))
    recorded = status(run_dir)["best"]
    assert (best["loss"], best["accuracy"], best["samples"]) == \
        (recorded["val_loss"], recorded["val_accuracy"], recorded["val_samples"])
    _equal_to_the_final_evaluation(run_dir, final)
    assert recorded["step"] < status(run_dir)["step"] and best["accuracy"] > final["accuracy"]


def test_bad_input_is_one_line(tmp_path):
    missing = run([PY, "-m", "train.evaluate", str(tmp_path / "nowhere")], expect=2)
    assert missing.stderr.startswith("error: ") and "is not a trainbox run directory" in missing.stderr
    run_dir = tmp_path / "run"
    run(python_cmd(*DEBUG, "--max-steps", 3, "--eval-every", 0, "--stop-at", 2, "--run-dir", run_dir), expect=75)
    unfinished = run([PY, "-m", "train.evaluate", str(run_dir)], expect=2)
    assert "the run has not finished (no model.pt)" in unfinished.stderr and "Traceback" not in unfinished.stderr
    # The old spelling of --checkpoint (--weights is python -m train's starting weights): one line naming the new
    for command in ("train.evaluate", "train.export"):
        old = run([PY, "-m", command, str(run_dir), "--weights", "best"], expect=2)
        assert old.stderr.strip().splitlines() == [
            f"error: python -m {command} --weights best: a finished run's weights are --checkpoint best (CHECKPOINT= "
            f"with make); --weights is python -m train's starting weights"]
    for target in ("evaluate", "export"):
        old = make(target, f"RUN={run_dir}", "WEIGHTS=ema", expect=2)
        assert old.stderr.splitlines()[0] == f"error: WEIGHTS=ema is now CHECKPOINT=ema: make {target} RUN={run_dir} " \
                                             f"CHECKPOINT=ema"  # then make's own "Error 2"


def test_a_run_folder_never_runs_code_unless_the_command_names_the_factory(tmp_path):
    """A run folder on a shared NAS whose config.json names a module:factory (planted here, it leaves a mark when
    imported): evaluate and export refuse in one line that gives --model, and import nothing; naming the same
    factory on the command line is the user's consent; another name is refused; torchvision models need nothing."""
    run_dir = tmp_path / "run"
    run(python_cmd(*DEBUG, "--max-steps", 2, "--eval-every", 0, "--run-dir", run_dir))
    planted = tmp_path / "site"
    planted.mkdir()
    mark = tmp_path / "imported"
    (planted / "planted.py").write_text(f"import pathlib\npathlib.Path({str(mark)!r}).touch()\n"
                                        f"from tests.models import tiny_groupnorm_cnn as net  # noqa: F401\n")
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**config, "model": "planted:net"}))
    env = env_for_tests(PYTHONPATH=f"{planted}{os.pathsep}{REPO}")
    for command in (["train.evaluate"], ["train.export"]):
        refused = run([PY, "-m", *command, str(run_dir)], expect=2, env=env)
        assert refused.stderr.strip().splitlines() == [
            f"error: {run_dir} was trained with --model planted:net, code outside trainbox, and its factory would be "
            f"imported and run: pass --model planted:net (MODEL= with make) if you trust that module"]
        other = run([PY, "-m", *command, str(run_dir), "--model", "tests.models:wide_mlp"], expect=2, env=env)
        assert "--model tests.models:wide_mlp does not name it" in other.stderr
        assert not mark.exists()
    refused = make("evaluate", f"RUN={run_dir}", expect=2)
    assert "pass --model planted:net (MODEL= with make)" in refused.stderr and not mark.exists()
    consented = run([PY, "-m", "train.evaluate", str(run_dir), "--model", "planted:net"], expect=None, env=env)
    assert mark.exists() and "code outside trainbox" not in consented.stderr  # imported: the user named it
