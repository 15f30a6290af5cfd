"""`--tracker-strict`: before any worker starts, the MLflow server at --tracking-uri must
answer (exit 2 if not). Without it a tracker that cannot be reached is a warning, and the
run sends it the rows when it answers (ddpcli.outputs.trackers.fanout).

Plain HTTP, no mlflow import: the launcher answers at once. A local store (a path, SQLite)
needs no probe; W&B without credentials runs offline and has nothing to reach.
"""

from __future__ import annotations

import urllib.error
import urllib.request

from ddpcli.config import TrainConfig
from ddpcli.errors import usage_error

PROBE_TIMEOUT_S = 10.0
# Every MLflow tracking server (and the proxies in front of one) answers this REST call.
PROBE_PATH = "/api/2.0/mlflow/experiments/search?max_results=1"


def check_reachable(cfg: TrainConfig) -> None:
    uri = cfg.tracking_uri
    if "mlflow" not in cfg.tracker or not uri or not uri.startswith(("http://", "https://")):
        return
    problem = mlflow_problem(uri)
    if problem:
        raise usage_error(
            f"invalid --tracking-uri: the MLflow server at {uri} {problem}; start it or fix "
            "--tracking-uri, or drop --tracker-strict to train anyway (the rows are sent when "
            "it answers)"
        )


def mlflow_problem(uri: str) -> str | None:
    """None when the server answers the probe; else what went wrong, in words."""
    try:
        with urllib.request.urlopen(uri.rstrip("/") + PROBE_PATH, timeout=PROBE_TIMEOUT_S):
            return None
    except urllib.error.HTTPError as error:
        return f"refused the request (HTTP {error.code} {error.reason})"
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        return f"does not answer ({reason})"
