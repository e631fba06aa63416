"""make export / python -m train.export: a run's model for a process that has torch alone."""

import json
import shutil
import sys

import torch

from tests.helpers import DEBUG, PEAKED, PY, make, python_cmd, run, snapshot
from train.config import Config, parse_config
from train.data import build_datasets, prepare_inputs
from train.models import build_model

# A fresh interpreter that cannot import trainbox or torchvision: what a serving process has.
TORCH_ONLY = """
import json, sys
sys.modules["torchvision"] = None
sys.modules["train"] = None
import torch
program = torch.export.load(sys.argv[1]).module()
batch = torch.load(sys.argv[2])
outputs = [program(batch), program(batch[:1]), program(batch[:7])]
torch.save(outputs, sys.argv[3])
assert not [m for m in sys.modules if m.split(".")[0] in ("train", "torchvision") and sys.modules[m] is not None]
"""


def test_export_runs_in_a_torch_only_process_and_equals_the_eager_model(reference_run, tmp_path):
    """best.pt and model.pt of a run whose best evaluation is not its last: each program equals its own eager
    model, and the two differ."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference_run(*PEAKED, workers=1), run_dir)
    make("export", f"RUN={run_dir}", "CHECKPOINT=best")
    run([PY, "-m", "train.export", str(run_dir)])  # model.pt, the default
    cfg = parse_config([*map(str, PEAKED)])
    _, val_set, classes = build_datasets(cfg)
    images = torch.stack([val_set[i][0] for i in range(64)])
    batch = prepare_inputs(images, torch.device("cpu"), channels_last=False)  # as the evaluation feeds it
    torch.save(batch, tmp_path / "batch.pt")
    programs = []
    for name, weights in (("best.pt2", "best.pt"), ("model.pt2", "model.pt")):
        record = json.loads((run_dir / f"{name}.json").read_text())
        assert (record["center_crop"], record["mean"], record["std"]) == (16, [0.5] * 3, [0.25] * 3)
        assert record["classes"] == json.loads((run_dir / "classes.json").read_text()) and len(record["classes"]) == 10
        run([sys.executable, "-I", "-c", TORCH_ONLY, str(run_dir / name), str(tmp_path / "batch.pt"),
             str(tmp_path / "out.pt")])
        outputs = torch.load(tmp_path / "out.pt")
        state = torch.load(run_dir / weights, weights_only=True)
        eager = build_model(Config(**json.loads((run_dir / "config.json").read_text())), classes)
        eager.load_state_dict(state.get("model", state))
        with torch.no_grad():
            expected = eager.eval()(batch)
        torch.testing.assert_close(outputs[0], expected, rtol=1e-5, atol=1e-5)  # fp32 tolerance
        torch.testing.assert_close(outputs[1], expected[:1], rtol=1e-5, atol=1e-5)  # the batch size is dynamic
        torch.testing.assert_close(outputs[2], expected[:7], rtol=1e-5, atol=1e-5)
        programs.append(outputs[0])
    assert not torch.allclose(*programs, rtol=1e-3, atol=1e-3)  # best.pt2 is best.pt's model, not model.pt's


def test_a_model_that_cannot_be_exported_is_one_line_and_nothing_is_written(tmp_path):
    run_dir = tmp_path / "run"
    run(python_cmd(*DEBUG, "--model", "tests.models:branches_on_its_input", "--max-steps", 2, "--run-dir", run_dir))
    before = snapshot(run_dir)
    proc = run([PY, "-m", "train.export", str(run_dir), "--model", "tests.models:branches_on_its_input"], expect=None)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0].startswith("error: --model tests.models:branches_on_its_input cannot be exported with "
                                "torch.export (") and errors[0].endswith("nothing was written")
    assert snapshot(run_dir) == before  # no model.pt2, no .json, no temp file
    missing = run([PY, "-m", "train.export", str(tmp_path / "nowhere")], expect=2)
    assert "is not a trainbox run directory" in missing.stderr
