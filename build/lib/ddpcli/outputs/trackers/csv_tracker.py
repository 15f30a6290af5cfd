"""`--tracker csv`: steps.jsonl and metrics.jsonl as spreadsheets, OUT/csv/steps.csv and
OUT/csv/metrics.csv, one column per key (a key that appears later widens the file).

They follow the files exactly: at its start the tracker rebuilds both from the rows that
steps.jsonl and metrics.jsonl hold (a resume has already dropped those it trains again),
then appends each row as it comes, a partial epoch's too (which a resume drops again).
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from ddpcli.outputs.trackers.base import Ending, Opening, RowKind, Tracker

CSV_DIR = "csv"
SHEETS: dict[RowKind, str] = {"step": "steps.csv", "epoch": "metrics.csv"}


class Sheet:
    """One CSV file and the rows it holds."""

    def __init__(self, path: Path, rows: list[dict[str, Any]]) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = []
        self.add(rows)
        self.rewrite()

    def add(self, rows: list[dict[str, Any]]) -> bool:
        """True when a row brought a new column (the file is written again)."""
        widened = False
        for row in rows:
            self.rows.append(row)
            for key in row:
                if key not in self.columns:
                    self.columns.append(key)
                    widened = True
        return widened

    def append(self, rows: list[dict[str, Any]]) -> None:
        if self.add(rows):
            self.rewrite()
            return
        with open(self.path, "a", newline="") as handle:
            handle.write(self.lines(rows, header=False))

    def rewrite(self) -> None:
        from ddpcli.files import write_text_atomic  # files imports torch

        write_text_atomic(self.path, self.lines(self.rows, header=True))

    def lines(self, rows: list[dict[str, Any]], header: bool) -> str:
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=self.columns, lineterminator="\n")
        if header:
            writer.writeheader()
        for row in rows:
            writer.writerow({key: cell(value) for key, value in row.items()})
        return text.getvalue()


def cell(value: Any) -> Any:
    """None is an empty cell; a float keeps every digit (repr), as the JSON line does."""
    if value is None:
        return ""
    return repr(value) if isinstance(value, float) else value


class CsvTracker(Tracker):
    name = "csv"

    def __init__(self) -> None:
        self.sheets: dict[RowKind, Sheet] = {}

    def where(self) -> str:
        return ", ".join(str(sheet.path) for sheet in self.sheets.values())

    def start(self, opening: Opening) -> str | None:
        folder = opening.out / CSV_DIR
        folder.mkdir(parents=True, exist_ok=True)
        for kind, sheet in SHEETS.items():
            rows = [row for row_kind, row in opening.earlier if row_kind == kind]
            self.sheets[kind] = Sheet(folder / sheet, rows)
        return None

    def log_rows(self, rows: list[tuple[RowKind, dict[str, Any]]]) -> None:
        for kind, sheet in self.sheets.items():
            mine = [row for row_kind, row in rows if row_kind == kind]
            if mine:
                sheet.append(mine)

    def finish(self, ending: Ending) -> None:
        return None
