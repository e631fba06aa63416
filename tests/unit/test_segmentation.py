"""--task segmentation in one process: its loss is the reference's (a sum over the labelled pixels, the auxiliary head
at 0.5) and its figures follow from their definitions, whatever way the pixels are split between ranks."""

import math

import pytest
import torch
import torch.nn.functional as F

from train.cli import parse_config
from train.tasks.factory import build_task

CPU = torch.device("cpu")


def _task(classes: int = 4):
    task = build_task(parse_config(["--task", "segmentation"]))
    task.describe({"classes": [f"c{i}" for i in range(classes)]})
    return task


def _batch(seed: int, n: int = 3, classes: int = 4, size: int = 9):
    g = torch.Generator().manual_seed(seed)
    output = {"out": torch.randn(n, classes, size, size, generator=g),
              "aux": torch.randn(n, classes, size, size, generator=g)}
    target = torch.randint(0, classes, (n, size, size), generator=g)
    target[torch.rand(n, size, size, generator=g) < 0.2] = 255  # ignored pixels
    return output, target


def test_the_loss_is_the_references_summed_over_the_labelled_pixels_with_the_aux_head_at_half():
    task = _task()
    output, target = _batch(0)
    total, count = task.loss(output, target)
    labelled = (target != 255).sum()
    assert count == labelled and task.count(target) == labelled
    # torchvision's references/segmentation: the mean over the labelled pixels of out, plus 0.5 x aux's
    reference = F.cross_entropy(output["out"], target, ignore_index=255) + \
        0.5 * F.cross_entropy(output["aux"], target, ignore_index=255)
    assert (total / count).item() == pytest.approx(reference.item(), rel=1e-6)


def test_the_scores_follow_from_their_definitions_and_from_any_split_of_the_pixels():
    """Pixel accuracy: the labelled pixels predicted right; IoU of a class: |predicted c and true c| over |predicted c
    or true c| among the labelled pixels; the mean over the classes that occur. Two ranks' states summed equal one."""
    task = _task()
    batches = [_batch(seed) for seed in (1, 2, 3)]
    whole, split = task.metric_state(CPU), [task.metric_state(CPU) for _ in range(2)]
    for i, (output, target) in enumerate(batches):
        task.update(whole, output, target)
        task.update(split[i % 2], output, target)
    assert torch.equal(split[0] + split[1], whole)  # sums: the all-reduce's result is the one-rank state
    scores = task.scores(whole, detail=True)
    predicted = torch.cat([o["out"].argmax(1) for o, _ in batches])
    truth = torch.cat([t for _, t in batches])
    labelled = truth != 255
    p, t = predicted[labelled], truth[labelled]
    assert scores["pixel_accuracy"] == pytest.approx((p == t).double().mean().item(), rel=1e-12)
    ious = [((p == c) & (t == c)).sum().item() / ((p == c) | (t == c)).sum().item() for c in range(4)]
    assert [scores["iou"][f"c{c}"] for c in range(4)] == pytest.approx(ious, rel=1e-12)
    assert scores["miou"] == pytest.approx(sum(ious) / 4, rel=1e-12)
    assert scores["samples"] == 9 and scores["confusion"][1][2] == ((t == 1) & (p == 2)).sum().item()
    total = sum(task.loss(o, t)[0].double() for o, t in batches)
    assert scores["loss"] == pytest.approx((total / labelled.sum()).item(), rel=1e-6)


def test_a_class_absent_from_truth_and_predictions_stays_out_of_the_mean():
    task = _task(classes=3)
    output = {"out": torch.tensor([[[[5.0, 5.0]], [[0.0, 0.0]], [[0.0, 0.0]]]])}  # predicts class 0 everywhere
    target = torch.tensor([[[0, 1]]])  # class 2: neither true nor predicted
    state = task.metric_state(CPU)
    task.update(state, output, target)
    scores = task.scores(state, detail=True)
    assert scores["iou"] == {"c0": 0.5, "c1": 0.0, "c2": None} and scores["miou"] == 0.25  # not NaN
    assert not math.isnan(scores["miou"])


def test_segmentation_takes_its_own_default_model_and_refuses_what_it_cannot_use(monkeypatch):
    from train.base.errors import ConfigError

    assert parse_config(["--task", "segmentation"]).model.model == "lraspp_mobilenet_v3_large"
    assert parse_config(["--task", "segmentation", "--model", "fcn_resnet50"]).model.model == "fcn_resnet50"
    for flags, line in ((["--dataset", "csv"], "--dataset csv holds no pixel masks"),
                        (["--model", "resnet50"], "--model resnet50 is not a segmentation model of torchvision"),
                        (["--weights", "w.pt"], "--weights w.pt with --task segmentation: starting weights are not")):
        with pytest.raises(ConfigError, match=line):
            build_task(parse_config(["--task", "segmentation", *flags])).check()
    with pytest.raises(ConfigError, match="--mixup-alpha 0.2 has no effect with --task segmentation"):
        parse_config(["--task", "segmentation", "--mixup-alpha", "0.2"])
    deterministic = build_task(parse_config(["--task", "segmentation", "--deterministic"]))
    deterministic.check()  # on the CPU: exact
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with a GPU, as the check asks
    with pytest.raises(ConfigError, match="--deterministic with --task segmentation on a GPU: the models' upsampling"):
        deterministic.check()
    build_task(parse_config(["--task", "segmentation", "--deterministic", "--device", "cpu"])).check()


def test_the_models_are_torchvisions_built_without_a_download_with_their_aux_head(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # where torch.hub would put a backbone's weights
    default = build_task(parse_config(["--task", "segmentation"]))
    default.describe({"classes": [f"c{i}" for i in range(5)]})
    model = default.network(default.cfg.model)  # built for real
    assert model(torch.zeros(1, 3, 32, 32))["out"].shape == (1, 5, 32, 32) and not list(tmp_path.rglob("*"))
    task = build_task(parse_config(["--task", "segmentation", "--model", "deeplabv3_mobilenet_v3_large"]))
    task.describe({"classes": [f"c{i}" for i in range(5)]})
    with torch.device("meta"):
        model = task.network(task.cfg.model)
    assert model.aux_classifier is not None and model.classifier[-1].out_channels == 5
    assert task.head(model) == "classifier" and "0.5 x the auxiliary head's" in task.plan()["loss"]
