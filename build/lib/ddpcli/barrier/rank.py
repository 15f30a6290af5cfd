"""One rank's view of the benchmark: its clock aligned on rank 0's, the arrival board in the
shared store, and a barrier that gives up after --timeout and says who never arrived."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from time import perf_counter as clock
from typing import Any, TextIO

import torch
import torch.distributed as dist

from ddpcli.config import BarrierConfig
from ddpcli.dist import DistContext
from ddpcli.environments import LauncherEnv
from ddpcli.environments.world import DEFAULT_MASTER_PORT
from ddpcli.errors import RUNTIME, DdpcliError, first_line, usage_error

CLOCK_ROUNDS = 16  # round trips per rank; the fastest one gives the offset
# Ranks other than 0 wait this much longer than rank 0, whose Gloo monitor names the missing.
MONITOR_HEAD_START_S = 1.0
# Joining the group may take a while on a busy machine; that is not the hang we look for.
GROUP_TIMEOUT_FLOOR_S = 60.0
SKIPPED_RANK_GIVES_UP_S = 60.0  # a safety net: the job is torn down long before
DEVICE_POLL_S = 0.0002


class BarrierTimeout(DdpcliError):
    """Raised on a rank that waited at a barrier past --timeout; its report is on disk."""

    def __init__(self, message: str):
        super().__init__(message, RUNTIME)


@dataclass(frozen=True)
class ClockOffset:
    offset_s: float  # add to this rank's clock to read rank 0's
    error_s: float  # half the best round trip: the most the offset can be wrong


class ArrivalBoard:
    """Who reached which barrier, kept in the TCPStore every rank already shares. The store
    still answers when the collective is stuck, so any rank can name the ones missing."""

    def __init__(self, env: LauncherEnv, timeout_s: float):
        if not env.master_addr:
            raise usage_error("MASTER_ADDR must be set for bench-barrier (and MASTER_PORT)")
        # Where ddpcli.dist puts the store under SLURM.
        port = env.master_port or DEFAULT_MASTER_PORT
        store = dist.TCPStore(
            env.master_addr, port, is_master=False, timeout=timedelta(seconds=timeout_s)
        )
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        self.store = dist.PrefixStore(f"ddpcli/bench-barrier/{run_id}/", store)
        self.world_size = env.world_size
        self.calls: Counter[str] = Counter()

    def arrive(self, barrier: str, rank: int) -> None:
        # Keyed by how many times this rank called it: barriers match by count, not by name.
        self.calls[barrier] += 1
        self.store.set(self.key(barrier, rank), "arrived")

    def missing(self, barrier: str) -> list[int]:
        return [r for r in range(self.world_size) if not self.store.check([self.key(barrier, r)])]

    def key(self, barrier: str, rank: int) -> str:
        return f"{barrier}/{self.calls[barrier]}/{rank}"


@dataclass
class BenchRank:
    """Everything one rank needs during the benchmark."""

    ctx: DistContext
    control: Any  # a Gloo group: clocks, start signal, results, the guarded demo barrier
    arrivals: ArrivalBoard
    clock: ClockOffset
    workdir: Path | None  # where the launching process collects reports; None under torchrun
    stacks: TextIO

    def shared(self, local_time: float) -> float:
        """This rank's clock reading, on rank 0's clock."""
        return local_time + self.clock.offset_s


def measure_clock_offset(rank: int, world_size: int, group) -> ClockOffset:
    """NTP-style: each rank sends a ping, rank 0 answers with its clock; assuming the two
    legs take equally long, rank 0 read its clock halfway through the round trip."""
    buffer = torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        for peer in range(1, world_size):
            for _ in range(CLOCK_ROUNDS):
                dist.recv(buffer, src=peer, group=group)
                buffer[0] = clock()
                dist.send(buffer, dst=peer, group=group)
        return ClockOffset(0.0, 0.0)
    best_trip, best_offset = float("inf"), 0.0
    for _ in range(CLOCK_ROUNDS):
        sent = clock()
        dist.send(buffer, dst=0, group=group)
        dist.recv(buffer, src=0, group=group)
        received = clock()
        if received - sent < best_trip:
            best_trip = received - sent
            best_offset = buffer.item() - (sent + received) / 2
    return ClockOffset(best_offset, best_trip / 2)


def group_timeout_s(cfg: BarrierConfig) -> float:
    return max(GROUP_TIMEOUT_FLOOR_S, cfg.timeout + MONITOR_HEAD_START_S + 5)


def join_bench(ctx: DistContext, env: LauncherEnv, cfg: BarrierConfig, workdir, stacks):
    # A Gloo group of its own: its timeout is the barrier's, not the (longer) join timeout,
    # and on NCCL it carries the control messages that must not touch the device.
    control = dist.new_group(
        backend="gloo", timeout=timedelta(seconds=cfg.timeout + MONITOR_HEAD_START_S)
    )
    offset = measure_clock_offset(ctx.rank, ctx.world_size, control)
    arrivals = ArrivalBoard(env, group_timeout_s(cfg))
    return BenchRank(ctx, control, arrivals, offset, workdir, stacks)


def gather_to_rank0(bench: BenchRank, value):
    """Every rank's `value`, in rank order, on rank 0; None elsewhere."""
    everyone = [None] * bench.ctx.world_size if bench.ctx.is_main else None
    dist.gather_object(value, everyone, dst=0, group=bench.control)
    return everyone


