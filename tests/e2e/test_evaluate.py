"""make evaluate / python -m train.evaluate: a run's model scored again, under any launcher, equal to the run's
own final evaluation on the same data and layout."""

import io
import json
import os
import pty
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import (DEBUG, PEAKED, PY, REPO, env_for_tests, make, metrics, python_cmd, run, status,
                           tracked_env)
from train.cluster.identity import free_port
from train.report import figure


def _equal_to_the_final_evaluation(run_dir, report):
    final = status(run_dir)
    assert (report["loss"], report["accuracy"], report["top5"], report["samples"]) == \
        (final["val_loss"], final["val_accuracy"], final["val_top5"], final["val_samples"])  # bit for bit
    confusion = torch.tensor(report["confusion"])
    assert confusion.sum() == report["samples"] and confusion.diag().sum() / report["samples"] == report["accuracy"]
    for i, name in enumerate(report["classes"]):
        assert report["per_class_accuracy"][name] == (confusion[i, i] / confusion[i].sum()).item()


@pytest.fixture(scope="module")
def peaked(reference_run, tmp_path_factory):
    """A copy, named exp1, of the PEAKED run of one process (trained once: its best evaluation, best.pt, came before
    its last, model.pt), after `make evaluate RUN=... CHECKPOINT=best` then `make evaluate RUN=...`: the run
    directory and the latter's output. Read it; evaluate copies of it elsewhere."""
    run_dir = tmp_path_factory.mktemp("peaked") / "exp1"
    shutil.copytree(reference_run(*PEAKED, workers=1), run_dir)
    make("evaluate", f"RUN={run_dir}", "CHECKPOINT=best")
    return run_dir, make("evaluate", f"RUN={run_dir}")


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    """A debug run of 2 workers (its evaluations at steps 20 and 40) with 253 validation images (its validation
    batches twice --batch-size: 32), trained under `python -X importtime`, and three evaluations of it, each its
    stderr a pipe: "one", model.pt on 1 worker under -X importtime, and "two-best", best.pt on 2 (--spawn), both with
    a progress line every batch (TRAINBOX_PROGRESS_EVERY=0); "three", model.pt on 3 workers,
    TRAINBOX_PROGRESS_EVERY=3600. The run directory, the training's stderr and {name: (stderr, report)}."""
    root = tmp_path_factory.mktemp("counted")
    run_dir = root / "run"
    trained = run([PY, "-X", "importtime", *python_cmd(*DEBUG, "--val-samples", 253, "--spawn", 2, "--run-dir",
                                                       run_dir)[1:]])
    every_batch, hourly = env_for_tests(TRAINBOX_PROGRESS_EVERY="0"), env_for_tests(TRAINBOX_PROGRESS_EVERY="3600")
    evaluated = {}
    for name, python, args, env in (("one", ["-X", "importtime"], [], every_batch),
                                    ("two-best", [], ["--checkpoint", "best", "--spawn", "2"], every_batch),
                                    ("three", [], ["--spawn", "3"], hourly)):
        out = root / f"eval-{name}.json"
        proc = run([PY, *python, "-m", "train.evaluate", str(run_dir), *args, "--out", str(out)], env=env)
        evaluated[name] = (proc.stderr, json.loads(out.read_text()))
    return run_dir, trained.stderr, evaluated


