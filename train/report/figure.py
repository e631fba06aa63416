"""The evaluation report's figure, drawn with matplotlib (Agg: no display needed) from the record that
`python -m train.evaluate` writes (eval-<checkpoint>.json), so the same record always gives the same picture.
Only the evaluation command imports this module: training never loads matplotlib.

  the confusion matrix: rows the true class, columns the predicted one, each row's colour its share of that
    class's images (a colour scale beside), the counts in the cells up to CELL_COUNTS_UP_TO classes, the class
    names on both axes up to NAMES_UP_TO (above: the matrix alone, its class indices, and the pairs name them);
  per-class accuracy, worst first (above NAMES_UP_TO classes, the WORST_SHOWN worst);
  the most confused pairs (true -> predicted), a table;
  a title with the run, the checkpoint and top-1.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: files only, whatever DISPLAY says
import matplotlib.pyplot as plt
import numpy as np

from train.files.rundir import atomic_file

CELL_COUNTS_UP_TO = 30  # classes: the counts written in the matrix's cells
NAMES_UP_TO = 50  # classes: the class names on the matrix's axes and every class in the bar chart
WORST_SHOWN = 25  # classes in the bar chart above NAMES_UP_TO
PAIRS = 10  # rows of the most confused pairs


def confused_pairs(confusion: list[list[int]], classes: list[str], n: int = PAIRS) -> list[dict]:
    """The n most frequent mistakes, (true class, predicted class) by count, then by share of the true class."""
    matrix = np.asarray(confusion)
    rows = matrix.sum(1)
    pairs = [{"true": classes[t], "predicted": classes[p], "count": int(matrix[t, p]),
              "share_of_true": float(matrix[t, p] / rows[t])}
             for t, p in zip(*np.nonzero(matrix), strict=True) if t != p]
    return sorted(pairs, key=lambda r: (-r["count"], -r["share_of_true"], r["true"], r["predicted"]))[:n]


def title(record: dict) -> str:
    top5 = f", top-5 {100 * record['top5']:.2f}%" if "top5" in record else ""
    return (f"{record['run']} · {Path(record['weights']).name} · top-1 {100 * record['accuracy']:.2f}%{top5} · "
            f"{record['samples']} images, loss {record['loss']:.4f}")


def figure(record: dict) -> plt.Figure:
    """The whole report on one figure: the matrix on the left; per-class accuracy and the pairs on the right."""
    classes = record["classes"]
    count = len(classes)
    side = min(max(5.0, 0.32 * count + 2.5), 14.0)  # inches for the matrix: cells big enough to read
    fig = plt.figure(figsize=(side + 7.5, max(side, 7.0)), dpi=100, layout="constrained")
    grid = fig.add_gridspec(2, 2, width_ratios=[side, 7.5], height_ratios=[3, 2])
    draw_matrix(fig, fig.add_subplot(grid[:, 0]), np.asarray(record["confusion"]), classes)
    draw_per_class(fig.add_subplot(grid[0, 1]), record)
    draw_pairs(fig.add_subplot(grid[1, 1]), record["confused_pairs"], count)
    fig.suptitle(title(record), fontsize=13, fontweight="bold")
    return fig


def draw_matrix(fig: plt.Figure, ax: plt.Axes, matrix: np.ndarray, classes: list[str]) -> None:
    count = len(classes)
    share = matrix / np.maximum(matrix.sum(1, keepdims=True), 1)
    image = ax.imshow(share, cmap="Blues", vmin=0, vmax=1, interpolation="nearest" if count <= NAMES_UP_TO else "auto")
    bar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.02)
    bar.set_label("share of the true class's images")
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title("confusion matrix (rows: the truth)", fontsize=11)
    if count <= NAMES_UP_TO:
        size = 9 if count <= CELL_COUNTS_UP_TO else 7
        ax.set_xticks(range(count), classes, rotation=45, ha="right", rotation_mode="anchor", fontsize=size)
        ax.set_yticks(range(count), classes, fontsize=size)
    else:
        ax.set_xlabel("predicted class (index in classes.json)")
        ax.set_ylabel("true class (index in classes.json)")
    if count <= CELL_COUNTS_UP_TO:
        for (t, p), n in np.ndenumerate(matrix):
            if n:
                ax.text(p, t, str(n), ha="center", va="center", fontsize=8 if count > 15 else 9,
                        color="white" if share[t, p] > 0.5 else "black")


def draw_per_class(ax: plt.Axes, record: dict) -> None:
    scored = sorted(((v, k) for k, v in record["per_class_accuracy"].items() if v is not None),
                    key=lambda vk: (vk[0], vk[1]))
    count = len(record["classes"])
    shown = scored if count <= NAMES_UP_TO else scored[:WORST_SHOWN]
    names = [k for _, k in shown]
    values = [100 * v for v, _ in shown]
    ax.barh(range(len(shown)), values, color=[plt.cm.RdYlGn(v / 100) for v in values], edgecolor="grey")
    ax.set_yticks(range(len(shown)), names, fontsize=9 if len(shown) <= 30 else 7)
    ax.invert_yaxis()  # the worst on top
    ax.set_xlim(0, 100)
    ax.set_xlabel(f"top-1 accuracy of the class (%); dashed: of all classes, {100 * record['accuracy']:.1f}%")
    ax.axvline(100 * record["accuracy"], color="black", linestyle="--", linewidth=1)
    if len(shown) <= 30:
        for i, v in enumerate(values):  # beside the bar, or inside a long one
            ax.text(v + 1 if v < 85 else v - 1, i, f"{v:.1f}", va="center", ha="left" if v < 85 else "right",
                    fontsize=8, color="black" if v < 85 else "white")
    what = "worst first" if len(shown) == len(scored) else f"the {len(shown)} worst of {count} classes"
    ax.set_title(f"per-class accuracy, {what}", fontsize=11)


def draw_pairs(ax: plt.Axes, pairs: list[dict], count: int) -> None:
    ax.axis("off")
    ax.set_title("most confused pairs", fontsize=11)
    if not pairs:
        ax.text(0.5, 0.5, "no mistakes", ha="center", va="center", transform=ax.transAxes)
        return
    rows = [[r["true"], r["predicted"], str(r["count"]), f"{100 * r['share_of_true']:.1f}%"] for r in pairs]
    table = ax.table(cellText=rows, colLabels=["true class", "predicted as", "images", "of the true class"],
                     loc="upper center", cellLoc="left", colLoc="left")
    table.auto_set_font_size(False)
    table.set_fontsize(9)
    table.scale(1, 1.25)
    for (row, _), cell in table.get_celld().items():
        cell.set_edgecolor("lightgrey")
        if row == 0:
            cell.set_text_props(fontweight="bold")


def save(fig: plt.Figure, path: Path) -> np.ndarray:
    """fig drawn once: its RGB pixels, for TensorBoard, and the same pixels as a PNG at path (written beside it,
    then moved in place)."""
    fig.canvas.draw()
    pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    with atomic_file(path, suffix=".png") as tmp:  # imsave reads the format from the name
        plt.imsave(tmp, pixels)
    return pixels


def segmentation_title(record: dict) -> str:
    return (f"{record['run']} · {Path(record['weights']).name} · mIoU {100 * record['miou']:.2f}%, pixel accuracy "
            f"{100 * record['pixel_accuracy']:.2f}% · {record['samples']} images, loss {record['loss']:.4f}")


def segmentation_figure(record: dict, pictures: list) -> plt.Figure:
    """A segmentation's report: per-class IoU worst first (dashed: the mean) on the left; on the right a few images of
    the validation set, each with its true mask and the model's, one colour per class (ignored pixels white)."""
    rows = max(len(pictures), 1)
    fig = plt.figure(figsize=(15, max(6.0, 2.6 * rows)), dpi=100, layout="constrained")
    grid = fig.add_gridspec(rows, 4, width_ratios=[6, 3, 3, 3])
    ax = fig.add_subplot(grid[:, 0])
    scored = sorted((v, k) for k, v in record["iou"].items() if v is not None)[:WORST_SHOWN]
    values = [100 * v for v, _ in scored]
    ax.barh(range(len(scored)), values, color=[plt.cm.RdYlGn(v / 100) for v in values], edgecolor="grey")
    ax.set_yticks(range(len(scored)), [k for _, k in scored], fontsize=9)
    ax.invert_yaxis()  # the worst on top
    ax.set_xlim(0, 100)
    ax.axvline(100 * record["miou"], color="black", linestyle="--", linewidth=1)
    ax.set_xlabel(f"IoU of the class (%); dashed: the mean, {100 * record['miou']:.1f}%")
    ax.set_title("per-class IoU, worst first", fontsize=11)
    colours = plt.get_cmap("tab20", max(len(record["classes"]), 2))
    for row, (image, truth, predicted) in enumerate(pictures):
        for column, (shown, name) in enumerate(((image.permute(1, 2, 0).numpy(), "image"),
                                                (_coloured(truth, colours), "true mask"),
                                                (_coloured(predicted, colours), "predicted"))):
            axis = fig.add_subplot(grid[row, column + 1])
            axis.imshow(shown, interpolation="nearest")
            axis.set_xticks([])
            axis.set_yticks([])
            if row == 0:
                axis.set_title(name, fontsize=11)
    fig.suptitle(segmentation_title(record), fontsize=13, fontweight="bold")
    return fig


def _coloured(mask, colours) -> np.ndarray:
    """A mask as RGB: class k in the colour map's k-th colour, ignored pixels (255) white."""
    values = np.asarray(mask, dtype=np.int64)
    rgb = colours(np.where(values == 255, 0, values))[..., :3]
    rgb[values == 255] = 1.0
    return rgb