# --- A barrier that gives up and says why ------------------------------------------------


def guarded_barrier(bench: BenchRank, name: str, timeout_s: float) -> None:
    """barrier(), but after `timeout_s` the rank stops waiting, reports who never arrived
    and where it waited, and raises BarrierTimeout."""
    bench.arrivals.arrive(name, bench.ctx.rank)
    started = clock()
    try:
        if bench.ctx.backend == "nccl":
            device_barrier_until(bench.ctx, started + timeout_s)
        else:
            # Rank 0 enforces the timeout and names every rank that did not arrive; the
            # others wait on rank 0 up to the control group's slightly longer timeout.
            dist.monitored_barrier(
                bench.control, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True
            )
    except (RuntimeError, TimeoutError) as error:  # DistBackendError is a RuntimeError
        raise barrier_timeout(bench, name, clock() - started, first_line(error)) from None


def device_barrier_until(ctx: DistContext, deadline: float) -> None:
    """NCCL's barrier is an all_reduce of one element on the device, and NCCL has no
    monitored barrier: poll the work and give up at the deadline ourselves."""
    work = dist.barrier(async_op=True)
    while not work.is_completed():
        if clock() > deadline:
            raise TimeoutError("the NCCL barrier did not complete in time")
        time.sleep(DEVICE_POLL_S)
    torch.cuda.synchronize(ctx.device)


def barrier_timeout(bench: BenchRank, name: str, waited_s: float, detail: str) -> BarrierTimeout:
    """Leave this rank's stack and what it knows for the launching process."""
    rank = bench.ctx.rank
    faulthandler.dump_traceback(file=bench.stacks, all_threads=False)
    bench.stacks.flush()
    missing = bench.arrivals.missing(name)
    report = {"rank": rank, "barrier": name, "waited_s": round(waited_s, 3), "missing": missing}
    report["backend_message"] = detail
    if bench.workdir is not None:
        (bench.workdir / f"hang-{rank}.json").write_text(json.dumps(report))
    who = ranks_in_words(missing) + (" never arrived" if missing else ": none missing")
    return BarrierTimeout(f"rank {rank}: barrier {name!r} gave up after {waited_s:.1f}s; {who}")


def ranks_in_words(ranks: list[int]) -> str:
    if not ranks:
        return "no rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def dump_stacks_on_sigterm(workdir: Path | None, rank: int) -> TextIO:
    """When the launcher tears the job down, each rank still alive writes its Python stack
    first: that is how a waiting or a missing rank tells where it is."""
    stacks = open(workdir / f"stack-{rank}.txt", "a") if workdir else sys.stderr  # noqa: SIM115
    faulthandler.register(signal.SIGTERM, file=stacks, all_threads=True, chain=True)
    return stacks