def test_make_evaluate_equals_the_final_evaluation_of_one_process(peaked):
    run_dir, proc = peaked  # make evaluate of a debug run of one process, trained once
    assert f"{run_dir}/model.pt: loss" in proc.stdout
    report = json.loads((run_dir / "eval-model.json").read_text())
    _equal_to_the_final_evaluation(run_dir, report)
    assert report["classes"] == json.loads((run_dir / "classes.json").read_text()) and report["world_size"] == 1
    assert (run_dir / "eval-model.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    board = EventAccumulator(str(run_dir / "tensorboard" / "eval-model"))
    board.Reload()
    assert board.Scalars("eval/accuracy")[0].value == report["accuracy"]


def test_evaluate_under_torchrun_and_spawn_counts_each_sample_once(counted):
    """253 validation images on 2 workers (127 + 126, no padding): the 2-worker run's figures, from either
    launcher (torchrun here; --spawn: best.pt, scored the same way); on 3 workers (85 + 84 + 84) and on 1, the same
    counts (the evaluations of `counted`)."""
    run_dir, _, evaluated = counted
    run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "train.evaluate",
         str(run_dir)])
    report = json.loads((run_dir / "eval-model.json").read_text())
    assert report["samples"] == 253 and report["world_size"] == 2
    _equal_to_the_final_evaluation(run_dir, report)
    best = evaluated["two-best"][1]
    recorded = status(run_dir)["best"]
    assert (best["loss"], best["accuracy"], best["samples"], best["world_size"]) == \
        (recorded["val_loss"], recorded["val_accuracy"], recorded["val_samples"], 2)
    # 3 workers share the 253 images unevenly, 1 takes them all: the same images counted once, the same counts.
    one, three = evaluated["one"][1], evaluated["three"][1]
    assert (one["world_size"], three["world_size"]) == (1, 3)
    assert (one["accuracy"], one["top5"], one["samples"], one["confusion"]) == \
        (three["accuracy"], three["top5"], three["samples"], three["confusion"]) == \
        (report["accuracy"], report["top5"], 253, report["confusion"])
    assert abs(one["loss"] - three["loss"]) <= 1e-6 * one["loss"]  # float32 sums in another order


def test_make_evaluate_weights_best_scores_the_best_evaluation_not_the_last(peaked):
    """A run whose best evaluation (best.pt) came before its last (model.pt): CHECKPOINT=best gives the best's figures
    and CHECKPOINT=model the final ones, and the two differ."""
    run_dir, _ = peaked
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


