"""What every tracker is: it starts a run (or continues the one a checkpoint names), takes
rows and files, and finishes. The fan-out (`ddpcli.outputs.trackers.fanout`) calls it from
a thread of its own, so a tracker may block on its network; an exception is its failure.

A tracker's metric names are the files' keys: a steps.jsonl row's `train_loss` is
`step/train_loss`, a metrics.jsonl row's `val_acc` is `epoch/val_acc`, each logged at the
row's `step`. Values that are not numbers (the data path's name, a null) are not metrics.
"""

from __future__ import annotations

import abc
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

RowKind = Literal["step", "epoch"]
ROW_KINDS: tuple[RowKind, ...] = ("step", "epoch")
# How a run ended, in the words a tracker's status takes.
Ending = Literal["finished", "stopped", "failed"]


@dataclass
class Opening:
    """Everything a tracker needs to start or continue its run."""

    out: Path  # the run folder
    experiment: str
    run_name: str
    tracking_uri: str | None  # MLflow's; None: a local store in the run folder
    params: dict[str, str]  # the resolved config, flat: config.json's keys
    tags: dict[str, str]  # system facts: world size, GPUs, backend, torch version
    run_id: str | None = None  # the run a checkpoint names: continue it
    resume_step: int = 0  # the checkpoint's step; 0 for a fresh start
    wandb_offline: bool = False
    # The rows steps.jsonl and metrics.jsonl hold as the run starts (a resume's, up to its
    # checkpoint): what the CSV files start from, and what a continued run may have missed.
    earlier: list[tuple[RowKind, dict[str, Any]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # lines a tracker leaves for the end


class Tracker(abc.ABC):
    name = "tracker"
    # True: what it logs stays logged (MLflow's and W&B's histories only grow), so rows
    # reach it once a checkpoint holds their step: a resume never logs a step twice.
    # False: it forgets what a resume retrains by itself (CSV, TensorBoard), and rows go live.
    append_only = False

    @abc.abstractmethod
    def start(self, opening: Opening) -> str | None:
        """Start (or continue) the run; its id, for the checkpoint (None: nothing to keep)."""

    def where(self) -> str | None:
        """Where its run is, in words, once started (the run's header says it)."""
        return None

    def logged_through(self) -> dict[RowKind, int] | None:
        """The last step of each kind of row the continued run holds (an append-only tracker
        that missed rows before its run's last checkpoint gets them again); None: unknown."""
        return None

    @abc.abstractmethod
    def log_rows(self, rows: list[tuple[RowKind, dict[str, Any]]]) -> None:
        """ROWS in the order the run wrote them: each with its kind (steps.jsonl's or
        metrics.jsonl's)."""

    def log_files(self, paths: list[Path]) -> None:
        """Files as the run's artifacts; a tracker that keeps none ignores them."""
        return None

    @abc.abstractmethod
    def finish(self, ending: Ending) -> None:
        """End the run with ENDING's status."""


def metrics_of(kind: RowKind, row: dict[str, Any]) -> dict[str, float]:
    """ROW's numbers under the tracker's names (`step/train_loss`); the row's own `step` is
    the x axis, not a metric."""
    return {
        f"{kind}/{key}": float(value)
        for key, value in row.items()
        if key != "step" and is_number(value)
    }


def is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value)


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """config.json as one level of `key: text` (a table's keys joined with a dot): strings
    as they are, everything else as its JSON (null, true, [0.9, 0.999])."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flat_params(value, f"{name}."))
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value)
    return flat
