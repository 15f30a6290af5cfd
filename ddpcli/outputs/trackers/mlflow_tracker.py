"""`--tracker mlflow`: one MLflow run per ddpcli run, at `--tracking-uri` (else
MLFLOW_TRACKING_URI, else a SQLite store in the run folder), continued by every resume.

MLflow's metric history only grows, so the fan-out sends a row once a checkpoint holds its
step (`ddpcli.outputs.trackers.fanout`). The `mlflow` package is an optional extra
(`pip install "ddpcli[mlflow]"`), imported here only when a run starts.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from ddpcli.outputs.trackers.base import (
    ROW_KINDS,
    Ending,
    Opening,
    RowKind,
    Tracker,
    metrics_of,
)

LOCAL_STORE = "mlflow.db"  # in the run folder, beside its artifacts
LOCAL_ARTIFACTS = "mlartifacts"
# MLflow retries a failed request for minutes by default: the fan-out retries on its own.
NETWORK_SETTINGS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
PARAMS_PER_BATCH = 100  # MLflow's limits on one log_batch
METRICS_PER_BATCH = 1000
PARAM_LENGTH = 6000
# MLflow 3's UI opens an experiment of this kind on its runs and charts (not on traces).
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}


def local_store(out: Path) -> str:
    return f"sqlite:///{(out / LOCAL_STORE).resolve()}"


class MlflowTracker(Tracker):
    name = "mlflow"
    append_only = True

    def __init__(self) -> None:
        self.client: Any = None
        self.run_id = ""
        self.uri = ""
        self.not_held: str | None = None  # the checkpoint's run, when the store lacks it

    def start(self, opening: Opening) -> str | None:
        for name, value in NETWORK_SETTINGS.items():
            os.environ.setdefault(name, value)
        from mlflow.tracking import MlflowClient

        # Its store's set-up lines (creating tables) are not the run's to say.
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        logging.getLogger("alembic").setLevel(logging.WARNING)

        self.uri = opening.tracking_uri or local_store(opening.out)
        self.client = MlflowClient(tracking_uri=self.uri)
        if opening.run_id and self.holds(opening.run_id):
            self.run_id = opening.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            # A run this store does not hold can never be continued here (the resume names
            # another store, or the run was deleted): a new run, which the fan-out gives the
            # run folder's earlier rows, keeps every step in the store the user points at.
            self.not_held = opening.run_id
            self.run_id = self.create_run(opening)
        self.log_tags(opening.tags)
        return self.run_id

    def holds(self, run_id: str) -> bool:
        """Whether the store has RUN_ID, not deleted; a store that does not answer raises."""
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException as error:
            if error.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise
        return bool(run.info.lifecycle_stage != "deleted")

    def create_run(self, opening: Opening) -> str:
        from mlflow.entities import Param

        experiment_id = self.experiment_id(opening)
        run = self.client.create_run(experiment_id, run_name=opening.run_name)
        params = [Param(key, value[:PARAM_LENGTH]) for key, value in opening.params.items()]
        for first in range(0, len(params), PARAMS_PER_BATCH):
            chunk = params[first : first + PARAMS_PER_BATCH]
            self.client.log_batch(run.info.run_id, params=chunk)
        return str(run.info.run_id)

    def experiment_id(self, opening: Opening) -> str:
        experiment = self.client.get_experiment_by_name(opening.experiment)
        if experiment is not None:
            return str(experiment.experiment_id)
        # The local store keeps its artifacts in the run folder too (MLflow's default is
        # ./mlruns under the current directory).
        location = None
        if opening.tracking_uri is None:
            location = (opening.out / LOCAL_ARTIFACTS).resolve().as_uri()
        try:
            return str(self.client.create_experiment(opening.experiment, location, EXPERIMENT_TAGS))
        except Exception:  # another run created it first
            experiment = self.client.get_experiment_by_name(opening.experiment)
            if experiment is None:
                raise
            return str(experiment.experiment_id)

    def log_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])

    def where(self) -> str:
        if self.not_held:
            return (
                f"the checkpoint's run {self.not_held} is not in {self.uri} (it is in another "
                f"store, or deleted): continued as new run {self.run_id} there, with the "
                "earlier rows of steps.jsonl and metrics.jsonl"
            )
        return f"run {self.run_id} at {self.uri}"

    def logged_through(self) -> dict[RowKind, int] | None:
        """Each kind of row has its `epoch` number: its history's last step is the kind's."""
        through: dict[RowKind, int] = {}
        for kind in ROW_KINDS:
            history = self.client.get_metric_history(self.run_id, f"{kind}/epoch")
            through[kind] = max((metric.step for metric in history), default=-1)
        return through

    def log_rows(self, rows: list[tuple[RowKind, dict[str, Any]]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(key, value, now, int(row["step"]))
            for kind, row in rows
            for key, value in metrics_of(kind, row).items()
        ]
        for first in range(0, len(metrics), METRICS_PER_BATCH):
            chunk = metrics[first : first + METRICS_PER_BATCH]
            self.client.log_batch(self.run_id, metrics=chunk)

    def log_files(self, paths: list[Path]) -> None:
        for path in paths:
            folder = "checkpoints" if path.suffix == ".pt" else None
            self.client.log_artifact(self.run_id, str(path), artifact_path=folder)

    def finish(self, ending: Ending) -> None:
        self.client.set_terminated(self.run_id, status=STATUS[ending])
