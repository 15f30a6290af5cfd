"""Before any worker starts: `--tracking-uri` is a store MLflow can open (exit 2 if it can
never be one, naming the forms it takes); with `--tracker-strict`, the MLflow server at it
must answer too. Without --tracker-strict a tracker that cannot be reached is a warning, and
the run sends it the rows when it answers (ddpcli.outputs.trackers.fanout).

Plain text and HTTP, no mlflow import: the launcher answers at once. A local store (SQLite)
needs no probe; W&B without credentials runs offline and has nothing to reach.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping

from ddpcli.config import TrainConfig
from ddpcli.errors import usage_error

PROBE_TIMEOUT_S = 10.0
# Every MLflow tracking server (and the proxies in front of one) answers this REST call.
PROBE_PATH = "/api/2.0/mlflow/experiments/search?max_results=1"

# The stores MLflow opens by itself (mlflow.tracking._tracking_service.utils); a plugin adds
# its scheme as an entry point of this group.
SERVER_SCHEMES = ("http", "https")
DATABASE_ENGINES = ("sqlite", "postgresql", "mysql", "mssql")  # each may add +DRIVER
PLUGIN_GROUP = "mlflow.tracking_store"
ACCEPTED_FORMS = (
    "http(s)://HOST:PORT (a tracking server), sqlite:///PATH.db (a local file), "
    "postgresql|mysql|mssql://USER@HOST/DB or databricks[://PROFILE]"
)
# MLflow 3.13 made a folder store an error unless this variable says true.
FOLDER_STORE_VARIABLE = "MLFLOW_ALLOW_FILE_STORE"
FOLDER_STORE_REFUSED_FROM = (3, 13)


def check_tracking_uri(cfg: TrainConfig, env: Mapping[str, str] | None = None) -> None:
    """A --tracking-uri MLflow can never open is exit 2 now: the run would train on with a
    tracker that fails at every try."""
    env = os.environ if env is None else env
    uri = cfg.tracking_uri
    if "mlflow" not in cfg.tracker or not uri:
        return
    problem = tracking_uri_problem(uri, env)
    if problem:
        given = "MLFLOW_TRACKING_URI" if env.get("MLFLOW_TRACKING_URI") == uri else "--tracking-uri"
        raise usage_error(
            f"invalid {given} {uri!r}: {problem}; give {ACCEPTED_FORMS}, or none for "
            "sqlite:///OUT/mlflow.db"
        )


def tracking_uri_problem(uri: str, env: Mapping[str, str]) -> str | None:
    """None when MLflow has a store for URI's form (whether it answers is the probe's)."""
    parsed = urllib.parse.urlparse(uri)
    scheme = parsed.scheme.lower() or uri.lower()
    if scheme in ("databricks-uc", "uc"):
        return "Unity Catalog is MLflow's model registry, not a store of runs"
    if scheme == "databricks":
        return None
    if len(parsed.scheme) <= 1 or scheme == "file":  # no scheme, or a Windows drive: a folder
        return folder_store_problem(env)
    if scheme in SERVER_SCHEMES:
        return None if parsed.hostname else "a tracking server's URI names its host"
    engine = scheme.partition("+")[0]
    if engine == "sqlite":
        if parsed.netloc or not parsed.path.strip("/"):
            return "a SQLite store is sqlite:/// (three slashes) and the file's path"
        return None
    if engine in DATABASE_ENGINES or scheme in plugin_schemes():
        return None
    return f"MLflow has no store for {scheme}://"


def folder_store_problem(env: Mapping[str, str]) -> str | None:
    allowed = env.get(FOLDER_STORE_VARIABLE, "").lower() in ("true", "1")
    if allowed or mlflow_version() < FOLDER_STORE_REFUSED_FROM:
        return None
    return (
        "it reads as a folder, and MLflow keeps runs in a database or on a server, not in a "
        f"folder (unless {FOLDER_STORE_VARIABLE}=true)"
    )


def mlflow_version() -> tuple[int, ...]:
    """The installed MLflow's (major, minor); the newest's rules when it cannot tell."""
    for package in ("mlflow", "mlflow-skinny"):
        try:
            text = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
        return tuple(int(part) for part in re.findall(r"\d+", text)[:2])
    return (999,)


def plugin_schemes() -> set[str]:
    return {entry.name for entry in importlib.metadata.entry_points(group=PLUGIN_GROUP)}


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
