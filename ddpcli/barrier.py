"""The barrier demo and the collective benchmarks of `ddpcli bench-barrier`.

Two halves. Inside each rank (`run_rank`): align clocks on rank 0's, run the staggered or
zero-first demo, time barriers and collectives. In the launching process (`run_bench`):
start the ranks, read rank 0's result, and when a barrier hangs, turn what the ranks left
behind (reports and faulthandler stacks) into one summary: who waits where, who is missing.

Times the ranks report are on one clock, rank 0's: each rank measures its offset over the
process group (best of several round trips), so nothing trusts wall clocks to agree.
"""

from __future__ import annotations

import faulthandler
import json
import linecache
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from time import perf_counter as clock
from typing import Any, TextIO

import numpy as np
import torch
import torch.distributed as dist

from ddpcli import ui
from ddpcli.config import BarrierConfig
from ddpcli.dist import DistContext, init_distributed, shutdown, zero_first
from ddpcli.environments import LauncherEnv, read_launcher_env
from ddpcli.errors import RUNTIME, DdpcliError, first_line, runtime_error, usage_error
from ddpcli.launch import WorkerJob, run_workers, worker_environment
from ddpcli.machine import check_gpu_indices, cpu_count
from ddpcli.timing import bandwidth_gbps, percentiles_us, synchronize, time_calls_ns

WORKER_MODULE = "ddpcli.barrier_worker"
RESULT_FILE = "result.json"
CLOCK_ROUNDS = 16  # round trips per rank; the fastest one gives the offset
START_LEAD_S = 0.1  # rank 0 sets the common start this far ahead, so every rank is ready
# Ranks other than 0 wait this much longer than rank 0, whose Gloo monitor names the missing.
MONITOR_HEAD_START_S = 1.0
# Joining the group may take a while on a busy machine; that is not the hang we look for.
GROUP_TIMEOUT_FLOOR_S = 60.0
SKIPPED_RANK_GIVES_UP_S = 60.0  # a safety net: the job is torn down long before
COLLECTIVE_BYTES_PER_SIZE = 512 << 20  # big messages run fewer iterations: about this much each
MIN_COLLECTIVE_ITERS = 3
DEVICE_POLL_S = 0.0002
DEMO_BARRIER = "demo"


class BarrierTimeout(DdpcliError):
    """Raised on a rank that waited at a barrier past --timeout; its report is on disk."""

    def __init__(self, message: str):
        super().__init__(message, RUNTIME)


class BarrierHang(DdpcliError):
    """The job hung at a barrier: `report` says who waited where and who never came."""

    def __init__(self, report: dict):
        super().__init__(describe_hang(report), RUNTIME)
        self.report = report


# --- One rank's view of the benchmark ------------------------------------------------------


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
        port = env.master_port or 29500  # where ddpcli.dist puts the store under SLURM
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


def skip_the_barrier(cfg: BarrierConfig) -> None:
    """The classic mistake: this rank goes on without calling barrier(), so the others
    wait for it. Here "going on" is sleeping until the job is torn down."""
    give_up = clock() + cfg.timeout + SKIPPED_RANK_GIVES_UP_S
    while clock() < give_up:
        time.sleep(0.05)
    raise runtime_error("the other ranks never gave up waiting for the skipped barrier")


def ranks_in_words(ranks: list[int]) -> str:
    if not ranks:
        return "no rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


# --- The demos --------------------------------------------------------------------------


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


# --- Latency of barrier() --------------------------------------------------------------


def barrier_call(ctx: DistContext) -> Callable[[], Any]:
    if ctx.backend != "nccl":
        return dist.barrier
    device = ctx.device

    def barrier_on_device() -> None:
        # NCCL's barrier is an all_reduce on the device: time it until the device is done.
        dist.barrier()
        torch.cuda.synchronize(device)

    return barrier_on_device


