"""What runs inside each probe process: `python -m ddpcli.checkenv.probe_worker REQUEST`.

The parent (ddpcli.checkenv.probe_ranks) starts one per local rank with torchrun's
variables. Each joins the process group through the parent's store, runs the stages in
order, and appends every stage's outcome to its own log file as the stage ends, so the
parent knows where each rank is even if it dies. A watchdog thread ends a stage that
overruns its budget, and the process with it.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddpcli.checkenv.facts import comparable_facts, software_versions
from ddpcli.checkenv.probe_plan import BARRIER_ITERATIONS, FACTS_FILE, ProbeRequest, stage_file
from ddpcli.dist import DistContext, init_distributed, shutdown
from ddpcli.environments import LauncherEnv, read_launcher_env
from ddpcli.errors import DdpcliError, first_line
from ddpcli.network import address_for
from ddpcli.process import collect_then_freeze
from ddpcli.timing import bandwidth_gbps, percentiles_us, synced_clock, synchronize, time_calls_ns

BARRIER_WARMUP = 3  # the first barriers set up connections
BANDWIDTH_ITERATIONS = 20
P2P_MESSAGE_BYTES = 4 * 2**20


class StageFailed(Exception):
    pass


@dataclass
class StageResult:
    detail: str
    data: dict = field(default_factory=dict)
    value: Any = None


class StageLog:
    """This rank's stages, one JSON line per event, appended as they happen; the parent
    reads the file to know where each rank is, even if the rank dies."""

    def __init__(self, path: Path, budgets: dict[str, float]):
        self.path = path
        self.budgets = budgets
        self.lock = threading.Lock()
        self.current: str | None = None
        self.began = 0.0

    def write(self, record: dict) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def started(self, seconds: float) -> None:
        self.write(
            {"stage": "start", "event": "end", "ok": True, "seconds": round(seconds, 3),
             "detail": "", "data": {}}
        )  # fmt: skip

    def begin(self, stage: str) -> None:
        with self.lock:
            self.current, self.began = stage, time.time()
            self.write({"stage": stage, "event": "begin", "t": self.began})

    def end(self, stage: str, passed: bool, detail: str, data: dict | None = None) -> bool:
        """False if the stage was already closed (by the watchdog)."""
        with self.lock:
            if self.current != stage:
                return False
            self.current = None
            seconds = round(time.time() - self.began, 4)
            self.write(
                {"stage": stage, "event": "end", "ok": passed, "seconds": seconds,
                 "detail": detail, "data": data or {}}
            )  # fmt: skip
            return True

    def overdue(self) -> tuple[str, float] | None:
        with self.lock:
            if self.current is None:
                return None
            budget = self.budgets[self.current]
            return (self.current, budget) if time.time() - self.began > budget else None


def start_watchdog(log: StageLog, parent_pid: int) -> None:
    """A stage that overruns its budget ends the process; so does losing the parent."""

    def watch() -> None:
        while True:
            time.sleep(0.2)
            if os.getppid() != parent_pid:
                os._exit(1)
            late = log.overdue()
            if late and log.end(late[0], False, f"timed out after {late[1]:g}s"):
                os._exit(1)

    threading.Thread(target=watch, name="probe-watchdog", daemon=True).start()


def run_stage(log: StageLog, stage: str, action: Callable[[], StageResult]) -> Any:
    log.begin(stage)
    try:
        result = action()
    except Exception as error:
        detail = error.message if isinstance(error, DdpcliError) else first_line(error)
        log.end(stage, False, detail)
        raise StageFailed(stage) from error
    log.end(stage, True, result.detail, result.data)
    return result.value


# --- The stages ------------------------------------------------------------------------------


def run_stages(env: LauncherEnv, request: ProbeRequest, log: StageLog) -> None:
    ctx = run_stage(log, "init", lambda: join_group(env, request))
    run_stage(log, "all_reduce", lambda: check_all_reduce(ctx))
    run_stage(log, "facts", lambda: gather_facts(ctx, request))
    run_stage(log, "barrier", lambda: measure_barrier(ctx))
    run_stage(log, "bandwidth", lambda: measure_bandwidth(ctx, request.message_bytes))
    local_ranks = request.node_ranks[ctx.node_rank]
    if ctx.device.type == "cuda" and len(local_ranks) > 1:
        run_stage(log, "p2p", lambda: check_peer_to_peer(ctx, local_ranks))
    shutdown()


def join_group(env: LauncherEnv, request: ProbeRequest) -> StageResult:
    ctx = init_distributed(
        env,
        want_gpu=request.use_gpus,
        backend=request.backend,
        init_method=None,
        timeout_s=request.stage_timeout,
        group_of_one=True,  # its collectives are what we check
    )
    return StageResult(f"{ctx.backend}, {ctx.device}", {"device": str(ctx.device)}, ctx)


def check_all_reduce(ctx: DistContext) -> StageResult:
    """Each rank fills its own row with rank+1: after the sum, row r must hold r+1 everywhere,
    which catches a lost, doubled or misplaced contribution."""
    rows = torch.zeros(ctx.world_size, 1024, device=ctx.device)
    rows[ctx.rank] = ctx.rank + 1
    dist.all_reduce(rows)
    synchronize(ctx.device)
    expected = torch.arange(1, ctx.world_size + 1, device=ctx.device, dtype=rows.dtype)
    wrong = (rows != expected.unsqueeze(1)).any(dim=1).nonzero().flatten().tolist()
    if wrong:
        raise RuntimeError(f"wrong sum: the contributions of ranks {wrong} came back altered")
    return StageResult("exact")


def gather_facts(ctx: DistContext, request: ProbeRequest) -> StageResult:
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, rank_facts(ctx, request))
    if ctx.local_rank == 0:
        target = Path(request.workdir) / FACTS_FILE
        partial = target.with_suffix(".part")
        partial.write_text(json.dumps(everyone))
        partial.replace(target)  # the parent never reads half a file
    return StageResult(f"{len(everyone)} ranks")


def rank_facts(ctx: DistContext, request: ProbeRequest) -> dict:
    gpu = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    return {
        "rank": ctx.rank,
        "local_rank": ctx.local_rank,
        "node_rank": ctx.node_rank,
        "host": socket.gethostname(),
        "address": address_for(request.ifname, request.master_addr) or "",
        "gpu": gpu,
        **comparable_facts(software_versions(with_driver=False)),
    }


def measure_barrier(ctx: DistContext) -> StageResult:
    """Latency of one barrier on this rank, timed until the device is done with it."""

    def barrier_once() -> None:
        dist.barrier()
        synchronize(ctx.device)

    time_calls_ns(barrier_once, BARRIER_WARMUP)
    samples_us = [ns / 1e3 for ns in time_calls_ns(barrier_once, BARRIER_ITERATIONS)]
    latency = percentiles_us(samples_us)
    data = {"p50_us": latency["p50"], "p90_us": latency["p90"], "max_us": latency["max"]}
    return StageResult(f"p50 {data['p50_us']:.0f} µs", data)


def measure_bandwidth(ctx: DistContext, message_bytes: int) -> StageResult:
    """One all_reduce of `message_bytes`, averaged over BANDWIDTH_ITERATIONS that start
    together on every rank."""
    message = torch.ones(message_bytes // 4, device=ctx.device)
    dist.all_reduce(message)  # warm-up: NCCL builds its rings on first use
    synchronize(ctx.device)
    dist.barrier()  # no rank's clock starts while another is still warming up
    started = synced_clock(ctx.device)
    for _ in range(BANDWIDTH_ITERATIONS):
        dist.all_reduce(message)
    seconds = (synced_clock(ctx.device) - started) / BANDWIDTH_ITERATIONS
    bandwidth = bandwidth_gbps("all_reduce", message_bytes, seconds, ctx.world_size)
    algorithm, bus = bandwidth["algbw_GBps"], bandwidth["busbw_GBps"]
    data = {"bytes": message_bytes, "ms": seconds * 1e3, "algbw_gbps": algorithm, "busbw_gbps": bus}
    size = f"{message_bytes / 2**20:.0f} MiB"
    if ctx.world_size == 1:
        return StageResult(f"{size} in {seconds * 1e3:.1f} ms (one rank: no traffic)", data)
    return StageResult(
        f"{size} in {seconds * 1e3:.1f} ms: {bus:.2f} GB/s bus bandwidth "
        f"({algorithm:.2f} GB/s algorithm)",
        data,
    )


def check_peer_to_peer(ctx: DistContext, local_ranks: list[int]) -> StageResult:
    """Every pair of this node's GPUs swaps a message (NCCL send/recv), and says whether
    CUDA gives it direct peer access: without it NCCL passes, silently, through host
    memory, at a fraction of NVLink's or PCIe's peer bandwidth."""
    pairs = 0
    for first, second in itertools.combinations(local_ranks, 2):
        if ctx.rank not in (first, second):
            continue
        peer = second if ctx.rank == first else first
        outgoing = torch.full((P2P_MESSAGE_BYTES // 4,), float(ctx.rank), device=ctx.device)
        incoming = torch.empty_like(outgoing)
        operations = [
            dist.P2POp(dist.isend, outgoing, peer),
            dist.P2POp(dist.irecv, incoming, peer),
        ]
        for pending in dist.batch_isend_irecv(operations):
            pending.wait()
        synchronize(ctx.device)
        if not bool((incoming == peer).all()):
            raise RuntimeError(f"data from rank {peer} arrived altered (GPU peer-to-peer)")
        pairs += 1
    dist.barrier()
    node_pairs = len(local_ranks) * (len(local_ranks) - 1) // 2
    return StageResult(
        f"{pairs} pair(s) with this rank",
        {"node_pairs": node_pairs, **peer_access(ctx, local_ranks)},
    )


def peer_access(ctx: DistContext, local_ranks: list[int]) -> dict[str, list[list[int]]]:
    """The pairs in which this rank is the lower local rank, sorted by whether CUDA can map
    the other GPU's memory directly (rank r drives cuda:r of the GPUs its node's ranks see);
    `unknown`: the other GPU is not visible to this process."""
    own = local_ranks.index(ctx.rank)
    access: dict[str, list[list[int]]] = {"direct": [], "host_memory": [], "unknown": []}
    for other in range(own + 1, len(local_ranks)):
        pair = [own, other]
        if other >= torch.cuda.device_count():
            access["unknown"].append(pair)
        elif torch.cuda.can_device_access_peer(ctx.device.index, other):
            access["direct"].append(pair)
        else:
            access["host_memory"].append(pair)
    return access


def main(argv: list[str]) -> None:
    began = time.time()
    request = ProbeRequest.read(Path(argv[1]))
    env = read_launcher_env()
    if env is None:
        sys.exit(f"{argv[0]}: started without a launcher's RANK/WORLD_SIZE (run check-env --probe)")
    log = StageLog(stage_file(Path(request.workdir), env.rank), request.budgets)
    log.started(time.time() - began)
    start_watchdog(log, request.parent_pid)
    try:
        run_stages(env, request, log)
        collect_then_freeze()
    except StageFailed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip atexit hooks that could wait on peers that are gone


if __name__ == "__main__":
    main(sys.argv)
