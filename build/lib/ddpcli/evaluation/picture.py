"""confusion.png: where the model errs, readable at 10 classes and at 1,000.

Up to FULL_MATRIX_CLASSES classes: the whole matrix, rows normalised to recall (each cell
the share of the true class's images predicted as the column's), every cell's count
written in it, every class named. Beyond: no one can read a thousand names on an axis, so
the picture is the most confused pairs as bars (true -> predicted, images, share of the
true class), beside the whole matrix as a texture whose off-diagonal marks show whether
the errors gather in blocks (similar classes next to each other in label order).
"""

from __future__ import annotations

from io import BytesIO
from pathlib import Path

import numpy as np

from ddpcli.evaluation.metrics import most_confused
from ddpcli.files import write_bytes_atomic

FULL_MATRIX_CLASSES = 30
PAIRS_SHOWN = 25
TEXTURE_SIDE = 250  # dots a side of the all-classes picture, whatever the classes


def write_confusion_png(matrix: np.ndarray, classes: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display, no GUI toolkit: the same picture everywhere
    from matplotlib.figure import Figure

    if len(classes) <= FULL_MATRIX_CLASSES:
        figure = full_matrix_figure(Figure, matrix, classes, title)
    else:
        figure = confused_pairs_figure(Figure, matrix, classes, title)
    buffer = BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    write_bytes_atomic(path, buffer.getvalue())


def row_shares(matrix: np.ndarray) -> np.ndarray:
    support = matrix.sum(axis=1, keepdims=True)
    return np.divide(matrix, support, out=np.zeros(matrix.shape), where=support > 0)


def full_matrix_figure(Figure, matrix: np.ndarray, classes: list[str], title: str):
    size = len(classes)
    side = min(14.0, 3.0 + 0.45 * size)
    figure = Figure(figsize=(side + 1.5, side))
    axes = figure.add_subplot()
    shares = row_shares(matrix)
    image = axes.imshow(shares, cmap="Blues", vmin=0, vmax=1)
    figure.colorbar(image, ax=axes, fraction=0.046, pad=0.04, label="share of the true class")
    font = 9 if size <= 12 else 7 if size <= 20 else 5
    for row in range(size):
        for column in range(size):
            if matrix[row, column]:
                colour = "white" if shares[row, column] > 0.5 else "black"
                axes.text(column, row, str(matrix[row, column]), ha="center", va="center",
                          fontsize=font, color=colour)  # fmt: skip
    axes.set_xticks(range(size), [short(name) for name in classes], rotation=60, ha="right",
                    fontsize=font + 1)  # fmt: skip
    axes.set_yticks(range(size), [short(name) for name in classes], fontsize=font + 1)
    axes.set_xlabel("predicted class")
    axes.set_ylabel("true class")
    axes.set_title(title, fontsize=10)
    return figure


def confused_pairs_figure(Figure, matrix: np.ndarray, classes: list[str], title: str):
    figure = Figure(figsize=(16, 9))
    grid = figure.add_gridspec(1, 2, width_ratios=[1.25, 1])
    bars, texture = figure.add_subplot(grid[0]), figure.add_subplot(grid[1])
    pairs = most_confused(matrix, classes, PAIRS_SHOWN)
    support = dict(zip(classes, matrix.sum(axis=1).tolist(), strict=True))
    if pairs:
        labels = [f"{short(true, 28)} → {short(predicted, 28)}" for true, predicted, _ in pairs]
        counts = [count for _, _, count in pairs]
        positions = np.arange(len(pairs))[::-1]
        bars.barh(positions, counts, color="#d62728")
        bars.set_yticks(positions, labels, fontsize=8)
        for position, (true, _, count) in zip(positions, pairs, strict=True):
            share = count / support[true] if support[true] else 0.0
            bars.text(count, position, f" {count} ({share:.0%})", va="center", fontsize=7)
        bars.set_xlabel("images of the true class predicted as the other")
        bars.xaxis.get_major_locator().set_params(integer=True)
        bars.margins(x=0.15)
    else:
        bars.text(0.5, 0.5, "no image misclassified", ha="center", va="center")
        bars.set_axis_off()
    bars.set_title(f"the {len(pairs)} most confused pairs (true → predicted)", fontsize=10)
    shares = row_shares(matrix)
    np.fill_diagonal(shares, 0)
    block = max(1, -(-len(classes) // TEXTURE_SIDE))
    # Each mark is a pair of classes confused (the worst of a block of BLOCK x BLOCK pairs,
    # so a single error still shows); a square root lifts the rare ones.
    extent = (0, len(classes), len(classes), 0)
    texture.imshow(np.sqrt(block_max(shares, block)), cmap="Reds", interpolation="nearest",
                   vmin=0, extent=extent)  # fmt: skip
    blocks = f", {block}x{block} pairs a dot" if block > 1 else ""
    texture.set_title(
        f"all {len(classes)} classes, errors only (darker: more{blocks})", fontsize=10
    )
    texture.set_xlabel("predicted label")
    texture.set_ylabel("true label")
    figure.suptitle(title, fontsize=11)
    return figure


def block_max(values: np.ndarray, block: int) -> np.ndarray:
    """VALUES shrunk by BLOCK on each side, each cell the largest of its block."""
    if block == 1:
        return values
    side = -(-len(values) // block) * block
    padded = np.zeros((side, side))
    padded[: len(values), : len(values)] = values
    blocks = side // block
    return padded.reshape(blocks, block, blocks, block).max(axis=(1, 3))


def short(name: str, limit: int = 18) -> str:
    return name if len(name) <= limit else name[: limit - 1] + "…"