def measure_latency(bench: BenchRank, cfg: BarrierConfig) -> dict | None:
    barrier_once = barrier_call(bench.ctx)
    time_calls_ns(barrier_once, cfg.warmup)
    samples_us = np.asarray(time_calls_ns(barrier_once, cfg.iters), dtype=np.float64) / 1e3
    everyone = gather_to_rank0(bench, samples_us)
    if everyone is None:
        return None
    per_rank = [{"rank": rank, **percentiles_us(s)} for rank, s in enumerate(everyone)]
    overall = percentiles_us(np.concatenate(everyone))
    overall.update(iters=cfg.iters, warmup=cfg.warmup)
    return {"latency_us": overall, "latency_us_per_rank": per_rank}


# --- Collectives, measured the way nccl-tests measures them -------------------------------


def collective_call(name: str, size_bytes: int, world_size: int, device) -> tuple[Callable, int]:
    """The operation to time and the bytes it moves as nccl-tests counts them (float32;
    all_gather's size is the gathered output, each rank contributing 1/n of it)."""
    elements = max(1, -(-size_bytes // 4))
    if name == "all_gather":
        contribution = torch.zeros(max(1, elements // world_size), device=device)
        gathered = torch.empty(contribution.numel() * world_size, device=device)
        gather = all_gather_one_tensor()
        return (lambda: gather(gathered, contribution)), gathered.numel() * 4
    # Zeros: a sum of zeros stays zero, so repeated all_reduces never overflow.
    tensor = torch.zeros(elements, device=device)
    if name == "all_reduce":
        return (lambda: dist.all_reduce(tensor)), tensor.numel() * 4
    return (lambda: dist.broadcast(tensor, src=0)), tensor.numel() * 4


def all_gather_one_tensor() -> Callable:
    """all_gather into one output tensor (nccl-tests' layout): torch 2.14 renamed it."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def collective_iterations(size_bytes: int, iters: int) -> int:
    """Every rank must run the same count: it depends on the size only, never on a clock."""
    return max(1, min(iters, max(MIN_COLLECTIVE_ITERS, COLLECTIVE_BYTES_PER_SIZE // size_bytes)))


def measure_collective(bench: BenchRank, cfg: BarrierConfig, name: str, size: int) -> dict:
    ctx = bench.ctx
    device = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
    operation, moved = collective_call(name, size, ctx.world_size, device)
    iterations = collective_iterations(moved, cfg.iters)
    for _ in range(min(cfg.warmup, iterations) or 1):
        operation()
    synchronize(device)
    dist.barrier(group=bench.control)
    started = clock()
    for _ in range(iterations):
        operation()
    synchronize(device)
    # Like nccl-tests: the time of one operation, averaged over the ranks.
    per_op = torch.tensor([(clock() - started) / iterations], dtype=torch.float64)
    dist.all_reduce(per_op, group=bench.control)
    seconds = per_op.item() / ctx.world_size
    bandwidth = bandwidth_gbps(name, moved, seconds, ctx.world_size)
    return {
        "collective": name,
        "size_bytes": moved,
        "count": moved // 4,
        "dtype": "float32",
        "iters": iterations,
        "time_us": round(seconds * 1e6, 2),
        **{key: round(value, 4) for key, value in bandwidth.items()},
    }


# --- One rank, start to end ------------------------------------------------------------


def run_rank(cfg: BarrierConfig, env: LauncherEnv, workdir: Path | None) -> dict | None:
    """Everything a rank does; returns the report on rank 0, None elsewhere."""
    if cfg.world_size != env.world_size:
        raise usage_error(
            f"the launcher started {env.world_size} ranks but the flags describe "
            f"{cfg.world_size}; drop --nproc/--gpus or make them agree"
        )
    torch.set_num_threads(max(1, cpu_count() // max(1, env.local_world_size)))
    stacks = dump_stacks_on_sigterm(workdir, env.rank)
    ctx = init_distributed(
        env,
        want_gpu=cfg.uses_gpus,
        backend=cfg.backend,
        # A real group even for one rank: its barrier is what we time.
        init_method=None if env.world_size > 1 else "env://",
        timeout_s=group_timeout_s(cfg),
    )
    hung = False
    try:
        bench = join_bench(ctx, env, cfg, workdir, stacks)
        report = run_phases(bench, cfg)
        if report is not None and workdir is not None:
            (workdir / RESULT_FILE).write_text(json.dumps(report, indent=2))
        return report
    except BarrierTimeout:
        hung = True  # tearing the group down would wait on the missing rank
        raise
    finally:
        if not hung:
            shutdown()


def run_phases(bench: BenchRank, cfg: BarrierConfig) -> dict | None:
    demos = {"staggered": staggered_demo, "zero-first": zero_first_demo}
    rows = gather_to_rank0(bench, demos[cfg.demo](bench, cfg)) if cfg.demo in demos else []
    latency = measure_latency(bench, cfg)
    collectives = [
        measure_collective(bench, cfg, name, size) for name in cfg.collective for size in cfg.sizes
    ]
    if not bench.ctx.is_main:
        return None
    report = describe_setup(bench.ctx, cfg)
    report["ranks"] = rows
    if rows:
        report.update(demo_summary(cfg.demo, rows))
    report.update(latency)
    report["collectives"] = collectives
    return report


def describe_setup(ctx: DistContext, cfg: BarrierConfig) -> dict:
    if ctx.backend == "nccl":
        how = (
            "NCCL implements barrier() as an all_reduce of one element on the GPU; "
            "each one is timed until torch.cuda.synchronize() returns"
        )
    else:
        how = "Gloo barrier() over TCP on the CPU; the demo's barrier is monitored_barrier()"
    return {
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "device": f"cuda (GPUs {','.join(map(str, cfg.gpus))})" if cfg.gpus else "cpu",
        "barrier": how,
        "demo": cfg.demo,
        "timeout_s": cfg.timeout,
    }


def dump_stacks_on_sigterm(workdir: Path | None, rank: int) -> TextIO:
    """When the launcher tears the job down, each rank still alive writes its Python stack
    first: that is how a waiting or a missing rank tells where it is."""
    stacks = open(workdir / f"stack-{rank}.txt", "a") if workdir else sys.stderr  # noqa: SIM115
    faulthandler.register(signal.SIGTERM, file=stacks, all_threads=True, chain=True)
    return stacks


# --- The launching process ---------------------------------------------------------------


def run_bench(
    cfg: BarrierConfig, debug: bool = False, on_start: Callable[[], None] | None = None
) -> dict | None:
    """Run the benchmark; rank 0's report (None on other ranks under an outside launcher).
    `on_start` runs once the checks have passed, just before the ranks start."""
    launcher = read_launcher_env()
    if launcher is not None:  # torchrun or SLURM made this process a rank
        return run_rank(cfg, launcher, workdir=None)
    check_gpu_indices(cfg.gpus, cpu_alternative="--nproc N for CPU ranks")
    if on_start is not None:
        on_start()
    workdir = Path(tempfile.mkdtemp(prefix="ddpcli-bench-barrier-"))
    try:
        return launch_ranks(cfg, workdir, debug)
    finally:
        if debug:
            ui.info(f"debug: what the ranks left behind is in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def launch_ranks(cfg: BarrierConfig, workdir: Path, debug: bool) -> dict:
    request = workdir / "config.json"
    request.write_text(cfg.model_dump_json())
    job = WorkerJob(
        module=WORKER_MODULE,
        args=[str(request), str(workdir)],
        nproc_per_node=cfg.world_size,
        timeout_s=group_timeout_s(cfg),
        env=bench_environment(cfg, debug),
    )
    try:
        run_workers(job, debug)
    except DdpcliError:
        hang = collect_hang(workdir, cfg)
        if hang is None:
            raise
        raise BarrierHang(hang) from None
    return json.loads((workdir / RESULT_FILE).read_text())


def bench_environment(cfg: BarrierConfig, debug: bool) -> dict[str, str]:
    env = worker_environment(cfg.gpus, cfg.world_size)
    if not debug and "TORCH_CPP_LOG_LEVEL" not in os.environ:
        # Gloo logs its own timeout errors; the summary below says the same, once.
        env["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    return env


# --- Turning a hang into a summary ---------------------------------------------------------

FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)')
THREAD_HEADER = re.compile(r"^(Thread 0x|Current thread 0x|Stack \(most recent call first\))")
# Our own plumbing around a barrier: the place to report is the line that called it.
BARRIER_PLUMBING = {"guarded_barrier", "device_barrier_until", "barrier_timeout"}


def collect_hang(workdir: Path, cfg: BarrierConfig) -> dict | None:
    """What the ranks left when a barrier timed out, or None if it was another failure."""
    reports = [json.loads(path.read_text()) for path in sorted(workdir.glob("hang-*.json"))]
    if not reports:
        return None
    missing = sorted(set().union(*(report["missing"] for report in reports)))
    monitor = next((r["backend_message"] for r in reports if r["rank"] == 0), None)
    ranks = []
    for rank in range(cfg.world_size):
        where = where_rank_is(workdir / f"stack-{rank}.txt")
        ranks.append({"rank": rank, "arrived": rank not in missing, "where": where})
    return {
        "error": "barrier timeout",
        "barrier": reports[0]["barrier"],
        "timeout_s": cfg.timeout,
        "backend": cfg.resolved_backend,
        "missing_ranks": missing,
        "reported_by": sorted(report["rank"] for report in reports),
        "monitor_message": monitor if cfg.resolved_backend == "gloo" else None,
        "ranks": ranks,
    }


def where_rank_is(stack_file: Path) -> dict | None:
    """The line of our code a rank was at, from its faulthandler dump."""
    if not stack_file.exists():
        return None
    for frames in thread_stacks(stack_file.read_text()):
        if any(frame["function"] == "_bootstrap" for frame in frames):
            continue  # a helper thread, not the rank's main line
        for frame in frames:  # most recent call first
            if "/ddpcli/" in frame["file"] and frame["function"] not in BARRIER_PLUMBING:
                return {**frame, "code": linecache.getline(frame["file"], frame["line"]).strip()}
    return None


def thread_stacks(dump: str) -> list[list[dict]]:
    stacks: list[list[dict]] = []
    for line in dump.splitlines():
        if THREAD_HEADER.match(line):
            stacks.append([])
        elif (match := FRAME.search(line)) and stacks:
            frame = match.groupdict()
            stacks[-1].append({**frame, "line": int(frame["line"])})
    return stacks


def describe_hang(report: dict) -> str:
    missing = report["missing_ranks"]
    lines = [
        f"barrier {report['barrier']!r} timed out after {report['timeout_s']:g}s: "
        + (f"{ranks_in_words(missing)} never arrived" if missing else "every rank arrived")
    ]
    if report.get("monitor_message"):
        lines.append(f"  Gloo monitored_barrier on rank 0: {report['monitor_message']}")
    elif report["backend"] == "nccl":
        lines.append("  NCCL: each rank gave up at its deadline; arrivals are from the TCPStore")
    for arrived, places in group_by_place(report["ranks"]).items():
        for place, ranks in places.items():
            lines.append(f"  {ranks_in_words(ranks)} {place_verb(arrived, len(ranks))} {place}")
    lines.append(
        "every rank must call barrier() the same number of times, in the same order "
        "(docs/barrier.md)"
    )
    return "\n".join(lines)


def place_verb(arrived: bool, count: int) -> str:
    if not arrived:
        return "never arrived; last seen at"
    return "waits at" if count == 1 else "wait at"


def group_by_place(ranks: list[dict]) -> dict[bool, dict[str, list[int]]]:
    places: dict[bool, dict[str, list[int]]] = {True: {}, False: {}}
    for entry in ranks:
        where = entry["where"]
        place = "an unknown place (no stack was left)"
        if where:
            short = where["file"][where["file"].rfind("ddpcli/") :]
            place = f"{short}:{where['line']} in {where['function']}(): {where['code']}"
        places[entry["arrived"]].setdefault(place, []).append(entry["rank"])
    return places