def test_make_evaluate_under_a_leftover_launcher_environment_or_a_bad_gpus_says_the_trainers_line(reference_run,
                                                                                                    tmp_path):
    """RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT left in a shell by another job: the trainer's line before the wait
    and, when no peer comes, its line naming the variables (exit 1), no traceback; GPUS=-1 the line make train
    gives. (The run's --timeout-s is set to 3 s in its config.json: the wait the evaluation takes from it.)"""
    run_dir = tmp_path / "run"
    shutil.copytree(reference_run(*PEAKED, workers=1), run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**config, "timeout_s": 3}))
    port = free_port()
    leftover = run(["make", "--no-print-directory", "evaluate", f"RUN={run_dir}"], expect=2, cwd=REPO,
                   env=env_for_tests(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
    variables = f"RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={port}"
    said = [line for line in leftover.stderr.splitlines() if not line.startswith("make: ")]
    assert said[0].startswith(f"trainbox: rank 0 of 2 from the environment ({variables}; ") and len(said) == 2, \
        leftover.stderr[-3000:]
    assert said[1].startswith(f"error: [rank 0] rank 1 did not join at 127.0.0.1:{port} within 3 s (") and \
        said[1].endswith(f"because {variables} are set in its environment (by neither torchrun nor --spawn); if they "
                         "are left over from another job, unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT and run the "
                         "same command to train alone, else start the other ranks with the same MASTER_ADDR and "
                         "MASTER_PORT"), leftover.stderr[-3000:]
    negative = make("evaluate", f"RUN={run_dir}", "GPUS=-1", expect=2)
    assert negative.stderr.splitlines()[0] == "error: GPUS=-1: a count of workers cannot be negative: give 0 for " \
                                              "the CPU or a positive count (GPUS=1, GPUS=4, ...)", negative.stderr


def test_a_run_folder_never_runs_code_unless_the_command_names_the_factory(reference_run, tmp_path):
    """A run folder on a shared NAS whose config.json names a module:factory (planted here, it leaves a mark when
    imported): evaluate and export refuse in one line that gives --model, and import nothing; naming the same
    factory on the command line is the user's consent; another name is refused; torchvision models need nothing."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference_run(*PEAKED, workers=1), run_dir)  # a debug run of one process, trained once
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


def test_the_report_a_person_reads(peaked, tmp_path):
    """make evaluate's eval-model.png is train/report/figure.py's figure of eval-model.json, pixel for pixel
    (tests/unit/test_report.py reads that figure: the labelled matrix, per-class accuracy worst first, the pairs),
    titled with the run, the checkpoint and top-1; TensorBoard has the same picture; the most confused pairs are
    the largest mistakes of the matrix, in the JSON and printed."""
    run_dir, proc = peaked  # exp1
    record = json.loads((run_dir / "eval-model.json").read_text())
    confusion, classes = np.array(record["confusion"]), record["classes"]
    mistakes = sorted((confusion[t, p] for t in range(len(classes)) for p in range(len(classes)) if t != p),
                      reverse=True)
    pairs = record["confused_pairs"]
    assert [r["count"] for r in pairs] == [n for n in mistakes[:10] if n] and pairs[0]["count"] > 0
    for r in pairs:
        t, p = classes.index(r["true"]), classes.index(r["predicted"])
        assert confusion[t, p] == r["count"] and r["share_of_true"] == confusion[t, p] / confusion[t].sum()
        assert re.search(rf"^  {re.escape(r['true'])} -> {re.escape(r['predicted'])} +{r['count']} ", proc.stdout,
                         re.MULTILINE)
    assert "most confused (true -> predicted: images, share of the true class):" in proc.stdout
    fig = figure.figure(record)
    assert fig.get_suptitle().startswith(f"exp1 · model.pt · top-1 {100 * record['accuracy']:.2f}%, top-5 ")
    expected = figure.save(fig, tmp_path / "again.png")
    written = figure.plt.imread(run_dir / "eval-model.png")
    assert written.shape[:2] == expected.shape[:2] and (np.round(written[..., :3] * 255) == expected).all()
    board = EventAccumulator(str(run_dir / "tensorboard" / "eval-model"), size_guidance={"images": 0})
    board.Reload()
    (image,) = board.Images("eval/report")
    shown = figure.plt.imread(io.BytesIO(image.encoded_image_string), format="png")
    assert shown.shape[:2] == expected.shape[:2] and (np.round(shown[..., :3] * 255) == expected).all()
    assert board.Scalars("eval/accuracy")[0].value == record["accuracy"]


def _progress_lines(text: str) -> list[str]:
    return [line for line in re.split(r"[\r\n]+", text.replace("\x1b[K", "")) if line.startswith("evaluating ")]


def test_an_evaluation_shows_its_progress_in_a_log_and_on_a_terminal(counted, tmp_path):
    """Its stderr a pipe (a CI log, a Slurm file): a plain line every TRAINBOX_PROGRESS_EVERY seconds (0: every
    batch) with done/total, the rate and the time left, then how it ended; nothing before the first interval is
    over (5 s by default: tests/unit/test_progress.py; an hour here). On a terminal: the same line redrawn in place.
    With 2 workers, rank 0 alone shows its share. (The evaluations of `counted`: 253 images, 8 batches of 32.)"""
    run_dir, _, evaluated = counted
    logged = evaluated["one"][0]
    lines = _progress_lines(logged)
    assert len(lines) == 9 and "\r" not in logged and "\x1b" not in logged, logged
    for done, line in enumerate(lines[:-1], 1):
        assert re.fullmatch(rf"evaluating model.pt \(253 images\): {done}/8 batches \({100 * done / 8:.1f}%\), "
                            rf"[0-9.,]+ batches/s, ETA \d+ s", line), line
    assert re.fullmatch(r"evaluating model.pt \(253 images\): 8/8 batches \(100\.0%\), [0-9.,]+ batches/s, "
                        r"\d+ s", lines[-1]), lines[-1]
    hourly = evaluated["three"][0]
    assert _progress_lines(hourly) == [], hourly  # nothing before the first interval is over

    controller, terminal = pty.openpty()
    proc = subprocess.Popen([PY, "-m", "train.evaluate", str(run_dir), "--out", str(tmp_path / "eval.json")],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=terminal,
                            env=env_for_tests(TRAINBOX_PROGRESS_EVERY="0"), cwd=REPO)
    os.close(terminal)
    seen = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the terminal closed: the process has ended
            break
        if not chunk:
            break
        seen += chunk
    os.close(controller)
    assert proc.wait(timeout=120) == 0
    shown = seen.decode()
    redraws = re.findall(r"\r(evaluating [^\r\n]*?)\x1b\[K", shown)  # the line redrawn, the rest erased
    assert [line.split(": ")[1].split()[0] for line in redraws] == [f"{n}/8" for n in range(1, 9)] + ["8/8"]
    assert "\n" not in shown[shown.index("\revaluating"):shown.rindex("\revaluating")]  # one line, drawn over
    assert "ETA" not in redraws[-1] and re.search(r", \d+ s$", redraws[-1]) and shown.endswith("\r\n")

    two = evaluated["two-best"][0]
    lines = _progress_lines(two)
    assert len(lines) == 5 and all(line.startswith("evaluating best.pt (rank 0's share of 253 images): ")
                                   for line in lines), two  # rank 0's 127 images in 4 batches, once


def test_training_never_imports_matplotlib_and_the_evaluation_command_does(counted):
    """The report's plotting library is the evaluation command's alone: a training run, evaluations included,
    never loads it (nor train.report.figure). (`counted`'s run and its evaluation on 1 worker, under -X importtime.)"""
    def imported(stderr: str) -> set[str]:
        return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}

    run_dir, trained, evaluated = counted
    trained = imported(trained)
    assert "torch" in trained and "train.run.validate" in trained and status(run_dir)["state"] == "done"
    assert [m["step"] for m in metrics(run_dir, "eval")] == [20, 40]  # evaluations included
    assert not {m for m in trained if m.split(".")[0] == "matplotlib" or m == "train.report.figure"}
    evaluated = imported(evaluated["one"][0])
    assert {"matplotlib.pyplot", "train.report.figure"} <= evaluated  # the control: it is seen where it is imported


def test_a_tracked_runs_evaluation_goes_to_its_mlflow_run(mlflow_server, reference_run, tmp_path):
    """A run tracked in MLflow: the evaluation's scores as metrics eval-<checkpoint>/..., its JSON and PNG as
    artifacts in eval-<checkpoint>/, in the run's own MLflow run, on the server MLFLOW_TRACKING_URI names, else the
    one the run was tracked at. A server that does not answer is one warning, and the files are written all the
    same; an untracked run sends nothing."""
    from mlflow import MlflowClient

    env = tracked_env(mlflow_server.uri, tmp_path)
    run_dir = tmp_path / "tracked"
    run(python_cmd(*DEBUG, "--max-steps", 4, "--eval-every", 0, "--run-dir", run_dir), env=env)
    run_id = json.loads((run_dir / "mlflow.json").read_text())["run_id"]
    proc = run([PY, "-m", "train.evaluate", str(run_dir), "--checkpoint", "best"], env=env)
    assert f"(+ eval-best.png, MLflow run {run_id})" in proc.stdout
    record = json.loads((run_dir / "eval-best.json").read_text())
    client = MlflowClient(mlflow_server.uri)
    metrics = client.get_run(run_id).data.metrics
    assert {k: metrics[f"eval-best/{k}"] for k in ("loss", "accuracy", "top5", "samples")} == \
        {k: record[k] for k in ("loss", "accuracy", "top5", "samples")}
    assert sorted(a.path for a in client.list_artifacts(run_id, "eval-best")) == ["eval-best/eval-best.json",
                                                                                  "eval-best/eval-best.png"]
    sent = client.download_artifacts(run_id, "eval-best/eval-best.png", str(tmp_path))
    assert open(sent, "rb").read() == (run_dir / "eval-best.png").read_bytes()
    untold = {k: v for k, v in env.items() if k != "MLFLOW_TRACKING_URI"}  # the server the run was tracked at
    run([PY, "-m", "train.evaluate", str(run_dir)], env=untold)
    assert client.get_run(run_id).data.metrics["eval-model/accuracy"] == \
        json.loads((run_dir / "eval-model.json").read_text())["accuracy"]

    os.remove(run_dir / "eval-best.json")
    down = run([PY, "-m", "train.evaluate", str(run_dir), "--checkpoint", "best"],
               env={**env, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}"})
    warnings = [line for line in down.stderr.splitlines() if "did not take the evaluation" in line]
    assert len(warnings) == 1 and "Connection refused" in warnings[0] and "Traceback" not in down.stderr, down.stderr
    assert (run_dir / "eval-best.json").is_file() and "MLflow run" not in down.stdout

    untracked = tmp_path / "untracked"
    shutil.copytree(reference_run(*PEAKED, workers=1), untracked)  # a debug run trained once, untracked
    alone = run([PY, "-m", "train.evaluate", str(untracked)], env=env)
    assert "MLflow" not in alone.stdout + alone.stderr and not (untracked / "mlflow.json").exists()
