"""Nothing lost, nothing silently wrong in the loop (issue 19): a non-finite loss stops the
run and keeps the last good checkpoint, and every JSON file ddpcli writes is valid JSON.
Real Gloo processes on tiny images, each run bounded."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_cli, settings_warnings

from ddpcli import ui
from ddpcli.checkpoint.loading import safe_load
from ddpcli.files import file_sha256

TINY = ["--cpu", "--arch", "tinycnn", "--image-size", "16", "--per-gpu-batch", "32"]


def strict_json(text: str):
    """json.loads as strict readers (jq, JavaScript) parse: NaN and Infinity are errors."""

    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def strict_lines(path: Path) -> list[dict]:
    return [strict_json(line) for line in path.read_text().splitlines()] if path.exists() else []


# --- Valid JSON, always ----------------------------------------------------------------------


def test_json_text_writes_null_for_non_finite_floats():
    document = {"loss": math.nan, "rates": [1.5, math.inf, (-math.inf, 2)], "path": Path("/x")}
    text = ui.json_text(document)
    assert strict_json(text) == {"loss": None, "rates": [1.5, None, [None, 2]], "path": "/x"}


# --- Runs of two epochs of two steps -----------------------------------------------------

# 128 images over 2 ranks in batches of 32: two optimizer steps per epoch.
TWO_STEPS_AN_EPOCH = [*TINY, "--nproc", "2", "--synthetic-size", "128"]
TWO_STEP_EPOCHS = [*TWO_STEPS_AN_EPOCH, "--epochs", "2"]
COMPARED = ("train_loss", "train_acc", "val_loss", "val_acc", "lr")


def train_two_step_epochs(out: Path, *extra: str):
    result = run_cli("train", *TWO_STEP_EPOCHS, "--out", str(out), *extra, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def two_step_reference(tmp_path_factory) -> Path:
    """An uninterrupted run of TWO_STEP_EPOCHS, read only: the reference a stopped and
    resumed run must match, and the good run a diverging resume must leave as it was."""
    out = tmp_path_factory.mktemp("reference") / "run"
    train_two_step_epochs(out)
    return out


# --- A non-finite loss stops the run ---------------------------------------------------------

NON_FINITE = re.compile(r"the training loss is (nan|inf|-inf) (at|between) step (\d+)")


def test_a_nan_loss_stops_the_run_within_one_logging_interval(tmp_path):
    out = tmp_path / "run"
    result = run_cli(
        "train", *TINY, "--nproc", "2", "--synthetic-size", "512", "--epochs", "2",
        "--lr", "1e9", "--log-every", "1", "--out", str(out), "--json", timeout=180,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stdout == ""  # no summary of a failed run, and never a bare NaN
    found = NON_FINITE.search(result.stderr)
    assert found and found.group(2) == "at", result.stderr[-3000:]  # --log-every 1: that step
    assert len(NON_FINITE.findall(result.stderr)) == 1  # every rank found it: said once
    assert "lower --lr (this run: 1e+09)" in result.stderr
    assert "no checkpoint had been saved yet" in result.stderr
    assert "Traceback" not in result.stderr
    assert strict_lines(out / "metrics.jsonl") == []  # no epoch of NaN recorded
    assert not (out / "checkpoints").exists() and not (out / "summary.json").exists()


def test_a_nan_loss_keeps_the_last_good_checkpoint(two_step_reference, tmp_path, in_process):
    # The good run: two epochs of two steps each, its checkpoints at step 4; a copy goes on.
    out = tmp_path / "run"
    shutil.copytree(two_step_reference, out)
    checkpoints = out / "checkpoints"
    before = {name: file_sha256(checkpoints / name) for name in ("last.pt", "best.pt")}
    good_epochs = (out / "metrics.jsonl").read_text()

    result = run_cli(
        "train", *TWO_STEPS_AN_EPOCH, "--epochs", "3", "--resume", "auto", "--log-every", "100",
        "--lr", "1e9", "--lr-scaling", "none", "--out", str(out), timeout=180,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert NON_FINITE.search(result.stderr) or "validation loss is" in result.stderr, result.stderr[
        -3000:
    ]
    assert "epoch 3, batch" in result.stderr  # stopped inside the epoch that diverged
    assert "last.pt and best.pt are kept as they were (step 4)" in result.stderr
    # Every rank found it at the same step: the job says it once, not once per rank.
    said = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(said) == 1 and "rank" not in said[0], result.stderr[-3000:]
    assert {name: file_sha256(checkpoints / name) for name in before} == before
    assert (out / "metrics.jsonl").read_text() == good_epochs  # valid JSON, no NaN epoch
    verify = in_process("checkpoint", "verify", str(checkpoints / "last.pt"))  # no worker
    assert verify.returncode == 0, verify.stdout + verify.stderr


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_weights_are_never_saved(tmp_path, bad):
    from test_speed_paths import context, rank_trainer, tiny_config

    from ddpcli.errors import DdpcliError

    trainer = rank_trainer(tiny_config(tmp_path, synthetic_size=32), context())
    trainer.check_weights()  # finite: nothing to say
    with torch.no_grad():
        next(trainer.model.parameters())[0].fill_(bad)
    with pytest.raises(DdpcliError) as stopped:
        trainer.check_weights()
    assert stopped.value.exit_code == 1
    assert "a weight is not finite at step 0" in stopped.value.message


# --- Accumulation: what a step really holds ----------------------------------------------


def in_process_trainer(tmp_path: Path, **overrides):
    """One CPU rank without a process group: the Trainer exactly as a worker builds it."""
    from test_speed_paths import context, rank_trainer, tiny_config

    return rank_trainer(tiny_config(tmp_path, **overrides), context())


@pytest.mark.parametrize(
    ("accumulate", "per_step", "global_batch", "note"),
    [
        (1, [1, 1, 1], 8, ""),
        (2, [2, 2, 1], 16, "each epoch's last optimizer step accumulates 1"),
        (5, [3, 3, 3], 24, "only 3 micro-batch(es) per rank: each optimizer step accumulates 3"),
    ],
)
def test_each_step_divides_by_the_micro_batches_it_holds(
    tmp_path, accumulate, per_step, global_batch, note
):
    # 24 images in batches of 8: three micro-batches per epoch.
    trainer = in_process_trainer(tmp_path, synthetic_size=24, accumulate=accumulate)
    schedule = trainer.schedule
    assert schedule.micro_total == 3
    assert [schedule.micro_batches_in_step(trainer.state, batch) for batch in (1, 2, 3)] == per_step
    assert schedule.global_batch == global_batch
    assert note in schedule.accumulation_note() and bool(note) == bool(schedule.accumulation_note())


def test_the_header_says_where_a_max_steps_stop_falls_on_the_schedule(tmp_path, capsys):
    """The schedule spans --epochs whatever --max-steps says; the header says both ends."""
    # 24 images in batches of 8, 4 epochs: three steps per epoch, twelve in the schedule.
    stopped = in_process_trainer(tmp_path, synthetic_size=24, epochs=4, max_steps=5)
    stopped.announce()
    header = capsys.readouterr().err
    assert "cosine decay to 0 at step 12; --max-steps stops at step 5\n" in header
    for max_steps in (None, 12, 20):  # no stop before the schedule's end: nothing to say
        in_process_trainer(tmp_path, synthetic_size=24, epochs=4, max_steps=max_steps).announce()
        header = capsys.readouterr().err
        assert "cosine decay to 0 at step 12\n" in header and "stops at" not in header


def test_accumulate_beyond_the_epoch_trains_as_the_micro_batches_there(tmp_path):
    """128 images, 2 ranks, batches of 32: two micro-batches per epoch. --accumulate 100
    must train exactly as --accumulate 2 (today its updates are 50 times too small) and
    report the global batch of 128 that each step really holds."""
    runs, warnings = {}, {}
    for accumulate in ("100", "2"):
        out = tmp_path / f"accumulate-{accumulate}"
        result = run_cli(
            "train", *TINY, "--nproc", "2", "--synthetic-size", "128", "--epochs", "2",
            "--accumulate", accumulate, "--out", str(out), "--json", timeout=180,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        runs[accumulate] = (strict_json(result.stdout), strict_lines(out / "metrics.jsonl"))
        warnings[accumulate] = result.stderr
        assert "accumulate 2 = global batch 128" in result.stderr
    assert "each optimizer step accumulates 2 (global batch 128, not 6400)" in warnings["100"]
    assert settings_warnings(warnings["2"]) == []
    (summary, metrics), (_, reference) = runs["100"], runs["2"]
    assert summary["global_batch"] == 128 and [m["step"] for m in metrics] == [1, 2]
    for got, want in zip(metrics, reference, strict=True):
        assert got["global_batch"] == want["global_batch"] == 128
        for key in ("train_loss", "val_loss", "val_acc", "lr"):
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key


def test_a_per_process_batch_larger_than_a_shard_exits_2(tmp_path):
    out = tmp_path / "run"
    result = run_cli(
        "train", *TINY, "--nproc", "2", "--synthetic-size", "4096", "--epochs", "1",
        "--per-gpu-batch", "100000", "--out", str(out), timeout=180,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "invalid --per-gpu-batch" in result.stderr  # ddpcli.data.pipeline says why
    assert "give each 2048, less than one batch of 100000" in result.stderr
    assert "--per-gpu-batch to 2048 or less" in result.stderr
    assert result.stderr.count("invalid --per-gpu-batch") == 1  # both ranks found it: said once
    assert "Traceback" not in result.stderr
    assert not (out / "metrics.jsonl").exists()


# --- A stop by --max-steps inside an epoch -------------------------------------------------


def test_a_max_steps_stop_inside_an_epoch_is_finished_exactly_by_a_resume(
    two_step_reference, tmp_path
):
    reference, out = two_step_reference, tmp_path / "run"
    stopped = train_two_step_epochs(out, "--max-steps", "3")  # one step into epoch 2
    assert "epoch 2/2, stopped by --max-steps 3 after batch 1 of 2" in stopped.stderr
    assert "cosine decay to 0 at step 4; --max-steps stops at step 3\n" in stopped.stderr
    metrics = strict_lines(out / "metrics.jsonl")
    assert [(m["epoch"], m["step"], m.get("partial")) for m in metrics] == [
        (1, 2, None),
        (2, 3, True),
    ]
    payload = safe_load(out / "checkpoints" / "last.pt", check_digest=True)
    # Recorded as a partial epoch, as a --save-every-steps checkpoint inside it would be.
    assert (payload["epoch"], payload["batch_in_epoch"], payload["step"]) == (1, 1, 3)
    assert payload["partial_sums"][2] == 64 and len(payload["metrics"]) == 1

    again = train_two_step_epochs(out, "--max-steps", "3", "--resume", "auto")
    assert "nothing to train: --max-steps 3 is reached (step 3, inside epoch 2)" in again.stderr
    assert strict_lines(out / "metrics.jsonl") == metrics  # left as it was

    resumed = train_two_step_epochs(out, "--max-steps", "4", "--resume", "auto")  # raised
    assert "at epoch 2, batch 1 (step 3)" in resumed.stderr
    assert settings_warnings(resumed.stderr) == []  # --max-steps changes where a run stops, no more
    finished = strict_lines(out / "metrics.jsonl")
    wanted = strict_lines(reference / "metrics.jsonl")
    assert [(m["epoch"], m["step"], m.get("partial")) for m in finished] == [
        (1, 2, None),
        (2, 4, None),
    ]
    for got, want in zip(finished, wanted, strict=True):
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-12), (got["epoch"], key)
    final = safe_load(out / "checkpoints" / "last.pt", check_digest=True)
    uninterrupted = safe_load(reference / "checkpoints" / "last.pt")
    assert (final["epoch"], final["batch_in_epoch"], final["step"]) == (2, 0, 4)
    for key, tensor in final["model"].items():
        assert torch.allclose(tensor, uninterrupted["model"][key], rtol=1e-5, atol=1e-7), key


# --- Throughput of a run stopped early ---------------------------------------------------------


def test_a_max_steps_stop_inside_an_epoch_records_the_measured_images_per_sec(tmp_path):
    """8 steps an epoch, stopped after 2: the timing window is planned on the steps the
    epoch runs, not on the 8 it would have run (which left nothing timed: 0 img/s)."""
    out = tmp_path / "run"
    eight_steps = [*TINY, "--nproc", "2", "--synthetic-size", "512", "--epochs", "1"]
    result = run_cli("train", *eight_steps, "--max-steps", "2", "--out", str(out), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = strict_lines(out / "metrics.jsonl")
    assert row["partial"] is True and row["step"] == 2
    assert row["images_per_sec"] > 0
    assert " 0 img/s" not in result.stderr
    assert f"{row['images_per_sec']:.0f} img/s" in result.stderr


def test_a_rate_that_was_not_measured_is_shown_as_none_not_zero():
    from ddpcli.dist import DistContext
    from ddpcli.training.metrics import StepTimer

    ctx = DistContext(0, 0, 1, 1, 0, torch.device("cpu"), "gloo")
    timer = StepTimer(torch.device("cpu"), planned_steps=8)
    timer.tick(32)  # a preemption after one step: still inside the untimed first steps
    assert timer.images_per_sec(ctx) is None
    metrics = {"train_loss": 2.0, "val_loss": None, "images_per_sec": None}
    assert ui.format_metrics(metrics).endswith("not validated · img/s not measured")
