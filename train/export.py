"""python -m train.export RUN_DIR (make export RUN=...): the run's model as a file to ship, with the
preprocessing a caller needs recorded beside it: an ExportedProgram that needs only torch, or an ONNX model for
ONNX Runtime, TensorRT, Triton and the rest.

  python -m train.export runs/exp1                      model.pt (the final model) -> runs/exp1/model.pt2
  python -m train.export runs/exp1 --checkpoint best    best.pt (the best evaluation)
  python -m train.export runs/exp1 --checkpoint ema     model_ema.pt -> model_ema.pt2 (--model-ema; best_ema too)
  python -m train.export runs/exp1 --checkpoint runs/exp1/checkpoints/step_00000200.pt --out /nas/models/exp1.pt2
  python -m train.export runs/exp1 --checkpoint runs/exp1/checkpoints/step_00000200.dcp   a sharded one: its model
  python -m train.export runs/exp2 --model mypkg.nets:build   a run of your own model: name its factory again
  make export RUN=runs/exp1 FORMAT=onnx                 -> runs/exp1/model.onnx (installs .venv-onnx on first use)

Writes OUT (the dimensions the task names dynamic: the batch, and for --task lm the sequence's length too) and OUT.json:
what the task says a caller must know (an image task: image size, resize, crop, interpolation, mean, std and the class
names; lm: its vocabulary and context). A caller:

  program = torch.export.load("model.pt2").module()
  logits = program(batch)          # batch: N x 3 x H x W float32, normalised as model.pt2.json says

  session = onnxruntime.InferenceSession("model.onnx")
  logits, = session.run(None, {"images": batch})    # a numpy array, as model.onnx.json says

--format onnx needs the onnx and onnxscript packages, which .venv does not hold: `make export FORMAT=onnx` (or
`make onnx-setup`) installs them from docker/onnx.lock into .venv-onnx, an environment that sees .venv's packages
and adds these, and runs the export there. A model that cannot be exported is one line naming why, and nothing
is written. torch is imported once the command line, the run folder and the checkpoint's name hold: a refusal answers
at once.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

from train.base.errors import ConfigError, end_process, fail, users_code
from train.evaluate import CHECKPOINTS, finished_run_parser, read_run, renamed
from train.files.rundir import atomic_file, atomic_write, move_into_place, read_description, to_json

MAX_BATCH = 4096
FORMATS = {"pt2": "torch.export, for a process with torch", "onnx": "ONNX Runtime, TensorRT, ..."}
ONNX_PACKAGES = ("onnx", "onnxscript")  # what torch.onnx's exporter imports (onnxruntime only runs the file)


def export(run_dir: Path, checkpoint: str, out: Path, model_spec: str = "", fmt: str = "pt2",
           task_spec: str = "") -> Path:
    cfg, classes, source = read_run(run_dir, checkpoint, model_spec, task_spec)
    import torch  # noqa: PLC0415 - torch, the weights and the task once the command line holds (a refusal is quick)

    from train.run.scoring import load_weights, network_of  # noqa: PLC0415
    from train.tasks.factory import build_task  # noqa: PLC0415

    state = load_weights(source, run_dir)
    with users_code((cfg.run.task, cfg.model.model)):  # an error raised in the team's own code: theirs, and one line
        task = build_task(cfg)
        task.describe(read_description(run_dir) or {"classes": classes})
        model = network_of(task, cfg.model, state, source).eval()
        example, names, described = task.export_io()  # an input of batch 2; the names; what a caller must know
    dims = {dim: torch.export.Dim(name, min=1, max=largest or MAX_BATCH)
            for dim, (name, largest) in task.dynamic_dims().items()}  # the batch, a sequence's length, ...
    try:
        program = torch.export.export(task.exportable(model), (example,), dynamic_shapes=(dims,))
    except Exception as e:  # noqa: BLE001 - torch.export's errors are many; its first line says why
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
        raise ConfigError(f"--model {cfg.model.model} cannot be exported with torch.export ({why}): nothing was "
                          f"written") from None
    if fmt == "onnx":
        save_onnx(to_onnx(program, example, cfg.model.model, names,
                          {dim: name for dim, (name, _) in task.dynamic_dims().items()}), out)
        shape = {"format": "onnx", **names}
    else:
        with atomic_file(out, suffix=".pt2") as tmp:  # torch.export.save wants the .pt2 suffix
            torch.export.save(program, tmp)
        shape = {"format": "pt2", "max_batch": MAX_BATCH}
    record = {"weights": str(source), "model": cfg.model.model, "task": task.name, **described, **shape}
    atomic_write(out.with_name(out.name + ".json"), (to_json(record, indent=2) + "\n").encode())
    return out


def to_onnx(program, example, model: str, names: dict, dims: dict | None = None):
    """The captured program in ONNX (torch.onnx's exporter, from the ExportedProgram; `example`: its input tensor),
    the dynamic dimensions (dims: {dim: name}, the batch by default) named. An operator ONNX has no translation for is
    one line naming it."""
    import torch  # noqa: PLC0415 - as in export()

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.onnx's deprecation notes on its own internals
            return torch.onnx.export(program, (example,), dynamo=True, verbose=False,
                                     input_names=[names["input"]], output_names=[names["output"]],
                                     dynamic_shapes=(dims or {0: "batch"},))
    except Exception as e:  # noqa: BLE001 - the exporter wraps its reasons; the innermost one says which operator
        while e.__cause__ is not None:
            e = e.__cause__
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip().splitlines() or [""]
        raise ConfigError(f"--model {model} cannot be exported to ONNX ({type(e).__name__}: {text[0][:200]}): "
                          f"nothing was written; FORMAT=pt2 (torch.export) may still take it") from None


def save_onnx(onnx_program, out: Path) -> None:
    """out, whole or not at all: written in a folder of its own beside it, then moved in place. A model over 2 GB
    keeps its weights in OUT.data (ONNX's external data, named in the file): that goes first, the model last."""
    staging = out.with_name(f".{out.name}.tmp{os.getpid()}")
    staging.mkdir()
    try:
        onnx_program.save(str(staging / out.name))
        files = sorted(staging.iterdir(), key=lambda f: f.name == out.name)
        for file in files:
            move_into_place(file, out.with_name(file.name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def check_format(fmt: str) -> None:
    """A format this command writes, in an environment that can write it."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt}: pass " + " or ".join(f"{k} ({v})" for k, v in FORMATS.items()))
    missing = [name for name in ONNX_PACKAGES if fmt == "onnx" and importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"--format onnx needs {' and '.join(missing)}, which {sys.prefix} does not hold: run make "
                          f"export FORMAT=onnx RUN=... (it installs them from docker/onnx.lock into .venv-onnx on "
                          f"first use), or make onnx-setup and then .venv-onnx/bin/python -m train.export")


def main(argv: list[str]) -> int:
    parser = finished_run_parser("python -m train.export", __doc__)
    parser.add_argument("--format", default="pt2", help="pt2 (torch.export, default) or onnx (ONNX: needs "
                                                       ".venv-onnx, which make export FORMAT=onnx installs)")
    parser.add_argument("--out", type=Path, help="the file to write (default: RUN_DIR/model.pt2 or model.onnx, as "
                                                 "the checkpoint; OUT.json beside)")
    try:
        ns = parser.parse_args(argv)
    except ConfigError as e:
        return fail(e)
    if ns.weights is not None:
        return fail(renamed(parser.prog, ns.weights))
    out = ns.out or ns.run_dir / (Path(CHECKPOINTS.get(ns.checkpoint, "model.pt")).stem + "." + ns.format)
    try:
        check_format(ns.format)
        if ns.out and not out.parent.is_dir():
            raise ConfigError(f"{out.parent} does not exist: create it or pass another --out")
        written = export(ns.run_dir, ns.checkpoint, out, ns.model, ns.format, ns.task)
    except ConfigError as e:
        return fail(e)
    print(f"exported {written} (+ {written.name}.json: its input and output, and what a caller does before it)")
    return 0


if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
