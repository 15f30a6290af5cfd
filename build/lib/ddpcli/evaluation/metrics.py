"""The figures of an evaluation, computed once, on rank 0, from every image's outcome in
index order: the same outcomes give the same figures bit for bit, whatever the world that
produced them. Pure numpy; fractions, as metrics.jsonl's `val_acc` is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

TOP_K = 5


@dataclass
class Outcomes:
    """Every image's outcome, in index order: its label, the model's top-k classes (best
    first) and their probabilities, and its loss (cross-entropy, fp32 per image)."""

    indices: np.ndarray  # int64 (N,)
    labels: np.ndarray  # int64 (N,)
    top_classes: np.ndarray  # int64 (N, k)
    top_probs: np.ndarray  # float32 (N, k)
    losses: np.ndarray  # float32 (N,)

    def __len__(self) -> int:
        return len(self.labels)

    @classmethod
    def joined(cls, parts: list[Outcomes]) -> Outcomes:
        """The ranks' outcomes as one, sorted by image index."""
        indices = np.concatenate([part.indices for part in parts])
        order = np.argsort(indices, kind="stable")

        def stacked(name: str) -> np.ndarray:
            return np.concatenate([getattr(part, name) for part in parts])[order]

        return cls(
            indices[order], stacked("labels"), stacked("top_classes"), stacked("top_probs"),
            stacked("losses"),
        )  # fmt: skip


def confusion_matrix(labels: np.ndarray, predicted: np.ndarray, num_classes: int) -> np.ndarray:
    """Rows: the true class; columns: the predicted one; cells: images."""
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(matrix, (labels, predicted), 1)
    return matrix


def ratio(numerator: float, denominator: float) -> float | None:
    """None where nothing was counted (a class never predicted has no precision)."""
    return float(numerator / denominator) if denominator else None


def per_class_rows(matrix: np.ndarray, classes: list[str]) -> list[dict[str, Any]]:
    rows = []
    for label, name in enumerate(classes):
        hits = int(matrix[label, label])
        support, predicted = int(matrix[label].sum()), int(matrix[:, label].sum())
        precision, recall = ratio(hits, predicted), ratio(hits, support)
        f1 = None
        if precision is not None and recall is not None:
            f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        rows.append(
            {"class": name, "precision": precision, "recall": recall, "f1": f1, "support": support}
        )
    return rows


def macro_average(rows: list[dict[str, Any]], key: str) -> float | None:
    """Over the classes the data has (support > 0); a class never predicted counts 0."""
    values = [row[key] or 0.0 for row in rows if row["support"]]
    return float(np.mean(values)) if values else None


def summarize(outcomes: Outcomes, classes: list[str]) -> tuple[dict[str, Any], np.ndarray]:
    """The metrics document and the confusion matrix."""
    count = len(outcomes)
    labels, top = outcomes.labels, outcomes.top_classes
    hits = top[:, 0] == labels
    matrix = confusion_matrix(labels, top[:, 0], len(classes))
    rows = per_class_rows(matrix, classes)
    top5 = None
    if len(classes) >= TOP_K:
        top5 = float((top[:, :TOP_K] == labels[:, None]).any(axis=1).sum() / count)
    # fp64, summed in index order: the same sum at any world.
    loss = float(outcomes.losses.astype(np.float64).sum() / count)
    document = {
        "samples": count,
        "top1": float(hits.sum() / count),
        "top5": top5,
        "loss": loss,
        "correct": int(hits.sum()),
        "macro_precision": macro_average(rows, "precision"),
        "macro_recall": macro_average(rows, "recall"),
        "macro_f1": macro_average(rows, "f1"),
        "per_class": rows,
    }
    return document, matrix


def most_confused(
    matrix: np.ndarray, classes: list[str], limit: int = 20
) -> list[tuple[str, str, int]]:
    """(true class, predicted class, images), the largest off-diagonal cells first; ties in
    label order."""
    off = matrix.copy()
    np.fill_diagonal(off, 0)
    flat = np.flatnonzero(off)
    order = flat[np.lexsort((flat, -off.ravel()[flat]))][:limit]
    size = len(classes)
    return [(classes[cell // size], classes[cell % size], int(off.ravel()[cell])) for cell in order]
