"""make export / python -m train.export: a run's model for a process that has torch alone, or ONNX Runtime alone."""

import json
import re
import shutil
import sys

import numpy as np
import pytest
import torch

from tests.helpers import DEBUG, PEAKED, PY, REPO, make, python_cmd, run, snapshot, without_bytecode
from train.cli import parse_config
from train.components.models import build_model
from train.config.settings import Config
from train.data import build_datasets, prepare_inputs

# A fresh interpreter that cannot import trainbox or torchvision: what a serving process has. BATCH, then each
# PROGRAM and the OUT its outputs go to.
TORCH_ONLY = """
import sys
sys.modules["torchvision"] = None
sys.modules["train"] = None
import torch
batch = torch.load(sys.argv[1])
for name, out in zip(sys.argv[2::2], sys.argv[3::2], strict=True):
    program = torch.export.load(name).module()
    torch.save([program(batch), program(batch[:1]), program(batch[:7])], out)
assert not [m for m in sys.modules if m.split(".")[0] in ("train", "torchvision") and sys.modules[m] is not None]
"""


# A serving process: ONNX Runtime and numpy, and no torch, trainbox or torchvision (.venv-onnx has them: blocked).
# BATCH, then each MODEL and the OUT its outputs go to; a line for each model: its input and output.
ONNX_RUNTIME_ONLY = """
import json, sys
for name in ("torch", "train", "torchvision"):
    sys.modules[name] = None
import numpy as np, onnxruntime
batch = np.load(sys.argv[1])
for model, out in zip(sys.argv[2::2], sys.argv[3::2], strict=True):
    session = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    (images,), (logits,) = session.get_inputs(), session.get_outputs()
    outputs = [session.run(None, {images.name: b})[0] for b in (batch, batch[:1], batch[:7])]
    np.savez(out, *outputs)
    print(json.dumps({"input": [images.name, images.shape], "output": [logits.name, logits.shape]}))
"""


def _pins(lock) -> dict[str, set[str]]:
    """A lock file's pins: each package's versions, with their markers."""
    found: dict[str, set[str]] = {}
    for name, pin in re.findall(r"^([A-Za-z0-9._-]+)==([^\\\n]+?) *\\$", lock.read_text(), re.MULTILINE):
        found.setdefault(name.lower(), set()).add(pin)
    return found


def _validation_batch(tmp_path):
    """The first 64 validation images of the PEAKED runs, as the evaluation feeds them to the model."""
    cfg = parse_config([*map(str, PEAKED)])
    _, val_set, classes = build_datasets(cfg)
    images = torch.stack([val_set[i][0] for i in range(64)])
    return prepare_inputs(images, torch.device("cpu"), channels_last=False), classes


def _eager(run_dir, weights, classes, batch):
    state = torch.load(run_dir / weights, weights_only=True)
    eager = build_model(Config.from_dict(json.loads((run_dir / "config.json").read_text())).model, classes)
    eager.load_state_dict(state.get("model", state))
    with torch.no_grad():
        return eager.eval()(batch)


@pytest.fixture(scope="module")
def exported(reference_run, tmp_path_factory):
    """A copy of the PEAKED run of one process (trained once: its best evaluation is not its last) after `make export
    RUN=... CHECKPOINT=best` (best.pt2) and `python -m train.export RUN_DIR` (model.pt2, the default). Read it; the
    tests add the other formats' files beside them."""
    run_dir = tmp_path_factory.mktemp("exported") / "run"
    shutil.copytree(reference_run(*PEAKED, workers=1), run_dir)
    make("export", f"RUN={run_dir}", "CHECKPOINT=best")
    run([PY, "-m", "train.export", str(run_dir)])  # model.pt, the default
    return run_dir


