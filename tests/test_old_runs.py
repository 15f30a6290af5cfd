"""A run folder and its checkpoint written by an earlier ddpcli (main of 2026-11-28, before the
request and the plan became two objects: tests/fixtures/run_2026_11_28) are read, checked and
resumed as they always were, and a run today writes the same keys."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import read_metrics, run_cli

FIXTURE = Path(__file__).parent / "fixtures" / "run_2026_11_28"
# The command that wrote it: 2 CPU ranks, 64 synthetic images of 16 px, one epoch of 2 steps.
ITS_COMMAND = [
    "train", "--cpu", "--nproc", "2", "--arch", "tinycnn", "--image-size", "16",
    "--synthetic-size", "64", "--per-gpu-batch", "16",
]  # fmt: skip
# Settings that came after the fixture was written: config.json has them too.
SETTINGS_ADDED_SINCE = {
    "flight_recorder",
    "global_batch",
    "batch_auto",
    "fake_oom",
    "decode",
    "decode_reason",
    "compile_mode",
}


def keys(path: Path) -> set[str]:
    return set(json.loads(path.read_text()))


def test_its_checkpoint_is_inspected_and_verified(in_process):
    last = FIXTURE / "checkpoints" / "last.pt"
    inspected = in_process("checkpoint", "inspect", str(last), "--json")
    assert inspected.returncode == 0, inspected.stderr
    report = json.loads(inspected.stdout)
    assert report["arch"] == "tinycnn" and report["step"] == 2, report
    verified = in_process("checkpoint", "verify", str(last))
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_it_resumes_to_a_second_epoch_and_the_files_keep_their_keys(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    resumed = run_cli(*ITS_COMMAND, "--epochs", "2", "--out", str(run), "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    epochs = [row["epoch"] for row in read_metrics(run)]
    assert epochs == [1, 2]  # the first epoch's row is the earlier run's
    assert read_metrics(run)[0] == read_metrics(FIXTURE)[0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epoch"] == 2 and summary["step"] == 4
    # Every key kept; new settings since are named here (a key gone would break its readers).
    assert keys(run / "config.json") - keys(FIXTURE / "config.json") == SETTINGS_ADDED_SINCE
    assert keys(FIXTURE / "config.json") <= keys(run / "config.json")
    assert keys(run / "summary.json") == keys(FIXTURE / "summary.json")
