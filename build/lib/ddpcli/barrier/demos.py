"""The two barrier demos: staggered sleeps (everyone leaves when the last arrives) and zero
first (rank 0 works while the others wait). Times are on rank 0's clock."""

from __future__ import annotations

import time
from time import perf_counter as clock
from typing import Any

import torch
import torch.distributed as dist

from ddpcli.barrier.rank import SKIPPED_RANK_GIVES_UP_S, BenchRank, guarded_barrier
from ddpcli.config import BarrierConfig
from ddpcli.dist import zero_first
from ddpcli.errors import runtime_error

START_LEAD_S = 0.1  # rank 0 sets the common start this far ahead, so every rank is ready
DEMO_BARRIER = "demo"


def wait_for_common_start(bench: BenchRank) -> float:
    """Rank 0 names a start instant on its clock; every rank sleeps until then on its own.
    Returns the start on rank 0's clock: the zero of every reported time."""
    start = torch.zeros(1, dtype=torch.float64)
    if bench.ctx.is_main:
        start[0] = clock() + START_LEAD_S
    dist.broadcast(start, src=0, group=bench.control)
    local_start = start.item() - bench.clock.offset_s
    while (left := local_start - clock()) > 0:
        time.sleep(left - 0.001 if left > 0.002 else 0)  # sleep, then spin the last ms
    return start.item()


def staggered_demo(bench: BenchRank, cfg: BarrierConfig) -> dict:
    """BACKGROUND's demo 1: rank r sleeps its share, then calls barrier()."""
    rank = bench.ctx.rank
    sleep_s = cfg.sleeps_per_rank[rank]
    zero = wait_for_common_start(bench)
    started = clock()
    time.sleep(sleep_s)
    if cfg.skip_rank == rank:
        skip_the_barrier(cfg)
    arrived = clock()
    guarded_barrier(bench, DEMO_BARRIER, cfg.timeout)
    left = clock()
    return demo_row(bench, zero, sleep_s=sleep_s, start=started, arrive=arrived, leave=left)


def zero_first_demo(bench: BenchRank, cfg: BarrierConfig) -> dict:
    """BACKGROUND's demo 2, run through ddpcli.dist.zero_first: the other ranks wait at a
    barrier while rank 0 works; rank 0 then joins the barrier and everyone else works."""
    rank = bench.ctx.rank
    work_s = cfg.sleeps_per_rank[rank]
    zero = wait_for_common_start(bench)
    entered = clock()
    with zero_first(bench.ctx):
        work_started = clock()
        time.sleep(work_s)
        work_ended = clock()
    exited = clock()
    # Rank 0 calls barrier() after its work, the others before theirs.
    arrived, left = (work_ended, exited) if rank == 0 else (entered, work_started)
    return demo_row(
        bench, zero, sleep_s=work_s, start=entered, arrive=arrived, leave=left,
        work_start=work_started, work_end=work_ended,
    )  # fmt: skip


def demo_row(bench: BenchRank, zero: float, **local_times: float) -> dict:
    """One rank's line of the report: local clock readings -> seconds since the start."""
    row: dict[str, Any] = {"rank": bench.ctx.rank, "sleep_s": local_times.pop("sleep_s")}
    for name, value in local_times.items():
        row[f"{name}_s"] = round(bench.shared(value) - zero, 6)
    row["wait_s"] = round(row["leave_s"] - row["arrive_s"], 6)
    row["clock_offset_ms"] = round(bench.clock.offset_s * 1e3, 4)
    row["clock_error_ms"] = round(bench.clock.error_s * 1e3, 4)
    return row


def demo_summary(demo: str, rows: list[dict]) -> dict:
    leaves = [row["leave_s"] for row in rows]
    last = max(rows, key=lambda row: row["arrive_s"])
    summary = {
        "leave_spread_ms": round((max(leaves) - min(leaves)) * 1e3, 3),
        "last_arrival": {"rank": last["rank"], "arrive_s": last["arrive_s"]},
        "clock_error_ms": max(row["clock_error_ms"] for row in rows),
    }
    if demo == "zero-first":
        others = [row["work_start_s"] for row in rows if row["rank"] != 0]
        rank0_end = rows[0]["work_end_s"]
        summary["zero_first"] = {
            "rank0_work_end_s": rank0_end,
            "others_first_work_start_s": min(others) if others else None,
            "rank0_finished_first": all(start >= rank0_end for start in others),
        }
    return summary


def skip_the_barrier(cfg: BarrierConfig) -> None:
    """The classic mistake: this rank goes on without calling barrier(), so the others
    wait for it. Here "going on" is sleeping until the job is torn down."""
    give_up = clock() + cfg.timeout + SKIPPED_RANK_GIVES_UP_S
    while clock() < give_up:
        time.sleep(0.05)
    raise runtime_error("the other ranks never gave up waiting for the skipped barrier")
