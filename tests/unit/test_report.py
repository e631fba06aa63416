"""The evaluation report's figure (train/report/figure.py), read from matplotlib's own objects: what a person sees on it
for 10 to 1000 classes. tests/e2e/test_evaluate.py checks the figure `make evaluate` writes is this one."""

import json
from pathlib import Path

import numpy as np
import pytest

from train.report import figure


def a_record(count: int, seed: int = 0) -> dict:
    """What `python -m train.evaluate` records, for `count` classes and 40 predictions per class, 70 % right."""
    rng = np.random.default_rng(seed)
    classes = [f"class {i}" for i in range(count)]
    truth = rng.integers(0, count, 40 * count)
    predicted = np.where(rng.random(truth.size) < 0.7, truth, rng.integers(0, count, truth.size))
    confusion = np.zeros((count, count), dtype=np.int64)
    np.add.at(confusion, (truth, predicted), 1)
    rows = confusion.sum(1)
    return {"run": "exp1", "weights": "runs/exp1/best.pt", "loss": 0.9, "accuracy": np.trace(confusion) / truth.size,
            "top5": 0.95, "samples": int(truth.size), "classes": classes, "confusion": confusion.tolist(),
            "per_class_accuracy": {c: (confusion[i, i] / rows[i] if rows[i] else None) for i, c in enumerate(classes)},
            "confused_pairs": figure.confused_pairs(confusion.tolist(), classes)}


def panels(fig) -> dict:
    """The figure's axes by what they show."""
    found = {ax.get_title().split(" (")[0].split(",")[0]: ax for ax in fig.axes if ax.get_title()}
    found["colour scale"] = next(ax for ax in fig.axes if ax.get_label() == "<colorbar>")
    return found


def test_the_confused_pairs_are_the_largest_mistakes_by_count():
    confusion = [[5, 3, 0], [1, 7, 4], [0, 4, 2]]
    pairs = figure.confused_pairs(confusion, ["a", "b", "c"])
    assert [(p["true"], p["predicted"], p["count"]) for p in pairs] == [
        ("c", "b", 4), ("b", "c", 4), ("a", "b", 3), ("b", "a", 1)]  # a tie: the larger share of the true class first
    assert pairs[0]["share_of_true"] == 4 / 6 and figure.confused_pairs([[3, 0], [0, 2]], ["a", "b"]) == []


@pytest.mark.parametrize("count", [10, 30, 40, 60, 1000])
def test_a_person_reads_the_figure(count):
    record = a_record(count)
    fig = figure.figure(record)
    axes = panels(fig)
    assert fig.get_suptitle() == (f"exp1 · best.pt · top-1 {100 * record['accuracy']:.2f}%, top-5 95.00% · "
                                  f"{40 * count} images, loss 0.9000")
    matrix = np.asarray(record["confusion"])

    # the matrix: which axis is the truth, the class names on both up to 50 classes, counts in the cells up to 30
    grid = axes["confusion matrix"]
    assert grid.get_title() == "confusion matrix (rows: the truth)"
    names = count <= 50  # the documented limits: names up to 50 classes, counts up to 30, then the 25 worst
    axes_say = "" if names else " (index in classes.json)"
    assert (grid.get_ylabel(), grid.get_xlabel()) == ("true class" + axes_say, "predicted class" + axes_say)
    shares = matrix / matrix.sum(1, keepdims=True)
    assert np.allclose(grid.images[0].get_array(), shares)  # each cell's colour: its share of the true class
    assert [t.get_text() for t in grid.get_yticklabels()] == (record["classes"] if names else
                                                              [t.get_text() for t in grid.get_yticklabels()])
    assert ([t.get_text() for t in grid.get_xticklabels()] == record["classes"]) is names
    cells = {(round(t.get_position()[1]), round(t.get_position()[0])): int(t.get_text()) for t in grid.texts}
    if count <= 30:
        assert cells == {(int(r), int(c)): int(matrix[r, c]) for r, c in zip(*np.nonzero(matrix), strict=True)}
    else:
        assert cells == {}
    assert axes["colour scale"].get_ylabel() == "share of the true class's images"

    # per-class accuracy, worst first: every class up to 50, the 25 worst above
    bars = axes["per-class accuracy"]
    worst_first = sorted(record["classes"], key=lambda c: (record["per_class_accuracy"][c], c))
    shown = [t.get_text() for t in bars.get_yticklabels()]
    assert shown == (worst_first if names else worst_first[:25])
    assert [p.get_width() for p in bars.patches] == pytest.approx(
        [100 * record["per_class_accuracy"][c] for c in shown])
    assert bars.yaxis_inverted()  # the first, the worst, on top
    (line,) = bars.lines
    assert list(line.get_xdata()) == [100 * record["accuracy"]] * 2 and line.get_linestyle() == "--"

    # the most confused pairs, a table whatever the class count
    table = axes["most confused pairs"].tables[0]
    cells = table.get_celld()
    rows = [[cells[r, c].get_text().get_text() for c in range(4)] for r in range(len(record["confused_pairs"]) + 1)]
    assert rows[0] == ["true class", "predicted as", "images", "of the true class"]
    assert rows[1:] == [[p["true"], p["predicted"], str(p["count"]), f"{100 * p['share_of_true']:.1f}%"]
                        for p in record["confused_pairs"]]
    assert len(rows) == 11
    figure.plt.close(fig)


def test_the_saved_png_is_the_figure(tmp_path):
    fig = figure.figure(a_record(12))
    pixels = figure.save(fig, tmp_path / "eval.png")
    saved = figure.plt.imread(tmp_path / "eval.png")
    assert saved.shape[:2] == pixels.shape[:2] and (np.round(saved[..., :3] * 255) == pixels).all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.png"]  # no temporary file left


def test_the_pictured_report_is_what_the_report_draws_today(tmp_path):
    """docs/eval-report.png (README, docs/training.md): what `make evaluate` wrote for a 100-step run of the built-in
    dataset, beside the record it wrote (docs/eval-report.json); the figure of that record today, pixel for pixel.
    When the report's drawing changes, the picture is made again."""
    docs = Path(__file__).resolve().parents[2] / "docs"
    record = json.loads((docs / "eval-report.json").read_text())
    assert record["run"] == "shapes-100-steps" and record["dataset"] == "shapes" and len(record["classes"]) == 10
    drawn = figure.save(figure.figure(record), tmp_path / "now.png")
    pictured = figure.plt.imread(docs / "eval-report.png")
    assert pictured.shape[:2] == drawn.shape[:2] and (np.round(pictured[..., :3] * 255) == drawn).all()
