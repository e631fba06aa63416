"""--task segmentation end to end on the built-in shapes masks: a run, its evaluation at another world size (each
pixel scored once), make evaluate's report, and make export as a torch-only program and an ONNX model."""

import json
import shutil
import sys

import numpy as np
import torch
from PIL import Image

from tests.e2e.test_export import ONNX_RUNTIME_ONLY, TORCH_ONLY
from tests.helpers import PY, REPO, make, metrics, python_cmd, run, status
from tests.unit.test_masks import block_pair, save_pair
from train.cli import parse_config
from train.tasks.factory import build_task

# 100 validation images: 3 workers share them unevenly (34, 33, 33).
SEG = ["--task", "segmentation", "--preset", "debug", "--val-samples", 100, "--max-steps", 20, "--eval-every", 10]


def _eager(run_dir, batch):
    """The run's network (its task's) with model.pt's weights, on a batch as the evaluation feeds it."""
    task = build_task(parse_config([*map(str, SEG)]))
    task.describe({"classes": json.loads((run_dir / "classes.json").read_text())})
    model = task.network(task.cfg.model)
    model.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True))
    with torch.no_grad():
        return model.eval()(batch)["out"]


def test_segmentation_trains_scores_every_pixel_once_at_any_world_size_and_ships(reference_run, tool_setup, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference_run(*SEG, workers=2), run_dir)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["task"]["name"] == "segmentation" and plan["task"]["metric"] == "miou" and plan["num_classes"] == 11
    # Bit for bit after a kill on the CPU, under torchrun and sbatch at 2 and 4 workers: CI's make chaos --task
    # segmentation (.ci/run); on CUDA to rounding only, as the plan says.
    assert plan["task"]["bit_exact_resume"].startswith("on the CPU; on CUDA to rounding only")
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model"] == "lraspp_mobilenet_v3_large" and config["task"] == "segmentation"  # the task's default
    evals = metrics(run_dir, "eval")
    assert [e["samples"] for e in evals] == [100, 100]  # every validation image once, 2 workers
    assert status(run_dir)["best"]["val_miou"] == max(e["miou"] for e in evals)
    # The run's model scored again on 1 worker (this process alone, as make evaluate runs it) and on 3: the same
    # pixels counted once, the same confusion matrix.
    scored = {}
    for workers in (1, 3):
        out = tmp_path / f"eval-{workers}.json"
        spawn = ["--spawn", str(workers)] if workers > 1 else []
        proc = run([PY, "-m", "train.evaluate", str(run_dir), *spawn, "--out", str(out)])
        scored[workers] = json.loads(out.read_text())
        assert "mIoU" in proc.stdout and "lowest IoU:" in proc.stdout
    one, three = scored[1], scored[3]
    assert one["confusion"] == three["confusion"] and one["samples"] == three["samples"] == 100
    assert (one["miou"], one["pixel_accuracy"], one["iou"]) == (three["miou"], three["pixel_accuracy"], three["iou"])
    assert one["miou"] == evals[-1]["miou"]  # model.pt: the final evaluation's weights
    assert abs(one["loss"] - three["loss"]) <= 1e-6 * one["loss"]  # float32 sums in another order
    assert sum(map(sum, one["confusion"])) == 100 * 16 * 16 and len(one["iou"]) == 11  # every pixel labelled here
    assert (tmp_path / "eval-1.png").stat().st_size > 10_000  # the report: IoU worst first, images and masks
    # make export: a program that needs torch alone, and ONNX Runtime's model, equal to the eager network.
    make("export", f"RUN={run_dir}")
    described = json.loads((run_dir / "model.pt2.json").read_text())
    assert described["task"] == "segmentation" and described["classes"] == one["classes"]
    assert described["output"].startswith("N x C x H x W logits")
    batch = torch.randn(9, 3, 16, 16)
    torch.save(batch, tmp_path / "batch.pt")
    run([sys.executable, "-I", "-c", TORCH_ONLY, str(tmp_path / "batch.pt"), str(run_dir / "model.pt2"),
         str(tmp_path / "out.pt")])
    program = torch.load(tmp_path / "out.pt")
    expected = _eager(run_dir, batch)
    torch.testing.assert_close(program[0], expected, rtol=1e-5, atol=1e-5)  # fp32 tolerance
    torch.testing.assert_close(program[2], expected[:7], rtol=1e-5, atol=1e-5)  # the batch size is dynamic
    tool_setup("onnx-setup")
    make("export", f"RUN={run_dir}", "FORMAT=onnx")
    np.save(tmp_path / "batch.npy", batch.numpy())
    served = run([str(REPO / ".venv-onnx" / "bin" / "python"), "-I", "-c", ONNX_RUNTIME_ONLY,
                  str(tmp_path / "batch.npy"), str(run_dir / "model.onnx"), str(tmp_path / "out.npz")])
    assert json.loads(served.stdout) == {"input": ["images", ["batch", 3, 16, 16]],
                                         "output": ["logits", ["batch", 11, 16, 16]]}
    with np.load(tmp_path / "out.npz") as saved:
        torch.testing.assert_close(torch.from_numpy(saved["arr_0"]), expected, rtol=1e-4, atol=1e-4)