def test_export_runs_in_a_torch_only_process_and_equals_the_eager_model(exported, tmp_path):
    """best.pt and model.pt of a run whose best evaluation is not its last (make export CHECKPOINT=best and python
    -m train.export): each program, run by one torch-only process, equals its own eager model, and the two differ."""
    run_dir = exported
    batch, classes = _validation_batch(tmp_path)
    torch.save(batch, tmp_path / "batch.pt")
    pairs = (("best.pt2", "best.pt"), ("model.pt2", "model.pt"))
    run([sys.executable, "-I", "-c", TORCH_ONLY, str(tmp_path / "batch.pt"),
         *(str(p) for name, _ in pairs for p in (run_dir / name, tmp_path / f"{name}.out"))])
    programs = []
    for name, weights in pairs:
        record = json.loads((run_dir / f"{name}.json").read_text())
        assert (record["center_crop"], record["mean"], record["std"]) == (16, [0.5] * 3, [0.25] * 3)
        assert record["classes"] == json.loads((run_dir / "classes.json").read_text()) and len(record["classes"]) == 10
        outputs = torch.load(tmp_path / f"{name}.out")
        expected = _eager(run_dir, weights, classes, batch)
        torch.testing.assert_close(outputs[0], expected, rtol=1e-5, atol=1e-5)  # fp32 tolerance
        torch.testing.assert_close(outputs[1], expected[:1], rtol=1e-5, atol=1e-5)  # the batch size is dynamic
        torch.testing.assert_close(outputs[2], expected[:7], rtol=1e-5, atol=1e-5)
        programs.append(outputs[0])
    assert not torch.allclose(*programs, rtol=1e-3, atol=1e-3)  # best.pt2 is best.pt's model, not model.pt's


