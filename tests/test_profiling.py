"""--profile-steps A:B: one torch.profiler trace per rank, Chrome/Perfetto JSON with the rank
and host in its name and metadata; and the step time split per rank into data wait,
compute, exposed communication and optimizer in summary.json, the slowest rank named."""

from __future__ import annotations

import json
import socket
from types import SimpleNamespace

import pytest
import torch
from conftest import run_cli

from ddpcli.config import build_train_config
from ddpcli.errors import DdpcliError
from ddpcli.training.profiling import StepProfiler, step_profiler, window_note


def step_spans(trace: dict) -> dict[int, tuple[float, float]]:
    """ProfilerStep#N -> (start, end) in the trace's microseconds."""
    return {
        int(event["name"].split("#")[1]): (event["ts"], event["ts"] + event["dur"])
        for event in trace["traceEvents"]
        if event.get("name", "").startswith("ProfilerStep#") and event.get("ph") == "X"
    }


def test_profile_steps_write_a_trace_per_rank_and_the_step_breakdown(tmp_path):
    out = tmp_path / "run"
    result = run_cli(
        "train", "--cpu", "--nproc", "2", "--arch", "tinycnn", "--image-size", "32",
        "--per-gpu-batch", "16", "--synthetic-size", "192", "--epochs", "1", "--log-every", "2",
        "--profile-steps", "2:4", "--out", str(out), "--json", timeout=150,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    host = socket.gethostname()
    folder = out / "profile" / "steps3-4"  # the steps the traces hold
    traces = sorted(path.name for path in folder.iterdir())
    assert traces == [f"rank0-{host}.pt.trace.json", f"rank1-{host}.pt.trace.json"]
    assert f"profile of steps 3-4: one trace per rank in {folder}" in result.stderr
    for rank in (0, 1):
        trace = json.loads((folder / f"rank{rank}-{host}.pt.trace.json").read_text())
        # torch's distributedInfo (what HTA reads), and ddpcli's own beside it
        assert trace["distributedInfo"]["rank"] == rank
        assert trace["distributedInfo"]["world_size"] == 2
        assert {"rank": rank, "host": host, "world_size": 2}.items() <= trace["ddpcli_run"].items()
        spans = step_spans(trace)
        assert sorted(spans) == [3, 4]  # the steps after step 2 up to step 4
        start, end = spans[3][0], spans[4][1]
        inside = {
            event["name"]
            for event in trace["traceEvents"]
            if event.get("ph") == "X" and start <= event["ts"] <= end
        }
        assert {"aten::convolution", "Optimizer.step#SGD.step"} <= inside, sorted(inside)[:40]
    breakdown = json.loads((out / "summary.json").read_text())["step_breakdown"]
    assert json.loads(result.stdout)["step_breakdown"] == breakdown  # --json's summary
    assert [row["rank"] for row in breakdown["per_rank"]] == [0, 1]
    assert breakdown["slowest_rank"] in (0, 1)
    assert breakdown["steps"] == 3  # the 6 steps less the 3 warm-up ones images/s leaves out
    for row in map(json.loads, (out / "steps.jsonl").read_text().splitlines()):
        assert min(row["compute_ms_per_rank"] + row["data_wait_frac_per_rank"]) >= 0, row
    for row in breakdown["per_rank"]:
        parts = ("data_wait", "compute", "exposed_comm", "optimizer", "other")
        assert sum(row[part] for part in parts) == pytest.approx(1.0, abs=0.01)
        assert row["compute"] > 0.1 and row["optimizer"] > 0 and row["step_ms"] > 0


def test_a_resumed_run_keeps_the_trace_of_the_steps_before_its_stop(tmp_path):
    """--profile-steps 2:6, preempted after step 4 (inside the window), resumed from it: the
    resume's trace (steps 5-6) goes beside the first part's (3-4), not over it."""
    ctx = SimpleNamespace(
        rank=0, local_rank=0, world_size=1, backend="gloo", device=torch.device("cpu"),
        is_main=True,
    )  # fmt: skip
    with StepProfiler((2, 6), first_step=2, out=tmp_path, ctx=ctx) as stopped:
        for step in (3, 4):  # each step's end; step 5 is under way at the preemption
            stopped.at_step(step)
    with StepProfiler((2, 6), first_step=4, out=tmp_path, ctx=ctx) as resumed:
        for step in (5, 6):
            resumed.at_step(step)
    host = socket.gethostname()
    traces = {
        path.relative_to(tmp_path / "profile").as_posix(): sorted(
            step_spans(json.loads(path.read_text()))
        )
        for path in (tmp_path / "profile").rglob("*.json")
    }
    first, rest = f"steps3-4/rank0-{host}.pt.trace.json", f"steps5-6/rank0-{host}.pt.trace.json"
    assert sorted(traces) == [first, rest]
    # The first part's trace also holds the span of step 5, under way at the stop (its save).
    assert traces[first][:2] == [3, 4] and 6 not in traces[first]
    assert traces[rest] == [5, 6]


def test_profile_steps_are_checked_before_any_rank_starts():
    result = run_cli("train", "--cpu", "--profile-steps", "4:2", "--dry-run", timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: invalid --profile-steps: A must be below B: 10:15 profiles the 5 steps after "
        "step 10 (got '4:2')"
    ]
    with pytest.raises(DdpcliError, match="the run stops at step 5 .--max-steps.") as error:
        build_train_config({"profile_steps": "5:9", "max_steps": 5}, None, environ={})
    assert error.value.exit_code == 2
    cfg = build_train_config({"profile_steps": " 10:15 "}, None, environ={})
    assert cfg.profile_window == (10, 15)
    assert build_train_config({}, None, environ={}).profile_window is None


def test_off_the_loop_keeps_no_profiler():
    cfg = build_train_config({"cpu": True}, None, environ={})
    assert step_profiler(cfg, ctx=None, first_step=0, total_steps=10) is None  # type: ignore[arg-type]


def test_a_window_the_run_cuts_short_is_said():
    assert window_note((2, 4), first_step=0, last_step=6) == ""
    assert window_note((2, 40), 0, 6) == "the run covers steps 1-6: the trace holds 3-6"
    assert "no step is profiled" in window_note((6, 9), 0, 6)
    assert "past the window" in window_note((2, 4), 5, 12)
