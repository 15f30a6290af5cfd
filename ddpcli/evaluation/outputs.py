"""The eval folder rank 0 writes: metrics.json, per_class.csv, confusion.csv,
confusion.png and, with --predictions, predictions.csv. Each file is written atomically."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

import numpy as np

from ddpcli import ui
from ddpcli.evaluation.metrics import Outcomes
from ddpcli.evaluation.picture import write_confusion_png
from ddpcli.files import write_text_atomic

METRICS_FILE = "metrics.json"
PER_CLASS_FILE = "per_class.csv"
CONFUSION_FILE = "confusion.csv"
PICTURE_FILE = "confusion.png"
PREDICTIONS_FILE = "predictions.csv"
EVAL_FILES = (METRICS_FILE, PER_CLASS_FILE, CONFUSION_FILE, PICTURE_FILE, PREDICTIONS_FILE)


def csv_text(rows: list[list[Any]]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows(rows)
    return buffer.getvalue()


def shown(value: float | None) -> str:
    return "" if value is None else f"{value:.6f}"


def write_eval_folder(
    out: Path,
    report: dict[str, Any],
    matrix: np.ndarray,
    outcomes: Outcomes,
    names: list[str],
    with_predictions: bool,
) -> dict[str, str]:
    """Every file of the folder; {what: path} for the report. An earlier eval's file that
    this one does not write is removed: the folder holds one eval's figures, never a mix."""
    out.mkdir(parents=True, exist_ok=True)
    earlier_eval = (out / METRICS_FILE).is_file()
    classes = report["classes"]
    files = {
        "metrics": out / METRICS_FILE,
        "per_class": out / PER_CLASS_FILE,
        "confusion": out / CONFUSION_FILE,
        "confusion_png": out / PICTURE_FILE,
    }
    if with_predictions:
        files["predictions"] = out / PREDICTIONS_FILE
    written = {key: str(path) for key, path in files.items()}
    write_text_atomic(files["metrics"], ui.json_text({**report, "files": written}, indent=2) + "\n")
    per_class = [["class", "precision", "recall", "f1", "support"]] + [
        [row["class"], shown(row["precision"]), shown(row["recall"]), shown(row["f1"]),
         row["support"]]
        for row in report["per_class"]
    ]  # fmt: skip
    write_text_atomic(files["per_class"], csv_text(per_class))
    confusion = [["true \\ predicted", *classes]] + [
        [name, *row] for name, row in zip(classes, matrix.tolist(), strict=True)
    ]
    write_text_atomic(files["confusion"], csv_text(confusion))
    write_confusion_png(matrix, classes, files["confusion_png"], picture_title(report))
    if with_predictions:
        write_text_atomic(files["predictions"], predictions_text(outcomes, names, classes))
    if earlier_eval:
        remove_unwritten(out, set(files.values()))
    return written


def remove_unwritten(out: Path, written: set[Path]) -> None:
    for path in (out / name for name in EVAL_FILES):
        if path not in written and path.is_file():
            path.unlink()
            ui.info(f"removed {path}: an earlier eval's, which this one does not write")


def picture_title(report: dict[str, Any]) -> str:
    accuracy = f"top-1 {100 * report['top1']:.2f}%"
    return (
        f"{Path(report['checkpoint']).name} ({report['weights']} weights) on "
        f"{report['data']} · {report['samples']} images · {accuracy}"
    )


def predictions_text(outcomes: Outcomes, names: list[str], classes: list[str]) -> str:
    """One row per image, in index order: its file (or index), its label, and the top-k
    classes with their probabilities."""
    k = outcomes.top_classes.shape[1]
    header = ["image", "label", "correct"]
    for rank in range(1, k + 1):
        header += [f"top{rank}", f"prob{rank}"]
    rows: list[list[Any]] = [header]
    for index, label, top, probs in zip(
        outcomes.indices.tolist(), outcomes.labels.tolist(), outcomes.top_classes.tolist(),
        outcomes.top_probs.tolist(), strict=True,
    ):  # fmt: skip
        row: list[Any] = [names[index], classes[label], int(top[0] == label)]
        for class_index, probability in zip(top, probs, strict=True):
            row += [classes[class_index], f"{probability:.6f}"]
        rows.append(row)
    return csv_text(rows)
