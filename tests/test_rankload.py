"""The data wait and the straggler: each rank's wait for data and its own compute, carried
in the loop's metric reduction, and the slowest rank named when it holds the others up."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from ddpcli.config import build_train_config
from ddpcli.errors import DdpcliError
from ddpcli.outputs.rankload import rank_figures, straggler_note


def test_a_rank_well_above_the_median_is_named_with_a_data_hint():
    figures = rank_figures(wait_s=[0.1, 3.0, 0.1], compute_s=[2.0, 2.0, 2.1], wall_s=5.0, steps=10)
    assert figures["slowest_rank"] == 1
    assert figures["data_wait_frac_per_rank"] == [0.02, 0.6, 0.02]
    assert figures["compute_ms_per_rank"] == [200.0, 200.0, 210.0]
    note = straggler_note({**figures, "data_path": "loader (2 workers)"})
    assert note.startswith("rank 1 is the slowest, 127% slower than the median rank")
    assert "raise --workers or try --data-path device (data path now: loader (2 workers))" in note


def test_ranks_within_ten_percent_name_no_one():
    figures = rank_figures(wait_s=[0.0, 0.0], compute_s=[1.0, 1.15], wall_s=1.2, steps=4)
    assert figures["slowest_rank"] is None and figures["data_wait_frac"] == 0.0
    assert straggler_note({**figures, "data_path": "device"}) == ""


def test_an_epoch_of_few_steps_warns_on_no_one():
    figures = rank_figures(wait_s=[0.1, 3.0], compute_s=[2.0, 2.0], wall_s=5.0, steps=4)
    assert figures["slowest_rank"] == 1  # recorded, but too few steps for a warning line
    assert straggler_note({**figures, "data_path": "loader"}) == ""


def test_slow_data_variable_is_checked():
    cfg = build_train_config({}, None, environ={"DDPCLI_SLOW_DATA": "1:0.05"})
    assert cfg.slow_data == (1, 0.05)
    with pytest.raises(DdpcliError, match="DDPCLI_SLOW_DATA") as error:
        build_train_config({}, None, environ={"DDPCLI_SLOW_DATA": "one"})
    assert error.value.exit_code == 2


def test_a_rank_slowed_on_purpose_is_named(tmp_path):
    out = tmp_path / "run"
    result = run_cli(
        "train", "--cpu", "--nproc", "2", "--arch", "tinycnn", "--image-size", "16",
        "--per-gpu-batch", "16", "--synthetic-size", "320", "--epochs", "1", "--log-every", "5",
        "--data-path", "loader", "--workers", "1", "--out", str(out), timeout=150,
        env={"DDPCLI_SLOW_DATA": "1:0.1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (metrics,) = (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
    assert metrics["slowest_rank"] == 1
    waits = metrics["data_wait_frac_per_rank"]
    assert waits[1] > 0.25 and waits[1] > 3 * waits[0]
    # Own compute leaves out DDP's waits for rank 1: rank 0 does not look as slow as it.
    assert metrics["compute_ms_per_rank"][0] < 0.5 * (
        1000 * 0.1 + metrics["compute_ms_per_rank"][1]
    )
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert rows[-1]["slowest_rank"] == 1 and rows[-1]["data_wait_frac"] > 0.1
    assert "slowest rank 1 (+" in result.stderr  # the step lines
    assert "rank 1 is the slowest" in result.stderr  # the epoch line and the summary
    assert "raise --workers or try --data-path device" in result.stderr
    # The step breakdown (summary.json) names the same rank; no --profile-steps, no traces.
    assert json.loads((out / "summary.json").read_text())["step_breakdown"]["slowest_rank"] == 1
    assert not (out / "profile").exists()
    assert "data wait " in result.stderr and "compute per step, ms: 0: " in result.stderr
