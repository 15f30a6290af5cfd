"""The probe's local ranks, seen from the parent: start each as its own process (`python -m
ddpcli.checkenv.probe_worker REQUEST`), watch the stage log each one appends to against
each stage's deadline, stop whatever overruns, and turn what each rank left into its
outcome (the stages it passed, and why the first one failed)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ddpcli.checkenv.probe_plan import (
    START_BUDGET_S,
    ProbePlan,
    ProbeRequest,
    RankLayout,
    stage_file,
)

WORKER_MODULE = "ddpcli.checkenv.probe_worker"
PARENT_GRACE_S = 5.0  # beyond a stage's budget, before the parent stops a silent worker
FAILED_PEER_GRACE_S = 3.0  # after a rank fails, time for the others to log their own failure
KILL_GRACE_S = 3.0
POLL_S = 0.1


@dataclass
class LocalRank:
    rank: int
    local_rank: int
    process: subprocess.Popen
    log_file: Path
    stage_file: Path
    spawned_at: float = field(default_factory=time.time)
    stopped_late: bool = False  # stopped by us for running past a stage's deadline
    stopped: bool = False  # stopped by us after another rank failed


def run_local_ranks(
    plan: ProbePlan,
    port: int,
    layout: RankLayout,
    node: dict,
    workdir: Path,
    progress: Callable[[str], None],
) -> list[dict]:
    """Run this node's ranks to the end (or their deadline); return their outcomes."""
    request = ProbeRequest.for_plan(plan, layout, workdir, os.getpid())
    request_file = request.write()
    ranks = layout.ranks_of(plan.node_rank)
    progress(f"probe: {len(ranks)} {plan.backend} process(es) here, world size {layout.world_size}")
    workers: list[LocalRank] = []
    try:
        for local_rank, rank in enumerate(ranks):
            workers.append(spawn_worker(plan, port, layout, rank, local_rank, request_file))
        watch_workers(workers, request.budgets)
    finally:
        stop_workers(workers)
    return [rank_outcome(worker, request.budgets, node) for worker in workers]


def spawn_worker(
    plan: ProbePlan, port: int, layout: RankLayout, rank: int, local_rank: int, request: Path
) -> LocalRank:
    env = {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(layout.world_size),
        "LOCAL_WORLD_SIZE": str(plan.nproc),
        "GROUP_RANK": str(plan.node_rank),
        "MASTER_ADDR": plan.master_addr,
        "MASTER_PORT": str(port),
        # Our parent hosts the store, as torchrun's agent does: every rank is its client.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if plan.ifname:
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = plan.ifname
    workdir = request.parent
    log_file = workdir / f"rank-{rank}.log"
    with open(log_file, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE, str(request)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped as one, never left behind
        )
    return LocalRank(rank, local_rank, process, log_file, stage_file(workdir, rank))


def watch_workers(workers: list[LocalRank], budgets: dict[str, float]) -> None:
    """Return when every worker ended, one ran past its stage's deadline, or one failed and
    the others had a moment to record their own view of it."""
    first_failure: float | None = None
    while any(worker.process.poll() is None for worker in workers):
        now = time.time()
        if first_failure is None and any(worker_failed(worker) for worker in workers):
            first_failure = now
        if first_failure is not None and now - first_failure > FAILED_PEER_GRACE_S:
            for worker in workers:
                worker.stopped = worker.process.poll() is None
            return
        late = [worker for worker in workers if running_late(worker, budgets, now)]
        if late:
            for worker in workers:
                worker.stopped_late = worker in late
                worker.stopped = worker not in late and worker.process.poll() is None
            return
        time.sleep(POLL_S)


def worker_failed(worker: LocalRank) -> bool:
    code = worker.process.poll()
    if code not in (None, 0):
        return True
    return any(not record.get("ok", True) for record in ended_stages(worker.stage_file))


def running_late(worker: LocalRank, budgets: dict[str, float], now: float) -> bool:
    if worker.process.poll() is not None:
        return False
    stage, since = open_stage(worker.stage_file)
    if stage is None and not ended_stages(worker.stage_file):
        stage, since = "start", worker.spawned_at
    if stage is None:
        return False
    return now - since > budgets.get(stage, START_BUDGET_S) + PARENT_GRACE_S


def stop_workers(workers: list[LocalRank]) -> None:
    """SIGTERM each worker's process group, then SIGKILL what is left: nothing outlives us."""
    alive = [worker.process for worker in workers if worker.process.poll() is None]
    for process in alive:
        signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + KILL_GRACE_S
    for process in alive:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(process, signal.SIGKILL)
            process.wait()


def signal_group(process: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended on its own meanwhile
        os.killpg(process.pid, signum)


def read_stage_log(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        with contextlib.suppress(ValueError):  # a line the worker is still writing
            records.append(json.loads(line))
    return records


def ended_stages(path: Path) -> list[dict]:
    return [record for record in read_stage_log(path) if record["event"] == "end"]


def open_stage(path: Path) -> tuple[str | None, float]:
    """The stage begun and not yet ended, with when it began."""
    begun: dict[str, float] = {}
    for record in read_stage_log(path):
        if record["event"] == "begin":
            begun[record["stage"]] = record["t"]
        else:
            begun.pop(record["stage"], None)
    if not begun:
        return None, 0.0
    stage = max(begun, key=begun.__getitem__)
    return stage, begun[stage]


def rank_outcome(worker: LocalRank, budgets: dict[str, float], node: dict) -> dict:
    stages = [
        {key: record.get(key) for key in ("stage", "ok", "seconds", "detail", "data")}
        for record in ended_stages(worker.stage_file)
    ]
    unfinished, _ = open_stage(worker.stage_file)
    if unfinished is None and not stages:
        unfinished = "start"
    code = worker.process.returncode
    if unfinished:
        stages.append(
            {
                "stage": unfinished,
                "ok": False,
                "detail": unfinished_reason(worker, unfinished, budgets),
            }
        )
    elif code not in (0, None) and all(stage["ok"] for stage in stages):
        stages.append({"stage": "exit", "ok": False, "detail": exit_reason(worker)})
    return {
        "rank": worker.rank,
        "local_rank": worker.local_rank,
        "node_rank": node["node_rank"],
        "host": node["host"],
        "address": node["address"],
        "exit_code": code,
        "stages": stages,
    }


def unfinished_reason(worker: LocalRank, stage: str, budgets: dict[str, float]) -> str:
    if worker.stopped_late:
        return f"still running after {budgets.get(stage, START_BUDGET_S):g}s: stopped by the probe"
    if worker.stopped:
        return "stopped after another rank failed or ran late"
    return exit_reason(worker)


def exit_reason(worker: LocalRank) -> str:
    code = worker.process.returncode
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    tail = log_tail(worker.log_file)
    return f"{how}: {tail}" if tail else how


def log_tail(path: Path, lines: int = 2) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    useful = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith(("frame #", "Exception raised", "<omit"))
    ]
    return " | ".join(useful[-lines:])[:400]


def unknown_outcomes(layout: RankLayout, node: dict, reason: str) -> list[dict]:
    return [
        {
            "rank": rank,
            "local_rank": local_rank,
            "node_rank": node["node_rank"],
            "host": node["host"],
            "address": node["address"],
            "exit_code": None,
            "stages": [{"stage": "report", "ok": False, "detail": reason}],
        }
        for local_rank, rank in enumerate(layout.ranks_of(node["node_rank"]))
    ]
