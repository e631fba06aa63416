"""python -m train.export RUN_DIR (make export RUN=...): the run's model as an ExportedProgram that needs only
torch to run, with the preprocessing a caller needs recorded beside it.

  python -m train.export runs/exp1                      model.pt (the final model) -> runs/exp1/model.pt2
  python -m train.export runs/exp1 --checkpoint best    best.pt (the best evaluation)
  python -m train.export runs/exp1 --checkpoint ema     model_ema.pt -> model_ema.pt2 (--model-ema; best_ema too)
  python -m train.export runs/exp1 --checkpoint runs/exp1/checkpoints/step_00000200.pt --out /nas/models/exp1.pt2
  python -m train.export runs/exp2 --model mypkg.nets:build   a run of your own model: name its factory again

Writes OUT (torch.export, the batch dimension dynamic) and OUT.json: image size, resize, crop, interpolation,
mean, std and the class names. A caller:

  program = torch.export.load("model.pt2").module()
  logits = program(batch)          # batch: N x 3 x H x W float32, normalised as model.pt2.json says

A model that cannot be exported is one line naming why, and nothing is written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from train.runfiles import atomic_write
from train.data import eval_steps, preprocessing
from train.errors import ConfigError, end_process, fail
from train.evaluate import CHECKPOINTS, load_run, renamed
from train.models import build_model
from train.weights import normalisation

MAX_BATCH = 4096


def export(run_dir: Path, checkpoint: str, out: Path, model_spec: str = "") -> Path:
    cfg, classes, state, source = load_run(run_dir, checkpoint, model_spec)
    model = build_model(cfg, len(classes))
    try:
        model.load_state_dict(state)
    except (RuntimeError, KeyError, TypeError) as e:
        raise ConfigError(f"{source} does not fit the run's --model {cfg.model} ({str(e).splitlines()[0][:160]}): "
                          f"pass weights of this run") from None
    model.eval()
    size = eval_steps(cfg)[1]  # what the evaluation feeds the model: its centre crop
    example = torch.zeros(2, 3, size, size)
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    try:
        program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    except Exception as e:  # noqa: BLE001 - torch.export's errors are many; its first line says why
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
        raise ConfigError(f"--model {cfg.model} cannot be exported with torch.export ({why}): nothing was "
                          f"written") from None
    tmp = out.with_name(f".{out.stem}.tmp{os.getpid()}.pt2")  # torch.export.save wants the .pt2 suffix
    try:
        torch.export.save(program, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    record = {"weights": str(source), "model": cfg.model, "image_size": size, "max_batch": MAX_BATCH,
              **preprocessing(cfg, classes, *normalisation(cfg))}
    atomic_write(out.with_name(out.name + ".json"), (json.dumps(record, indent=2) + "\n").encode())
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run's folder (runs/<name>)")
    parser.add_argument("--checkpoint", default="model", help="model (model.pt, default), best (best.pt), ema "
                                                              "(model_ema.pt), best_ema (best_ema.pt) or a checkpoint "
                                                              "file of the run")
    parser.add_argument("--weights", help=argparse.SUPPRESS)  # the old spelling: one line naming the new
    parser.add_argument("--out", type=Path, help="the file to write (default: RUN_DIR/model.pt2; OUT.json beside)")
    parser.add_argument("--model", default="", help="a run of a package.module:factory model: the same factory, "
                                                    "to allow its import (a run folder alone never runs code)")
    ns = parser.parse_args(argv)
    if ns.weights is not None:
        return fail(renamed("python -m train.export", ns.weights))
    out = ns.out or ns.run_dir / (Path(CHECKPOINTS.get(ns.checkpoint, "model.pt")).stem + ".pt2")
    try:
        if ns.out and not out.parent.is_dir():
            raise ConfigError(f"{out.parent} does not exist: create it or pass another --out")
        written = export(ns.run_dir, ns.checkpoint, out, ns.model)
    except ConfigError as e:
        return fail(str(e))
    print(f"exported {written} (+ {written.name}.json: size, mean, std, interpolation, classes)")
    return 0


if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