def _mask_folder(data, train: int, val: int) -> None:
    for split, count in (("train", train), ("val", val)):
        for i in range(count):
            save_pair(data, split, f"p{i}", *block_pair(20, 24, offset=i % 3))
    (data / "classes.txt").write_text("".join(f"c{v}\n" for v in range(60)))


def test_a_folder_of_images_and_masks_trains_from_a_runs_weights_and_a_defect_is_one_line_before_any_run_folder(
        reference_run, tmp_path):
    """A folder of 60 classes starts from the shapes run's model.pt (11 classes), its backbone frozen: the heads'
    convolutions to the classes start anew, every backbone tensor (BatchNorm statistics included) stays the weights'."""
    data = tmp_path / "data"
    _mask_folder(data, 8, 3)
    flags = ["--task", "segmentation", "--dataset", "masks", "--data-dir", data, "--image-size", 16, "--batch-size", 4,
             "--max-steps", 4, "--eval-every", 2, "--num-workers", 0]
    source = reference_run(*SEG, workers=2) / "model.pt"
    proc = run(python_cmd(*flags, "--weights", source, "--freeze", "backbone", "--run-dir", tmp_path / "run"))
    assert "head classifier.low_classifier, classifier.high_classifier: 11 -> 60 classes, initialised anew" in \
        proc.stderr
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["source"]["kind"] == "masks" and plan["num_classes"] == 60 and plan["train_samples"] == 8
    assert [e["samples"] for e in metrics(tmp_path / "run", "eval")] == [3, 3] and status(tmp_path / "run")["best"]
    weights, trained = (torch.load(p, weights_only=True) for p in (source, tmp_path / "run" / "model.pt"))
    assert trained["classifier.high_classifier.weight"].shape[0] == 60
    assert all(torch.equal(trained[k], weights[k]) for k in trained if k.startswith("backbone."))
    assert not torch.equal(trained["classifier.cbr.0.weight"], weights["classifier.cbr.0.weight"])  # it trained
    Image.new("L", (24, 21)).save(data / "val" / "masks" / "p1.png")  # a mask of another size than its image
    refused = run(python_cmd(*flags, "--run-dir", tmp_path / "refused"), expect=2)
    assert refused.stderr.count("\n") == 1 and "masks of another size than their image (1): val/masks/p1.png" in \
        refused.stderr and not (tmp_path / "refused").exists()


def test_accumulation_trains_on_the_large_batchs_mean_of_labelled_pixels(tmp_path):
    """--grad-accum 4 at batch 8 equals batch 32 on a folder of masks whose random resize pads each crop with 255
    (ignored) by its own amount, so that every image counts another number of pixels: the trainer divides by the
    labelled pixels of the whole step. A network without batch statistics in float64 (tests.models): to rounding
    (1e-9), where a mean per micro-batch is off by far more."""
    data = tmp_path / "data"
    _mask_folder(data, 64, 4)
    flags = ["--task", "segmentation", "--dataset", "masks", "--data-dir", data, "--image-size", 16, "--num-workers", 0,
             "--model", "tests.models:tiny_segmenter_in_double", "--max-steps", 4, "--eval-every", 4, "--log-every", 1,
             "--lr", 0.05]
    run(python_cmd(*flags, "--batch-size", 8, "--grad-accum", 4, "--run-dir", tmp_path / "accumulated"))
    run(python_cmd(*flags, "--batch-size", 32, "--run-dir", tmp_path / "large"))
    a, b = (metrics(tmp_path / d, "train") for d in ("accumulated", "large"))
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3, 4]
    assert all(abs(x["loss"] - y["loss"]) < 1e-9 for x, y in zip(a, b, strict=True)), (a, b)
    weights, reference = (torch.load(tmp_path / d / "model.pt", weights_only=True) for d in ("accumulated", "large"))
    assert all((weights[k] - reference[k]).abs().max() < 1e-9 for k in weights)


