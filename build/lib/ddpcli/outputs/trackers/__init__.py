"""`--tracker csv,mlflow,wandb,tensorboard`: the rows of steps.jsonl and metrics.jsonl, sent
on by rank 0 to experiment trackers; the run folder's files stay the record.

- `base`: what a tracker is (start or continue a run, log rows, log files, finish) and what
  it is told (`Opening`); the metric names (`step/KEY`, `epoch/KEY`) and the flat config;
- `fanout`: every tracker behind one object, each in a thread of its own (`Courier`), so
  that a tracker that fails or hangs costs training nothing: one warning, what it missed
  sent when it answers again or named in summary.json; rows reach the append-only trackers
  (MLflow, W&B) once a checkpoint holds their step, so that a resume never logs one twice;
- `csv_tracker`, `tensorboard_tracker`, `mlflow_tracker`, `wandb_tracker`: one each. The
  packages of the last three are optional extras, imported only by a run that asks for them
  (here: only which extra is missing, without importing it).

May import config/, the shared top-level modules and outputs' own modules; nothing here
imports torch, mlflow or wandb at module level.
"""

from __future__ import annotations

import importlib.util

TRACKERS = ("csv", "mlflow", "wandb", "tensorboard")
# Each tracker's package: the extra that installs it (pip install "ddpcli[EXTRA]").
PACKAGES = {"mlflow": "mlflow", "wandb": "wandb", "tensorboard": "tensorboard"}


def missing_package(tracker: str) -> str | None:
    """The package TRACKER needs when it is not installed, else None (csv needs none)."""
    package = PACKAGES.get(tracker)
    if package is None or importlib.util.find_spec(package) is not None:
        return None
    return package


def install_hint(tracker: str) -> str:
    package = PACKAGES[tracker]
    return f'pip install "ddpcli[{package}]" (or pip install {package})'
