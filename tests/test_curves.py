"""Per-step metrics (steps.jsonl), curves.png at the end of a run, `ddpcli plot` and
`--tensorboard`: real 2-rank CPU runs, each bounded by a timeout."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from conftest import LiveProcess, clean_env, ctrl_c_after, run_cli
from typer.testing import CliRunner

from ddpcli.cli import app
from ddpcli.errors import DdpcliError
from ddpcli.outputs.curves import choose_panels, read_run
from ddpcli.outputs.steplog import StepLog, read_rows

PNG_HEADER = b"\x89PNG\r\n\x1a\n"
# 256 images, 2 ranks, 16 per rank: 8 steps per epoch.
TINY = [
    "train", "--cpu", "--nproc", "2", "--arch", "tinycnn", "--image-size", "16",
    "--synthetic-size", "256", "--per-gpu-batch", "16", "--log-every", "3",
]  # fmt: skip
FULL_RUN_STEPS = [3, 6, 8, 9, 12, 15, 16]  # every 3rd step, and each epoch's last
# The full run also writes TensorBoard's event files where the package is installed (the test
# extras hold it): one run for the curves, the plots and --tensorboard.
TENSORBOARD = ["--tensorboard"] if importlib.util.find_spec("tensorboard") else []


def steps_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_HEADER
    assert 5_000 < len(data) < 300_000


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("runs") / "first"
    result = run_cli(*TINY, "--epochs", "2", *TENSORBOARD, "--out", str(out), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result.stderr


# --- steps.jsonl -----------------------------------------------------------------------------


def test_a_run_logs_every_interval_and_ends_pointing_at_its_curves(full_run):
    out, stderr = full_run
    rows = steps_of(out)
    assert [row["step"] for row in rows] == FULL_RUN_STEPS
    assert [row["epoch"] for row in rows] == [1, 1, 1, 2, 2, 2, 2]
    assert [row["epoch_fraction"] for row in rows] == [3 / 8, 6 / 8, 1, 1 / 8, 4 / 8, 7 / 8, 1]
    for row in rows:
        assert 0 < row["train_loss"] < 10 and 0 <= row["train_acc"] <= 1
        assert row["lr"] >= 0 and row["images_per_sec"] > 0
    assert rows[-1]["lr"] == 0 < rows[0]["lr"]  # the rate after the step: 0 after the last
    assert_png(out / "curves.png")
    assert f"curves: {out / 'curves.png'}" in stderr


def test_a_resumed_run_drops_the_rows_past_its_checkpoint_and_repeats_none(full_run, tmp_path):
    """--max-steps 5 stops inside epoch 1 (a row at 5, where the resume starts); rows an
    interrupted run wrote past its checkpoint are dropped; the resumed rows are the
    uninterrupted run's, interval for interval, once its intervals line up again."""
    out = tmp_path / "second"
    first = run_cli(*TINY, "--epochs", "2", "--max-steps", "5", "--out", str(out), timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    assert [row["step"] for row in steps_of(out)] == [3, 5]
    with open(out / "steps.jsonl", "a") as handle:  # what a run killed after step 5 left
        handle.write(json.dumps({"step": 6, "train_loss": 123.0}) + "\n")
        handle.write('{"step": 7, "train_lo')  # cut short mid-write
    resumed = run_cli(*TINY, "--epochs", "2", "--resume", "auto", "--out", str(out), timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = steps_of(out)
    assert [row["step"] for row in rows] == [3, 5, 6, 8, 9, 12, 15, 16]
    assert all(row["train_loss"] < 10 for row in rows)
    reference = {row["step"]: row for row in steps_of(full_run[0])}
    for row in rows:
        if row["step"] in (3, 8, 9, 12, 15, 16):  # same interval as the uninterrupted run
            want = reference[row["step"]]
            assert row["train_loss"] == pytest.approx(want["train_loss"], rel=1e-6), row["step"]
            assert row["lr"] == pytest.approx(want["lr"], rel=1e-9)


def test_step_rows_hold_the_interval_not_the_epoch_so_far(tmp_path):
    log = StepLog(tmp_path, enabled=True)
    log.start(0)
    log.start_epoch(None)
    log.record({"step": 1}, [4.0, 1.0, 2.0], lr=0.1)  # loss sum, correct, count
    log.record({"step": 2}, [5.0, 3.0, 4.0], lr=0.2)
    rows = read_rows(tmp_path / "steps.jsonl")
    assert [(r["train_loss"], r["train_acc"], r["lr"]) for r in rows] == [
        (2.0, 0.5, 0.1),
        (0.5, 1.0, 0.2),
    ]
    log.start(1)  # a resume from step 1
    assert [r["step"] for r in read_rows(tmp_path / "steps.jsonl")] == [1]


# --- ddpcli plot ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def second_run(full_run) -> Path:
    """A copy of the first run's files under another name, with its loss doubled."""
    out = full_run[0].parent / "second"
    out.mkdir()
    for name in ("steps.jsonl", "metrics.jsonl"):
        rows = read_rows(full_run[0] / name)
        for row in rows:
            row["train_loss"] *= 2
        (out / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out


# `ddpcli plot` starts no worker: each command runs in this process (in_process).


def test_plot_overlays_two_runs_in_one_picture_named_in_the_legend(
    full_run, second_run, in_process
):
    picture = second_run.parent / "both.svg"
    result = in_process("plot", str(full_run[0]), str(second_run), "--out", str(picture))
    assert result.returncode == 0, result.stderr
    svg = picture.read_text()
    assert "first train" in svg and "second train" in svg and "first val" in svg
    assert "learning rate" in svg
    assert f"{picture}" in result.stderr
    assert "first to step 16, second to step 16" in result.stderr


def test_plot_draws_text_curves_and_a_png(full_run, tmp_path, in_process):
    picture = tmp_path / "curves.png"
    result = in_process("plot", str(full_run[0]), "--out", str(picture), "--text", "--metric", "lr")
    assert result.returncode == 0, result.stderr
    assert_png(picture)
    assert "learning rate" in result.stdout and "step" in result.stdout


def test_plot_a_folder_without_metrics_exits_2_with_one_line(tmp_path, in_process):
    result = in_process("plot", str(tmp_path), "--out", str(tmp_path / "x.png"))
    assert result.returncode == 2
    assert f"invalid RUN_DIR: {tmp_path} holds no metrics" in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2 and "Traceback" not in result.stderr
    assert not (tmp_path / "x.png").exists()


def logged_run(folder: Path) -> Path:
    """A run folder holding two intervals, written as a run writes them."""
    folder.mkdir(parents=True)
    rows = [{"step": 1, "train_loss": 2.0, "lr": 0.1}, {"step": 2, "train_loss": 1.5, "lr": 0.05}]
    (folder / "steps.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def test_plot_a_folder_whose_rows_hold_no_values_exits_2_and_draws_nothing(tmp_path, in_process):
    (tmp_path / "metrics.jsonl").write_text('{"x": 1}\n{"step": "one", "train_loss": "high"}\n')
    result = in_process("plot", str(tmp_path), "--out", str(tmp_path / "x.png"))
    assert result.returncode == 2, result.stderr
    assert f"invalid RUN_DIR: {tmp_path} holds no metrics" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "x.png").exists()


def test_plot_of_several_folders_skips_those_without_metrics_with_one_warning_each(
    tmp_path, in_process
):
    runs = tmp_path / "runs"
    first, second = logged_run(runs / "a"), logged_run(runs / "c")
    (runs / "b").mkdir()  # a run stopped before its first interval
    (runs / "notes.txt").write_text("what runs/* also matches")
    picture = tmp_path / "all.svg"
    folders = [str(path) for path in sorted(runs.iterdir())]
    result = in_process("plot", *folders, "--out", str(picture), "--json")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 2, result.stderr
    assert f"skipped {runs / 'b'}: it holds no metrics" in warnings[0]
    assert f"skipped {runs / 'notes.txt'}: it is not a folder" in warnings[1]
    svg = picture.read_text()
    assert "a train" in svg and "c train" in svg and "b train" not in svg
    drawn = json.loads(result.stdout)
    assert [run["folder"] for run in drawn["runs"]] == [str(first), str(second)]
    assert [run["folder"] for run in drawn["skipped"]] == [folders[1], folders[3]]


def test_plot_of_several_folders_none_with_metrics_exits_2(tmp_path, in_process):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    picture = tmp_path / "x.png"
    result = in_process("plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(picture))
    assert result.returncode == 2, result.stderr
    assert "none of the 2 RUN_DIRs holds metrics" in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2 and "Traceback" not in result.stderr
    assert not picture.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--metric", "speed"], "invalid --metric: 'speed' is not one of loss, acc"),
        (["--out", "curves.jpg"], "invalid --out: curves.jpg must end in .png, .svg, .pdf"),
    ],
)
def test_plot_bad_options_exit_2(full_run, args, message):
    result = CliRunner().invoke(app, ["plot", str(full_run[0]), *args])
    assert result.exit_code == 2
    assert message in result.output


def test_a_run_read_while_it_writes_skips_a_line_cut_short(tmp_path):
    (tmp_path / "steps.jsonl").write_text('{"step": 1, "train_loss": 2.0}\n{"step": 2, "tra')
    run = read_run(tmp_path)
    assert run.series["train_loss"].steps == [1] and run.last_step == 1
    with pytest.raises(DdpcliError, match="invalid --metric"):
        choose_panels(["nope"])


# --- an interrupted run ---------------------------------------------------------------------


def test_ctrl_c_leaves_readable_steps_and_a_picture(tmp_path):
    out = tmp_path / "run"
    args = [*TINY, "--synthetic-size", "8192", "--log-every", "2", "--epochs", "1"]
    run = LiveProcess([sys.executable, "-m", "ddpcli", *args, "--out", str(out)], clean_env())
    code = ctrl_c_after(run, "step 4/")
    # Exit 130 and one line on Ctrl-C is the contract's, and not this test's subject.
    assert code != 0, run.stderr[-3000:]
    assert [row["step"] for row in steps_of(out)][:2] == [2, 4]
    assert_png(out / "curves.png")
    assert f"curves up to where the run stopped: {out / 'curves.png'}" in run.stderr


# --- --tensorboard --------------------------------------------------------------------------


def test_tensorboard_missing_exits_2_saying_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr("ddpcli.launcher.resolve.tensorboard_installed", lambda: False)
    args = ["train", "--cpu", "--tensorboard", "--dry-run", "--out", str(tmp_path / "r")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert "invalid --tensorboard: the tensorboard package is not installed" in result.output
    assert "pip install" in result.output


def test_tensorboard_writes_event_files_its_reader_takes(full_run):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    out, _ = full_run  # run with --tensorboard (TENSORBOARD)
    events = accumulator.EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [event.step for event in events.Scalars("train/loss")] == FULL_RUN_STEPS
    assert [event.step for event in events.Scalars("val/acc")] == [8, 16]
    assert events.Scalars("train/lr")[0].value > 0