def test_a_cityscapes_folder_at_a_batch_of_one_trains_every_image_bit_identically_and_its_checks_hold_for_evaluate(
        tmp_path):
    """Cityscapes' layout (images/<city>/<base>_leftImg8bit.png, masks/<city>/<base>_gtFine_labelTrainIds.png, its
    colour masks beside them) at --batch-size 1, one training mask all 255 (ignored): every image trains (the plan
    counts 8 of 8; the steps of the ignored one count nothing, said in the metrics, never a division by zero), and two
    identical runs on 2 threads give the same weights bit for bit. make evaluate on another folder runs training's
    mask checks: a value outside the run's classes is one line, and other classes name classes.txt."""
    data = tmp_path / "data"
    for split, count in (("train", 8), ("val", 2)):
        for i in range(count):
            city = ("aachen", "bremen")[i % 2]
            for part in ("images", "masks"):
                (data / split / part / city).mkdir(parents=True, exist_ok=True)
            image, mask = block_pair(20, 24, offset=i % 3)
            if split == "train" and i == 5:
                mask[:] = 255
            base = data / split / "{}" / city / f"{city}_{i:06d}_000019"
            Image.fromarray(image.permute(1, 2, 0).numpy()).save(f"{base}_leftImg8bit.png".format("images"))
            Image.fromarray(mask.numpy()).save(f"{base}_gtFine_labelTrainIds.png".format("masks"))
            Image.new("RGB", (24, 20)).save(f"{base}_gtFine_color.png".format("masks"))
    (data / "classes.txt").write_text("".join(f"c{v}\n" for v in range(30)))
    flags = ["--task", "segmentation", "--dataset", "masks", "--data-dir", data, "--image-size", 32, "--batch-size", 1,
             "--max-steps", 8, "--eval-every", 8, "--log-every", 1, "--num-workers", 0, "--threads", 2, "--seed", 5]
    for name in ("a", "b"):
        run(python_cmd(*flags, "--run-dir", tmp_path / name))
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert plan["train_samples"] == 8 and plan["val_samples"] == 2
    assert plan["source"]["train"].endswith("train/images, masks/<path>.png (or Cityscapes' names)")
    assert plan["source"]["val"].endswith("val/images, masks/<path>.png (or Cityscapes' names)")
    empty = [m for m in metrics(tmp_path / "a", "train") if m.get("empty_batches")]
    assert [(m["loss"], m["empty_batches"]) for m in empty] == [(None, 1)]  # the ignored image's step, once
    weights, again = (torch.load(tmp_path / name / "model.pt", weights_only=True) for name in ("a", "b"))
    assert all(torch.equal(weights[k], again[k]) for k in weights)
    other = tmp_path / "other"
    shutil.copytree(data / "val", other / "val")
    (other / "classes.txt").write_text("".join(f"c{v}\n" for v in range(30)))
    image, mask = block_pair(20, 24)
    mask[0, 0] = 40
    Image.fromarray(mask.numpy()).save(other / "val" / "masks" / "aachen" /
                                       "aachen_000000_000019_gtFine_labelTrainIds.png")
    refused = run([PY, "-m", "train.evaluate", str(tmp_path / "a"), "--data-dir", str(other)], expect=2)
    assert refused.stderr.count("\n") == 1 and "masks with values that are neither 255 nor a class of 0 .. 29 (1): " \
        "val/masks/aachen/aachen_000000_000019_gtFine_labelTrainIds.png (40)" in refused.stderr
    (other / "classes.txt").write_text("".join(f"k{v}\n" for v in range(41)))
    refused = run([PY, "-m", "train.evaluate", str(tmp_path / "a"), "--data-dir", str(other)], expect=2)
    assert "give a validation set of the run's classes (DATA_DIR/classes.txt, one name per line" in refused.stderr
