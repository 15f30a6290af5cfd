"""The run's record between epochs: one row per logging interval in `steps.jsonl` (and, with
`--tracker`, the same rows sent on to the trackers), written by rank 0 alone.

Rows come from the sums the loop already reduces at its logging points (`[loss sum,
correct, count]` of the epoch so far, over all ranks, then each rank's data wait and
compute seconds): an interval's values are the
difference between two such reductions, so logging adds no host synchronisation.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Protocol

from ddpcli import ui
from ddpcli.outputs.rankload import rank_figures, rank_seconds

STEPS_FILE = "steps.jsonl"
TENSORBOARD_DIR = "tensorboard"  # --tracker tensorboard's event files


class Sink(Protocol):
    """Somewhere else the rows go (the trackers: ddpcli.outputs.trackers), beside
    steps.jsonl and metrics.jsonl."""

    def step_row(self, row: dict[str, Any]) -> None: ...
    def epoch_row(self, metrics: dict[str, Any]) -> None: ...


class StepLog:
    """Appends one JSON line per interval; a line is flushed at once, so a run that is still
    going (or was killed) leaves a file every reader can take up to its last row."""

    def __init__(self, out: Path, enabled: bool) -> None:
        self.out = out
        self.path = out / STEPS_FILE
        self.enabled = enabled
        self.sink: Sink | None = None
        self.totals = [0.0, 0.0, 0.0]  # the epoch's sums at the previous row
        self.rank_totals: list[float] = []  # each rank's [wait, compute] s at the previous row
        self.step = 0  # the step of the previous row
        self.since = time.perf_counter()
        self.last_row: dict[str, Any] = {}

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def start(self, step: int) -> None:
        """Training starts (or resumes) after STEP: the rows past it, which an interrupted
        run wrote after its last checkpoint, are dropped, since this run logs them again;
        a fresh run (step 0) starts an empty file."""
        self.step = step
        if not self.enabled:
            return
        # Here, not at the top: files imports torch, and `ddpcli plot` reads rows with
        # this module without it.
        from ddpcli.files import write_text_atomic

        kept = [row for row in read_rows(self.path) if row.get("step", 0) <= step]
        write_text_atomic(self.path, "".join(ui.json_text(row) + "\n" for row in kept))

    def attach(self, sink: Sink | None) -> None:
        """SINK (the trackers) gets each row from now on, after steps.jsonl."""
        self.sink = sink if self.enabled else None

    def start_epoch(self, totals: list[float] | None) -> None:
        """TOTALS: the sums a resumed epoch starts from (its checkpoint's), else none."""
        self.totals = list(totals) if totals else [0.0, 0.0, 0.0]
        self.rank_totals = []
        self.since = time.perf_counter()

    def record(self, position: dict[str, Any], totals: list[float], lr: float) -> None:
        """One row for the steps since the previous one. POSITION: step, epoch and
        epoch_fraction; TOTALS: the epoch's reduced sums now, the metrics' then each rank's
        [wait, compute] seconds (ddpcli.outputs.rankload); every rank calls this, with the same
        sums, so that each keeps its interval start."""
        metric_totals, rank_totals = totals[:3], totals[3:]
        loss, correct, count = (a - b for a, b in zip(metric_totals, self.totals, strict=True))
        now = time.perf_counter()
        images = max(count, 1.0)
        previous = self.rank_totals or [0.0] * len(rank_totals)
        if any(now_s < then_s for now_s, then_s in zip(rank_totals, previous, strict=True)):
            previous = [0.0] * len(rank_totals)  # the clocks restarted after the warm-up steps
        interval = [a - b for a, b in zip(rank_totals, previous, strict=True)]
        wait_s, compute_s = rank_seconds(interval)
        figures = rank_figures(wait_s, compute_s, now - self.since, position["step"] - self.step)
        row = {
            **position,
            "train_loss": loss / images,
            "train_acc": correct / images,
            "lr": lr,
            # The reduction that produced TOTALS waited for every rank: a synced clock.
            "images_per_sec": count / max(now - self.since, 1e-9),
            **figures,
        }
        self.totals, self.rank_totals, self.since = list(metric_totals), list(rank_totals), now
        self.step, self.last_row = position["step"], row
        if not self.enabled:
            return
        with open(self.path, "a") as handle:
            handle.write(ui.json_text(row) + "\n")
        if self.sink is not None:
            self.sink.step_row(row)

    def epoch_end(self, metrics: dict[str, Any]) -> None:
        """METRICS: the row just appended to metrics.jsonl (a partial epoch's too)."""
        if self.enabled and self.sink is not None:
            self.sink.epoch_row(metrics)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a .jsonl file; a line cut short (a run killed mid-write, or one
    still writing) is left out, not an error."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows
