"""`ddpcli bench-barrier` end to end: real Gloo ranks, started by the real CLI.

Sleeps are short and iterations few: the timing checks have wide margins because other
work shares this machine's two cores. Speed itself is measured in benchmarks/, not here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import REPO, run_cli

# Generous: process start-up (importing torch in every rank) dominates on a busy machine.
TOLERANCE_S = 0.05


def bench(*args: str, timeout: float = 90):
    return run_cli("bench-barrier", *args, timeout=timeout)


def assert_no_traceback(result) -> None:
    assert "Traceback" not in result.stdout + result.stderr, result.stderr


# --- the staggered demo ------------------------------------------------------------------


def test_staggered_demo_ranks_leave_together_when_the_last_arrives():
    sleeps = [0.1, 0.5, 0.3]
    result = bench("--nproc", "3", "--sleeps", "0.1,0.5,0.3", "--iters", "20", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # the whole of stdout is one JSON document
    rows = report["ranks"]
    assert [row["rank"] for row in rows] == [0, 1, 2]
    last_arrival = max(row["arrive_s"] for row in rows)
    leaves = [row["leave_s"] for row in rows]
    assert max(leaves) - min(leaves) < TOLERANCE_S
    for row, sleep_s in zip(rows, sleeps, strict=True):
        assert row["arrive_s"] - row["start_s"] == pytest.approx(sleep_s, abs=TOLERANCE_S)
        assert row["leave_s"] >= row["arrive_s"]
        # Each rank waits for the last one: the differences of the sleeps.
        assert row["wait_s"] == pytest.approx(last_arrival - row["arrive_s"], abs=TOLERANCE_S)
    assert report["last_arrival"]["rank"] == 1
    assert report["leave_spread_ms"] == pytest.approx((max(leaves) - min(leaves)) * 1e3, abs=0.01)
    assert_contract_shape(report, world_size=3)
    assert result.stderr.strip() == ""  # --json: no human output


def test_one_rank_times_a_real_barrier():
    """A one-GPU node's default world: one rank still forms a group, whose barrier is timed.
    A collective of one rank moves nothing: no bandwidth (broadcast's read "44 TB/s")."""
    result = bench("--nproc", "1", "--iters", "5", "--collective", "broadcast,all_reduce",
                   "--sizes", "1K", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert_no_traceback(result)
    report = json.loads(result.stdout)
    assert [row["rank"] for row in report["ranks"]] == [0]
    assert_contract_shape(report, world_size=1, collectives=("broadcast", "all_reduce"))
    for row in report["collectives"]:
        assert row["time_us"] > 0 and row["algbw_GBps"] is None and row["busbw_GBps"] is None


def assert_contract_shape(report: dict, world_size: int, collectives: tuple[str, ...] = ()) -> None:
    for row in report["ranks"]:
        assert {"rank", "arrive_s", "leave_s", "wait_s"} <= row.keys()
    overall = report["latency_us"]
    assert {"p50", "p90", "p99", "max"} <= overall.keys()
    assert 0 < overall["p50"] <= overall["p90"] <= overall["p99"] <= overall["max"]
    assert [row["rank"] for row in report["latency_us_per_rank"]] == list(range(world_size))
    assert report["world_size"] == world_size and report["backend"] == "gloo"
    assert [row["collective"] for row in report["collectives"]] == list(collectives)


def test_one_ranks_collectives_say_na_for_bandwidth_and_why(capsys):
    from ddpcli.cli.barrier import show_collectives

    row = {"collective": "broadcast", "size_bytes": 1 << 20, "count": 1 << 18, "iters": 9,
           "time_us": 0.02, "algbw_GBps": None, "busbw_GBps": None}  # fmt: skip
    show_collectives({"world_size": 1, "collectives": [row]})
    shown = capsys.readouterr().err
    table_row = next(line for line in shown.splitlines() if "broadcast" in line)
    assert table_row.count("n/a") == 2 and "1 MiB" in table_row
    assert "bandwidth n/a: a collective of one rank moves no data" in " ".join(shown.split())


def test_human_report_has_table_timeline_and_latency():
    result = bench("--nproc", "2", "--sleeps", "0.05,0.3", "--iters", "10")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""  # human output goes to stderr
    text = result.stderr
    assert "staggered demo" in text
    assert "left together" in text and "rank 1, got there" in text
    assert "░" in text and "┃" in text  # the timeline
    assert "barrier latency in µs" in text and "p99" in text


def test_zero_first_rank0_finishes_before_anyone_else_starts():
    result = bench(
        "--nproc", "3", "--demo", "zero-first", "--sleeps", "0.3,0.05,0.05",
        "--iters", "5", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    rank0, *others = report["ranks"]
    assert report["zero_first"]["rank0_finished_first"] is True
    for row in others:
        assert row["work_start_s"] >= rank0["work_end_s"]
        assert row["wait_s"] == pytest.approx(0.3, abs=TOLERANCE_S)  # they waited for rank 0


# --- collectives ------------------------------------------------------------------------


def test_collectives_report_nccl_tests_bandwidths():
    result = bench(
        "--nproc", "2", "--demo", "none", "--collective", "all_reduce,all_gather,broadcast",
        "--sizes", "4,1K,64K", "--iters", "5", "--warmup", "1", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ranks"] == []
    rows = report["collectives"]
    assert [(row["collective"], row["size_bytes"]) for row in rows] == [
        ("all_reduce", 4), ("all_reduce", 1024), ("all_reduce", 65536),
        ("all_gather", 8), ("all_gather", 1024), ("all_gather", 65536),  # 1 float per rank
        ("broadcast", 4), ("broadcast", 1024), ("broadcast", 65536),
    ]  # fmt: skip
    factor = {"all_reduce": 2 * (2 - 1) / 2, "all_gather": (2 - 1) / 2, "broadcast": 1.0}
    for row in rows:
        assert row["time_us"] > 0
        algbw = row["size_bytes"] / (row["time_us"] * 1e-6) / 1e9
        assert row["algbw_GBps"] == pytest.approx(algbw, rel=0.01, abs=1e-4)
        expected_busbw = row["algbw_GBps"] * factor[row["collective"]]
        assert row["busbw_GBps"] == pytest.approx(expected_busbw, rel=0.01, abs=1e-4)


# --- a skipped barrier: bounded, named, nothing left running ------------------------------


def run_watching_processes(*args: str, timeout: float = 90):
    """Run the CLI and list any process of the job still alive after it returned (tagged
    through an environment variable every rank inherits); then clean up regardless."""
    token = f"ddpcli-test-{uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "DDPCLI_TEST_RUN": token}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "ddpcli", "bench-barrier", *args]
    started = time.monotonic()
    # A new interpreter, not the zygote's fork: the launcher sets TORCH_CPP_LOG_LEVEL before
    # it imports torch, which reads it then (Gloo's own log lines are the point here).
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        cwd=REPO, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise AssertionError(f"bench-barrier {' '.join(args)} ran past {timeout}s") from None
    elapsed = time.monotonic() - started
    leftovers = processes_tagged(token)
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    return (
        subprocess.CompletedProcess(command, process.returncode, stdout, stderr),
        elapsed,
        leftovers,
    )


def processes_tagged(token: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if token.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:  # gone already, or not ours
            continue
    return found


def test_skip_rank_times_out_names_the_rank_and_where_the_others_wait():
    timeout_s = 3
    result, elapsed, leftovers = run_watching_processes(
        "--nproc", "3", "--sleeps", "0,0.1,0", "--skip-rank", "2", "--timeout", str(timeout_s)
    )
    assert result.returncode == 1, result.stderr
    assert_no_traceback(result)
    # Start-up of three torch processes on a busy machine is most of the margin.
    assert elapsed < timeout_s + 45, f"took {elapsed:.1f}s"
    assert leftovers == [], "processes of the job outlived it"
    text = result.stderr
    assert "rank 2 never arrived" in text
    assert "Ranks 2 failed to pass monitoredBarrier" in text  # Gloo's own word, from rank 0
    assert "ProcessGroupGloo.cpp" not in text  # said once, in the summary, not logged by each
    assert "ranks 0, 1 wait at ddpcli/barrier/demos.py:" in text and "staggered_demo" in text
    assert "last seen at ddpcli/barrier/demos.py:" in text and "skip_the_barrier" in text


def test_skip_rank_zero_is_named_by_the_others_in_json():
    result, _, leftovers = run_watching_processes(
        "--nproc", "2", "--skip-rank", "0", "--timeout", "2", "--json"
    )
    assert result.returncode == 1, result.stderr
    assert_no_traceback(result)
    assert leftovers == []
    report = json.loads(result.stdout)
    assert report["missing_ranks"] == [0]
    assert report["reported_by"] == [1]
    waiting = {entry["rank"]: entry for entry in report["ranks"]}
    assert waiting[1]["arrived"] and waiting[1]["where"]["function"] == "staggered_demo"
    assert not waiting[0]["arrived"] and waiting[0]["where"]["function"] == "skip_the_barrier"
    assert "rank 0 never arrived" in result.stderr


# --- bad input and help -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--nproc", "0"], "--nproc"),
        (["--nproc", "3", "--sleeps", "0.2,0.9"], "--sleeps"),
        (["--sleeps", "-1,2"], "--sleeps"),
        (["--skip-rank", "5"], "--skip-rank"),
        (["--collective", "all_reduce", "--sizes", "1Q"], "--sizes"),
        (["--gpus", "0", "--nproc", "2"], "--gpus"),
    ],
)
def test_bad_input_exits_2_with_one_line(in_process, monkeypatch, args, names):
    # Refused before any rank starts: in this process, which the command's own setting of
    # TORCH_CPP_LOG_LEVEL must not outlive (the variable as it was, after the test).
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "placeholder")
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL")
    result = in_process("bench-barrier", *args)
    assert result.returncode == 2
    assert_no_traceback(result)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and names in lines[0], result.stderr
    assert result.stdout == ""


def test_help_does_not_import_torch():
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ddpcli", "bench-barrier", "--help"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0
    assert "--skip-rank" in result.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()]
    assert "torch" not in imported


# --- GPUs ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_nccl_barrier_is_an_all_reduce_timed_on_the_device():
    result = bench(
        "--gpus", "0", "--iters", "20", "--collective", "all_reduce", "--sizes", "4,1M",
        "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["backend"] == "nccl"
    assert "all_reduce" in report["barrier"] and "synchronize" in report["barrier"]
    assert report["latency_us"]["p50"] > 0
    assert [row["size_bytes"] for row in report["collectives"]] == [4, 1 << 20]


# --- long runs say how long they will take ---------------------------------------------------


def test_a_long_latency_run_says_its_estimate_up_front_then_its_progress(capsys, monkeypatch):
    from ddpcli.barrier import measure

    monkeypatch.setattr(measure, "PROGRESS_EVERY_S", 0.05)
    calls = []

    def barrier() -> None:
        calls.append(1)
        time.sleep(0.001)

    samples = measure.time_calls_with_progress(barrier, 200, warmup_ns=[1_000_000] * 5)
    assert len(samples) == len(calls) == 200  # every call timed once, none added
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("timing 200 barriers on each rank: about 0.2 s at 1000 µs each")
    assert any(line.startswith("barriers: ") and " of 200 (" in line for line in lines[1:])
    assert all("left" in line for line in lines[1:])


def test_a_short_latency_run_says_nothing(capsys):
    from ddpcli.barrier import measure

    samples = measure.time_calls_with_progress(lambda: None, 50, warmup_ns=[])
    assert len(samples) == 50 and capsys.readouterr().err == ""


def test_durations_in_words():
    from ddpcli.barrier.measure import duration_words

    words = [duration_words(s) for s in (0.24, 45.4, 200, 7500)]
    assert words == ["0.2 s", "45 s", "3 min 20 s", "2 h 5 min"]