def test_onnx_export_runs_in_onnx_runtime_alone_and_equals_the_eager_model(exported, tmp_path):
    """make export FORMAT=onnx: its environment (ONNX_VENV) installed on first use from docker/onnx.lock, once,
    .venv unchanged; best.onnx and model.onnx, run by ONNX Runtime in a process without torch, equal their
    eager models within 1e-4 on the validation batch at any batch size, beside the same preprocessing as the .pt2."""
    run_dir, onnx_venv = exported, tmp_path / "venv-onnx"
    first = make("export", f"RUN={run_dir}", "CHECKPOINT=best", "FORMAT=onnx", f"ONNX_VENV={onnx_venv}")
    assert f"{onnx_venv}/bin/python -m pip install" in first.stdout and (onnx_venv / ".installed").is_file()
    again = make("export", f"RUN={run_dir}", "FORMAT=onnx", f"ONNX_VENV={onnx_venv}")
    assert "pip install" not in again.stdout  # installed once
    own = sorted(p.name for p in onnx_venv.glob("lib/python*/site-packages/*") if p.suffix not in (".pth",)
                 and not p.name.endswith(".dist-info") and p.name != "__pycache__")
    assert {"onnx", "onnxruntime", "onnxscript"} <= set(own) and not {"torch", "numpy", "train"} & set(own)
    (site,) = onnx_venv.glob("lib/python*/site-packages")
    assert without_bytecode(site) == []  # compiled once, on every core, not at each export
    listed = "import importlib.util as u; print([n for n in ('onnx', 'onnxscript', 'onnxruntime') if u.find_spec(n)])"
    assert run([PY, "-c", listed]).stdout == "[]\n"  # .venv has none of them
    assert "onnx" not in (REPO / "requirements.lock").read_text()  # nor does make setup, nor the image, install them
    pins = [_pins(REPO / name) for name in ("requirements.lock", "docker/onnx.lock")]
    shared = pins[0].keys() & pins[1].keys()
    assert {"numpy", "protobuf"} <= shared and all(pins[0][n] == pins[1][n] for n in shared)  # what both hold: as .venv
    batch, classes = _validation_batch(tmp_path)
    np.save(tmp_path / "batch.npy", batch.numpy())
    pairs = (("best.onnx", "best.pt"), ("model.onnx", "model.pt"))
    served = run([str(onnx_venv / "bin" / "python"), "-I", "-c", ONNX_RUNTIME_ONLY, str(tmp_path / "batch.npy"),
                  *(str(p) for name, _ in pairs for p in (run_dir / name, tmp_path / f"{name}.npz"))])
    assert [json.loads(line) for line in served.stdout.splitlines()] == 2 * [
        {"input": ["images", ["batch", 3, 16, 16]], "output": ["logits", ["batch", 10]]}]
    outputs = {}
    for name, weights in pairs:
        record = json.loads((run_dir / f"{name}.json").read_text())
        pt2 = json.loads((run_dir / "model.pt2.json").read_text())  # the exported fixture's
        assert (record["format"], record["input"], record["output"]) == ("onnx", "images", "logits")
        assert {k: v for k, v in record.items() if k not in ("format", "input", "output", "max_batch", "weights")} \
            == {k: v for k, v in pt2.items() if k not in ("format", "max_batch", "weights")}
        assert record["weights"] == str(run_dir / weights) and len(record["classes"]) == 10
        with np.load(tmp_path / f"{name}.npz") as saved:
            full, one, seven = (torch.from_numpy(saved[f"arr_{i}"]) for i in range(3))
        expected = _eager(run_dir, weights, classes, batch)
        torch.testing.assert_close(full, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(one, expected[:1], rtol=1e-4, atol=1e-4)  # the batch size is dynamic
        torch.testing.assert_close(seven, expected[:7], rtol=1e-4, atol=1e-4)
        outputs[name] = full
    assert not torch.allclose(*outputs.values(), rtol=1e-3, atol=1e-3)  # best.onnx is best.pt's model


def test_a_model_that_cannot_be_exported_is_one_line_and_nothing_is_written(tool_setup, tmp_path):
    """make export of a model torch.export cannot capture, as .pt2 and as ONNX, and FORMAT=onnx of one with an
    operator ONNX lacks: one line each naming why, and nothing written or lost (an earlier model.onnx stays as it
    was); the second still exports as .pt2. A run folder that is none, a format trainbox does not write, and ONNX
    asked of .venv: one line naming the fix."""
    tool_setup("onnx-setup")  # .venv-onnx, which make export FORMAT=onnx uses
    for model, why in (("branches_on_its_input", "cannot be exported with torch.export ("),
                       ("has_no_onnx_operator", "cannot be exported to ONNX (DispatchError: No ONNX function found "
                                                "for <OpOverload(op='prims.bessel_i0'")):
        run_dir = tmp_path / model
        run(python_cmd(*DEBUG, "--model", f"tests.models:{model}", "--max-steps", 2, "--eval-every", 0,
                       "--run-dir", run_dir))
        (run_dir / "model.onnx").write_bytes(b"an earlier export")
        before = snapshot(run_dir)
        if model == "branches_on_its_input":  # as .pt2 too, in the torch-only process
            proc = run([PY, "-m", "train.export", str(run_dir), "--model", f"tests.models:{model}"], expect=None)
            errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
            assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
            assert errors[0].startswith(f"error: --model tests.models:{model} cannot be exported with "
                                        "torch.export (") and errors[0].endswith("nothing was written")
            assert snapshot(run_dir) == before  # no model.pt2, no .json, no temp file
        proc = make("export", f"RUN={run_dir}", "FORMAT=onnx", f"MODEL=tests.models:{model}", expect=None)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert errors[0].startswith(f"error: --model tests.models:{model} {why}"), errors[0]
        assert "nothing was written" in errors[0]
        assert snapshot(run_dir) == before  # no .json, no temp folder, the earlier model.onnx untouched
    make("export", f"RUN={run_dir}", f"MODEL=tests.models:{model}")  # torch.export takes it
    assert (run_dir / "model.pt2").is_file()
    other = make("export", f"RUN={run_dir}", "FORMAT=tflite", expect=2)
    assert other.stderr.splitlines()[0] == "error: --format tflite: pass pt2 (torch.export, for a process with " \
                                           "torch) or onnx (ONNX Runtime, TensorRT, ...)"
    missing = run([PY, "-m", "train.export", str(tmp_path / "nowhere")], expect=2)
    assert "is not a trainbox run directory" in missing.stderr
    in_venv = run([PY, "-m", "train.export", str(run_dir), "--format", "onnx"], expect=2)
    assert in_venv.stderr.startswith("error: --format onnx needs onnx and onnxscript, which ") and \
        "make export FORMAT=onnx RUN=..." in in_venv.stderr and len(in_venv.stderr.splitlines()) == 1
    assert not (run_dir / "model.onnx.json").exists()
