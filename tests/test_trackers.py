"""`--tracker`: what the trackers hold, read back from them, equals steps.jsonl and
metrics.jsonl; a preempted run resumed at another world size is one MLflow run; a tracker
that cannot be reached costs training nothing and is reported.

MLflow is a real tracking server (SQLite, 127.0.0.1, a free port) started here and stopped
in a finalizer; W&B runs offline and its run file is read back. Nothing reaches the internet.
"""

from __future__ import annotations

import csv
import glob
import json
import shlex
import signal
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, LiveProcess, clean_env, free_port, kill_group, run_bounded, run_cli

from ddpcli.outputs.trackers import fanout
from ddpcli.outputs.trackers.base import Tracker

# MLflow 3 reports its own use to the internet unless told not to: no test may reach it.
OFFLINE = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
WANDB_OFFLINE = {"WANDB_MODE": "offline"}  # no W&B credentials: offline, in OUT/wandb
SERVER_START_S = 180  # mlflow server imports a lot: on a busy CI core it takes a while
TINY = [
    "train", "--cpu", "--arch", "tinycnn", "--image-size", "16", "--per-gpu-batch", "16",
    "--log-every", "2",
]  # fmt: skip


# --- a real MLflow server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    command = [
        sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
        "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
        "--artifacts-destination", str(folder / "artifacts"), "--workers", "1",
    ]  # fmt: skip
    env = clean_env(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", **OFFLINE)
    log = open(folder / "server.log", "w")  # noqa: SIM115 (closed in the finalizer)
    server = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(uri, server, folder / "server.log")
        yield uri
    finally:
        kill_group(server.pid)
        server.wait(timeout=30)
        log.close()


def wait_for_health(uri: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"mlflow server ended:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"mlflow server not up in {SERVER_START_S}s:\n{log.read_text()[-3000:]}")


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def numeric(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def expected_history(rows: list[dict], kind: str) -> dict[str, list[tuple[int, float]]]:
    """What a tracker must hold for ROWS: `kind/key` -> [(step, value)], in step order."""
    history: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and numeric(value):
                history.setdefault(f"{kind}/{key}", []).append((row["step"], float(value)))
    return history


def mlflow_history(client, run_id: str, keys) -> dict[str, list[tuple[int, float]]]:
    return {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        for key in keys
    }


# --- MLflow, CSV and W&B offline across a preemption and a world change --------------------


def test_preempted_run_resumed_at_another_world_is_one_mlflow_run_equal_to_the_files(
    mlflow_uri, tmp_path
):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    settings = [
        *TINY, "--synthetic-size", "1024", "--epochs", "2", "--out", str(out),
        "--tracker", "mlflow,csv,wandb", "--tracking-uri", mlflow_uri,
        "--experiment", "preempted", "--tracker-checkpoints", "--save-every-steps", "4",
        "--preempt-signal", "USR1",
    ]  # fmt: skip
    command = [sys.executable, "-m", "ddpcli", *settings, "--nproc", "2"]
    # Rank 0's data is slowed so that the signal lands inside the first epoch.
    run = LiveProcess(command, clean_env(DDPCLI_SLOW_DATA="0:0.05", **OFFLINE, **WANDB_OFFLINE))
    try:
        run.wait_for("epoch 1/2 step 6/", 180)
        run.process.send_signal(signal.SIGUSR1)
        code = run.finish(timeout=120)
    finally:
        run.kill()
    assert code == 1, run.stderr[-3000:]
    assert "error: preempted at epoch 1 step" in run.stderr, run.stderr[-3000:]
    assert any(row.get("partial") for row in read_rows(out / "metrics.jsonl"))
    # An interrupted run may have logged steps after its last checkpoint: the resume trains
    # them again, and neither the files nor the trackers may keep the first try's row.
    past = {**read_rows(out / "steps.jsonl")[-1], "step": 999, "train_loss": 9.0}
    with open(out / "steps.jsonl", "a") as handle:
        handle.write(json.dumps(past) + "\n")

    resumed = run_cli(
        *settings, "--nproc", "3", "--resume", "auto", timeout=300, env={**OFFLINE, **WANDB_OFFLINE}
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "world 2 -> 3" in resumed.stderr
    assert "--tracker mlflow: run " in resumed.stderr

    steps, epochs = read_rows(out / "steps.jsonl"), read_rows(out / "metrics.jsonl")
    assert [row["epoch"] for row in epochs] == [1, 2]  # the partial row was replaced
    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name("preempted")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, "the resume opened another MLflow run"
    run_info = runs[0]
    assert run_info.info.status == "FINISHED"
    assert run_info.info.run_name == "run"
    assert run_info.data.tags["world_size"] == "3"  # the resumed world's facts
    assert run_info.data.tags["backend"] == "gloo" and "torch" in run_info.data.tags
    config = json.loads((out / "config.json").read_text())
    assert run_info.data.params["per_gpu_batch"] == "16"
    assert set(run_info.data.params) >= {key for key in config if not isinstance(config[key], dict)}

    for rows, kind in ((steps, "step"), (epochs, "epoch")):
        want = expected_history(rows, kind)
        got = mlflow_history(client, run_info.info.run_id, want)
        assert got == want, kind
    # no metric beyond the files' keys
    logged = set(run_info.data.metrics)
    assert logged == set(expected_history(steps, "step")) | set(expected_history(epochs, "epoch"))
    artifacts = {item.path for item in client.list_artifacts(run_info.info.run_id)}
    assert {"curves.png", "summary.json", "checkpoints"} <= artifacts

    for name, rows in (("steps.csv", steps), ("metrics.csv", epochs)):
        with open(out / "csv" / name) as handle:
            sheet = list(csv.DictReader(handle))
        assert [int(row["step"]) for row in sheet] == [row["step"] for row in rows], name
        assert [float(row["train_loss"]) for row in sheet] == [row["train_loss"] for row in rows]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trackers"]["mlflow"] == {"run_id": run_info.info.run_id}

    # W&B offline: each part wrote a folder of its own, and the upload command names both,
    # which together hold every row of the files, none twice.
    (sync_line,) = [line for line in resumed.stderr.splitlines() if "wandb sync " in line]
    named = shlex.split(sync_line.split("wandb sync ", 1)[1])
    folders = sorted(Path(path) for pattern in named for path in glob.glob(pattern))
    assert len(folders) == 2 and folders == sorted((out / "wandb").glob("offline-run-*"))
    history: dict[str, list[tuple[int, float]]] = {}
    for folder in folders:
        (run_file,) = folder.glob("run-*.wandb")
        for key, values in wandb_history(run_file).items():
            history[key] = sorted(history.get(key, []) + values)
    assert history == {**expected_history(steps, "step"), **expected_history(epochs, "epoch")}
    for part in (run.stderr, resumed.stderr):  # W&B's own chatter stays out of the run's lines
        assert not [line for line in part.splitlines() if line.startswith("wandb:")], part


# --- a resume pointed at a store that lacks the checkpoint's run --------------------------


def test_a_resume_against_another_mlflow_store_starts_a_run_there_with_every_row(
    mlflow_uri, tmp_path, monkeypatch, capsys
):
    from mlflow.tracking import MlflowClient

    from ddpcli.outputs.trackers.mlflow_tracker import NETWORK_SETTINGS

    for name, value in {**OFFLINE, **NETWORK_SETTINGS}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(fanout, "RETRY_FIRST_S", 0.05)
    monkeypatch.setattr(fanout, "EXIT_WAIT_S", 10.0)
    store = mlflow_uri  # the module's server (beside the test above, for xdist): made once
    earlier = [
        ("step", {"step": 2, "epoch": 1, "train_loss": 2.0}),
        ("step", {"step": 4, "epoch": 1, "train_loss": 1.5}),
        ("epoch", {"step": 4, "epoch": 1, "val_acc": 0.25}),
        ("epoch", {"step": 5, "epoch": 2, "val_acc": 0.5, "partial": True}),  # CSV's only
    ]
    first_id = "0123456789abcdef0123456789abcdef"  # the run the checkpoint names, elsewhere
    run_ids = {"mlflow": first_id}
    trackers = fanout.Trackers(["mlflow"], run_ids)
    trackers.start(fanout.Opening(tmp_path, "moved", "run", store, {}, {}, earlier=earlier))
    trackers.step_row({"step": 6, "epoch": 2, "train_loss": 1.0})
    trackers.checkpoint_saved(6)
    report = trackers.rows_report()
    trackers.finish([], "finished")

    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("moved").experiment_id])
    assert run.info.run_id == run_ids["mlflow"] != first_id  # the next checkpoint keeps it
    assert run.info.status == "FINISHED"
    assert mlflow_history(client, run.info.run_id, ["step/train_loss", "epoch/val_acc"]) == {
        "step/train_loss": [(2, 2.0), (4, 1.5), (6, 1.0)],
        "epoch/val_acc": [(4, 0.25)],
    }
    assert report == {"trackers": {"mlflow": {"run_id": run.info.run_id}}}
    said = " ".join(capsys.readouterr().err.split())
    assert f"the checkpoint's run {first_id} is not in {store}" in said, said
    assert f"new run {run.info.run_id}" in said


# --- a tracker that cannot be reached; W&B offline ------------------------------------------


def test_unreachable_mlflow_costs_nothing_and_wandb_offline_holds_the_rows(tmp_path):
    out = tmp_path / "run"
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = clean_env(NETRC=str(tmp_path / "no-netrc"), **OFFLINE)  # and no W&B credentials
    for name in ("WANDB_API_KEY", "WANDB_MODE", "MLFLOW_TRACKING_URI"):
        env.pop(name, None)
    command = [
        sys.executable, "-m", "ddpcli", *TINY, "--synthetic-size", "256", "--epochs", "1",
        "--nproc", "2", "--out", str(out), "--tracker", "wandb,mlflow", "--tracking-uri", dead,
    ]  # fmt: skip
    result = run_bounded(command, 240, env)
    assert result.returncode == 0, result.stderr[-3000:]
    steps, epochs = read_rows(out / "steps.jsonl"), read_rows(out / "metrics.jsonl")
    assert len(epochs) == 1 and steps[-1]["step"] == 8  # training went on, to its end
    warnings = [line for line in result.stderr.splitlines() if "--tracker mlflow:" in line]
    assert warnings and "training goes on" in warnings[0], result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trackers"]["mlflow"]["not_sent"].startswith("steps 2-8 (4 rows)")
    assert "--tracker wandb: offline run" in result.stderr
    assert "wandb sync " in result.stderr.splitlines()[-1] or "wandb sync " in result.stderr
    assert "Symlinked" not in result.stderr  # W&B's warning for each file it was given

    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    history = wandb_history(run_file)
    want = {**expected_history(steps, "step"), **expected_history(epochs, "epoch")}
    assert history == want


def wandb_history(path: Path) -> dict[str, list[tuple[int, float]]]:
    """A W&B run file's history records (LevelDB's log format, W&B's protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    history: dict[str, list[tuple[int, float]]] = {}
    for data in leveldb_records(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") != "history":
            continue
        step = record.history.step.num
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            if not key.startswith("_"):
                history.setdefault(key, []).append((step, float(json.loads(item.value_json))))
    return {key: sorted(values) for key, values in history.items()}


def leveldb_records(data: bytes, block: int = 32768, header: int = 7):
    assert data[:4] == b":W&B"
    offset, pieces = header, b""
    while offset + header <= len(data):
        room = block - offset % block
        if room < header:
            offset += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + header])
        if kind == 0 and length == 0:
            offset += room
            continue
        pieces += data[offset + header : offset + header + length]
        offset += header + length
        if kind in (1, 4):  # a full record, or its last piece
            yield pieces
            pieces = b""


# --- the command line ----------------------------------------------------------------------


def test_a_tracker_not_installed_exits_2_naming_its_extra(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from ddpcli.cli.app import app

    monkeypatch.setattr("ddpcli.launcher.resolve.missing_package", {"mlflow": "mlflow"}.get)
    args = ["train", "--cpu", "--tracker", "csv,mlflow", "--dry-run", "--out", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "invalid --tracker mlflow: the mlflow package is not installed" in result.output
    assert 'pip install "ddpcli[mlflow]"' in result.output


def test_an_unknown_tracker_and_an_unreachable_strict_one_exit_2(tmp_path, in_process):
    bad = in_process("train", "--cpu", "--tracker", "csv,neptune", "--dry-run")
    assert bad.returncode == 2 and "--tracker" in bad.stderr, bad.stderr
    dead = f"http://127.0.0.1:{free_port()}"
    strict = in_process(
        "train", "--cpu", "--tracker", "mlflow", "--tracking-uri", dead, "--tracker-strict",
        "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert strict.returncode == 2, strict.stderr
    assert f"invalid --tracking-uri: the MLflow server at {dead} does not answer" in strict.stderr
    assert "Traceback" not in strict.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()  # no worker started


def test_a_tracking_uri_mlflow_can_never_open_exits_2_naming_the_forms(
    in_process, tmp_path, monkeypatch
):
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)
    train = ["train", "--cpu", "--tracker", "mlflow", "--dry-run", "--out", str(tmp_path / "run")]
    cases = {
        "foo://bar": "MLflow has no store for foo://",
        "not a uri at all": "it reads as a folder",
        "http://": "a tracking server's URI names its host",
    }
    for uri, why in cases.items():
        result = in_process(*train, "--tracking-uri", uri)
        said = " ".join(result.stderr.split())
        assert result.returncode == 2, result.stderr
        assert f"invalid --tracking-uri {uri!r}: {why}" in said, said
        assert "http(s)://HOST:PORT" in said and "sqlite:///PATH.db" in said
        assert "Traceback" not in result.stderr
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "foo://bar")
    from_env = in_process(*train)
    assert from_env.returncode == 2, from_env.stderr
    assert "invalid MLFLOW_TRACKING_URI 'foo://bar'" in " ".join(from_env.stderr.split())


def test_a_tracking_uri_without_the_mlflow_tracker_exits_2(in_process, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    train = ["train", "--cpu", "--dry-run", "--out", str(tmp_path / "run")]
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for trackers in ([], ["--tracker", "csv,tensorboard"]):
        result = in_process(*train, *trackers, "--tracking-uri", store)
        said = " ".join(result.stderr.split())
        assert result.returncode == 2, result.stderr
        assert "invalid --tracking-uri: it is MLflow's store" in said, said
        assert "add mlflow to --tracker" in said
    # MLflow's own variable may be set for other tools: a run without MLflow leaves it be.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    assert in_process(*train, "--tracker", "csv").returncode == 0


def test_help_imports_neither_mlflow_nor_wandb():
    code = (
        "import sys; from typer.testing import CliRunner; from ddpcli.cli.app import app; "
        "CliRunner().invoke(app, ['train', '--help']); "
        "print(sorted(m for m in ('mlflow', 'wandb', 'torch') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert result.stdout.strip() == "[]", result.stderr


# --- the fan-out, with trackers of our own -------------------------------------------------


class Recording(Tracker):
    """Holds what it is sent; fails while `down` is set."""

    def __init__(self, name: str, append_only: bool, down: threading.Event) -> None:
        self.name, self.append_only, self.down = name, append_only, down
        self.rows: list[tuple[str, int]] = []
        self.ended = None

    def start(self, opening):
        self.check()
        return f"{self.name}-run"

    def check(self) -> None:
        if self.down.is_set():
            raise ConnectionError("connection refused")

    def log_rows(self, rows):
        self.check()
        self.rows += [(kind, row["step"]) for kind, row in rows]

    def finish(self, ending):
        self.check()
        self.ended = ending


def fake_trackers(monkeypatch, down: threading.Event):
    made = {
        "remote": Recording("remote", append_only=True, down=down),
        "local": Recording("local", append_only=False, down=threading.Event()),
    }
    monkeypatch.setattr(fanout, "tracker_for", made.__getitem__)
    monkeypatch.setattr(fanout, "RETRY_FIRST_S", 0.05)
    monkeypatch.setattr(fanout, "EXIT_WAIT_S", 5.0)
    run_ids: dict[str, str] = {}
    trackers = fanout.Trackers(["remote", "local"], run_ids)
    trackers.start(fanout.Opening(Path("."), "e", "r", None, {}, {}))
    return trackers, made, run_ids


def test_append_only_trackers_get_rows_once_a_checkpoint_holds_them(monkeypatch, capsys):
    trackers, made, run_ids = fake_trackers(monkeypatch, threading.Event())
    assert run_ids == {"remote": "remote-run", "local": "local-run"}  # before any checkpoint
    for step in (2, 4, 6):
        trackers.step_row({"step": step, "train_loss": 1.0})
    trackers.checkpoint_saved(4)
    trackers.step_row({"step": 8, "train_loss": 1.0})
    trackers.stop("failed")  # step 6 and 8: past the checkpoint, a resume trains them again
    assert made["remote"].rows == [("step", 2), ("step", 4)]
    assert made["local"].rows == [("step", step) for step in (2, 4, 6, 8)]
    assert made["remote"].ended == "failed"
    assert "steps 6-8 (2 rows) past the last checkpoint not sent" in capsys.readouterr().err


def test_a_tracker_down_mid_run_gets_what_it_missed_when_it_answers(monkeypatch, capsys):
    down = threading.Event()
    trackers, made, _ = fake_trackers(monkeypatch, down)
    trackers.step_row({"step": 2})
    trackers.checkpoint_saved(2)
    down.set()
    for step in (4, 6):
        trackers.step_row({"step": step})
        trackers.checkpoint_saved(step)  # training goes on: nothing waits for the tracker
    time.sleep(0.3)
    down.clear()
    report = trackers.rows_report()
    trackers.finish([], "finished")
    assert made["remote"].rows == [("step", 2), ("step", 4), ("step", 6)]
    assert made["remote"].ended == "finished"
    assert report == {
        "trackers": {"remote": {"run_id": "remote-run"}, "local": {"run_id": "local-run"}}
    }
    err = capsys.readouterr().err
    assert err.count("--tracker remote: ConnectionError: connection refused") == 1
    assert "--tracker remote answers again" in err


def test_a_tracker_down_to_the_end_is_named_in_the_summary_within_a_bounded_wait(monkeypatch):
    down = threading.Event()
    trackers, made, _ = fake_trackers(monkeypatch, down)
    down.set()
    for step in (2, 4):
        trackers.step_row({"step": step})
    trackers.checkpoint_saved(4)
    began = time.monotonic()
    report = trackers.rows_report()
    trackers.finish([], "finished")
    assert time.monotonic() - began < 10
    assert report["trackers"]["remote"]["not_sent"] == "steps 2-4 (2 rows)"
    assert "not_sent" not in report["trackers"]["local"]
    assert made["remote"].rows == []
