"""A run's records are what it trained: a resume that would change what the run is is refused before anything is
written, a longer run trains on the learning rates plan.json shows, and a run that diverges stops with exit code 2
and writes no model of it. Every JSON file it leaves is strict JSON."""

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import DEBUG, make, metrics, python_cmd, run, snapshot, status, torchrun_cmd
from train import evaluate
from train import export
from train.files import checkpoint_io as ckpt


def strict_json(path: Path):
    """The file parsed by a strict parser: NaN, Infinity and -Infinity are not JSON (RFC 8259)."""
    def refuse(constant):
        raise AssertionError(f"{path} holds {constant}, which is not JSON")
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(line, parse_constant=refuse) for line in text.splitlines()]
    return json.loads(text, parse_constant=refuse)


def json_files(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.rglob("*.json*") if p.suffix in (".json", ".jsonl"))


def test_a_resume_with_other_settings_is_refused_and_a_longer_run_trains_on_the_plans_rates(tmp_path):
    run_dir = tmp_path / "run"
    first = [*DEBUG, "--max-steps", 10, "--lr", 0.02, "--log-every", 1, "--run-dir", run_dir]
    run(python_cmd(*first))
    before = snapshot(run_dir)
    for changed, shown in ((["--lr", 0.5], "--lr 0.02 -> 0.5"), (["--optimizer", "sgd"], "--optimizer adamw -> sgd")):
        refused = run(python_cmd(*first, "--max-steps", 20, *changed), expect=2)
        assert refused.stderr.count("\n") == 1 and refused.stderr.startswith("error: "), refused.stderr
        assert f"is a run of other settings, which its checkpoint fixes ({shown})" in refused.stderr
        assert f"--weights {run_dir}/checkpoints/step_00000010.pt" in refused.stderr
        assert snapshot(run_dir) == before  # config.json, status.json, every checkpoint: as they were
    longer = run(python_cmd(*first, "--max-steps", 20))
    assert "resumed from" in longer.stderr and status(run_dir)["state"] == "done" and status(run_dir)["step"] == 20
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["resumes"] == [{"step": 10, "changed": {"max_steps": [10, 20]}}]
    assert json.loads((run_dir / "config.json").read_text())["max_steps"] == 20
    # The rates as trained: the 10-step schedule's for steps 1-10, the 20-step schedule's from step 11, each logged
    # after its step as the rate of the next (the last step logs the schedule's end).
    planned = json.loads(run(python_cmd(*DEBUG, "--max-steps", 20, "--lr", 0.02, "--dry-run")).stdout)["lr"]["values"]
    first_plan = json.loads(run(python_cmd(*DEBUG, "--max-steps", 10, "--lr", 0.02, "--dry-run")).stdout)["lr"]
    assert plan["lr"] == {"per": "step", "values": first_plan["values"] + planned[10:]}
    logged = {m["step"]: m["lr"] for m in metrics(run_dir, "train")}
    assert [logged[step] for step in range(1, 20) if step != 10] == \
        [plan["lr"]["values"][step] for step in range(1, 20) if step != 10]
    for path in json_files(run_dir):
        strict_json(path)


def test_a_diverged_run_stops_with_exit_2_and_keeps_only_finite_weights(tmp_path, capsys):
    """By step 3 the weights are finite but so large that the evaluation overflows (BatchNorm's statistics near 1e33):
    that evaluation stops the run, and its model never becomes best.pt. Weights that are not finite, however they
    got there, are refused by make evaluate and make export in one line."""
    run_dir = tmp_path / "run"
    proc = run(python_cmd(*DEBUG, "--lr", 1e6, "--spawn", 2, "--save-every", 2, "--log-every", 1, "--eval-every", 3,
                          "--run-dir", run_dir), expect=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert "the run diverged: the evaluation at step 3 had a loss of nan" in errors[0] or \
        "the run diverged: the loss was" in errors[0] or "were no longer finite" in errors[0], errors[0]
    assert "a restart cannot mend that: try a lower --lr" in errors[0]
    assert not any((run_dir / name).exists() for name in ("model.pt", "best.pt", "model_ema.pt"))
    recorded = strict_json(run_dir / "status.json")
    assert (recorded["state"], recorded["exit_code"]) == ("failed", 2) and "diverged" in recorded["error"]
    newest = ckpt.newest_valid(run_dir)
    assert newest is not None and f"--weights {newest} starts it from this run's newest checkpoint" in errors[0]
    state = torch.load(newest, weights_only=True)
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())
    for path in json_files(run_dir):
        strict_json(path)
    statistics = state["model"]["features.0.1.running_var"]
    diverged = {**state["model"], "features.0.1.running_var": torch.full_like(statistics, float("nan"))}
    torch.save({"model": diverged, "step": 3}, run_dir / "best.pt")  # as an earlier version could leave it
    capsys.readouterr()
    assert evaluate.main([str(run_dir), "--checkpoint", "best"]) == 2
    assert export.main([str(run_dir), "--checkpoint", "best"]) == 2
    refused = capsys.readouterr().err.splitlines()
    assert refused == 2 * [f"error: {run_dir}/best.pt: features.0.1.running_var is not finite (8 of 8 values NaN or "
                           f"infinite), the weights of a diverged run: pass a checkpoint from before it diverged "
                           f"(--checkpoint {run_dir}/checkpoints/step_N.pt, CHECKPOINT= with make), or train again "
                           f"with a lower --lr"], refused
    assert not list(run_dir.glob("eval-*")) and not list(run_dir.glob("best.pt2*"))


@pytest.mark.parametrize("launcher", ["torchrun", "make train"])
def test_a_diverged_run_fails_under_torchrun_and_make_train_too(tmp_path, launcher):
    """The same divergence under torchrun, and under make train (torchrun with restarts: each restart of a diverged
    run ends at once, exit 2 again): a non-zero exit, the one line, status failed, no model."""
    run_dir = tmp_path / "run"
    args = [*DEBUG, "--lr", "1e6", "--log-every", "1", "--device", "cpu", "--run-dir", run_dir]
    if launcher == "torchrun":
        proc = run(torchrun_cmd(2, *args), expect=None)
    else:
        proc = make("train", "RUNTIME=local", "GPUS=2", "ARGS=" + " ".join(map(str, args)), expect=None)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "the run diverged" in proc.stderr or "were no longer finite" in proc.stderr, proc.stderr[-3000:]
    assert "a restart cannot mend that: try a lower --lr" in proc.stderr
    recorded = strict_json(run_dir / "status.json")
    assert (recorded["state"], recorded["exit_code"]) == ("failed", 2) and "diverged" in recorded["error"]
    assert not any((run_dir / name).exists() for name in ("model.pt", "best.pt", "model_ema.pt"))
    if launcher == "make train":
        assert "trainbox: the workers stopped on the error above (exit 2)" in proc.stderr, proc.stderr[-3000:]
