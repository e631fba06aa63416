"""--task segmentation in one process: its loss is the reference's (a sum over the labelled pixels, the auxiliary head
at 0.5) and its figures follow from their definitions, whatever way the pixels are split between ranks."""

import math

import pytest
import torch
import torch.nn.functional as F

from train.base.errors import ConfigError
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
                        (["--model", "resnet50"], "--model resnet50 is not a segmentation model of torchvision")):
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
    assert task.head(model) == "classifier" and "0.5 x the auxiliary head's" in task.facts()["loss"]


def _segmenter(name: str, classes: int, *flags):
    task = build_task(parse_config(["--task", "segmentation", "--model", name, *flags]))
    task.describe({"classes": [f"c{i}" for i in range(classes)]})
    return task, task.network(task.cfg.model)


@pytest.mark.parametrize("name", ["lraspp_mobilenet_v3_large", "fcn_resnet50"])
def test_a_classifiers_weights_start_the_backbone_as_torchvisions_weights_backbone_does(name, tmp_path, monkeypatch):
    """--weights MobileNet_V3_Large_Weights.IMAGENET1K_V1 (ResNet50_Weights for fcn_resnet50): the backbone's tensors
    are the ones torchvision's own builder takes from that file with weights_backbone=, the heads start anew. The file
    is a classifier of that architecture with random weights, placed where torch.hub keeps the named file."""
    from torchvision import models

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    entry = models.get_model_weights(name.split("_", 1)[1]).IMAGENET1K_V1
    torch.manual_seed(3)
    classifier = models.get_model(name.split("_", 1)[1], weights=None)
    path = tmp_path / "hub" / "checkpoints" / entry.url.rsplit("/", 1)[1]
    path.parent.mkdir(parents=True)
    torch.save(classifier.state_dict(), path)
    reference = models.get_model(name, weights=None, weights_backbone=entry, num_classes=5).state_dict()
    task, model = _segmenter(name, 5, "--weights", f"{type(entry).__name__}.IMAGENET1K_V1")
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(task.start_from(torch.load(path, weights_only=True), model))
    ours = model.state_dict()
    backbone = [k for k in ours if k.startswith("backbone.")]
    assert len(backbone) > 100 and all(torch.equal(ours[k], reference[k]) for k in backbone)
    assert all(torch.equal(ours[k], fresh[k]) for k in ours if not k.startswith("backbone."))  # the heads: anew
    with pytest.raises(ConfigError, match=r"--weights .* do not fit --model .*: backbone\..* is missing in the "):
        task.start_from({k.replace("features.", "stem."): v for k, v in classifier.state_dict().items()
                         if not k.startswith("layer1.")}, model)  # another architecture's


def test_a_segmentation_models_weights_start_every_tensor_but_the_convolutions_to_another_class_count(caplog):
    """A segmentation run's model.pt (11 classes) starts a 5-class run: the heads' convolutions to the classes start
    anew, every other tensor (BatchNorm statistics included) is the weights'; the same class count takes them all."""
    torch.manual_seed(0)
    _, source = _segmenter("deeplabv3_mobilenet_v3_large", 11)
    weights = source.state_dict()
    task, model = _segmenter("deeplabv3_mobilenet_v3_large", 5, "--weights", "w.pt")
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level("INFO", logger="train"):
        model.load_state_dict(task.start_from(weights, model))
    heads = {"classifier.4.weight", "classifier.4.bias", "aux_classifier.4.weight", "aux_classifier.4.bias"}
    assert "head classifier.4, aux_classifier.4: 11 -> 5 classes, initialised anew" in caplog.text
    ours = model.state_dict()
    assert all(torch.equal(ours[k], fresh[k] if k in heads else weights[k]) for k in ours)
    same, model = _segmenter("deeplabv3_mobilenet_v3_large", 11, "--weights", "w.pt")
    model.load_state_dict(same.start_from(weights, model))
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_segmentation_weights_name_the_model_or_its_backbone():
    from train.base.vision import named_weights
    from train.run.plan import dry_run

    for weights, part in (("MobileNet_V3_Large_Weights.IMAGENET1K_V1", {"for": "the backbone"}),
                          ("LRASPP_MobileNet_V3_Large_Weights.DEFAULT", {})):
        planned = dry_run(parse_config(["--task", "segmentation", "--weights", weights]), 1).to_dict()["weights"]
        assert planned["torchvision"] == str(named_weights("lraspp_mobilenet_v3_large", weights))
        assert {k: v for k, v in planned.items() if k == "for"} == part

    assert str(named_weights("lraspp_mobilenet_v3_large", "DEFAULT")) == \
        "LRASPP_MobileNet_V3_Large_Weights.COCO_WITH_VOC_LABELS_V1"
    assert str(named_weights("fcn_resnet50", "ResNet50_Weights.IMAGENET1K_V2")) == "ResNet50_Weights.IMAGENET1K_V2"
    fits = r"LRASPP_MobileNet_V3_Large_Weights.DEFAULT or MobileNet_V3_Large_Weights.DEFAULT \(its backbone\) fit it"
    with pytest.raises(ConfigError, match="--weights ResNet50_Weights.DEFAULT are weights of another architecture than "
                                          f"--model lraspp_mobilenet_v3_large: {fits}"):
        named_weights("lraspp_mobilenet_v3_large", "ResNet50_Weights.DEFAULT")


def test_a_segmentation_network_of_your_own_returns_the_logits_alone():
    task, model = _segmenter("tests.models:tiny_segmenter_in_double", 4)
    _, target = _batch(1, classes=4)
    logits = model(torch.randn(3, 3, 9, 9))
    assert logits.shape == (3, 4, 9, 9) and logits.dtype == torch.float64
    total, count = task.loss(logits, target)
    assert total.item() == pytest.approx(F.cross_entropy(logits, target, ignore_index=255, reduction="sum").item())
    with pytest.raises(ConfigError, match="names no head of its model"):
        task.head(model)
